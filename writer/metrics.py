"""The writer process's metrics, written to `metrics/writer.prom` on every tick (`core.metrics`).

Gathered here, in the writer: each group's size and time (`run_writer`'s `on_group`), and at
each write the journal's backlog and apply failures (`JournaledStore`), the lake export's
progress (`LakeExporter`) and where the writer's memory is (`tollgate_writer_memory_bytes`,
read every `MEMORY_SECONDS`: what DuckDB's buffer manager counts, RocksDB's parts, glibc's
heap; the rest of the RSS is code, DuckDB's allocations outside its buffer manager and what
its allocator keeps). Nothing here is on a reply's path but two histogram observations per
group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core.metrics import rss_family, write_registry
from flows.process_memory import heap_bytes
from warehouse.export import STREAMS, LakeExporter
from warehouse.journal import JournaledStore
from warehouse.retention import Retention
from warehouse.writer import LoopStatus

__all__ = ["WriterMetrics"]

GROUP_OPS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
GROUP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MEMORY_SECONDS = 5.0


class _StateCollector(Collector):
    def __init__(self, owner: WriterMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        store, exporter = self.owner.store, self.owner.exporter
        yield GaugeMetricFamily("tollgate_journal_backlog_groups",
                                "Journaled (acknowledged) groups not yet in the operational file",
                                value=store.seq - store.applied_seq)
        yield GaugeMetricFamily("tollgate_journal_backlog_bytes",
                                "Journal bytes written since the last group known to be in the file",
                                value=max(0, store.journaled_bytes - store.applied_bytes))
        yield GaugeMetricFamily("tollgate_journal_pending_rows",
                                "Rows waiting to be handed to the applier thread",
                                value=store.pending_rows)
        yield CounterMetricFamily("tollgate_journal_apply_failures",
                                  "Failed applies of journaled groups to the operational file",
                                  value=store.apply_failures)
        yield GaugeMetricFamily("tollgate_journal_unapplied_rows",
                                "Acknowledged rows not yet in the operational file",
                                value=store.unapplied_rows)
        yield GaugeMetricFamily("tollgate_journal_backlog_limit_rows",
                                "Unapplied rows past which writes are refused while the file refuses them",
                                value=store.max_backlog_rows)
        failing = store.failing_since
        yield GaugeMetricFamily("tollgate_storage_failing_seconds",
                                "Seconds since the operational file began refusing writes (0: it takes them)",
                                value=0.0 if failing is None else max(0.0, time.monotonic() - failing))
        status = self.owner.status
        if status is not None:
            yield CounterMetricFamily("tollgate_writer_refused_ops",
                                      "Ops answered 503 before being decided, while storage refused writes",
                                      value=status.refused_ops)
            backlog = status.backlog() if status.backlog is not None else None
            yield GaugeMetricFamily("tollgate_export_backlog_events",
                                    "Events the operational file holds that the lake lacks",
                                    value=backlog or 0)
            yield GaugeMetricFamily("tollgate_export_backlog_limit_events",
                                    "The export backlog from which event ingestion is refused"
                                    " (TOLLGATE_EXPORT_BACKLOG_ROWS; 0: no bound)",
                                    value=status.backlog_bound)
            yield GaugeMetricFamily("tollgate_ingest_backlog_refusing",
                                    "1 while event ingestion is refused for the export's backlog",
                                    value=1 if status.busy else 0)
            yield GaugeMetricFamily("tollgate_ingest_pace_seconds",
                                    "How long each event post waits before it is read, for the"
                                    " export's backlog (0: none)", value=status.pace / 1000)
            yield CounterMetricFamily("tollgate_ingest_backlog_spells",
                                      "Spells of event ingestion refused for the export's backlog",
                                      value=status.busy_spells)
        yield CounterMetricFamily("tollgate_writer_group_failures",
                                  "Groups that could not be committed (their ops answered 503)",
                                  value=self.owner.group_failures)
        if exporter is not None:
            now = time.time()
            yield GaugeMetricFamily("tollgate_export_lag_seconds",
                                    "Age in seconds of the oldest row the lake lacks (0: it holds every row)",
                                    value=max(0.0, now - exporter.caught_up_at))
            behind = GaugeMetricFamily("tollgate_export_rows_behind",
                                       "Rows of the operational file the last export round left behind",
                                       labels=["stream"])
            shipped = CounterMetricFamily("tollgate_export_rows",
                                          "Rows exported to the lake by this writer process",
                                          labels=["stream"])
            for stream in STREAMS:
                behind.add_metric([stream], exporter.rows_behind.get(stream, 0))
                shipped.add_metric([stream], exporter.rows_exported.get(stream, 0))
            yield behind
            yield shipped
            yield CounterMetricFamily("tollgate_export_rounds",
                                      "Lake export rounds that shipped rows",
                                      value=exporter.rounds)
            yield CounterMetricFamily("tollgate_export_round_seconds",
                                      "Time of the export rounds that shipped rows",
                                      value=exporter.round_seconds)
            yield CounterMetricFamily("tollgate_export_failures",
                                      "Failed lake export rounds (each retried)",
                                      value=exporter.failures)
            yield GaugeMetricFamily("tollgate_export_events_last_timestamp_seconds",
                                    "When events last reached the lake (Unix time; 0: not yet)",
                                    value=exporter.events_exported_at)
            yield GaugeMetricFamily("tollgate_lake_snapshots",
                                    "Snapshots the lake kept after the exporter's last expiry of"
                                    " those older than TOLLGATE_LAKE_SNAPSHOT_HOURS",
                                    value=exporter.snapshots_kept)
            yield CounterMetricFamily("tollgate_lake_snapshots_expired",
                                      "Lake snapshots this writer process expired",
                                      value=exporter.snapshots_expired)
            yield CounterMetricFamily("tollgate_lake_expire_failures",
                                      "Failed expiries of the lake's old snapshots (each retried"
                                      " 10 minutes later)", value=exporter.expire_failures)
        retention = self.owner.retention
        if retention is not None:
            deleted = CounterMetricFamily("tollgate_retention_deleted_rows",
                                          "Rows that left the operational file (its window)",
                                          labels=["table"])
            for table, rows in sorted(retention.deleted.items()):
                deleted.add_metric([table], rows)
            yield deleted
            yield CounterMetricFamily("tollgate_operational_checkpoints",
                                      "Checkpoints of the operational file's WAL by the writer",
                                      value=retention.checkpoints)
            yield CounterMetricFamily("tollgate_operational_checkpoint_failures",
                                      "Checkpoints of the operational file that failed (retried)",
                                      value=retention.checkpoint_failures)
            yield CounterMetricFamily("tollgate_operational_checkpoint_seconds",
                                      "Time the writer's checkpoints took, the exporter waiting",
                                      value=retention.checkpoint_seconds)
        yield GaugeMetricFamily("tollgate_writer_last_tick_timestamp_seconds",
                                "When the writer's tick last ran (Unix time)", value=time.time())
        memory = self.owner.memory_parts()
        if memory:
            parts = GaugeMetricFamily("tollgate_writer_memory_bytes",
                                      "The writer's memory by part (read every few seconds)",
                                      labels=["part"])
            for part, value in sorted(memory.items()):
                parts.add_metric([part], value)
            yield parts
        yield rss_family("writer")


class WriterMetrics:
    def __init__(self, store: JournaledStore, path: Path,
                 exporter: LakeExporter | None = None, status: LoopStatus | None = None,
                 memory_of: Callable[[], dict[str, int]] | None = None,
                 retention: Retention | None = None) -> None:
        """`memory_of` returns the writer's own parts (DuckDB's and the index's), called from
        the thread that calls `write`."""
        self.store = store
        self.retention = retention
        self.memory_of = memory_of
        self._memory: dict[str, int] = {}
        self._memory_at = 0.0
        self.exporter = exporter
        self.status = status
        self.path = path
        self.group_failures = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.group_ops = Histogram("tollgate_writer_group_ops", "Ops per group commit", ["lane"],
                                   buckets=GROUP_OPS_BUCKETS, registry=self.registry)
        self.group_seconds = Histogram(
            "tollgate_writer_group_seconds",
            "Time of a group: its ops decided, its rows journaled and synced", ["lane"],
            buckets=GROUP_SECONDS_BUCKETS, registry=self.registry)
        self.commit_seconds = Histogram(
            "tollgate_writer_commit_seconds",
            "The commit's part of a group's time: its rows appended to the journal and synced",
            buckets=GROUP_SECONDS_BUCKETS, registry=self.registry)
        self.registry.register(_StateCollector(self))
        # Per lane, the two bound children (labels() takes a lock each time).
        self._lanes: dict[str, tuple[Any, Any]] = {}
        self._observe_commit = self.commit_seconds.observe

    def on_group(self, lane: str, ops: int, seconds: float, commit_seconds: float,
                 committed: bool) -> None:
        children = self._lanes.get(lane)
        if children is None:
            children = self._lanes[lane] = (self.group_ops.labels(lane).observe,
                                            self.group_seconds.labels(lane).observe)
        children[0](ops)
        children[1](seconds)
        if committed:
            self._observe_commit(commit_seconds)
        else:
            self.group_failures += 1

    def memory_parts(self) -> dict[str, int]:
        """The last reading of the memory's parts, read again when `MEMORY_SECONDS` passed."""
        now = time.monotonic()
        if now - self._memory_at >= MEMORY_SECONDS:
            self._memory_at = now
            parts = dict(heap_bytes())
            if self.memory_of is not None:
                parts.update(self.memory_of())
            self._memory = parts
        return self._memory

    def write(self) -> None:
        write_registry(self.registry, self.path)
