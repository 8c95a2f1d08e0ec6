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
   A sweep rates the events up to the greatest export id it read at its start (`through`),
   and every run it writes records that bound (`rates_through`); events exported later wait
   for the next sweep. So a completed sweep's runs never hold an event beyond the watermark,
   and the next sweep need not look them up (see "The anti-join" below).
4. All of an account's pending events fall in one chunk, so the carry of a run (per account,
   meter and price row, in occurred_at order, from 0) is exactly the carry one run over
   everything would give.

Every swept event gets at least one row: `rated` lines, or `skipped_no_policy`,
`quarantined` or `deferred` (its aggregate policy rates it per day, see `aggregate_days`).

The steps live beside this module: `batch.chunks` plans chunks and passes, `batch.staging`
holds the rated events between the scan and the runs, and `batch.run_writer` makes each
chunk a run. This module is the order they run in: the lake's state, the scan, the threads
that prepare runs, and the commits.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb

from batch.chunks import BUCKETS, CHUNK_EVENTS, plan_passes
from batch.rating_plan import RatingPlan, sql_instant
from batch.rating_runs import RatingLock, RunSummary, batch_runs_sql, rated_events_sql
from batch.run_writer import PreparedRun, RunWriter
from batch.staging import memory_limit, memory_stage, parquet_stage, stage_width
from core.clock import SYSTEM_CLOCK, Clock

__all__ = ["Progress", "sweep", "sweep_locked"]

Progress = Callable[[int, int], None]  # (events done, events in all)


# Runs on other machines may stamp their start with a clock that is a little off.
CLOCK_MARGIN = timedelta(hours=1)


def _may_rate_beyond(runs: str, watermark: str) -> str:
    """SQL: a completed batch run (alias `runs`) may hold rows of events beyond `watermark`:
    any rerate run, and a sweep's run unless it records that it rated nothing past an export
    id at or below the watermark (runs written before `rates_through` was recorded count as
    may). An aggregate run's lines are days, with no event id: it holds no event's rows."""
    bound = f"CAST(json_extract_string({runs}.params, '$.rates_through') AS BIGINT)"
    return (f"{runs}.kind <> 'aggregate'"
            f" AND NOT coalesce({runs}.kind = 'sweep' AND {bound} <= {watermark}, false)")


@dataclass(frozen=True)
class _State:
    watermark: int  # the greatest export id a completed sweep had looked at (-1: none)
    since: datetime | None  # when that sweep read it
    recent: int  # completed batch runs that started after `since` (less the margin)
    greatest: int  # the greatest export id in the lake now (-1: none)
    unexported: int  # events without an export id
    candidates: int  # events beyond the watermark or without an export id


def _state(conn: duckdb.DuckDBPyConnection) -> _State:
    """What the lake tells a sweep: the watermark, how many runs started after it was read
    (so might hold rows of events beyond it), and the events beyond it.

    The events are counted in queries of their own, with the watermark as a literal: a
    condition on export_id reaches the scan, and DuckLake skips every file at or below the
    watermark by its statistics, so a sweep reads the files of the new exports, not the
    history. Counted in one query with the runs, the condition was a subquery's and every
    sweep read the export_id of every event ever stored (docs/measurements.md, "A lake's
    history and the flows")."""
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
        f"  OR (runs.started_at >= (SELECT read_at FROM mark) - INTERVAL {margin} SECONDS"
        f"  AND {_may_rate_beyond('runs', '(SELECT through FROM watermark)')}))").fetchone()
    if row is None:
        return _State(-1, None, 0, -1, 0, 0)
    watermark = int(row[0])
    # A literal, not a parameter: the plan's filter must be a constant to reach the scan.
    beyond = conn.execute("SELECT max(export_id), count(*) FROM lake.events"
                          f" WHERE export_id > {watermark:d}").fetchone()
    unexported = conn.execute("SELECT count(*) FROM lake.events WHERE export_id IS NULL").fetchone()
    newest, new = beyond if beyond else (None, 0)
    missing = int(unexported[0]) if unexported else 0
    # None beyond the watermark: the greatest export id is the watermark's (-1: no events).
    greatest = int(newest) if newest is not None else watermark
    return _State(watermark, row[1], int(row[2]), greatest, missing, int(new) + missing)


def sweep(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, lock: RatingLock, *,
          chunk_events: int = CHUNK_EVENTS, scratch: Path | None = None,
          progress: Progress | None = None, clock: Clock = SYSTEM_CLOCK,
          round_events: int | None = None) -> list[RunSummary]:
    """Rate every pending event; one run per chunk. Returns the runs written."""
    with lock:
        return sweep_locked(conn, plan, chunk_events=chunk_events, scratch=scratch,
                            progress=progress, clock=clock, round_events=round_events)


