"""The sweep: rate every event of the lake that no batch run has rated yet.

`sweep(conn, plan, lock)` runs over a DuckDB connection with the lake attached as `lake`:

1. It takes the rating lock (`rating_runs.RatingLock`) and only then looks for work, so a
   second sweep started at the same moment waits and then finds nothing left to do.
2. Candidates are the events exported after the last completed sweep's watermark (the
   greatest `export_id` it had seen; the exporter writes export ids in commit order) plus any
   event without an export id. An event is pending when no completed sweep, rerate or
   aggregate run holds a row for it; inline ratings do not count, they are provisional.
3. Pending events are split into chunks of about `chunk_events` by a hash of the billing
   account. When there is one chunk, one statement rates and prices every pending event
   (`pipelines.rating_plan`), carries the remainders and writes the run. Otherwise one scan
   rates and prices every pending event and writes its lines, one partition per chunk, to a
   scratch folder; then each chunk gets the remainder carry and its amounts. Each chunk
   becomes one run in one lake transaction (`rating_runs.write_run`): its rows and its
   rating_runs row land together or not at all.
   A crash loses at most the chunk in flight, which the next sweep rates again; no event is
   ever half rated. Memory stays flat however many events wait, and the events are read once.
4. All of an account's pending events fall in one chunk, so the carry of a run (per account,
   meter and price row, in occurred_at order, from 0) is exactly the carry one run over
   everything would give.

Every swept event gets at least one row: `rated` lines, or `skipped_no_policy`,
`quarantined` or `deferred` (its aggregate policy rates it per day, see `aggregate_days`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb

from pipelines.rating_plan import LINE_CATALOG, RatingPlan, amounts_sql, priced_sql, sql_instant
from pipelines.rating_runs import (
    RatingLock,
    RunSummary,
    batch_runs_sql,
    new_run_id,
    write_run,
)

__all__ = ["CHUNK_EVENTS", "Progress", "event_rows_sql", "plan_chunks", "sweep", "sweep_locked"]

CHUNK_EVENTS = 1_000_000
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
    chunks: list[Chunk] = []
    current: Chunk | None = None
    for bucket, count in counts:
        if current is not None and current.events + count > chunk_events:
            chunks.append(current)
            current = None
        first = bucket if current is None else current.first_bucket
        current = Chunk(first, bucket, count + (0 if current is None else current.events))
    if current is not None:
        chunks.append(current)
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


def _watermark(conn: duckdb.DuckDBPyConnection) -> tuple[int, datetime | None]:
    """(the greatest export id a completed sweep had looked at, when that sweep read it)."""
    row = conn.execute(
        "SELECT CAST(json_extract_string(params, '$.through_export_id') AS BIGINT),"
        " coalesce(CAST(json_extract_string(params, '$.through_read_at') AS TIMESTAMPTZ), started_at)"
        f" FROM ({batch_runs_sql()}) WHERE kind = 'sweep'"
        " AND json_extract_string(params, '$.through_export_id') IS NOT NULL"
        " ORDER BY 1 DESC, 2 DESC LIMIT 1").fetchone()
    return (int(row[0]), row[1]) if row else (-1, None)


# Runs on other machines may stamp their start with a clock that is a little off.
CLOCK_MARGIN = timedelta(hours=1)


def _write_chunk(conn: duckdb.DuckDBPyConnection, lines: str, params: dict[str, object], *,
                 events: int | str | None, progress: Progress | None = None, total: int = 0) -> RunSummary:
    """One chunk's lines (priced, before the carry) as one sweep run."""
    started_at = datetime.now(timezone.utc)
    began = time.monotonic()
    run_id = new_run_id("sweep", started_at)
    summary = write_run(conn, run_id=run_id, kind="sweep", started_at=started_at, params=params,
                        events=events, rows_sql=event_rows_sql(run_id, started_at, lines))
    if progress is not None:
        progress(total, total)
    return RunSummary(summary.run_id, summary.kind, summary.events, summary.lines,
                      time.monotonic() - began)


def sweep(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, lock: RatingLock, *,
          chunk_events: int = CHUNK_EVENTS, scratch: Path | None = None,
          progress: Progress | None = None) -> list[RunSummary]:
    """Rate every pending event; one run per chunk. Returns the runs written."""
    with lock:
        return sweep_locked(conn, plan, chunk_events=chunk_events, scratch=scratch,
                            progress=progress)


