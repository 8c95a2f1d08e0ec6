"""The operational file behind a write-ahead journal: how a group becomes durable.

Measured on the 2-core machine this is built on, DuckDB costs about a millisecond per
statement whatever its size: an Arrow insert of 32 rows 1.0 to 1.5 ms, a commit 0.6 to 1 ms.
A group of gate ops touches three or four tables, so committing each group in DuckDB cost
4 to 5 ms of the writer's time and the writer, not HTTP, bounded the gate at about 750
authorize+commit pairs a second. An append to a file plus `fdatasync` costs 0.2 ms.

So a group is made durable by appending its rows (msgpack, with a CRC) to the journal
(segment files under `journal/` in the data folder) and syncing it; only then are its
replies sent. The rows are applied to the DuckDB file later, in one transaction for many
groups, on a thread of their own (`materialize_soon`: when many rows wait, and on the
writer's tick once the oldest has waited `APPLY_AFTER_SECONDS`), together with the number
of the last group applied (`journal_state`); then the segments that held them are deleted. A commit to the file with a checkpoint took 30-200 ms
here, which in the writer's loop was the p99 of every request. At start, `recover` applies
every complete group after that number, so a `kill -9` between the two steps loses nothing
and applies nothing twice; a torn last record (never acknowledged) is cut off. A bad record
with a valid one after it, or a jump in group numbers, may be an acknowledged group lost: the
store then refuses to open (`JournalCorrupt`, see `warehouse.journal_scan`) and changes nothing.

Everything that reads the operational file in the writer process calls `materialize` first
(or `reading`); the lake exporter reads only what is applied, a few seconds later.

When the file refuses a write (a full disk: the journal's prefilled segments need no new
blocks, so it keeps taking groups), the applier keeps the rows and tries again after a pause
that doubles up to `APPLY_RETRY_MAX_SECONDS`. The journal keeps acknowledging until the rows
it holds beyond the file reach `max_backlog_rows`; from then on the store is `refusing` and
the writer answers every write 503 `STORAGE.UNAVAILABLE` (`warehouse.writer`), so memory and
the journal stay bounded. The first apply that succeeds ends it. A read that needs the file
meanwhile fails with `StorageUnavailable` (503) instead of retrying on every request. At a
start, `recover` applies what the journal holds in transactions of at most
`RECOVERY_STEP_ROWS` rows. A journal segment that cannot be made (or a spare that cannot be
prefilled) leaves the current segment in use; an append that fails fails its group (503).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from core.constants import INT64_MAX, INT64_MIN
from core.priority import run_in_background
from warehouse.durable import sync_dir
from warehouse.journal_scan import (
    HEAD,
    JournalCorrupt,
    JournalScan,
    Record,
    Stretch,
    read_tables,
    scan_journal,
)
from warehouse.journal_scan import encode as _encode

__all__ = ["DirectStore", "Journal", "JournalCorrupt", "JournaledStore", "StorageUnavailable",
           "TableWriter", "register_table", "write_rows"]

log = logging.getLogger("tollgate.writer")

_HEAD = HEAD  # payload length, crc32 of the payload

# Writes rows of one table into DuckDB inside the materializing transaction.
TableWriter = Callable[[duckdb.DuckDBPyConnection, list[tuple[Any, ...]]], None]



class StorageUnavailable(Exception):
    """The operational file refuses writes (or the store refuses them for it): an op that
    needed it fails alone, answered 503 `STORAGE.UNAVAILABLE` with `Retry-After`."""

    def __init__(self, message: str, retry_after: float = 2.0) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))

    def to_wire(self) -> dict[str, Any]:
        return {"status": 503, "code": "STORAGE.UNAVAILABLE", "message": str(self),
                "headers": {"Retry-After": str(self.retry_after)}}


def _invalidates(exc: BaseException) -> bool:
    """Whether a failed write left DuckDB's database unusable until it is reopened."""
    return isinstance(exc, duckdb.FatalException) or "database has been invalidated" in str(exc)


