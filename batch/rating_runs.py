"""Rating runs in the lake: what a run is, how it is written, and which ratings are current.

A rating run (sweep, rerate or aggregate) writes its rows to `lake.ratings` and its one
`lake.rating_runs` row (status `completed`) in ONE lake transaction, so a crash leaves all
of a run or none of it, and no reader ever sees half a run. Runs are serialized by an
exclusive lock on a file next to the lake (`RatingLock`), and a run decides what to rate only
after taking it, so two sweeps started together never rate an event twice: the second finds
the first one's rows.

Current values (the rating rules: "the latest run per event and line"):

- For each (realm, source_id) rated by a completed batch run (sweep, rerate, aggregate), the
  rows of the latest such run (by finished_at, then run_id), reversal rows excluded. A rerate
  appends reversals of the previous lines and the new lines under a new run; the old run stays.
- An event that no batch run has rated yet is current under its inline rating (run `inline`,
  provisional: priced without carry), which the sweep then supersedes.
- Gate commit lines (source `gate_commit`) are final when written; they are always current.

Because reversal rows negate exactly the lines they replace, the sum of every row of the
completed batch runs equals the sum of the current ones: both views agree.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batch.rating_plan import LINE_CATALOG, insert_rows
from core.clock import SYSTEM_CLOCK, Clock
from warehouse.lake import transaction, with_lake_retry
from warehouse.usage_days import rollup_lines_sql, rollup_rows_sql

__all__ = [
    "BATCH_KINDS",
    "KIND_COLUMNS",
    "PRICED_KIND_COLUMNS",
    "RATING_COLUMNS",
    "STORED_COLUMNS",
    "RatingLock",
    "RunSummary",
    "current_ratings_sql",
    "new_run_id",
    "rated_events_sql",
    "rating_id_sql",
    "missing_kinds",
    "record_kinds",
    "reversal_rows_sql",
    "WrittenRun",
    "commit_written_runs",
    "write_lines_files",
    "write_lines_run",
    "write_run",
]

BATCH_KINDS = ("sweep", "rerate", "aggregate")

RATING_COLUMNS = (
    "rating_id, run_id, source, source_id, event_id, realm, billing_account_id, status, "
    "policy_id, policy_version, feature_code, meter_code, quantity_minor, price_id, "
    "unit_price_xusd, unit_quantity_minor, amount_xusd, occurred_at, rated_at, line_index"
)

# What a run writes to lake.rating_rows: the view's columns and the row's line_id (NULL for
# a row that spells out its description; see warehouse.lake).
STORED_COLUMNS = RATING_COLUMNS + ", line_id"

# The columns of a line kind without a price row (a kind of rating_rows).
KIND_COLUMNS = "line_id, status, policy_id, policy_version, feature_code, meter_code, line_index"

# ... and of a kind of rating_lines, with its price row.
PRICED_KIND_COLUMNS = KIND_COLUMNS + ", price_id, unit_price_xusd, unit_quantity_minor"

_BATCH_KIND_LIST = ", ".join(f"'{kind}'" for kind in BATCH_KINDS)


@dataclass(frozen=True, slots=True)
class RunSummary:
    run_id: str
    kind: str
    events: int  # events (or aggregate days) rated
    lines: int  # rows written, reversals included
    seconds: float


def new_run_id(kind: str, now: datetime) -> str:
    """`<kind>-<UTC time to the microsecond>-<tag>`: sortable, unique across processes."""
    return f"{kind}-{now.astimezone(timezone.utc).strftime('%Y%m%dT%H%M%S%fZ')}-{secrets.token_hex(6)}"


def rating_id_sql(run_id: str, *, reversal: bool = False) -> str:
    """The rating_id of a row of run `run_id`: its source, its line and the run's random tag
    (48 bits), short because every row stores one. An aggregate day's row (no event_id) also
    names its policy version: a day split by a new version holds a line of each version
    with the same line_index."""
    tag = run_id.rsplit("-", 1)[-1]
    version = "CASE WHEN event_id IS NULL THEN concat(policy_version, ':') ELSE '' END"
    return (f"concat(source_id, ':', {version}, line_index,"
            f" ':{tag}{':reversal' if reversal else ''}')")


def reversal_rows_sql(run_id: str, rated_at: str, current: str) -> str:
    """Rows that negate the `rated` rows of relation `current` (lake.ratings columns) under
    run `run_id`: same line, quantity and amount negated, status `reversal`."""
    return (
        f"SELECT {rating_id_sql(run_id, reversal=True)}, '{run_id}', source, source_id, event_id,"
        " realm, billing_account_id, 'reversal', policy_id, policy_version, feature_code,"
        " meter_code, -quantity_minor, price_id, unit_price_xusd, unit_quantity_minor,"
        f" -amount_xusd, occurred_at, {rated_at}, line_index, CAST(NULL AS BIGINT)"
        f" FROM {current} WHERE status = 'rated'"
    )


class RatingLock:
    """An exclusive lock (flock) on a file, held while a rating run decides and writes.

    flock is released by the kernel when the holder dies, so a crashed run never leaves the
    lock behind. `timeout` None waits for as long as it takes."""

    def __init__(self, path: Path, timeout: float | None = None) -> None:
        self.path = path
        self.timeout = timeout
        self._fd: int | None = None

    def __enter__(self) -> RatingLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    raise TimeoutError(f"another rating run holds {self.path}") from None
                time.sleep(0.05)
        self._fd = fd
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def batch_runs_sql() -> str:
    """Completed batch runs with their order: later runs supersede earlier ones."""
    return (
        "SELECT run_id, kind, started_at, finished_at, params FROM lake.rating_runs"
        f" WHERE status = 'completed' AND kind IN ({_BATCH_KIND_LIST})"
    )


def rated_events_sql(runs_where: str = "TRUE") -> str:
    """The event_id of every event row of the completed batch runs `b` (rating_runs columns)
    that match `runs_where`: rows spelled out in rating_rows and a sweep's rating_lines."""
    runs = f"SELECT * FROM ({batch_runs_sql()}) AS b WHERE {runs_where}"
    return (f"SELECT r.event_id FROM lake.rating_rows AS r JOIN ({runs}) AS b ON b.run_id = r.run_id"
            " WHERE r.source = 'event' AND r.event_id IS NOT NULL"
            f" UNION ALL SELECT l.event_id FROM lake.rating_lines AS l JOIN ({runs}) AS b"
            " ON b.run_id = l.run_id")


