"""The operational file holds a window, not history: rows that the lake holds leave it.

The lake is the append-only store of record. An event leaves the operational file once it is
(1) exported to the lake (its seq at or below the `events` export watermark), (2) in the
event index for good (at or below the index's durable watermark, `EventIndex.
durable_watermark`), and (3) older than the window (TOLLGATE_OPERATIONAL_WINDOW_SECONDS,
default an hour) or more than the rows bound behind the export's watermark
(TOLLGATE_OPERATIONAL_WINDOW_ROWS, default 32 M a GiB of the writer's memory ceiling:
`core.settings.Settings.window_rows` says why). Commit lines and inline ratings leave on (1)
and (3). Commits (kept for the
replay of a lease's commit) and leases leave once no lease the gate book remembers needs them
(`GATE_MEMORY`, a day past the book's week): the book rebuilds balances, usage and carried
remainders from aggregates kept as commits are applied (`warehouse.gate_store`), so pruning
never changes a balance. So the file's size
follows the window and the traffic, never the history, and nothing leaves before the lake
and the index have it.

Each call deletes at most `STEP_ROWS` rows a table, from the lowest seq up, so a step costs
a bounded time; it runs on the journal's applier thread after a batch is applied (off every
reply's path). When the file's write-ahead log has grown past `WAL_BOUND` it is checkpointed
there too: DuckDB skips its automatic checkpoint while another connection (the lake
exporter's) has a transaction open, and the WAL grew to 2.2 GB in 10 minutes of load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import duckdb

from core.clock import SYSTEM_CLOCK, Clock

__all__ = ["Retention", "STEP_ROWS", "WAL_BOUND"]

log = logging.getLogger("tollgate.writer")

STEP_ROWS = 200_000
WAL_BOUND = 64 << 20
FORCE_WAIT_SECONDS = 1.0
# Ended leases are remembered for 7 days (`writer.gate.book.ENDED_LEASE_MEMORY`); a day more.
GATE_MEMORY = timedelta(days=8)

# stream, its time column, whether the index must hold it too
_TABLES: tuple[tuple[str, str, bool], ...] = (
    ("events", "created_at", True),
    ("commit_lines", "committed_at", False),
    ("inline_ratings", "rated_at", False),
)


class Retention:
    """One instance per writer process; `step` is called from the applier thread."""

    def __init__(self, file: Path, window_seconds: float,
                 index_watermark: Callable[[], int], *, clock: Clock = SYSTEM_CLOCK,
                 every_seconds: float = 2.0, exporter_lock: Any = None,
                 window_rows: int | None = None) -> None:
        self.wal = file.with_name(file.name + ".wal")
        self.window = timedelta(seconds=window_seconds)
        # At most this many exported rows of a stream stay, however young (None: no bound).
        self.window_rows = window_rows
        self.index_watermark = index_watermark
        self.clock = clock
        self.every_seconds = every_seconds
        self._last = 0.0
        self.deleted = {t: 0 for t, _, _ in _TABLES} | {"commits": 0, "leases": 0}
        self.checkpoints = 0
        self.checkpoint_failures = 0
        self.checkpoint_seconds = 0.0  # the checkpoints' time, the exporter's lock held
        # The lake exporter's hold on the file (`LakeExporter.op_lock`): a checkpoint waits
        # for it rather than fail on the exporter's transaction.
        self.exporter_lock = exporter_lock

    def step(self, conn: duckdb.DuckDBPyConnection, *, force: bool = False) -> int:
        """Delete one bounded step of what may leave, then checkpoint if the WAL is past its
        bound; the rows deleted."""
        now = time.monotonic()
        if not force and now - self._last < self.every_seconds:
            self._checkpoint_if_due(conn)
            return 0
        self._last = now
        marks = dict(conn.execute("SELECT stream, last_seq FROM export_watermarks").fetchall())
        cutoff = self.clock.now() - self.window
        indexed = None
        total = 0
        for table, at, needs_index in _TABLES:
            upto = int(marks.get(table, 0))
            if needs_index:
                if indexed is None:
                    indexed = self.index_watermark()
                upto = min(upto, indexed)
            if upto <= 0:
                continue
            # Past the rows bound, rows leave whatever their age: the seqs of a stream have
            # no gaps, so those at or below the export watermark less the bound.
            by_rows = 0
            if self.window_rows is not None:
                by_rows = min(upto, int(marks.get(table, 0)) - self.window_rows)
            # The lowest seq that may leave now, under the same conditions as the DELETE. Not
            # `min(seq)` of the whole table: while the applier and the exporter hold
            # transactions on it DuckDB scans the column for that (2 ms at 1 M rows, 88 ms at
            # 11 M in a soak, every 2 s, growing with the window), where the window's condition
            # lets the zone maps of the time column skip every row group newer than the cutoff
            # (1-5 ms throughout; docs/measurements.md, "What grew in the writer"). The rows
            # bound's condition is on seq, whose zone maps skip the rest alike; when rows
            # pass it, the lowest of them is the lowest of all that may leave.
            row = None
            if by_rows > 0:
                row = conn.execute(f"SELECT min(seq) FROM {table} WHERE seq <= ?",
                                   [by_rows]).fetchone()
            if row is None or row[0] is None:
                row = conn.execute(f"SELECT min(seq) FROM {table} WHERE seq <= ? AND {at} < ?",
                                   [upto, cutoff]).fetchone()
            if row is None or row[0] is None:
                continue
            upto = min(upto, int(row[0]) + STEP_ROWS - 1)
            got = conn.execute(f"DELETE FROM {table} WHERE seq <= ? AND ({at} < ? OR seq <= ?)",
                               [upto, cutoff, by_rows]).fetchone()
            n = int(got[0]) if got else 0
            self.deleted[table] += n
            total += n
        total += self._gate_step(conn)
        if total:
            log.debug("retention: %d rows left the operational file", total)
        self._checkpoint_if_due(conn, force=total > 0 and force)
        return total

    def _gate_step(self, conn: duckdb.DuckDBPyConnection) -> int:
        """Commits, leases and their transitions that no remembered lease needs."""
        cutoff = self.clock.now() - GATE_MEMORY
        got = conn.execute(
            "DELETE FROM commits WHERE rowid IN (SELECT rowid FROM commits WHERE committed_at < ? "
            "LIMIT ?)", [cutoff, STEP_ROWS]).fetchone()
        commits = int(got[0]) if got else 0
        gone = conn.execute(
            "SELECT lease_id FROM leases WHERE expires_at < ? AND lease_id NOT IN "
            "(SELECT lease_id FROM commits) LIMIT ?", [cutoff, STEP_ROWS]).fetchall()
        if gone:
            conn.execute("BEGIN")
            try:
                ids = [r[0] for r in gone]
                conn.execute("DELETE FROM lease_transitions WHERE lease_id IN (SELECT unnest(?))", [ids])
                conn.execute("DELETE FROM leases WHERE lease_id IN (SELECT unnest(?))", [ids])
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        self.deleted["commits"] += commits
        self.deleted["leases"] += len(gone)
        return commits + len(gone)

    def _checkpoint_if_due(self, conn: duckdb.DuckDBPyConnection, force: bool = False) -> None:
        try:
            size = self.wal.stat().st_size
        except FileNotFoundError:
            return
        if size < WAL_BOUND and not force:
            return
        lock = self.exporter_lock
        if lock is not None and not lock.acquire(timeout=FORCE_WAIT_SECONDS):
            return  # the exporter holds it still: at a later step
        began = time.perf_counter()
        try:
            self._checkpoint(conn)
        finally:
            self.checkpoint_seconds += time.perf_counter() - began
            if lock is not None:
                lock.release()

    def _checkpoint(self, conn: duckdb.DuckDBPyConnection) -> None:
        # A plain CHECKPOINT fails while another connection has a write open, and under load
        # the exporter's watermark writes and the writer's tick often do: measured here, it
        # failed every time and the WAL passed 170 MB in 150 s. FORCE (DuckDB 1.4 on) waits
        # for the checkpoint lock, holding back new transactions meanwhile; this thread is
        # off every reply's path. Tried plainly first, so the idle case never waits.
        for attempt in range(3):
            try:
                conn.execute("CHECKPOINT")
                self.checkpoints += 1
                return
            except duckdb.Error:
                time.sleep(0.01 * (attempt + 1))
        # Bounded: a FORCE CHECKPOINT left to wait was seen to wait for good under load (the
        # transaction it waits for can wait for it), so it is interrupted after
        # `FORCE_WAIT_SECONDS` and tried again at a later step.
        timer = threading.Timer(FORCE_WAIT_SECONDS, conn.interrupt)
        timer.start()
        try:
            conn.execute("FORCE CHECKPOINT")
            self.checkpoints += 1
        except (duckdb.Error, RuntimeError) as exc:
            self.checkpoint_failures += 1
            log.warning("checkpoint of the operational file failed (%s); retrying later", exc)
        finally:
            timer.cancel()