def sweep_locked(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, *,
                 chunk_events: int = CHUNK_EVENTS, scratch: Path | None = None,
                 progress: Progress | None = None, clock: Clock = SYSTEM_CLOCK,
                 round_events: int | None = None) -> list[RunSummary]:
    """`sweep` for a caller that already holds the rating lock. `scratch` is a folder for
    the Parquet stage of a sweep too big for memory (a temporary folder when None).

    A backlog bigger than `round_events` (by default what the flow's memory limit holds,
    `ROUND_EVENT_BYTES` an event) is rated in rounds, each over the next prefix of export
    ids, each ending with its own watermark: as the sweeps of the minutes it piled up in
    would have rated it. A round's chunks are ranges of accounts, and one account's events
    are one chunk (its carry runs in order within a run), so without rounds a sweep's memory
    followed the largest account's backlog (7.7 GiB for 50 M events of one account)."""
    plan.install(conn)
    if round_events is None:
        round_events = max(memory_limit(conn) // ROUND_EVENT_BYTES, chunk_events)
    read_at = clock.now()  # before the greatest export id is read
    state = _state(conn)
    # The sweep ends at the greatest export id it read now, however many rounds it takes.
    # Each round's watermark records a read time when no event beyond its bound was in the
    # lake yet, for the next sweep's anti-join: the last round's bound is `end`, read now;
    # an earlier round's later events were there already, so it keeps the time of the
    # watermark this sweep started from (none: a time before any event).
    end = max(state.watermark, state.greatest)
    early = state.since if state.since is not None else _BEFORE_ANY_EVENT
    total = state.candidates
    runs: list[RunSummary] = []
    reported = 0

    def step(events: int, of: int) -> None:
        nonlocal reported
        reported = max(reported, base + events)
        if progress is not None:
            progress(reported, max(total, base + of))

    while True:
        before, base = len(runs), reported
        more = _sweep_round(conn, plan, runs, chunk_events=chunk_events, scratch=scratch,
                            progress=step, clock=clock, round_events=round_events, end=end,
                            end_read_at=read_at, early_read_at=early)
        if not more or len(runs) == before:  # (a round always writes its watermark's run)
            return runs


# What a round records as its watermark's read time when events beyond its bound were in the
# lake already and the sweep began without a watermark: the next round looks up every run.
_BEFORE_ANY_EVENT = datetime(1970, 1, 1, tzinfo=timezone.utc)


# A round holds what the flow's memory limit gives at this many bytes an event (about 1 M
# events at the default 1 GB), in whole exports. On a backlog of 10 M events of one account
# (`tollgate flows run rate-events`, docs/measurements.md "Fifty million events"): one run,
# 11.5 s and a peak RSS of 2.11 GB; rounds of 3.5 M events, 7.1 s and 1.89 GB; of 1.5 M,
# 8.1 s and 1.69 GB; of 0.5 M, 7.9-8.2 s and 455 MB. (The process keeps up to 1 GiB it
# freed for reuse, `flows.process_memory`, so the peak is not linear in the round.)
ROUND_EVENT_BYTES = 1024


def _round_bound(conn: duckdb.DuckDBPyConnection, watermark: int, through: int,
                 round_events: int) -> tuple[int, int]:
    """The greatest export id up to which the events beyond `watermark` number at most
    `round_events` (the first export id's events at least), and how many there are."""
    counts = conn.execute(
        "SELECT export_id, count(*) FROM lake.events"
        f" WHERE export_id > {watermark} AND export_id <= {through} GROUP BY ALL ORDER BY 1").fetchall()
    bound, events = watermark, 0
    for export_id, n in counts:
        if events and events + n > round_events:
            break
        bound, events = int(export_id), events + int(n)
    return bound, events


def _sweep_round(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, runs: list[RunSummary], *,
                 chunk_events: int, scratch: Path | None, progress: Progress, clock: Clock,
                 round_events: int, end: int, end_read_at: datetime,
                 early_read_at: datetime) -> bool:
    """One round of `sweep_locked`: its runs are added to `runs`. Returns whether events up
    to `end` wait beyond this round's bound."""
    state = _state(conn)
    watermark, since = state.watermark, state.since
    through = min(max(watermark, state.greatest), end)
    unexported = bool(state.unexported)
    candidates = state.candidates
    if not candidates or (through <= watermark and not unexported):
        return False
    if candidates > round_events and through > watermark:
        bound, events = _round_bound(conn, watermark, through, round_events)
        if bound < through:
            through = bound
            candidates = events + state.unexported
    read_at = end_read_at if through == end else early_read_at
    # An event exported beyond the watermark was not in the lake when the watermark sweep
    # read it, so only a run that started after that moment can have rated it (runs hold
    # the rating lock one at a time; the sweep's own chunks start later still): only those
    # runs' rows are looked up: a sweep's cost follows what is new, not the size of the lake. An
    # event without an export id (loaded into the lake by hand) is checked against all runs.
    # Of those, a completed sweep's runs are left out: they rated nothing beyond its bound.
    recent = ("TRUE" if since is None else f"b.started_at >= {sql_instant(since - CLOCK_MARGIN)}"
              f" AND {_may_rate_beyond('b', str(watermark))}")
    anti = ""
    if state.recent:
        # Only when such runs exist (a rerate, or a sweep that died before its last run): the anti-join costs ~0.2 s per million pending events even when it
        # removes nothing, and its rated side is every row of those runs.
        anti = f" ANTI JOIN ({rated_events_sql(recent)}) AS r ON r.event_id = e.event_id"
    exported = f"e.export_id > {watermark} AND e.export_id <= {through}"

    def rated(where: str = "TRUE") -> str:
        """The rated pending events (`slots_sql`) among those `where` (alias e)."""
        pending = f"SELECT e.* FROM lake.events AS e{anti} WHERE {exported} AND {where}"
        if unexported:
            pending += (f" UNION ALL SELECT e.* FROM lake.events AS e ANTI JOIN"
                        f" ({rated_events_sql()}) AS r ON r.event_id = e.event_id"
                        f" WHERE e.export_id IS NULL AND {where}")
        return plan.slots_sql(f"({pending})")

    writer = RunWriter(conn, plan, clock)
    # UUIDs reach Arrow as 16 bytes, not text (the carry orders ties by them).
    lossless = conn.execute("SELECT current_setting('arrow_lossless_conversion')").fetchone()
    conn.execute("SET arrow_lossless_conversion = true")
    try:
        if candidates <= chunk_events:
            # One chunk: its events in one query, straight to the carry and the lake.
            # The relation API materializes in parallel; execute() streams on one thread.
            events = conn.sql(rated()).to_arrow_table()
            run = writer.write(events, {"buckets": [0, BUCKETS - 1], "rates_through": through,
                                       "through_export_id": through,
                                       "through_read_at": read_at.isoformat()})
            progress(events.num_rows, events.num_rows)
            runs.append(run)
        else:
            runs += _sweep_chunks(conn, writer, rated, candidates, chunk_events, through=through,
                                  read_at=read_at, scratch=scratch, progress=progress,
                                  where=f"(e.export_id IS NULL OR ({exported}))")
        return through < end
    finally:
        conn.execute(f"SET arrow_lossless_conversion = {bool(lossless and lossless[0])}")


def _sweep_chunks(conn: duckdb.DuckDBPyConnection, writer: RunWriter,
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
    width = stage_width(conn, writer.slot_bytes, where)
    budget = memory_limit(conn) * 3 // 4
    passes = plan_passes(conn, where, candidates, width, budget)
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
                            bound=through, through=through if number == len(passes) - 1 else None,
                            read_at=read_at, scratch=scratch, step=step)
    if progress is not None and done < total:
        progress(total, total)  # (candidates a run had rated already)
    return runs


def _sweep_pass(conn: duckdb.DuckDBPyConnection, writer: RunWriter, rated: str,
                chunk_events: int, *, in_memory: bool, where: str, bound: int,
                through: int | None, read_at: datetime, scratch: Path | None,
                step: Callable[[int], None]) -> list[RunSummary]:
    """One pass of `_sweep_chunks`: the events of `rated` staged, then carried and committed
    a chunk at a time. `bound`: the greatest export id the sweep rates (every run records
    it); `through`: the watermark its last run records (None: not the last pass)."""
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="sweep-", dir=scratch))
    try:
        if in_memory:
            chunks, prepare = memory_stage(conn, writer, rated, chunk_events, _PREPARERS)
        else:
            chunks, prepare = parquet_stage(conn, writer, rated, chunk_events, where, folder)
        # Every chunk with events, and the last one always when it records the watermark.
        kept = [i for i, c in enumerate(chunks)
                if c.events or (i == len(chunks) - 1 and through is not None)]
        runs: list[RunSummary] = []
        ahead: deque[Future[PreparedRun | None]] = deque()
        waiting: list[PreparedRun] = []  # prepared, in order, not yet committed
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

        def prepare_unless_stopped(index: int) -> PreparedRun | None:
            return None if stop.is_set() else prepare(index)

        pool = ThreadPoolExecutor(_PREPARERS)
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
                prepared.params = {"buckets": [chunk.first_bucket, chunk.last_bucket], "rates_through": bound}
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
            # Told to stop (a signal, not a failure), the process ends: a chunk being
            # carried is not waited for (seconds), and the files it may leave are orphans
            # that compact-lake deletes, as after a crash.
            stopping = not isinstance(sys.exc_info()[1], (Exception, type(None)))
            pool.shutdown(wait=not stopping, cancel_futures=True)
            for prepared in waiting:
                prepared.discard()
            for future in ahead if not stopping else ():
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