def current_batch_sql(where: str = "TRUE") -> str:
    """The current rows of every (realm, source_id) a completed batch run rated, reversals
    excluded, with `run_finished_at`. `where` filters lake.ratings (alias r) first."""
    return (
        "SELECT * EXCLUDE (_latest) FROM ("
        " SELECT r.*, b.finished_at AS run_finished_at,"
        " max((b.finished_at, r.run_id)) OVER (PARTITION BY r.realm, r.source_id) AS _latest"
        f" FROM lake.ratings AS r JOIN ({batch_runs_sql()}) AS b ON b.run_id = r.run_id"
        f" WHERE r.source = 'event' AND ({where}))"
        " WHERE _latest = (run_finished_at, run_id) AND status <> 'reversal'"
    )


def current_ratings_sql(occurred: str = "TRUE") -> str:
    """Every current rating row: batch ratings, inline ratings of events no batch run has
    rated yet, and gate commit lines. `occurred`, a condition on `r.occurred_at`, narrows
    every part, the inline rows' anti-join included, so a range costs its own rows, not the
    lake's history. Every row of a source shares its occurred_at (an event's, a day's, a
    commit's), so the condition never splits a source's rows."""
    batch = current_batch_sql(occurred)
    rated_by_batch = (
        f"SELECT DISTINCT r.realm, r.source_id FROM lake.ratings AS r"
        f" JOIN ({batch_runs_sql()}) AS b ON b.run_id = r.run_id WHERE r.source = 'event'"
        f" AND ({occurred})"
    )
    inline = (
        f"SELECT r.* FROM lake.ratings AS r WHERE r.source = 'event' AND ({occurred})"
        f" AND r.run_id NOT IN (SELECT run_id FROM lake.rating_runs WHERE kind IN ({_BATCH_KIND_LIST}))"
        f" AND NOT EXISTS (SELECT 1 FROM ({rated_by_batch}) AS x"
        "  WHERE x.realm = r.realm AND x.source_id = r.source_id)"
    )
    return (
        f"SELECT {RATING_COLUMNS} FROM ({batch})"
        f" UNION ALL SELECT {RATING_COLUMNS} FROM ({inline})"
        f" UNION ALL SELECT {RATING_COLUMNS} FROM lake.ratings AS r WHERE r.source = 'gate_commit'"
        f" AND ({occurred})"
    )