def _brief(exc: BaseException) -> str:
    """An error in one line, for logs and answers."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


class Journal:
    """A file of committed groups, one after another: [length][crc32][msgpack (seq, {table:
    rows})], then zeros or the end of the file.

    A journal created with `prefill` bytes is written full of zeros (and synced) first, and
    groups then overwrite those zeros in place. Measured here under `bench/gate.py`, a sync
    after appending to a file cost 0.41 ms at the median and 0.74 ms on average: an append
    changes the file's size, so `fdatasync` must also commit the file system's own journal.
    An overwrite of blocks already written syncs only the data (0.12-0.18 against
    0.19-0.29 ms, idle and with the cores busy), and the gate loop was faster in 6 of 7
    alternating runs, by 4-23 %."""

    def __init__(self, path: Path, *, prefill: int = 0) -> None:
        self.path = path
        created = bool(prefill) or not path.exists()
        # A prefilled journal is always a new file (never one that may hold groups).
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_EXCL if prefill else 0), 0o600)
        self.broken = False
        self.prefilled = False
        if created and prefill:
            try:
                _zero_fill(self._fd, prefill)
                os.fdatasync(self._fd)
            except OSError:
                os.close(self._fd)
                path.unlink(missing_ok=True)
                raise
            self.prefilled = True
        self._length = os.fstat(self._fd).st_size  # the file's length
        self._size = 0 if self.prefilled else self._length  # where the next group goes
        if created and not prefill:
            sync_dir(path.parent)  # the new name survives a power loss, not only a kill

    def append(self, seq: int, tables: dict[str, list[tuple[Any, ...]]]) -> int:
        """Write one group and sync it; on failure its bytes are taken back (zeros where the
        file was prefilled, cut where it grew). If even that fails, the journal is `broken`
        and refuses every later group (503s until a restart, whose recovery reads what the
        file really holds)."""
        if self.broken:
            raise OSError("the journal could not be restored after a failed write")
        payload = _encode((seq, tables))
        record = _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
        at = self._size
        try:
            written = os.pwrite(self._fd, record, at)
            while written < len(record):
                written += os.pwrite(self._fd, record[written:], at + written)
            os.fdatasync(self._fd)
        except OSError:
            self._take_back(at, len(record))
            raise
        self._size = at + len(record)
        self._length = max(self._length, self._size)
        return len(record)

    def _take_back(self, at: int, size: int) -> None:
        try:
            if at + size > self._length:
                os.ftruncate(self._fd, max(self._length, at))
            inside = min(self._length, at + size) - at
            if inside > 0:
                os.pwrite(self._fd, bytes(inside), at)
            os.fdatasync(self._fd)  # the failed group must not come back after a power loss
        except OSError:
            self.broken = True

    def groups(self) -> Iterator[tuple[int, dict[str, list[tuple[Any, ...]]]]]:
        """Every complete group in the file, in order; a torn tail (a bad or partial record
        with no valid one after it) is cut off (the zeros of a prefilled file are no tail).
        Bad bytes with a valid record after them raise `JournalCorrupt` before anything is
        read or cut: that is not a write in flight but a group that may be lost."""
        scan = scan_journal(self.path.parent, 0, [self.path])
        if any(p.stretches for p in scan.problems):
            raise JournalCorrupt(scan)
        [segment] = scan.segments
        tail = next((p for p in segment.pieces if isinstance(p, Stretch)), None)
        records = [p for p in segment.pieces if isinstance(p, Record)]
        self._size = records[-1].end if records else 0
        if tail is not None:
            self.cut(tail.offset)
        for record in records:
            assert record.tables is not None  # scanned with its rows kept
            yield record.seq, record.tables

    def cut(self, at: int) -> None:
        """Cut an unfinished record off at `at` (nothing valid follows it)."""
        log.warning("journal: cutting %d bytes of an unfinished record at offset %d of %s",
                    self._length - at, at, self.path.name)
        os.ftruncate(self._fd, at)
        os.fdatasync(self._fd)
        self._length = at
        self._size = min(self._size, at)

    @property
    def size(self) -> int:
        """The bytes its groups take."""
        return self._size

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _zero_fill(fd: int, size: int) -> None:
    block = bytes(1 << 20)
    at = 0
    while at < size:
        at += os.pwrite(fd, block[:min(len(block), size - at)], at)


_BIGINT = (INT64_MIN, INT64_MAX)


def out_of_range(row: tuple[Any, ...]) -> bool:
    """True when an integer of `row` does not fit the file's BIGINT columns: such a row would
    be refused by DuckDB only when applied, after its group was acknowledged."""
    low, high = _BIGINT
    return any(type(v) is int and not low <= v <= high for v in row)


def _insert_inferred(table: str) -> TableWriter:
    def write(conn: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]]) -> None:
        # One Arrow insert per table: executemany runs a statement per row.
        columns = list(zip(*rows, strict=True))
        staged = pa.Table.from_arrays(  # noqa: F841 (read by DuckDB below)
            [pa.array(column) for column in columns], names=[f"c{i}" for i in range(len(columns))])
        conn.execute(f"INSERT INTO {table} SELECT * FROM staged")
    return write


# Tables whose rows need more than the column types Arrow infers (the events table).
_WRITERS: dict[str, TableWriter] = {}


def register_table(table: str, writer: TableWriter) -> None:
    _WRITERS[table] = writer


def write_rows(conn: duckdb.DuckDBPyConnection, tables: dict[str, list[tuple[Any, ...]]]) -> None:
    """Insert staged rows, one statement per table, in the caller's transaction."""
    for table, rows in tables.items():
        if rows:
            writer = _WRITERS.get(table)
            if writer is None:
                writer = _WRITERS[table] = _insert_inferred(table)
            writer(conn, rows)


