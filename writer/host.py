"""The writer process: `python -m writer.host --fd N [--listen-fd L] --data-dir D`.

Started by the service with one end of a socket pair (`--fd`) and, when the service runs HTTP
workers, a listening Unix socket (`--listen-fd`) on which each worker connects and gets the
same "ready" frame first. It opens the operational file (the
only process that does), applies what its journal holds beyond it, rebuilds in-memory state
from it, says it is ready, and then runs the group-commit loop of `warehouse.writer` with
the handlers of every write op. It exits
when the service's end of the pair closes, and, on Linux, when the service dies (PR_SET_PDEATHSIG), so
a killed service never leaves the file locked.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import msgspec

from core.clock import SYSTEM_CLOCK
from core.constants import WRITER_JOURNAL_REFUSED, WRITER_REOPEN
from core.layout import DataFolder, keep_private
from core.lifetime import end_with_parent
from core.logs import setup_logging
from core.settings import Settings
from flows.process_memory import release_process_memory, settle_writer_memory
from pipelines.catalog import Catalog, CatalogInvalid, load_catalog
from warehouse.catalog_store import CatalogStore
from warehouse.event_index import EventIndex, idempotency_digest
from warehouse.export import LakeExporter, run_exporter_thread
from warehouse.journal import JournalCorrupt, JournaledStore, StorageUnavailable, register_table
from warehouse.operational import open_operational, schema_version
from warehouse.outbox import EventOutbox
from warehouse.retention import Retention
from warehouse.writer import LoopStatus, OperationalFileLost, run_writer
from writer.events.ingest import IngestHandler
from writer.gate.book import GateBook
from writer.metrics import WriterMetrics
from writer.ops import (
    BULK_OPS,
    OPS,
    AuthorizeOp,
    CancelOp,
    CommitBatchOp,
    CommitOp,
    IngestOp,
    RecordOutcomeOp,
    StandingOp,
    UsageOp,
)

__all__ = ["CatalogView", "main", "memory_shares", "sync_catalog"]


log = logging.getLogger("tollgate.writer")
RATE_STEP = 100  # single events rated inline per step between groups
# Events of the ingest lane a gate group may take along (`run_writer`'s riders): a few single
# events cost a gate group well under a millisecond, and each saves a journal sync.
GATE_RIDER_EVENTS = 32
# Every 2 s (ticks of 0.25 s) the writer gives glibc's freed pages back (`malloc_trim`): the
# applier's Arrow inserts and the exporter free tens of MB a round, which glibc otherwise keeps.
# Every 20 s, glibc kept 70-160 MiB between two trims under full batch load (its part of the
# writer's RSS swinging by as much); what is given back is faulted in again as it is reused,
# which at the rate the free part grew (~8 MiB/s) is a few milliseconds a second.
TRIM_TICKS = 8


def memory_shares(ceiling: int) -> tuple[int, int]:
    """How the writer's memory ceiling (TOLLGATE_WRITER_MEMORY) is cut: DuckDB's memory limit
    for the operational file (also the pool its blocks come from, held for good: see `main`)
    and the event index's block cache, in bytes. The rest (about 72 %) is not slack: measured
    under batch load (docs/measurements.md, "The writer's memory"), the process's code and
    libraries take ~100 MiB, the Python heap with the groups in flight, the journal's pending
    rows and the exporter's Arrow batches up to ~120 MiB at its peaks, RocksDB's two
    memtables (8 MiB each) and the top level of its filters' and index's partitions, and both
    allocators keep some of what they freed (DuckDB's jemalloc about a tenth of its limit).
    With 40 % and 15 % the writer reached 1,063 MiB of a 1 GiB ceiling; with 30 % held as a
    pool, 1,010 MiB at its peak in a 10-minute soak.

    The index's cache holds its Bloom filter and index partitions (`warehouse.event_index`):
    new events' keys lead with their occurred_at, so their lookups read only the newest
    partitions of each level, and 3 % held them at 27 M ids; a larger cache only filled with
    partitions of files compaction had replaced (at 12 %, 122 MiB more of the writer's RSS
    for the same lookups: docs/measurements.md, "The dedupe index").

    >>> [n >> 20 for n in memory_shares(1 << 30)]
    [256, 30]
    """
    return int(ceiling * 0.25), int(ceiling * 0.03)


def _idempotency_writer(index: EventIndex) -> Any:
    """The idempotency table's rows go to the index, not to the file: applied from the
    journal at start, they restore the records of groups whose put the kill cut off (the
    writer puts them as soon as a group is durable, so most of these puts repeat one)."""
    def write(conn: Any, rows: list[tuple[Any, ...]]) -> None:
        index.put_idempotency(
            (idempotency_digest(r[0], r[1], r[2], r[3]), r[4], _micros(r[8]), bytes(r[6]))
            for r in rows)
    return write


def _micros(at: Any) -> int:
    from datetime import datetime
    if isinstance(at, str):
        at = datetime.fromisoformat(at)
    return int(at.timestamp() * 1_000_000)


class CatalogView:
    """The applied catalog as the writer process sees it, re-read when the file changes."""

    def __init__(self, folder: DataFolder) -> None:
        self._store = CatalogStore(folder.catalog)
        self._sig: Any = None
        self.current = Catalog.empty()
        self.refresh()

    def refresh(self) -> bool:
        """Re-read the catalog if it changed; True when a new one was loaded."""
        sig = self._store.signature()
        if sig == self._sig:
            return False
        self._sig = sig
        text = self._store.read()
        if text is None:
            return False
        try:
            self.current = load_catalog(text)
        except CatalogInvalid as exc:
            log.error("applied catalog is invalid, keeping the previous one: %s", exc)
            return False
        return True


def sync_catalog(catalog: CatalogView, gate: GateBook, conn: Any) -> None:
    """The tick's catalog step: a new catalog makes its grants pending, and pending grants
    are written on every tick until the write lands (a failed write is not lost with the
    catalog change that asked for it)."""
    if catalog.refresh():
        gate.grants_pending = True
    gate.sync_pending_grants(conn)


class _Adapter:
    """A gate method as a writer handler."""

    __slots__ = ("apply",)

    def __init__(self, method: Any) -> None:
        self.apply = method


def _events_of(op: IngestOp) -> int:
    """What an ingest op costs of a group's budget (TOLLGATE_WRITER_GROUP_EVENTS)."""
    return len(op.events)


def _split_events(op: IngestOp, n: int) -> tuple[IngestOp, IngestOp]:
    """An ingest op cut after its first n events (`run_writer` answers the op once, with the
    outcomes of both parts joined)."""
    return (IngestOp(op.realm, op.path, op.events[:n]), IngestOp(op.realm, op.path, op.events[n:]))


def _join_stored(parts: list[list[Any]]) -> list[Any]:
    return [stored for part in parts for stored in part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, default=None)
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args(argv)
    keep_private()  # the operational file and the journal: 0600
    end_with_parent(signal.SIGKILL)
    # Ctrl-C in a terminal reaches the whole process group. The service stops on it and then
    # closes its end of the socket, which ends this loop after the last rows reach the file;
    # dying here first would skip that. (A dead service still takes this process with it.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A file size limit (ulimit -f) then fails the write like a full disk does (EFBIG),
    # answered 503 and retried, instead of killing the writer.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    settle_writer_memory()
    settings = Settings.from_env(args.data_dir)
    setup_logging("writer", settings.log_format or None)
    folder = settings.folder
    sock = socket.socket(fileno=args.fd)
    duckdb_memory, index_cache = memory_shares(settings.writer_memory)
    conn = open_operational(folder.operational)
    conn.execute(f"SET memory_limit = '{duckdb_memory >> 20}MiB'")
    # DuckDB's allocator (jemalloc) keeps freed pages until a task peaks past its flush
    # threshold (128 MiB): purge them in the background and after any task past 32 MiB.
    conn.execute("SET allocator_flush_threshold = '32MiB'")
    conn.execute("SET allocator_background_threads = true")
    # DuckDB's blocks (the file's buffers, a checkpoint's work) come from a pool of its
    # whole share that is never given back: without it, each checkpoint of the WAL (every
    # 16 MiB, about every 2 s at full batch speed) took 100-180 MiB and gave them back, and
    # the writer's RSS swung by that much from second to second (docs/measurements.md, "The
    # writer's memory").
    conn.execute(f"SET block_allocator_memory = '{duckdb_memory >> 20}MiB'")
    try:
        store = JournaledStore(conn, folder.journal, max_backlog_rows=settings.max_backlog_rows,
                               fault_file=folder.root / settings.test_full_disk_file
                               if settings.test_full_disk_file else None)
    except JournalCorrupt as exc:
        conn.close()
        print(f"tollgate: {exc}", file=sys.stderr, flush=True)
        return WRITER_JOURNAL_REFUSED
    index = EventIndex(folder.index, index_cache)
    register_table("idempotency", _idempotency_writer(index))
    status = LoopStatus()
    try:
        store.recover()
    except StorageUnavailable as exc:
        # The file refuses the journal's rows (a full disk): start all the same, refusing
        # every op until a tick has applied them and rebuilt the state below from the file.
        log.error("the operational file refuses the journal's rows; every op is refused until"
                  " it takes them: %s", exc)
        status.stale = str(exc)
    catalog = CatalogView(folder)
    outbox = EventOutbox(conn, index)
    ingest = IngestHandler(outbox)
    clock = SYSTEM_CLOCK
    gate = GateBook(lambda: catalog.current, clock, index)
    gate.rebuild(conn)
    exporter = LakeExporter(settings.data_dir,
                            snapshot_window=timedelta(seconds=settings.lake_snapshot_seconds))

    def export_backlog() -> int | None:
        # Events the writer has numbered that the lake does not hold yet.
        exported = exporter.exported_seq["events"]
        return None if exported is None else max(0, outbox.last_seq - exported)

    # From the file's watermark now, not from the exporter's first round: a writer started
    # while the lake is away (a compaction holding it, an attach failing) must still bound
    # what waits for it.
    mark = conn.execute("SELECT last_seq FROM export_watermarks WHERE stream = 'events'").fetchone()
    exporter.exported_seq["events"] = int(mark[0]) if mark else 0
    status.backlog, status.backlog_bound = export_backlog, settings.export_backlog_rows
    retention = Retention(folder.operational, settings.operational_window_seconds,
                          index.durable_watermark, clock=clock, exporter_lock=exporter.op_lock,
                          window_rows=settings.window_rows)

    def upkeep(c: Any) -> None:
        # On the applier's thread, after a batch is applied or now and then when idle.
        retention.step(c)
        gate.expire_idempotency()
        gate.expire_leases()

    store.after_apply = upkeep
    handlers: dict[type, Any] = {
        IngestOp: ingest,
        AuthorizeOp: _Adapter(gate.authorize),
        CommitOp: _Adapter(gate.commit),
        CancelOp: _Adapter(gate.cancel),
        RecordOutcomeOp: _Adapter(gate.record_outcome),
        CommitBatchOp: _Adapter(gate.commit_batch),
        UsageOp: _Adapter(gate.usage),
        StandingOp: _Adapter(gate.standing),
    }

    def rebuild(s: JournaledStore) -> None:
        # Every acknowledged group is in the journal: apply them, then read the file. If
        # even that fails, the process ends rather than decide on state it cannot trust;
        # the next start applies the journal.
        c = s.reading()
        outbox.reload(c)
        gate.rebuild(c)

    from writer.events.inline_rating import InlineRater

    inline_rater = InlineRater(catalog, clock)

    def rate_singles(limit: int | None = None) -> None:
        # The events are durable and their replies sent: a failure here is logged and can no
        # longer change any reply. The rows reach the file with the store's next transaction.
        waiting = ingest.accepted_singles
        items = waiting[:limit] if limit is not None else list(waiting)
        del waiting[:len(items)]
        if items:
            try:
                store.defer("inline_ratings", inline_rater.rate(conn, items))
            except Exception:
                log.exception("inline rating of %d events failed", len(items))

    def after_group(s: JournaledStore) -> None:
        # Rating in its own transaction after every group cost a second commit per group and
        # cut single-event throughput by a fifth; the writer's tick (every 0.25 s) rates what
        # accumulated, and its rows go in with the tick's transaction. Under load, each group
        # is followed by one step of RATE_STEP events: rating costs 35-55 us an event here,
        # and a step of 1,000 held every reply behind it for ~60 ms (the p99 of singles).
        if len(ingest.accepted_singles) >= RATE_STEP:
            rate_singles(RATE_STEP)

    ticks = 0

    def memory_of() -> dict[str, int]:
        # On the loop's thread (the tick), which owns `conn`.
        parts = index.memory()
        rows = conn.execute("SELECT sum(memory_usage_bytes)::BIGINT FROM duckdb_memory()").fetchall()
        parts["duckdb_buffers"] = int(rows[0][0] or 0) if rows else 0
        return parts

    metrics = WriterMetrics(store, folder.metrics / "writer.prom", exporter, status, memory_of,
                            retention) \
        if settings.metrics_on else None

    def tick(c: Any) -> None:
        nonlocal ticks
        ticks += 1
        rate_singles()
        sync_catalog(catalog, gate, c)
        gate.expire_due(c)
        if ticks % 600 == 0:
            gate.forget_old()
        if ticks % TRIM_TICKS == 0:
            release_process_memory()
        if metrics is not None:
            try:
                metrics.write()
            except Exception:
                if ticks % 240 == 1:  # once a minute at most
                    log.exception("could not write the writer's metrics")

    decoder = msgspec.msgpack.Decoder(tuple[int, OPS])

    def decode_request(frame: bytes) -> tuple[int, Any]:
        return decoder.decode(frame)

    # The state just rebuilt (leases, usage, holds) lives as long as the process:
    # keep it out of the collector's full scans, whose pauses grow with it.
    gc.collect()
    gc.freeze()
    hello = msgspec.msgpack.encode({"ready": True, "schema_version": schema_version(conn),
                                    "events": len(outbox)})
    log.info("writer ready: schema version %d, %d events, journal group %d",
             schema_version(conn), len(outbox), store.seq)
    greeting = len(hello).to_bytes(4, "big") + hello
    sock.sendall(greeting)
    listener = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else None
    # The statements above leave their last result open on this connection, and with it a
    # transaction that no checkpoint of the file gets past (the loop may not use this
    # connection again for hours): close it.
    conn.execute("SELECT 1").fetchall()
    # The lake export runs beside the writer loop on a cursor of its own, so lake commits
    # never hold up a group.
    stop = threading.Event()
    exporter_thread = run_exporter_thread(conn, settings.data_dir, stop, exporter=exporter)
    try:
        run_writer(store, sock, decode_request, handlers, on_rollback=rebuild, tick=tick,
                   clock=clock, after_group=after_group, tick_seconds=0.25,
                   on_group=metrics.on_group if metrics is not None else None,
                   read_only=frozenset({StandingOp}), status=status, bulk=BULK_OPS,
                   bulk_budget=_events_of, bulk_group_budget=settings.writer_group_events,
                   contended_budget=max(1, settings.writer_group_events // 2),
                   rider_budget=GATE_RIDER_EVENTS, split=_split_events, join=_join_stored,
                   listener=listener, greeting=greeting)
    except OperationalFileLost as lost:
        # Every acknowledged group is in the journal; the file cannot take it on this
        # connection. The index keeps what it holds (its log synced), the rest is the next
        # process's to apply.
        log.error("the operational file was invalidated (%s) and the disk has room again: this"
                  " writer process ends, and a new one reopens the file and applies the journal",
                  lost)
        stop.set()
        exporter_thread.join(timeout=2.0)
        index.close()
        return WRITER_REOPEN
    stopping_at = time.monotonic()
    rate_singles()  # what the last tick did not reach
    try:
        store.close()  # everything into the file first, so the exporter's last round ships it
    except StorageUnavailable as exc:
        log.error("the operational file refuses the journal's last rows; they stay in the journal"
                  " and are applied at the next start: %s", exc)
    applied_at = time.monotonic()
    stop.set()
    # Its last rounds fit in the service's stop (TOLLGATE_STOP_SECONDS, `api.supervisor`); a
    # round is one lake transaction, and what is left is exported after the next start.
    exporter_thread.join(timeout=min(5.0, settings.stop_seconds * 0.3))
    exported_at = time.monotonic()
    try:
        retention.step(conn, force=True)  # what the last export let go, before the next start
    except Exception:
        log.exception("upkeep of the operational file at stop failed")
    conn.close()
    index.close()
    log.info("writer stopped: journal applied in %.2f s, lake export ended in %.2f s%s, file"
             " upkeep and close %.2f s", applied_at - stopping_at, exported_at - applied_at,
             " (still running)" if exporter_thread.is_alive() else "",
             time.monotonic() - exported_at)
    return 0


if __name__ == "__main__":
    sys.exit(main())