def missing_kinds(conn: duckdb.DuckDBPyConnection, rows: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """The kinds of `rows` (first column: line_id) that lake.rating_line_kinds lacks."""
    if not rows:
        return []
    known = {row[0] for row in conn.execute("SELECT DISTINCT line_id FROM lake.rating_line_kinds"
                                            " WHERE line_id IS NOT NULL").fetchall()}
    return [row for row in rows if row[0] not in known]


def record_kinds(conn: duckdb.DuckDBPyConnection, rows: list[tuple[object, ...]], columns: str) -> None:
    """Add to lake.rating_line_kinds the kinds of `rows` (first column: line_id) it lacks.
    Runs are serialized by the rating lock, so no kind is ever recorded twice; a kind that no
    row names yet is harmless, so they go first, on their own."""
    missing = missing_kinds(conn, rows)
    if not missing:
        return
    def insert() -> None:
        with transaction(conn):
            insert_rows(conn, "lake.rating_line_kinds", missing, columns)
    with_lake_retry(insert)


# Rows per Parquet row group of the lines files (DuckDB's own row groups hold 122,880),
# and per Arrow batch handed to DuckDB's INSERT.
_ROW_GROUP = 1 << 17


# Columns of the lines files with min/max statistics. Not event_id nor billing_account_id:
# a run's random UUIDs and its hash buckets of accounts span nearly their whole ranges, so
# those statistics would never let a reader skip a file, and they were a third of the
# writing's CPU (DuckLake records them as unknown; filters on them stay exact).
_STATISTICS = ["run_id", "realm", "occurred_at", "line_id", "quantity_minor", "amount_xusd"]


def write_lines_files(lines: pa.Table, run_id: str, folder: Path, parts: int = 1) -> list[Path]:
    """`lines` (the columns of `write_lines_run`) with their run_id column, as `parts`
    Parquet files in `folder` (one thread each), named after the run so a file left by a
    crash is recognisably one run's (no more files than row groups). The run is not in the
    lake until `write_lines_run` adds them."""
    folder.mkdir(parents=True, exist_ok=True)
    count = lines.num_rows
    parts = max(min(parts, -(-count // _ROW_GROUP)), 1)
    step = max(-(-count // parts), 1)
    slices = [lines.slice(first, step) for first in range(0, count, step)] or [lines]
    paths = [folder / f"{run_id}-{n}.parquet" for n in range(len(slices))]

    def write(n: int) -> None:
        run = pa.DictionaryArray.from_arrays(pa.array(np.zeros(slices[n].num_rows, dtype=np.int32)),
                                             pa.array([run_id]))
        rows = slices[n].add_column(0, "run_id", run)
        # A column without NULLs is written as required: no definition levels to encode
        # (a tenth of the writing's CPU). DuckLake reads it like any other.
        rows = rows.cast(pa.schema([field.with_nullable(rows.column(field.name).null_count > 0)
                                    for field in rows.schema]))
        pq.write_table(rows, paths[n], compression="snappy",
                       row_group_size=_ROW_GROUP,
                       use_dictionary=["run_id", "realm", "billing_account_id"],
                       write_statistics=_STATISTICS)

    try:
        if len(slices) == 1:
            write(0)
        else:
            with ThreadPoolExecutor(len(slices)) as pool:
                list(pool.map(write, range(len(slices))))
    except BaseException:
        for path in paths:
            path.unlink(missing_ok=True)
        raise
    return paths


def write_lines_run(conn: duckdb.DuckDBPyConnection, *, run_id: str, kind: str,
                    started_at: datetime, params: Mapping[str, object], lines: pa.Table,
                    events: int, folder: Path | None = None,
                    kinds: Sequence[tuple[object, ...]] = ()) -> RunSummary:
    """Append `lines` (columns event_id, realm, billing_account_id, occurred_at, line_id,
    quantity_minor, amount_xusd; kinds already recorded) to lake.rating_lines under `run_id`,
    and the run's completed lake.rating_runs row (`events` events rated), in one lake
    transaction (run again when the SQLite catalog is busy, like `write_run`).

    With `folder` (`warehouse.lake.table_folder`), pyarrow writes the Parquet files there,
    two at a time (`write_lines_files`), and the transaction adds them to the table
    (`ducklake_add_data_files`): measured on 1.6 M lines, 0.30 s and 0.54 CPU seconds
    against 0.44 s and 0.80 for DuckDB's INSERT. A file of a transaction that did not
    commit is removed; one left by a crash is an orphan that `compact-lake` deletes.
    Without, the rows are INSERTed (handed over in batches: DuckDB scans an Arrow table
    one batch per thread). A sweep writes its files ahead and commits several runs at
    once instead (`write_lines_files`, `commit_written_runs`). `kinds`: line kinds
    (PRICED_KIND_COLUMNS) the lake lacks, recorded in the same transaction."""
    began = time.monotonic()
    run = WrittenRun(run_id, kind, started_at, params, events, lines.num_rows,
                     write_lines_files(lines, run_id, folder, 2)
                     if folder is not None and lines.num_rows else [], began)
    if folder is not None:
        return commit_written_runs(conn, [run], kinds)[0]
    name = f"_run_lines_{run_id.rsplit('-', 1)[-1]}"
    conn.register(name, pa.Table.from_batches(lines.to_batches(max_chunksize=_ROW_GROUP),
                                              schema=lines.schema))
    try:
        return commit_written_runs(conn, [run], kinds, inserted=name)[0]
    finally:
        conn.unregister(name)


@dataclass
class WrittenRun:
    """A run whose lines are already in Parquet files (`write_lines_files`), not yet in the lake."""

    run_id: str
    kind: str
    started_at: datetime
    params: Mapping[str, object]
    events: int
    lines: int
    files: list[Path]
    began: float  # time.monotonic() when its work began

    def discard(self) -> None:
        """Remove the files of a run that will not be committed."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files = []


def commit_written_runs(conn: duckdb.DuckDBPyConnection, runs: Sequence[WrittenRun],
                        kinds: Sequence[tuple[object, ...]] = (),
                        inserted: str | None = None,
                        clock: Clock = SYSTEM_CLOCK) -> list[RunSummary]:
    """Add the files of `runs` to lake.rating_lines and their completed lake.rating_runs rows
    (and `kinds`, PRICED_KIND_COLUMNS, the lake lacks) in ONE lake transaction: all of them
    or none (then their files are removed). Each commit costs ~0.1 CPU seconds in the
    SQLite catalog whatever it holds, so a sweep commits its runs a few at a time.
    `inserted`: a relation of the lines of the one run, INSERTed instead of files."""
    if not runs:
        return []
    committed = False
    try:
        def write() -> None:
            with transaction(conn):
                if kinds:
                    insert_rows(conn, "lake.rating_line_kinds", list(kinds), PRICED_KIND_COLUMNS)
                paths = [str(path) for run in runs for path in run.files]
                if paths:
                    conn.execute("CALL ducklake_add_data_files('lake', 'rating_lines', ?)", [paths])
                if inserted is not None:
                    [run] = runs
                    conn.execute(
                        f"INSERT INTO lake.rating_lines SELECT '{run.run_id}', event_id, realm,"
                        " billing_account_id, occurred_at, line_id, quantity_minor, amount_xusd"
                        f" FROM {inserted}")
                ids = ", ".join(f"'{run.run_id}'" for run in runs)
                conn.execute(rollup_lines_sql("lake", f"run_id IN ({ids})"))
                finished_at = clock.now()
                insert_rows(conn, "lake.rating_runs", [
                    (run.run_id, run.kind, "completed", run.started_at, finished_at,
                     json.dumps(dict(run.params), sort_keys=True), run.events, run.lines)
                    for run in runs])
        with_lake_retry(write, attempts=10)
        committed = True
    finally:
        if not committed:
            for run in runs:
                run.discard()
    for run in runs:
        run.files = []  # the lake's now, not the run's to remove
    now = time.monotonic()
    return [RunSummary(run.run_id, run.kind, run.events, run.lines, now - run.began) for run in runs]


def write_run(conn: duckdb.DuckDBPyConnection, *, run_id: str, kind: str, started_at: datetime,
              params: Mapping[str, object], rows_sql: str, events: int | str | None,
              clock: Clock = SYSTEM_CLOCK) -> RunSummary:
    """Append the rows of `rows_sql` (columns of STORED_COLUMNS, in order) to lake.rating_rows,
    the line kinds of the installed rating plan that the lake lacks, and the run's completed
    lake.rating_runs row, in one lake transaction. `events`: the number of events rated;
    a query giving it (run inside the transaction, before the rows are written, so it sees
    what `rows_sql` reads); or None: the distinct event ids among the rows just written.

    The SQLite catalog refuses a commit while another process reads it ("database is
    locked"); nothing of the transaction is kept then, so it is run again."""
    began = time.monotonic()
    # Runs are serialized by the rating lock, so no kind is ever recorded twice; a kind that
    # no row names yet is harmless, so they go first, on their own.
    record_kinds(conn, conn.execute(
        "SELECT line_id, status, policy_id, policy_version, feature_code, meter_code, line_index"
        f" FROM {LINE_CATALOG}").fetchall(), KIND_COLUMNS)

    def write() -> tuple[int, int]:
        with transaction(conn):
            counted: int | None = None
            if isinstance(events, str):
                found = conn.execute(events).fetchone()
                counted = int(found[0]) if found else 0
            inserted = conn.execute(
                f"INSERT INTO lake.rating_rows ({STORED_COLUMNS}) {rows_sql}").fetchone()
            count = int(inserted[0]) if inserted else 0
            conn.execute(rollup_rows_sql("lake", f"(SELECT * FROM lake.rating_rows WHERE run_id = '{run_id}')"))
            if isinstance(events, int):
                counted = events
            if counted is None:
                found = conn.execute("SELECT count(DISTINCT event_id) FROM lake.rating_rows"
                                     " WHERE run_id = ?", [run_id]).fetchone()
                counted = int(found[0]) if found else 0
            finished_at = clock.now()
            conn.execute(
                "INSERT INTO lake.rating_runs VALUES (?, ?, 'completed', ?, ?, ?, ?, ?)",
                [run_id, kind, started_at, finished_at, json.dumps(dict(params), sort_keys=True),
                 counted, count])
        return counted, count

    written, lines = with_lake_retry(write, attempts=10)
    return RunSummary(run_id, kind, written, lines, time.monotonic() - began)