class DirectStore:
    """Rows straight into a connection, in the caller's transaction: for tools and tests
    that write the file without a writer process."""

    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self.conn = conn

    def commit(self, tables: dict[str, list[tuple[Any, ...]]]) -> None:
        write_rows(self.conn, tables)

    def reading(self) -> duckdb.DuckDBPyConnection:
        return self.conn


class _Batch:
    """Rows handed to the applier: every group up to `seq`, the journal segments that hold
    exactly those groups, and deferred rows."""

    __slots__ = ("tables", "seq", "segments", "deferred", "journaled_bytes", "journaled_rows")

    def __init__(self, tables: dict[str, list[tuple[Any, ...]]], seq: int, segments: list[Journal],
                 deferred: dict[str, list[tuple[Any, ...]]]) -> None:
        self.tables = tables
        self.seq = seq
        self.segments = segments
        self.deferred = deferred
        self.journaled_bytes = 0  # the store's journaled bytes when it was taken
        self.journaled_rows = 0  # and its journaled rows


class JournaledStore:
    """The writer's view of the operational file: groups go to the journal, rows reach DuckDB
    in larger transactions, applied on a thread of their own. Called from one thread (the
    writer loop).

    The journal is a series of segment files under `journal_dir`, each prefilled with
    `SEGMENT_BYTES` of zeros (see `Journal`) by a background thread before it is needed, as
    `spare.tmp`, and renamed into the series when it is put to use. Rows are handed to the
    applier in batches; a segment is deleted whole once it is full (the writer moved on to
    the next) and the file holds its groups. `recover` reads whatever segments are left, in
    order, and skips the groups the file already holds. Until a spare is ready (at start)
    groups are appended to a segment that was not prefilled. DuckDB releases the GIL while
    it works, so the writer keeps deciding and journaling groups while a transaction (and
    now and then a checkpoint of 0.1-0.2 s) runs beside it."""

    # Rows waiting beyond this are handed over at once; beyond twice this, the writer waits.
    MAX_PENDING_ROWS = 50_000
    # Fewer are handed over on the writer's tick once the oldest has waited this long
    # (`materialize_due`). Handed over on every tick (0.5 s), a full batch load reached the
    # file in transactions of ~20,000 rows, which cost DuckDB about twice the CPU an event of
    # transactions of 50,000 (its per-commit work: the WAL's sync and checkpoint; measured
    # in docs/measurements.md, "The applier's transactions").
    APPLY_AFTER_SECONDS = 2.0
    SEGMENT_BYTES = 16 << 20
    # At a start, the journal's groups reach the file in transactions of about this many rows.
    RECOVERY_STEP_ROWS = 50_000
    # After a failed apply the next try waits this long, doubling up to the maximum.
    APPLY_RETRY_FIRST_SECONDS = 0.25
    APPLY_RETRY_MAX_SECONDS = 5.0
    ROOM_BYTES = 128 << 20

    def __init__(self, conn: duckdb.DuckDBPyConnection, journal_dir: Path, *,
                 max_backlog_rows: int = 100_000, fault_file: Path | None = None) -> None:
        """`max_backlog_rows`: while the file refuses writes, how many journaled rows it may
        lack before the store refuses writes too (`refusing`). `fault_file`, for tests only:
        while that file exists, every apply to the file fails as on a full disk."""
        self.conn = conn
        self.max_backlog_rows = max_backlog_rows
        self.fault_file = fault_file
        self._applier_conn = conn.cursor()
        self._dir = journal_dir
        journal_dir.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, list[tuple[Any, ...]]] = {}
        self._pending_rows = 0
        self._pending_since = 0.0  # time.monotonic() when the oldest waiting row came
        self._deferred: dict[str, list[tuple[Any, ...]]] = {}
        # For the writer's metrics: journal bytes appended by this process, those known to
        # be in the file (their difference is the backlog), and failed applies.
        self.journaled_bytes = 0
        self.applied_bytes = 0
        self.apply_failures = 0
        # The same in rows (recovered groups included): the backlog `refusing` bounds.
        self.journaled_rows = 0
        self.applied_rows = 0
        # While applies fail: since when (monotonic), the last error, when to try again and
        # the pause before the try after that.
        self.failing_since: float | None = None
        self.last_apply_error = ""
        self._retry_at = 0.0
        self._retry_pause = 0.0
        self._rotation_failed = False
        # Set when a failed write invalidated the file's database (DuckDB does so on an I/O
        # error in its WAL or a checkpoint, such as a full disk): no later try on this
        # connection can succeed, so the writer process ends once there is room again and a
        # new one reopens the file and applies the journal (`has_room`, `warehouse.writer`).
        self.lost = ""
        row = conn.execute("SELECT coalesce(max(applied_seq), 0) FROM journal_state").fetchone()
        self.applied_seq = int(row[0]) if row else 0
        self.seq = self.applied_seq
        found = self._segment_paths()
        # Read before anything is created or cut: a journal that may have lost an
        # acknowledged group stops here, as it is (the operator decides; the message says how).
        # Rows are not kept: `recover` reads them again a segment at a time, so a large
        # journal never sits in memory whole.
        self._scan: JournalScan | None = scan_journal(journal_dir, self.applied_seq, found,
                                                      keep_tables=False)
        if not self._scan.ok:
            raise JournalCorrupt(self._scan)
        self._next_segment = (int(found[-1].stem) + 1) if found else 1
        self._segments: list[Journal] = []  # not yet deleted, oldest first; the last is `journal`
        self._thread: threading.Thread | None = None
        self._done: _Batch | None = None
        self._failed: tuple[_Batch, BaseException] | None = None
        self._spare_path = journal_dir / "spare.tmp"
        self._spare_path.unlink(missing_ok=True)  # left by an earlier run: it never held a group
        self._spare: Journal | None = None
        self._spare_thread: threading.Thread | None = None
        self.journal = self._new_segment()
        # Upkeep of the file run on the applier's thread after each batch, and on its own
        # now and then when no rows come (`warehouse.retention`): never on a reply's path.
        self.after_apply: Callable[[duckdb.DuckDBPyConnection], None] | None = None
        self._idle_upkeep_at = 0.0

    def _segment_paths(self) -> list[Path]:
        return sorted(self._dir.glob("*.journal"))

    def _new_segment(self) -> Journal:
        """The next segment of the series: the spare if it is ready, else a file to append to.
        On an error nothing is added to `_segments` (the caller keeps the current segment)."""
        path = self._dir / f"{self._next_segment:012d}.journal"
        self._next_segment += 1
        spare = self._spare
        if spare is not None:
            os.rename(spare.path, path)
            self._spare = None
            spare.path = path
            try:
                sync_dir(self._dir)
            except OSError:
                spare.close()  # left as zeros, which a start reads as no group
                raise
            self._segments.append(spare)
            journal = spare
        else:
            journal = Journal(path)
            self._segments.append(journal)
        self._prepare_spare_soon()
        return journal

    def _prepare_spare_soon(self) -> None:
        # The thread first: it sets `_spare` before it ends, so once it is not alive the
        # value read next is final (the other order could start a second thread that
        # adopts the first one's file).
        if (self._spare_thread is not None and self._spare_thread.is_alive()) or self._spare is not None:
            return
        self._spare_thread = threading.Thread(target=self._prepare_spare, name="journal-spare", daemon=True)
        self._spare_thread.start()

    def _prepare_spare(self) -> None:
        run_in_background()
        try:
            self._spare = Journal(self._spare_path, prefill=self.SEGMENT_BYTES)
        except OSError:
            log.warning("could not prepare a journal segment; appending instead", exc_info=True)

    def _rotation_due(self) -> bool:
        journal = self.journal
        return (journal.size >= self.SEGMENT_BYTES or journal.broken
                or (not journal.prefilled and self._spare is not None))

    def recover(self) -> int:
        """Apply every journaled group the file does not hold yet; the number applied. The
        segments were read when the store opened (and found sound): their groups follow on
        from the file's last one, and what is cut is only a record nobody was told about.
        Raises `StorageUnavailable` if the file refuses them: every group is read and kept
        all the same, and `materialize` tries again."""
        applied = 0
        refused: StorageUnavailable | None = None
        scan, self._scan = self._scan, None
        for segment in scan.segments if scan is not None else []:
            old = Journal(segment.path)
            data = segment.path.read_bytes() if segment.records else b""
            for piece in segment.pieces:
                if isinstance(piece, Stretch):  # a torn tail: nothing valid after it anywhere
                    old.cut(piece.offset)
                    break
                if piece.seq <= self.seq:  # in the file already
                    continue
                self._merge(read_tables(data, piece))
                self.seq = piece.seq
                applied += 1
                if self._pending_rows >= self.RECOVERY_STEP_ROWS and refused is None:
                    # A large backlog goes in steps, each recorded in `journal_state`: the
                    # segment being read is not in `_segments` yet, so it is not deleted.
                    try:
                        self.materialize()
                    except StorageUnavailable as exc:
                        refused = exc  # read the rest; the writer's tick tries again
            segment.pieces, data = [], b""  # its rows are merged or applied: let them go
            self._segments.insert(len(self._segments) - 1, old)
        if refused is not None:
            raise refused
        self.materialize()
        if applied:
            log.info("journal: applied %d groups left from the last run", applied)
        return applied

    def commit(self, tables: dict[str, list[tuple[Any, ...]]]) -> None:
        """Make one group durable (journal + sync). Raises OSError if it could not be, and
        ValueError for a row the file would refuse (the group fails before it is durable)."""
        if not tables:
            return
        for table, rows in tables.items():
            if table != "events" and any(out_of_range(row) for row in rows):  # events: checked at ingest
                raise ValueError(f"a {table} row holds an integer beyond BIGINT")
        seq = self.seq + 1
        self.journaled_bytes += self.journal.append(seq, tables)
        self.seq = seq
        self._merge(tables)

    def _merge(self, tables: dict[str, list[tuple[Any, ...]]]) -> None:
        if not self._pending_rows:
            self._pending_since = time.monotonic()
        for table, rows in tables.items():
            self._pending.setdefault(table, []).extend(rows)
            self._pending_rows += len(rows)
            self.journaled_rows += len(rows)

    def defer(self, table: str, rows: list[tuple[Any, ...]]) -> None:
        """Rows that need no journal: derived, best-effort data (inline ratings) that a crash
        may lose. They go in with the next batch, in a transaction of their own, so a row
        the file refuses costs only those rows (logged), never the journaled ones."""
        kept = [row for row in rows if not out_of_range(row)]
        if len(kept) < len(rows):
            log.warning("dropping %d %s rows with integers beyond BIGINT", len(rows) - len(kept), table)
        if kept:
            self._deferred.setdefault(table, []).extend(kept)

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    @property
    def unapplied_rows(self) -> int:
        """Journaled (acknowledged) rows not known to be in the file."""
        return max(0, self.journaled_rows - self.applied_rows)

    @property
    def refusing(self) -> bool:
        """Whether writes must be refused: the file refuses them and the journal holds
        `max_backlog_rows` or more rows it lacks."""
        return self.failing_since is not None and self.unapplied_rows >= self.max_backlog_rows

    def refusal(self) -> StorageUnavailable:
        """What a refused write is answered: 503 with the time to the next try."""
        wait = max(0.0, self._retry_at - time.monotonic())
        # The error itself (which may name paths) is in the writer's log, not in answers.
        return StorageUnavailable(
            f"the service's storage refuses writes (a full disk?); {self.unapplied_rows}"
            f" acknowledged rows wait for it (the bound is {self.max_backlog_rows}): retry",
            retry_after=wait)

    def has_room(self) -> bool:
        """Whether the data folder's disk could take the journal's backlog again: at least
        `ROOM_BYTES` free beyond twice the bytes the file lacks (and no test fault)."""
        if self.fault_file is not None and self.fault_file.exists():
            return False
        try:
            fs = os.statvfs(self._dir.parent)
        except OSError:
            return False
        lacking = max(0, self.journaled_bytes - self.applied_bytes)
        return fs.f_bavail * fs.f_frsize >= self.ROOM_BYTES + 2 * lacking

    def _note_failure(self, exc: BaseException) -> None:
        """An apply failed (called from either thread): pause before the next try."""
        now = time.monotonic()
        if not self.lost and _invalidates(exc):
            self.lost = _brief(exc)
            log.error("the operational file's database was invalidated by a failed write; this"
                      " writer process ends once the disk has room again, and a new one reopens"
                      " the file and applies the journal")
        self.apply_failures += 1
        self.last_apply_error = _brief(exc)
        self._retry_pause = min(self.APPLY_RETRY_MAX_SECONDS,
                                max(self.APPLY_RETRY_FIRST_SECONDS, self._retry_pause * 2))
        self._retry_at = now + self._retry_pause
        if self.failing_since is None:
            self.failing_since = now
            log.error("the operational file refused %d journaled rows; they stay in the journal"
                      " and are tried again, writes are refused past %d", self.unapplied_rows,
                      self.max_backlog_rows, exc_info=exc)
        else:
            log.warning("the operational file still refuses writes (%s); next try in %g s",
                        self.last_apply_error, self._retry_pause)

    def _note_success(self) -> None:
        if self.failing_since is not None:
            log.warning("the operational file takes writes again after %.1f s",
                        time.monotonic() - self.failing_since)
            self.failing_since = None
            self.last_apply_error = ""
            self._retry_pause = 0.0

    def retry_due(self) -> bool:
        """Whether the file may be tried now: no failed apply, or its pause is over."""
        return self.failing_since is None or time.monotonic() >= self._retry_at

    def _take(self) -> _Batch | None:
        """The waiting rows as a batch (with a failed batch before them); the segments the
        writer has moved on from go with it, to be deleted once it is applied. The current
        segment keeps taking groups until it is full (or a prefilled spare can replace a
        segment that was not prefilled)."""
        if (self._failed is None and self.seq == self.applied_seq and not self._deferred
                and len(self._segments) == 1):  # (segments read at a start are deleted too)
            return None
        # The next segment first. One that cannot be made (no space for the journal either)
        # leaves the current one in use: its groups stay applied as they come.
        journal = self.journal
        if self._rotation_due():
            try:
                journal = self._new_segment()
            except OSError:
                if not self._rotation_failed:
                    log.warning("journal: could not start a new segment; %s stays in use",
                                self.journal.path.name, exc_info=True)
                self._rotation_failed = True
            else:
                if self._rotation_failed:
                    log.warning("journal: a new segment could be started again")
                self._rotation_failed = False
        closed = self._segments[:-1]
        self._segments = [journal]
        self.journal = journal
        if self._failed is not None:
            batch, _ = self._failed
            self._failed = None
            for table, rows in self._pending.items():
                batch.tables.setdefault(table, []).extend(rows)
            for table, rows in self._deferred.items():
                batch.deferred.setdefault(table, []).extend(rows)
            batch.seq = self.seq
            batch.segments.extend(closed)
        else:
            batch = _Batch(self._pending, self.seq, closed, self._deferred)
        self._pending, self._pending_rows, self._deferred = {}, 0, {}
        batch.journaled_bytes = self.journaled_bytes
        batch.journaled_rows = self.journaled_rows
        return batch

    def _settle(self) -> None:
        """Note what the applier finished (called from the writer thread)."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
        if self._done is not None:
            self.applied_seq = max(self.applied_seq, self._done.seq)
            self.applied_bytes = max(self.applied_bytes, self._done.journaled_bytes)
            self.applied_rows = max(self.applied_rows, self._done.journaled_rows)
            self._done = None
            self._note_success()

    def materialize_due(self) -> None:
        """The writer's tick: `materialize_soon`, unless fewer than MAX_PENDING_ROWS rows
        wait and the oldest has waited less than APPLY_AFTER_SECONDS (nothing failed)."""
        if (0 < self._pending_rows < self.MAX_PENDING_ROWS and self._failed is None
                and time.monotonic() - self._pending_since < self.APPLY_AFTER_SECONDS):
            self._settle()
            return
        self.materialize_soon()

    def materialize_soon(self) -> None:
        """Hand the waiting rows to the applier thread, unless it is still busy (then they
        wait for the next call, or the writer waits if far too many are waiting)."""
        self._settle()
        if self._thread is not None:
            if self._pending_rows < 2 * self.MAX_PENDING_ROWS:
                return
            self._thread.join()
            self._settle()
        if not self.retry_due():
            return  # the file refused the last try: wait out the pause
        batch = self._take()
        if batch is None:
            if self.after_apply is not None and time.monotonic() - self._idle_upkeep_at > 2.0:
                self._idle_upkeep_at = time.monotonic()
                self._thread = threading.Thread(target=self._upkeep_in_thread,
                                                name="journal-upkeep", daemon=True)
                self._thread.start()
            return
        self._thread = threading.Thread(target=self._apply_in_thread, args=(batch,),
                                        name="journal-apply", daemon=True)
        self._thread.start()

    def _upkeep_in_thread(self) -> None:
        run_in_background()
        self._upkeep(self._applier_conn)

    def _upkeep(self, conn: duckdb.DuckDBPyConnection) -> None:
        if self.after_apply is None:
            return
        try:
            self.after_apply(conn)
        except Exception:
            log.exception("upkeep of the operational file failed; retrying later")

    def _apply_in_thread(self, batch: _Batch) -> None:
        run_in_background()
        try:
            self._apply(self._applier_conn, batch)
        except BaseException as exc:
            self._failed = (batch, exc)
            self._note_failure(exc)
            return
        self._done = batch
        self._upkeep(self._applier_conn)

    def _apply(self, conn: duckdb.DuckDBPyConnection, batch: _Batch) -> None:
        if batch.seq > self.applied_seq or any(batch.tables.values()):
            conn.execute("BEGIN")
            try:
                self._check_fault()
                write_rows(conn, batch.tables)
                conn.execute("DELETE FROM journal_state")
                conn.execute("INSERT INTO journal_state VALUES (?)", [batch.seq])
                conn.execute("COMMIT")
            except BaseException:
                try:
                    conn.execute("ROLLBACK")
                except duckdb.Error:
                    pass
                raise
        # From here on the batch is in the file: nothing below may mark it failed (a retry
        # would apply it twice).
        batch.tables = {}
        for segment in batch.segments:
            try:
                segment.close()
                segment.path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                log.warning("could not delete applied journal segment %s (it is skipped at start)",
                            segment.path, exc_info=True)
        batch.segments = []
        if batch.deferred:
            try:
                conn.execute("BEGIN")
                write_rows(conn, batch.deferred)
                conn.execute("COMMIT")
            except Exception:
                log.exception("dropping %d best-effort rows the file refused",
                              sum(len(rows) for rows in batch.deferred.values()))
                try:
                    conn.execute("ROLLBACK")
                except duckdb.Error:
                    pass
            batch.deferred = {}

    def _check_fault(self) -> None:
        """The test hook (`fault_file`): fail the apply as a full disk would; when the file
        says `fatal`, as DuckDB does when the full disk also invalidated its database."""
        fault = self.fault_file
        if fault is not None and fault.exists():
            if fault.read_text().strip() == "fatal":
                raise duckdb.FatalException(
                    "FATAL Error: Failed: database has been invalidated because of a previous"
                    f" fatal error (test fault: {fault.name} says fatal)")
            raise duckdb.IOException("Could not write to the operational file: No space left on"
                                     f" device (test fault: {fault.name} exists)")

    def materialize(self) -> None:
        """Apply every durable group not yet in the DuckDB file, now (the writer waits).
        While the file refuses writes, raises `StorageUnavailable` (at once during the
        pause after a failed try)."""
        if self._thread is not None:
            self._thread.join()
        self._settle()
        if not self.retry_due():
            raise self.refusal()
        batch = self._take()
        if batch is None:
            return
        try:
            self._apply(self.conn, batch)
        except Exception as exc:
            self._failed = (batch, exc)
            self._note_failure(exc)
            raise self.refusal() from exc
        self.applied_seq = batch.seq
        self.applied_bytes = max(self.applied_bytes, batch.journaled_bytes)
        self.applied_rows = max(self.applied_rows, batch.journaled_rows)
        self._note_success()

    def reading(self) -> duckdb.DuckDBPyConnection:
        """The connection, with every durable group applied: for reads of the file."""
        self.materialize()
        return self.conn

    def close(self) -> None:
        self._retry_at = 0.0  # one last try, whatever the pause
        self.materialize()
        self.journal.close()
        self.journal.path.unlink(missing_ok=True)  # everything it holds is in the file
        if self._spare_thread is not None:
            self._spare_thread.join()
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        self._spare_path.unlink(missing_ok=True)
        self._applier_conn.close()