def sweep_locked(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, *,
                 chunk_events: int = CHUNK_EVENTS, scratch: Path | None = None,
                 progress: Progress | None = None) -> list[RunSummary]:
    """`sweep` for a caller that already holds the rating lock. `scratch` is a folder for
    the lines between the two passes (a temporary folder when None)."""
    plan.install(conn)
    watermark, since = _watermark(conn)
    read_at = datetime.now(timezone.utc)  # before the greatest export id is read
    row = conn.execute("SELECT coalesce(max(export_id), -1), count(*) FILTER (export_id IS NULL)"
                       " FROM lake.events").fetchone()
    through = max(watermark, int(row[0]) if row else -1)
    unexported = bool(row and row[1])
    candidates = f"(e.export_id IS NULL OR e.export_id > {watermark})"
    chunks = plan_chunks(conn, candidates, chunk_events)
    if not chunks:
        return []
    # An event exported beyond the watermark was not in the lake when the watermark sweep
    # read it, so only a run that started after that moment can have rated it (runs hold
    # the rating lock one at a time; the sweep's own chunks start later still): only those
    # runs' rows are looked up: a sweep's cost follows what is new, not the size of the lake. An
    # event without an export id (loaded into the lake by hand) is checked against all runs.
    recent = "TRUE" if since is None else f"b.started_at >= {sql_instant(since - CLOCK_MARGIN)}"
    rated = (f"SELECT r.event_id FROM lake.rating_rows AS r JOIN ({batch_runs_sql()}) AS b"
             " ON b.run_id = r.run_id WHERE r.source = 'event' AND r.event_id IS NOT NULL")
    pending = (f"(SELECT e.* FROM lake.events AS e ANTI JOIN ({rated} AND {recent}) AS r"
               f" ON r.event_id = e.event_id WHERE e.export_id > {watermark}")
    if unexported:
        pending += (f" UNION ALL SELECT e.* FROM lake.events AS e ANTI JOIN ({rated}) AS r"
                    " ON r.event_id = e.event_id WHERE e.export_id IS NULL")
    pending += ")"
    priced = priced_sql("(" + plan.lines_sql(pending) + ")")
    if len(chunks) == 1:
        # One chunk: rate, price, carry and write in one statement, with no scratch files.
        return [_write_chunk(conn, f"({priced})", {"buckets": [chunks[0].first_bucket,
                                                               chunks[0].last_bucket],
                                                   "through_export_id": through,
                                                   "through_read_at": read_at.isoformat()},
                             events=f"SELECT count(*) FROM {pending}", progress=progress,
                             total=chunks[0].events)]
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="sweep-", dir=scratch))
    try:
        # Pass 1, one scan: every pending event rated and priced, its lines written to the
        # scratch folder in one partition per chunk (uncompressed: they are read once, soon).
        chunk_of = " ".join(f"WHEN _bucket <= {c.last_bucket} THEN {i}" for i, c in enumerate(chunks))
        conn.execute(
            f"COPY (SELECT * EXCLUDE (_bucket), CASE {chunk_of} END AS chunk FROM"
            f" (SELECT *, hash(billing_account_id) % {BUCKETS} AS _bucket FROM ({priced})))"
            f" TO '{folder}' (FORMAT parquet, PARTITION_BY (chunk), COMPRESSION uncompressed)")
        # Pass 2, per chunk: the carry, the amounts and the run's one lake transaction.
        total = sum(c.events for c in chunks)
        runs: list[RunSummary] = []
        done = 0
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            files = folder / f"chunk={index}"
            lines = (f"read_parquet('{files}/*.parquet')" if files.is_dir() else
                     f"(SELECT * FROM ({priced}) WHERE FALSE)")
            count = conn.execute(f"SELECT count(DISTINCT event_id) FROM {lines}").fetchone()
            events = int(count[0]) if count else 0
            if events or last:
                params: dict[str, object] = {"buckets": [chunk.first_bucket, chunk.last_bucket]}
                if last:
                    # Every candidate up to this export id has now been looked at by a sweep.
                    params["through_export_id"] = through
                    params["through_read_at"] = read_at.isoformat()
                runs.append(_write_chunk(conn, lines, params, events=events))
            shutil.rmtree(files, ignore_errors=True)
            done += chunk.events
            if progress is not None:
                progress(done, total)
        return runs
    finally:
        shutil.rmtree(folder, ignore_errors=True)
