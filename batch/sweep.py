"""The sweep: rate every event of the lake that no batch run has rated yet.

`sweep(conn, plan, lock)` runs over a DuckDB connection with the lake attached as `lake`:

1. It takes the rating lock (`rating_runs.RatingLock`) and only then looks for work, so a
   second sweep started at the same moment waits and then finds nothing left to do.
2. Candidates are the events exported after the last completed sweep's watermark (the
   greatest `export_id` it had seen; the exporter writes export ids in commit order) plus any
   event without an export id. An event is pending when no completed sweep, rerate or
   aggregate run holds a row for it; inline ratings do not count, they are provisional.
3. Pending events are split into chunks of about `chunk_events` by a hash of the billing
   account. A query rates the pending events (`RatingPlan.slots_sql`: a row per event with
   its priced lines); numpy carries the remainders and prices each line (`batch.carry`);
   the lines go to lake.rating_lines in Parquet files pyarrow writes. With one chunk that
   is all; with more, the rated events are staged in memory as Arrow with their account's
   bucket, whose counts make the chunks; two threads carry chunks and write their files
   while this one commits them. Each chunk is one run; the runs ready at a commit (at least
   one a second) go in one lake transaction (`rating_runs.commit_written_runs`): their
   files and rating_runs rows land together or not at all. Events too many for the memory
   budget are rated in passes over ranges of account buckets. A run whose sums might
   leave int64 is priced by the SQL window in HUGEINT instead (`rating_plan.amounts_sql`,
   rows in lake.rating_rows). A crash loses at most the runs not yet committed, which the
   next sweep rates again; no event is ever half rated. Memory stays flat however many
   events wait.
4. All of an account's pending events fall in one chunk, so the carry of a run (per account,
   meter and price row, in occurred_at order, from 0) is exactly the carry one run over
   everything would give.

Every swept event gets at least one row: `rated` lines, or `skipped_no_policy`,
`quarantined` or `deferred` (its aggregate policy rates it per day, see `aggregate_days`).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset  # noqa: F401 (DuckDB imports it to scan an Arrow table: once, here)

from batch.carry import CarryOutOfRange, PriceTerms, carry_shares, contiguous, micros, uuid_words
from batch.rating_plan import LINE_CATALOG, RatingPlan, amounts_sql, sql_instant
from batch.rating_runs import (
    RatingLock,
    RunSummary,
    WrittenRun,
    batch_runs_sql,
    commit_written_runs,
    missing_kinds,
    new_run_id,
    rated_events_sql,
    write_lines_files,
    write_lines_run,
    write_run,
)
from core.clock import SYSTEM_CLOCK, Clock
from warehouse.lake import table_folder, with_lake_retry

__all__ = ["CHUNK_EVENTS", "Progress", "SlotLines", "event_rows_sql", "plan_chunks", "slot_lines", "sweep",
           "sweep_locked"]

# Events per run (chunks are of equal size, an even number of them, about this big).
# Smaller chunks shorten the stretches where one core idles (the first carry, the last
# commit): interleaved at 5 M events, 5.7-6.2 s with chunks of 500,000 against 6.5-6.7 s
# with 1,000,000 before two threads carried them; now within the noise, with less memory.
CHUNK_EVENTS = 500_000
BUCKETS = 1024  # account hash buckets; chunks are runs of consecutive buckets

Progress = Callable[[int, int], None]  # (events done, events in all)


@dataclass(frozen=True, slots=True)
class Chunk:
    first_bucket: int
    last_bucket: int
    events: int  # candidates in these buckets

    def where(self, alias: str) -> str:
        return (f"hash({alias}.billing_account_id) % {BUCKETS}"
                f" BETWEEN {self.first_bucket} AND {self.last_bucket}")


def plan_chunks(conn: duckdb.DuckDBPyConnection, candidates: str, chunk_events: int) -> list[Chunk]:
    """Consecutive account buckets grouped into chunks of about `chunk_events` candidates
    (a single bucket bigger than that is a chunk of its own)."""
    counts = conn.execute(
        f"SELECT hash(e.billing_account_id) % {BUCKETS} AS bucket, count(*) FROM lake.events AS e"
        f" WHERE {candidates} GROUP BY bucket ORDER BY bucket").fetchall()
    return group_buckets(counts, chunk_events)


def group_buckets(counts: Iterable[tuple[int, int]], chunk_events: int, multiple: int = 1) -> list[Chunk]:
    """`plan_chunks` from (bucket, events) pairs in bucket order: as few chunks as keep
    them near `chunk_events` (their number rounded up to a `multiple`), of about equal size
    (a small last chunk would cost a run of its own; a bucket bigger than a chunk is a
    chunk of its own)."""
    found = [(bucket, count) for bucket, count in counts if count]
    total = sum(count for _, count in found)
    if not total:
        return []
    parts = -(-total // max(chunk_events, 1))
    if parts > 1:
        parts = -(-parts // multiple) * multiple
    chunks: list[Chunk] = []
    before = 0
    last_part = -1
    for bucket, count in found:
        # A bucket goes to the part its first event falls in, by equal shares of the total.
        part = before * parts // total
        if chunks and part == last_part:
            last = chunks[-1]
            chunks[-1] = Chunk(last.first_bucket, bucket, last.events + count)
        else:
            chunks.append(Chunk(bucket, bucket, count))
        last_part = part
        before += count
    return chunks


def event_rows_sql(run_id: str, rated_at: datetime, priced: str) -> str:
    """lake.rating_rows rows (STORED_COLUMNS order) of the priced event lines of `priced`: the
    line's kind by its line_id, so the described columns and the two ids are left NULL for
    the `ratings` view to fill (writing them out was half of a sweep's time)."""
    amounts = amounts_sql(priced, "event_id, line_key")
    return (
        f"SELECT NULL, '{run_id}', 'event', NULL, a.event_id, a.realm, a.billing_account_id,"
        " NULL, NULL, NULL, NULL, NULL, a.quantity_minor, a.price_id, a.unit_price_xusd,"
        f" a.unit_quantity_minor, a.amount_xusd, a.occurred_at, {sql_instant(rated_at)}, NULL,"
        f" c.line_id FROM ({amounts}) AS a JOIN {LINE_CATALOG} AS c ON c.line_key = a.line_key"
    )


# Runs on other machines may stamp their start with a clock that is a little off.
CLOCK_MARGIN = timedelta(hours=1)


@dataclass(frozen=True)
class _State:
    watermark: int  # the greatest export id a completed sweep had looked at (-1: none)
    since: datetime | None  # when that sweep read it
    recent: int  # completed batch runs that started after `since` (less the margin)
    greatest: int  # the greatest export id in the lake now (-1: none)
    unexported: int  # events without an export id
    candidates: int  # events beyond the watermark or without an export id


def _state(conn: duckdb.DuckDBPyConnection) -> _State:
    """What the lake tells a sweep, in one query (each costs ~10-20 ms in the catalog): the
    watermark, how many runs started after it was read (so might hold rows of events
    beyond it), and the events beyond it."""
    margin = int(CLOCK_MARGIN.total_seconds())
    row = conn.execute(
        f"WITH runs AS ({batch_runs_sql()}), mark AS ("
        " SELECT CAST(json_extract_string(params, '$.through_export_id') AS BIGINT) AS through,"
        " coalesce(CAST(json_extract_string(params, '$.through_read_at') AS TIMESTAMPTZ),"
        " started_at) AS read_at FROM runs WHERE kind = 'sweep'"
        " AND json_extract_string(params, '$.through_export_id') IS NOT NULL"
        " ORDER BY 1 DESC, 2 DESC LIMIT 1),"
        " watermark AS (SELECT coalesce((SELECT through FROM mark), -1) AS through)"
        " SELECT (SELECT through FROM watermark), (SELECT read_at FROM mark),"
        " (SELECT count(*) FROM runs WHERE NOT EXISTS (SELECT 1 FROM mark)"
        f"  OR runs.started_at >= (SELECT read_at FROM mark) - INTERVAL {margin} SECONDS),"
        " e.*"
        " FROM (SELECT coalesce(max(export_id), -1), count(*) FILTER (export_id IS NULL),"
        "  count(*) FILTER (export_id IS NULL OR export_id > (SELECT through FROM watermark))"
        "  FROM lake.events) AS e").fetchone()
    if row is None:
        return _State(-1, None, 0, -1, 0, 0)
    return _State(int(row[0]), row[1], int(row[2]), int(row[3]), int(row[4]), int(row[5]))


# Up to this many (line, price row) pairs, line kinds are looked up in a table.
_DENSE_KINDS = 1 << 16


class _RunWriter:
    """Writes the rated events of a chunk (an Arrow table of `RatingPlan.slots_sql` columns:
    each event and its lines in slots) as one sweep run: the carry and amounts in numpy
    (`batch.carry`), the rows to lake.rating_lines, one per line. A chunk whose sums
    might leave int64 is priced by the SQL window in HUGEINT instead, into lake.rating_rows,
    exactly as before there was a fast path."""

    def __init__(self, conn: duckdb.DuckDBPyConnection, plan: RatingPlan,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.conn = conn
        self.clock = clock
        self.slots = plan.slot_count()
        self.slot_columns = plan.slot_columns()
        self.slot_bytes = plan.slot_bytes()
        self.terms = PriceTerms.of(plan.price_terms())
        kinds, self.kind_ids = plan.priced_kinds()
        self.width = len(plan.prices) + 1
        # A table by (line, price row) when small; a catalog of many realms has few pairs
        # of its lines' and prices' cross product, looked up one distinct pair at a time.
        self.kind_table = (np.array([self.kind_ids.get(k, 0) for k in range(len(plan.lines) * self.width)],
                                    dtype=np.int64)
                           if len(plan.lines) * self.width <= _DENSE_KINDS else None)
        self.folder = table_folder(conn, "rating_lines")
        # Kinds the lake lacks go in with the first run's rows, in its transaction (on
        # their own they took a transaction more: ~0.1 s of every sweep that adds one).
        # A sweep of chunks looks them up while its threads carry the first chunks
        # (`look_up_kinds`): before the scan, the lookup's ~25 ms were on its critical path.
        self._kinds = kinds
        self.missing: list[tuple[object, ...]] | None = None  # None: not looked up yet

    def look_up_kinds(self) -> list[tuple[object, ...]]:
        """The line kinds the lake lacks (looked up the first time), until a commit records them."""
        if self.missing is None:
            # (after the scan: a busy catalog must not throw the scan's work away)
            self.missing = with_lake_retry(lambda: missing_kinds(self.conn, self._kinds))
        return self.missing

    def columns(self) -> str:
        """The columns of `slots_sql` the writer reads."""
        return f"event_id, realm, billing_account_id, occurred_at, {', '.join(self.slot_columns)}"

    def _line_ids(self, line_key: np.ndarray, price_key: np.ndarray) -> np.ndarray:
        pair = line_key * self.width + price_key + 1
        if self.kind_table is not None:
            return self.kind_table[pair]
        distinct, where = np.unique(pair, return_inverse=True)
        return np.array([self.kind_ids.get(int(k), 0) for k in distinct], dtype=np.int64)[where]

    def write(self, events: pa.Table, params: dict[str, object]) -> RunSummary:
        prepared = self.prepare(events, files=2)
        prepared.params = params
        [run] = self.commit([prepared])
        return run

    def prepare(self, events: pa.Table, files: int = 1) -> _Prepared:
        """The run's rows: the carry and amounts of its lines, written to `files` Parquet
        files in the table's folder (no lake access: safe on threads of their own while
        another run commits; the lake has the files only once `commit` adds them)."""
        started_at = self.clock.now()
        prepared = _Prepared(new_run_id("sweep", started_at), started_at, time.monotonic(),
                             events)
        try:
            lines = slot_lines(events, self.slots, self.terms)
        except CarryOutOfRange:
            return prepared  # priced in SQL at commit
        taken = pa.array(lines.parent)
        rows = pa.table({
            "event_id": contiguous(events.column("event_id")).take(taken),
            "realm": pc.dictionary_encode(contiguous(events.column("realm"))).take(taken),
            "billing_account_id": lines.accounts.take(taken),
            "occurred_at": contiguous(events.column("occurred_at")).take(taken),
            "line_id": pa.array(self._line_ids(lines.line_key, lines.price_key)),
            "quantity_minor": lines.quantity,
            "amount_xusd": lines.amount,
        })
        if self.folder is None:
            prepared.rows = rows
        else:
            prepared.written = WrittenRun(
                prepared.run_id, "sweep", started_at, {}, events.num_rows, rows.num_rows,
                write_lines_files(rows, prepared.run_id, self.folder, files) if rows.num_rows else [],
                prepared.began)
            # Its lines are in files: the commit needs none of its events. Kept until the
            # commit (a sweep of 5 M events commits once, at the end), they were ~40 MB a
            # chunk of memory faulted in afresh: 400 MB more at the peak, and ~0.2 CPU s.
            prepared.events = None
        return prepared

    def commit(self, runs: list[_Prepared]) -> list[RunSummary]:
        """Write prepared runs (their `params` set) to the lake: those with their files
        written in one transaction, any other in one of its own."""
        done: list[RunSummary] = []
        written = []
        for run in runs:
            if run.written is not None:
                run.written.params = run.params
                written.append(run.written)
        if written:
            done += commit_written_runs(self.conn, written, kinds=self.look_up_kinds(),
                                        clock=self.clock)
            self.missing = []
        for prepared in runs:
            if prepared.written is None:
                done.append(self._commit_alone(prepared))
        return done

    def _commit_alone(self, prepared: _Prepared) -> RunSummary:
        run_id, started_at, params = prepared.run_id, prepared.started_at, prepared.params
        assert prepared.events is not None  # (kept for every run without files)
        if prepared.rows is not None:
            summary = write_lines_run(self.conn, run_id=run_id, kind="sweep",
                                      started_at=started_at, params=params,
                                      lines=prepared.rows, events=prepared.events.num_rows,
                                      kinds=self.look_up_kinds())
            self.missing = []
        else:
            name = f"_sweep_events_{run_id.rsplit('-', 1)[-1]}"
            self.conn.register(name, prepared.events)
            try:
                def column(name_: str, kind: str) -> str:
                    return name_ if name_ in self.slot_columns else f"CAST(NULL AS {kind})"
                lines_sql = "(" + " UNION ALL ".join(
                    f"SELECT event_id, realm, billing_account_id, occurred_at, k{j} AS line_key,"
                    f" {column(f'q{j}', 'BIGINT')} AS quantity_minor,"
                    f" {column(f'p{j}', 'INTEGER')} AS price_key FROM {name} WHERE k{j} IS NOT NULL"
                    for j in range(self.slots)) + ")"
                summary = write_run(self.conn, run_id=run_id, kind="sweep", started_at=started_at,
                                    clock=self.clock,
                                    params=params, events=prepared.events.num_rows,
                                    rows_sql=event_rows_sql(run_id, started_at, lines_sql))
            finally:
                self.conn.unregister(name)
        return RunSummary(run_id, summary.kind, summary.events, summary.lines,
                          time.monotonic() - prepared.began)


@dataclass(frozen=True)
class SlotLines:
    """The lines of a table of rated events in slots, one entry per line, slot by slot."""

    parent: np.ndarray  # the event's row
    line_key: np.ndarray
    quantity: pa.Array  # int64, NULL for a line without one
    price_key: np.ndarray  # -1 without a price row
    amount: pa.Array  # amount_xusd (NULL without a quantity), carried
    accounts: pa.DictionaryArray  # the events' billing accounts, encoded (not per line)


def slot_lines(events: pa.Table, slots: int, terms: PriceTerms) -> SlotLines:
    """Every line of `events` (columns of `RatingPlan.slots_sql` with `slots` slots) and its
    amount, carried per (account, price row) in occurred_at order (`carry_shares`; raises
    `CarryOutOfRange` for sums that might leave int64)."""
    parents: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    quantities: list[pa.Array] = [pa.array([], type=pa.int64())]
    prices: list[np.ndarray] = []
    names = set(events.column_names)
    for j in range(slots):
        key = contiguous(events.column(f"k{j}"))
        rows = np.flatnonzero(np.asarray(key.is_valid()))
        if not len(rows):
            continue
        taken = pa.array(rows)
        parents.append(rows)
        keys.append(np.asarray(key.take(taken)).astype(np.int64))
        # A slot no policy puts a quantity or price in has no column for it.
        quantities.append(contiguous(events.column(f"q{j}")).take(taken).cast(pa.int64())
                          if f"q{j}" in names else pa.nulls(len(rows), pa.int64()))
        prices.append(np.asarray(pc.fill_null(contiguous(events.column(f"p{j}")).take(taken), -1))
                      .astype(np.int64) if f"p{j}" in names else np.full(len(rows), -1, np.int64))
    empty = np.zeros(0, dtype=np.int64)
    parent = np.concatenate(parents) if parents else empty
    line_key = np.concatenate(keys) if keys else empty
    price_key = np.concatenate(prices) if prices else empty
    quantity = pa.concat_arrays(quantities)
    event_ids = events.column("event_id")

    def tie_break(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        high, low = uuid_words(event_ids, parent[rows])
        return high, low, line_key[rows]

    accounts = pc.dictionary_encode(contiguous(events.column("billing_account_id")))
    amount = carry_shares(np.asarray(accounts.indices).astype(np.int64)[parent],
                          micros(events.column("occurred_at"))[parent],
                          quantity, price_key, terms, tie_break)
    return SlotLines(parent, line_key, quantity, price_key, amount, accounts)


@dataclass
class _Prepared:
    run_id: str
    started_at: datetime
    began: float
    events: pa.Table | None  # the chunk's rated events, as read (None once its lines are in files)
    # Its lines in files, waiting for the commit; or (no folder for files) the rows to
    # INSERT; neither: priced in SQL (HUGEINT) at the commit.
    written: WrittenRun | None = None
    rows: pa.Table | None = None
    params: dict[str, object] = field(default_factory=dict)

    def discard(self) -> None:
        """Remove the files of a run that will not be committed."""
        if self.written is not None:
            self.written.discard()


def sweep(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, lock: RatingLock, *,
          chunk_events: int = CHUNK_EVENTS, scratch: Path | None = None,
          progress: Progress | None = None, clock: Clock = SYSTEM_CLOCK) -> list[RunSummary]:
    """Rate every pending event; one run per chunk. Returns the runs written."""
    with lock:
        return sweep_locked(conn, plan, chunk_events=chunk_events, scratch=scratch,
                            progress=progress, clock=clock)


def sweep_locked(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, *,
                 chunk_events: int = CHUNK_EVENTS, scratch: Path | None = None,
                 progress: Progress | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> list[RunSummary]:
    """`sweep` for a caller that already holds the rating lock. `scratch` is a folder for
    the Parquet stage of a sweep too big for memory (a temporary folder when None)."""
    plan.install(conn)
    read_at = clock.now()  # before the greatest export id is read
    state = _state(conn)
    watermark, since = state.watermark, state.since
    through = max(watermark, state.greatest)
    unexported = bool(state.unexported)
    candidates = state.candidates
    if not candidates:
        return []
    # An event exported beyond the watermark was not in the lake when the watermark sweep
    # read it, so only a run that started after that moment can have rated it (runs hold
    # the rating lock one at a time; the sweep's own chunks start later still): only those
    # runs' rows are looked up: a sweep's cost follows what is new, not the size of the lake. An
    # event without an export id (loaded into the lake by hand) is checked against all runs.
    recent = "TRUE" if since is None else f"b.started_at >= {sql_instant(since - CLOCK_MARGIN)}"
    anti = ""
    if state.recent:
        # Only when such runs exist: the anti-join costs ~0.2 s per million pending events
        # even when it removes nothing. That saves it on a lake's first sweep (and in
        # bench/rating.py) only: a later sweep always finds the run of the watermark.
        anti = f" ANTI JOIN ({rated_events_sql(recent)}) AS r ON r.event_id = e.event_id"

    def rated(where: str = "TRUE") -> str:
        """The rated pending events (`slots_sql`) among those `where` (alias e)."""
        pending = f"SELECT e.* FROM lake.events AS e{anti} WHERE e.export_id > {watermark} AND {where}"
        if unexported:
            pending += (f" UNION ALL SELECT e.* FROM lake.events AS e ANTI JOIN"
                        f" ({rated_events_sql()}) AS r ON r.event_id = e.event_id"
                        f" WHERE e.export_id IS NULL AND {where}")
        return plan.slots_sql(f"({pending})")

    writer = _RunWriter(conn, plan, clock)
    # UUIDs reach Arrow as 16 bytes, not text (the carry orders ties by them).
    lossless = conn.execute("SELECT current_setting('arrow_lossless_conversion')").fetchone()
    conn.execute("SET arrow_lossless_conversion = true")
    try:
        if candidates <= chunk_events:
            # One chunk: its events in one query, straight to the carry and the lake.
            # The relation API materializes in parallel; execute() streams on one thread.
            events = conn.sql(rated()).to_arrow_table()
            run = writer.write(events, {"buckets": [0, BUCKETS - 1], "through_export_id": through,
                                       "through_read_at": read_at.isoformat()})
            if progress is not None:
                progress(events.num_rows, events.num_rows)
            return [run]
        return _sweep_chunks(conn, writer, rated, candidates, chunk_events, through=through,
                             read_at=read_at, scratch=scratch, progress=progress,
                             where=f"(e.export_id IS NULL OR e.export_id > {watermark})")
    finally:
        conn.execute(f"SET arrow_lossless_conversion = {bool(lossless and lossless[0])}")


# A rated event staged in memory as Arrow takes: event_id 16 bytes, occurred_at 8, its
# bucket 2, the offsets of realm and account 4 each, validity bits ~2; the text of realm
# and account; its slots. Times a margin (measured: the benchmark's mix, estimated 78
# bytes an event, took 77.6).
_STAGED_FIXED_BYTES = 36
_STAGE_OVERHEAD = 1.1


def _stage_width(conn: duckdb.DuckDBPyConnection, slot_bytes: int, where: str) -> float:
    """The bytes one event `where` (alias e) takes in the stage, on average."""
    row = conn.execute("SELECT avg(length(e.realm) + length(e.billing_account_id))"
                       f" FROM lake.events AS e WHERE {where}").fetchone()
    text = float(row[0]) if row and row[0] is not None else 0.0
    return (_STAGED_FIXED_BYTES + slot_bytes + text) * _STAGE_OVERHEAD


def _memory_limit(conn: duckdb.DuckDBPyConnection) -> int:
    row = conn.execute("SELECT value FROM duckdb_settings() WHERE name = 'memory_limit'").fetchone()
    text = str(row[0]) if row else ""
    number, _, unit = text.partition(" ")
    scale = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40, "KB": 10 ** 3,
             "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "bytes": 1}.get(unit.strip())
    try:
        return int(float(number) * scale) if scale else 1 << 30
    except ValueError:
        return 1 << 30


def _sweep_chunks(conn: duckdb.DuckDBPyConnection, writer: _RunWriter,
                  rated: Callable[[str], str], candidates: int, chunk_events: int, *,
                  through: int, read_at: datetime, scratch: Path | None,
                  progress: Progress | None, where: str) -> list[RunSummary]:
    """More than one chunk: a scan rates the pending events and stages them (one row each,
    its priced lines in slots), then each chunk becomes a run.

    The stage is an Arrow table in this process, within three quarters of DuckDB's memory
    limit: each row carries its account's bucket, the buckets' counts make the chunks, and
    each chunk is a `take` of its rows. When the events do not fit, they are rated in
    passes, each over a range of account buckets that fits: every pass scans the events
    again, but DuckDB reads the payloads of that range's events only (the bucket filter
    goes into the scan), measured at ~0.1 CPU seconds a pass per million events of the
    lake, where staging 20 M events in Parquet files cost ~1.5 CPU seconds per million.
    A single bucket too big for memory is staged in Parquet, one partition per chunk.
    Memory stays flat however many events wait. (Streaming the rows to Python instead
    took 5.4 s for the scan of 5 M events: DuckDB's Arrow stream runs on one thread, the
    relation API's materialization on all.)

    Two threads carry chunks and write their files while this one commits them in order:
    with one, this thread's commits (each ~0.1 s in the SQLite catalog) were the queue."""
    width = _stage_width(conn, writer.slot_bytes, where)
    budget = _memory_limit(conn) * 3 // 4
    passes: list[Chunk | None] = [None]
    if candidates * width > budget:
        passes = list(plan_chunks(conn, where, max(int(budget // width), 1))) or [None]
    total = sum(p.events for p in passes if p is not None) or candidates
    runs: list[RunSummary] = []
    done = 0

    def step(events: int) -> None:
        nonlocal done
        done += events
        if progress is not None:
            progress(min(done, total), total)

    for number, part in enumerate(passes):
        within = "TRUE" if part is None else part.where("e")
        runs += _sweep_pass(conn, writer, rated(within), chunk_events,
                            in_memory=part is None or part.events * width <= budget,
                            where=f"{where} AND {within}",
                            through=through if number == len(passes) - 1 else None,
                            read_at=read_at, scratch=scratch, step=step)
    if progress is not None and done < total:
        progress(total, total)  # (candidates a run had rated already)
    return runs


def _sweep_pass(conn: duckdb.DuckDBPyConnection, writer: _RunWriter, rated: str,
                chunk_events: int, *, in_memory: bool, where: str, through: int | None,
                read_at: datetime, scratch: Path | None,
                step: Callable[[int], None]) -> list[RunSummary]:
    """One pass of `_sweep_chunks`: the events of `rated` staged, then carried and committed
    a chunk at a time. `through`: the watermark its last run records (None: not the last pass)."""
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="sweep-", dir=scratch))
    try:
        if in_memory:
            chunks, prepare = _memory_stage(conn, writer, rated, chunk_events)
        else:
            chunks, prepare = _parquet_stage(conn, writer, rated, chunk_events, where, folder)
        # Every chunk with events, and the last one always when it records the watermark.
        kept = [i for i, c in enumerate(chunks)
                if c.events or (i == len(chunks) - 1 and through is not None)]
        runs: list[RunSummary] = []
        ahead: deque[Future[_Prepared | None]] = deque()
        waiting: list[_Prepared] = []  # prepared, in order, not yet committed
        waiting_events = 0
        last_commit = time.monotonic()

        def commit_waiting() -> None:
            nonlocal last_commit, waiting_events
            runs.extend(writer.commit(waiting))
            step(waiting_events)
            waiting.clear()
            waiting_events = 0
            last_commit = time.monotonic()

        stop = threading.Event()

        def prepare_unless_stopped(index: int) -> _Prepared | None:
            return None if stop.is_set() else prepare(index)

        with ThreadPoolExecutor(_PREPARERS) as pool:
            try:
                queued = 0
                for position, index in enumerate(kept):
                    while queued < len(kept) and queued <= position + _PREPARERS:
                        ahead.append(pool.submit(prepare_unless_stopped, kept[queued]))
                        queued += 1
                    writer.look_up_kinds()  # (the first time: while the first chunks are carried)
                    prepared = ahead.popleft().result()
                    assert prepared is not None  # (stopped only below)
                    chunk = chunks[index]
                    prepared.params = {"buckets": [chunk.first_bucket, chunk.last_bucket]}
                    if index == len(chunks) - 1 and through is not None:
                        # Every candidate up to this export id has now been looked at by a sweep.
                        prepared.params["through_export_id"] = through
                        prepared.params["through_read_at"] = read_at.isoformat()
                    waiting.append(prepared)
                    waiting_events += chunk.events
                    shutil.rmtree(folder / f"chunk={index}", ignore_errors=True)
                    # Runs are committed a few at a time (a commit costs the same for one
                    # run or several): a crash loses at most COMMIT_SECONDS of work.
                    if (position == len(kept) - 1 or prepared.written is None
                            or time.monotonic() - last_commit >= COMMIT_SECONDS):
                        commit_waiting()
            finally:
                # After a failure (or a signal to stop: promptly), runs not committed never
                # reach the lake: their files are removed, and chunks not begun are not.
                stop.set()
                for prepared in waiting:
                    prepared.discard()
                for future in ahead:
                    if future.cancel():
                        continue
                    try:
                        left = future.result()
                    except Exception:  # noqa: BLE001 (the first failure is the one raised)
                        continue
                    if left is not None:
                        left.discard()
        return runs
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# Threads carrying chunks and writing their files at once (each writes one file per run).
_PREPARERS = 2
# The longest a prepared run waits for its commit (runs prepared meanwhile share it).
COMMIT_SECONDS = 1.0


def _memory_stage(conn: duckdb.DuckDBPyConnection, writer: _RunWriter, rated: str,
                  chunk_events: int) -> tuple[list[Chunk], Callable[[int], _Prepared]]:
    """The rated events as Arrow, in this process, with their account's bucket; the chunks
    their counts make, and how to prepare one (a take of its rows, batch by batch: a take
    from the whole chunked table would concatenate it first)."""
    stage = conn.sql(f"SELECT {writer.columns()},"
                     f" CAST(hash(billing_account_id) % {BUCKETS} AS USMALLINT) AS _bucket"
                     f" FROM ({rated})").to_arrow_table()
    schema = stage.schema.remove(stage.schema.get_field_index("_bucket"))
    batches = [batch for batch in stage.to_batches() if batch.num_rows]
    del stage
    buckets = [np.asarray(batch.column("_bucket")).astype(np.intp) for batch in batches]
    counts = np.zeros(BUCKETS, dtype=np.int64)
    for bucket in buckets:
        counts += np.bincount(bucket, minlength=BUCKETS)
    chunks = (group_buckets(enumerate(counts.tolist()), chunk_events, _PREPARERS)
              or [Chunk(0, BUCKETS - 1, 0)])
    # int16: numpy sorts it by radix (int32 took 0.2 s at 5 M events, on one core).
    chunk_of = np.zeros(BUCKETS, dtype=np.int16)
    for i, chunk in enumerate(chunks):
        chunk_of[chunk.first_bucket:chunk.last_bucket + 1] = i
    # Each batch's rows in chunk order (a stable sort keeps them in order within a chunk),
    # with where each chunk's rows start.
    held: list[tuple[pa.RecordBatch, np.ndarray, np.ndarray]] = []
    for batch, bucket in zip(batches, buckets, strict=True):
        of = chunk_of[bucket]
        order = np.argsort(of, kind="stable")
        starts = np.searchsorted(of[order], np.arange(len(chunks) + 1))
        held.append((batch.drop_columns(["_bucket"]), order, starts))
    del batches, buckets

    def prepare(index: int) -> _Prepared:
        return writer.prepare(pa.Table.from_batches(
            [batch.take(pa.array(order[starts[index]:starts[index + 1]]))
             for batch, order, starts in held], schema))

    return chunks, prepare


def _parquet_stage(conn: duckdb.DuckDBPyConnection, writer: _RunWriter, rated: str,
                   chunk_events: int, where: str,
                   folder: Path) -> tuple[list[Chunk], Callable[[int], _Prepared]]:
    """The rated events in Parquet under `folder`, one partition per chunk of `plan_chunks`
    (candidates `where`); the chunks, and how to prepare one (each on a connection of its
    own: they are read on two threads)."""
    chunks = plan_chunks(conn, where, chunk_events) or [Chunk(0, BUCKETS - 1, 0)]
    chunk_of = " ".join(f"WHEN _bucket <= {c.last_bucket} THEN {i}" for i, c in enumerate(chunks))
    staged = (f"SELECT {writer.columns()}, CASE {chunk_of} END AS chunk FROM"
              f" (SELECT *, hash(billing_account_id) % {BUCKETS} AS _bucket FROM ({rated}))")
    conn.execute(f"COPY ({staged}) TO '{folder}'"
                 " (FORMAT parquet, PARTITION_BY (chunk), COMPRESSION uncompressed)")

    def prepare(index: int) -> _Prepared:
        part = folder / f"chunk={index}"
        source = (f"read_parquet('{part}/*.parquet')" if part.is_dir()
                  else f"({rated}) WHERE FALSE")
        with conn.cursor() as reader:
            reader.execute("SET TimeZone = 'UTC'")
            reader.execute("SET arrow_lossless_conversion = true")
            return writer.prepare(
                reader.sql(f"SELECT {writer.columns()} FROM {source}").to_arrow_table())

    return chunks, prepare
