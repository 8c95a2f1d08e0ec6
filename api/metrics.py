"""GET /metrics: the service's Prometheus metrics, of all three processes, in one answer.

Unauthenticated, like /healthz (it names routes and sizes, no realm, account or key);
TOLLGATE_METRICS moves it to an address of its own or turns it off (`core.settings`).

The HTTP process counts every request (`observe_request`, called by `api.observe` for
Litestar's routes and the direct ones alike) and adds, at each scrape: its queue to the
writer, its resident memory, the files the writer and the scheduler write
(`core.metrics`), the age of the writer's file, and the sweep lag (how long events have
been in the lake without a rating sweep having started since).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from core.metrics import rss_family

if TYPE_CHECKING:
    from api.runtime import Runtime

__all__ = ["CONTENT_TYPE_LATEST", "HttpMetrics", "http_metrics_folder", "worker_ended"]

log = logging.getLogger("tollgate.metrics")

REQUEST_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                           2.5, 5.0, 10.0)
PROCESS_FILES = ("writer.prom", "scheduler.prom")
# The workers' gauges, summed over the live workers ("livesum"), or the lowest ("livemin").
_WORKER_GAUGES: tuple[tuple[str, str, Any], ...] = (
    ("tollgate_writer_queue_depth", "Ops of the HTTP workers not yet sent to the writer", "livesum"),
    ("tollgate_writer_ops_in_flight", "Ops sent to the writer and not yet answered", "livesum"),
    ("tollgate_writer_send_buffer_bytes", "Bytes for the writer that its socket has not taken yet",
     "livesum"),
    ("tollgate_writer_up", "1 while every HTTP worker is connected to the writer process", "livemin"),
)


class _ServiceCollector(Collector):
    """What is read at scrape time: the writer queue, memory, the other processes' files."""

    def __init__(self, owner: HttpMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        runtime = self.owner.runtime
        writer = getattr(runtime, "writer", None) if runtime is not None else None
        shared = self.owner.shared
        if shared is not None:
            # Every worker's requests and gauges, summed (the files of `shared`'s folder).
            for family in shared.collect():
                families[family.name] = family
            writer = None
        if writer is not None:
            yield GaugeMetricFamily("tollgate_writer_queue_depth",
                                    "Ops of the HTTP process not yet sent to the writer",
                                    value=writer.queued)
            yield GaugeMetricFamily("tollgate_writer_ops_in_flight",
                                    "Ops sent to the writer and not yet answered",
                                    value=writer.in_flight)
            yield GaugeMetricFamily("tollgate_writer_send_buffer_bytes",
                                    "Bytes for the writer that its socket has not taken yet",
                                    value=writer.send_buffer_bytes)
            yield GaugeMetricFamily("tollgate_writer_up", "1 while the writer process is connected",
                                    value=0 if writer.closed else 1)
        # The writer's status frames reach every worker alike: this worker's view is the service's.
        seen = getattr(runtime, "writer", None) if runtime is not None else None
        if seen is not None:
            yield GaugeMetricFamily("tollgate_storage_refusing",
                                    "1 while the writer refuses writes because the operational file"
                                    " does (503 STORAGE.UNAVAILABLE; /healthz not ready)",
                                    value=1 if seen.refusing and not seen.closed else 0)
        if runtime is not None and shared is None:  # else summed over the workers' files
            yield GaugeMetricFamily("tollgate_ingest_queue_bytes",
                                    "Body bytes of event requests admitted and not yet answered",
                                    value=runtime.ingest_bytes)
            yield CounterMetricFamily("tollgate_ingest_refused",
                                      "Event requests answered 503 STORAGE.BUSY (the ingest queue was full, or the lake export far behind)",
                                      value=runtime.ingest_refused)
        if shared is None:
            families["tollgate_process_resident_memory_bytes"] = rss_family("http")
        folder = self.owner.folder
        values: dict[str, float] = {}
        if folder is not None:
            for name in PROCESS_FILES:
                path = folder / name
                try:
                    text = path.read_text(encoding="utf-8")
                    modified = path.stat().st_mtime
                except OSError:
                    continue
                try:
                    parsed = list(text_string_to_metric_families(text))
                except Exception:
                    log.warning("unreadable metrics file %s", path.name)
                    continue
                if name == "writer.prom":
                    yield GaugeMetricFamily(
                        "tollgate_writer_last_tick_age_seconds",
                        "Seconds since the writer's tick last wrote its metrics (grows while it hangs)",
                        value=max(0.0, time.time() - modified))
                for family in parsed:
                    for sample in family.samples:
                        if not sample.labels:
                            values[sample.name] = sample.value
                    held = families.get(family.name)
                    if held is None:
                        families[family.name] = family
                    else:
                        held.samples.extend(family.samples)
        started = values.get("tollgate_sweep_last_start_timestamp_seconds")
        exported = values.get("tollgate_export_events_last_timestamp_seconds")
        if started is not None and exported is not None:
            # Events reached the lake after the last completed sweep started: they have
            # waited at most this long for a rating.
            yield GaugeMetricFamily(
                "tollgate_sweep_lag_seconds",
                "Seconds since the last completed sweep started, while events exported after"
                " that start wait for the next (0: none wait)",
                value=max(0.0, time.time() - started) if exported > started else 0.0)
        yield from families.values()


def http_metrics_folder(metrics: Path) -> Path:
    """Where the HTTP workers keep their counters (prometheus_client's multiprocess mode)."""
    return metrics / "http"


class HttpMetrics:
    """The HTTP process's registry and its request metrics.

    Under `tollgate serve` each worker counts in files of `metrics/http/` (prometheus_client's
    multiprocess mode, PROMETHEUS_MULTIPROC_DIR, set by `api.supervisor`), and a scrape, on
    whichever worker it reaches, sums every worker's: requests, latencies, the writer queue
    gauges and the workers' resident memory (`process="http"`; the gauges are sampled every
    second). A worker that was restarted keeps its counts in the sums."""

    def __init__(self, folder: Path | None = None) -> None:
        self.runtime: Runtime | None = None
        self.folder = folder
        self.registry = CollectorRegistry(auto_describe=False)
        multiprocess = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        counted = self.registry
        self.shared: Any = None
        self.gauges: dict[str, Any] = {}
        self.ingest_refused: Any = None  # counted in the files (several workers), else read from the runtime
        if multiprocess:
            from prometheus_client.multiprocess import MultiProcessCollector

            os.makedirs(multiprocess, mode=0o700, exist_ok=True)
            counted = CollectorRegistry(auto_describe=False)  # in the files; summed at a scrape
            self.shared = MultiProcessCollector(None, multiprocess)  # type: ignore[no-untyped-call]
            for name, text, mode in _WORKER_GAUGES:
                self.gauges[name] = Gauge(name, text, registry=counted, multiprocess_mode=mode)
            self.gauges["ingest"] = Gauge("tollgate_ingest_queue_bytes",
                                          "Body bytes of event requests admitted and not yet answered",
                                          registry=counted, multiprocess_mode="livesum")
            self.ingest_refused = Counter("tollgate_ingest_refused",
                                          "Event requests answered 503 STORAGE.BUSY (the ingest queue was full, or the lake export far behind)",
                                          registry=counted)
            self.gauges["rss"] = Gauge("tollgate_process_resident_memory_bytes",
                                       "Resident memory of each process of the service", ["process"],
                                       registry=counted, multiprocess_mode="livesum").labels("http")
        self.requests = Counter("tollgate_http_requests", "HTTP requests answered, per route and status",
                                ["method", "route", "status"], registry=counted)
        self.seconds = Histogram("tollgate_http_request_seconds",
                                 "Time from a request's arrival to its last response byte",
                                 ["method", "route", "status"], buckets=REQUEST_SECONDS_BUCKETS,
                                 registry=counted)
        self.writer_reply = Histogram("tollgate_writer_reply_seconds",
                                      "Time from an op's submit to the writer's reply, per lane"
                                      " (gate calls; event ingestion)", ["lane"],
                                      buckets=REQUEST_SECONDS_BUCKETS, registry=counted)
        self._reply_lanes: dict[str, Any] = {}
        self.registry.register(_ServiceCollector(self))
        # Per (method, route, status): the two bound children (labels() takes a lock and
        # builds a tuple every time).
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        children = self._children.get(key)
        if children is None:
            labels = (method, route, str(status))
            children = (self.requests.labels(*labels), self.seconds.labels(*labels))
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def sample(self) -> None:
        """Set this worker's gauges in the shared files (every second)."""
        if not self.gauges:
            return
        from core.metrics import rss_bytes

        writer = getattr(self.runtime, "writer", None)
        if writer is not None:
            self.gauges["tollgate_writer_queue_depth"].set(writer.queued)
            self.gauges["tollgate_writer_ops_in_flight"].set(writer.in_flight)
            self.gauges["tollgate_writer_send_buffer_bytes"].set(writer.send_buffer_bytes)
            self.gauges["tollgate_writer_up"].set(0 if writer.closed else 1)
        self.gauges["rss"].set(rss_bytes())

    def observe_writer_reply(self, lane: str, seconds: float) -> None:
        observe = self._reply_lanes.get(lane)
        if observe is None:
            observe = self._reply_lanes[lane] = self.writer_reply.labels(lane).observe
        observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve_elsewhere(self, host: str, port: int) -> Any:
        """Serve the registry on an address of its own (TOLLGATE_METRICS=HOST:PORT)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, host, registry=self.registry)
        log.info("metrics served on %s:%d", host, port)
        return server


def clear_process_files(folder: Path) -> None:
    """Forget an earlier service's files (`serve` calls this before it starts the others)."""
    for name in PROCESS_FILES:
        try:
            os.unlink(folder / name)
        except FileNotFoundError:
            pass
    for path in http_metrics_folder(folder).glob("*.db"):
        path.unlink(missing_ok=True)


def worker_ended(folder: Path, pid: int) -> None:
    """Drop the live gauges of a worker that ended (its counters stay in the sums)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(http_metrics_folder(folder)))  # type: ignore[no-untyped-call]
