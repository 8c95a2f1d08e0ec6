"""The lake: DuckLake tables that flows, analysts and the service's exporter share.

Locally the DuckLake catalog is a SQLite file and the data a folder of Parquet files under
`<data>/lake/`, so several processes can read and write at once; at scale the catalog is
PostgreSQL and the data an object store (same tables, other ATTACH string). Every table is
append-only. The extensions come from the `duckdb-extension-*` wheels and install offline.

DuckDB's SQLite attach has no busy timeout, so a writer or reader can meet `database is
locked` while another process commits: `with_lake_retry` retries such a step.

Tables (all times UTC):

    events           event_id UUID, realm, billing_account_id, request_hash, semantic_kind,
                     event_type, occurred_at TIMESTAMPTZ, subject_ref, payload JSON, labels JSON,
                     created_at TIMESTAMPTZ, ingest_path, seq BIGINT, export_id BIGINT
    event_labels     event_id UUID, realm, billing_account_id, key, slot (text|uuid|bool|number),
                     value_text, value_uuid UUID, value_bool BOOLEAN, value_number DOUBLE, export_id
    ratings          (a view) rating_id, run_id, source (event|gate_commit), source_id,
                     event_id UUID, realm, billing_account_id,
                     status (rated|reversal|skipped_no_policy|quarantined|deferred),
                     policy_id, policy_version, feature_code, meter_code, quantity_minor BIGINT,
                     price_id, unit_price_xusd BIGINT, unit_quantity_minor BIGINT,
                     amount_xusd BIGINT, occurred_at TIMESTAMPTZ, rated_at TIMESTAMPTZ,
                     line_index INTEGER
    rating_rows      what `ratings` reads besides rating_lines: its columns plus line_id
                     BIGINT. A line a rerate rates (or a sweep too large for the int64
                     carry) stores line_id and leaves rating_id, source_id, status,
                     policy_id, policy_version, feature_code, meter_code and line_index NULL;
                     the view takes them from rating_line_kinds and derives the two ids. Every
                     other row (reversals included) stores them all and line_id NULL.
    rating_lines     the lines sweeps write, narrow: run_id, event_id UUID, realm,
                     billing_account_id, occurred_at TIMESTAMPTZ, line_id BIGINT,
                     quantity_minor BIGINT, amount_xusd BIGINT. `ratings` takes the rest from
                     the line's kind (its price row included) and rated_at from the run.
    rating_line_kinds  line_id BIGINT, status, policy_id, policy_version, feature_code,
                     meter_code, line_index INTEGER, price_id, unit_price_xusd BIGINT,
                     unit_quantity_minor BIGINT (one row per kind of rating line; the price
                     columns are set for the kinds of rating_lines, which include the price row)
    rating_runs      run_id, kind (sweep|rerate|inline|gate|aggregate), status, started_at,
                     finished_at, params JSON, events BIGINT, lines BIGINT
    usage_reports    period (day|month), period_start DATE, realm, billing_account_id,
                     feature_code, meter_code, quantity_minor BIGINT, amount_xusd BIGINT,
                     event_count BIGINT, line_count BIGINT, run_id, published_at TIMESTAMPTZ
    usage_report_scopes  run_id, snapshot_id BIGINT, day DATE, whole BOOLEAN: the days
                     (and their months) each publication covers; the view `usage_reports_latest` reads the
                     report as it stands through them
    usage_days       the lines of every batch run and of the gate summed per account, UTC
                     day and line kind (`warehouse.usage_days`)
    catalog_versions fingerprint, applied_at TIMESTAMPTZ, source
    catalog_prices   fingerprint, realm, meter_code, price_id, unit_price_xusd BIGINT,
                     unit_quantity_minor BIGINT, rounding, effective_at TIMESTAMPTZ
    catalog_policy_versions  fingerprint, realm, policy_id, version, engine,
                     effective_at TIMESTAMPTZ, dsl_json
    catalog_features fingerprint, realm, feature_code, family, primary_meter, meters VARCHAR[]
    export_log       stream, export_id BIGINT, from_seq BIGINT, to_seq BIGINT, rows BIGINT,
                     exported_at TIMESTAMPTZ
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TypeVar

import duckdb

from core.layout import DataFolder
from warehouse import usage_days

__all__ = ["LAKE_TABLES", "attach_lake", "compaction_turn", "connect_lake", "export_turn", "lake_paths",
           "table_folder", "transaction", "with_lake_retry"]

T = TypeVar("T")
log = logging.getLogger("tollgate.lake")

LAKE_TABLES: dict[str, str] = {
    "events": """
        event_id UUID, realm VARCHAR, billing_account_id VARCHAR, request_hash VARCHAR,
        semantic_kind VARCHAR, event_type VARCHAR, occurred_at TIMESTAMPTZ, subject_ref VARCHAR,
        payload JSON, labels JSON, created_at TIMESTAMPTZ, ingest_path VARCHAR, seq BIGINT,
        export_id BIGINT""",
    "event_labels": """
        event_id UUID, realm VARCHAR, billing_account_id VARCHAR, key VARCHAR, slot VARCHAR,
        value_text VARCHAR, value_uuid UUID, value_bool BOOLEAN, value_number DOUBLE,
        export_id BIGINT""",
    "rating_rows": """
        rating_id VARCHAR, run_id VARCHAR, source VARCHAR, source_id VARCHAR, event_id UUID,
        realm VARCHAR, billing_account_id VARCHAR, status VARCHAR, policy_id VARCHAR,
        policy_version VARCHAR, feature_code VARCHAR, meter_code VARCHAR, quantity_minor BIGINT,
        price_id VARCHAR, unit_price_xusd BIGINT, unit_quantity_minor BIGINT, amount_xusd BIGINT,
        occurred_at TIMESTAMPTZ, rated_at TIMESTAMPTZ, line_index INTEGER, line_id BIGINT""",
    "rating_lines": """
        run_id VARCHAR, event_id UUID, realm VARCHAR, billing_account_id VARCHAR,
        occurred_at TIMESTAMPTZ, line_id BIGINT, quantity_minor BIGINT, amount_xusd BIGINT""",
    "rating_line_kinds": """
        line_id BIGINT, status VARCHAR, policy_id VARCHAR, policy_version VARCHAR,
        feature_code VARCHAR, meter_code VARCHAR, line_index INTEGER, price_id VARCHAR,
        unit_price_xusd BIGINT, unit_quantity_minor BIGINT""",
    "rating_runs": """
        run_id VARCHAR, kind VARCHAR, status VARCHAR, started_at TIMESTAMPTZ,
        finished_at TIMESTAMPTZ, params JSON, events BIGINT, lines BIGINT""",
    "usage_reports": """
        period VARCHAR, period_start DATE, realm VARCHAR, billing_account_id VARCHAR,
        feature_code VARCHAR, meter_code VARCHAR, quantity_minor BIGINT, amount_xusd BIGINT,
        event_count BIGINT, line_count BIGINT, run_id VARCHAR, published_at TIMESTAMPTZ""",
    # One row per publication, empty ones included: the latest report is found here.
    "usage_report_runs": "run_id VARCHAR, published_at TIMESTAMPTZ, day_rows BIGINT, month_rows BIGINT",
    # What each publication covers: one row per UTC day it published (and with it the day's
    # month; NULL and `whole`: every day and month), and the lake snapshot it read, where the
    # next one's changes start (`batch.usage_reports.changed_days`). Read through
    # `usage_reports_latest`.
    "usage_report_scopes": "run_id VARCHAR, snapshot_id BIGINT, day DATE, whole BOOLEAN",
    "catalog_versions": "fingerprint VARCHAR, applied_at TIMESTAMPTZ, source VARCHAR",
    "catalog_prices": """
        fingerprint VARCHAR, realm VARCHAR, meter_code VARCHAR, price_id VARCHAR,
        unit_price_xusd BIGINT, unit_quantity_minor BIGINT, rounding VARCHAR,
        effective_at TIMESTAMPTZ""",
    "catalog_policy_versions": """
        fingerprint VARCHAR, realm VARCHAR, policy_id VARCHAR, version VARCHAR, engine VARCHAR,
        effective_at TIMESTAMPTZ, dsl_json VARCHAR""",
    "catalog_features": """
        fingerprint VARCHAR, realm VARCHAR, feature_code VARCHAR, family VARCHAR,
        primary_meter VARCHAR, meters VARCHAR[]""",
    "export_log": """
        stream VARCHAR, export_id BIGINT, from_seq BIGINT, to_seq BIGINT, rows BIGINT,
        exported_at TIMESTAMPTZ""",
    # One row per close of aggregate days that left none waiting: where the next one starts
    # (`batch.aggregate_days`).
    "aggregate_closes": "closed_at TIMESTAMPTZ, looked_through TIMESTAMPTZ, days BIGINT",
}


# Described columns: stored on rows without a line_id, else those of the row's line kind.
_DESCRIBED = ("status", "policy_id", "policy_version", "feature_code", "meter_code", "line_index")

# `ratings` as analysts and the flows read it. Writing a sweep's 1.6 M rows per million
# events with every string spelled out (two of them unique per row) took 1.41 s of a 2.3 s
# sweep; with line ids instead, 0.75 s less (see docs/measurements.md). Unqualified names
# bind to the lake the view is read from, whatever alias it is attached under.
# Stored as the view's comment: a lake whose view has another is given this definition on
# the next writable attach. Change it whenever RATINGS_VIEW changes.
RATINGS_VIEW_VERSION = "tollgate ratings view 2"
_ROWS_VIEW = (
    "SELECT CASE WHEN r.line_id IS NULL THEN r.rating_id ELSE concat(CAST(r.event_id AS VARCHAR),"
    " ':', k.line_index, ':', string_split(r.run_id, '-')[-1]) END AS rating_id,"
    " r.run_id, r.source,"
    " CASE WHEN r.line_id IS NULL THEN r.source_id ELSE CAST(r.event_id AS VARCHAR) END AS source_id,"
    " r.event_id, r.realm, r.billing_account_id, "
    + ", ".join(f"CASE WHEN r.line_id IS NULL THEN r.{c} ELSE k.{c} END AS {c}" for c in _DESCRIBED[:5])
    + ", r.quantity_minor, r.price_id, r.unit_price_xusd, r.unit_quantity_minor, r.amount_xusd,"
    " r.occurred_at, r.rated_at,"
    " CASE WHEN r.line_id IS NULL THEN r.line_index ELSE k.line_index END AS line_index"
    " FROM rating_rows AS r LEFT JOIN (SELECT DISTINCT * FROM rating_line_kinds) AS k"
    " ON k.line_id = r.line_id"
)
# A sweep's lines (rating_lines): eight columns written instead of twenty-one, the price row
# in the line's kind and rated_at the run's start, which took the write from ~0.7 s to
# ~0.3 s per million events (docs/measurements.md).
_LINES_VIEW = (
    "SELECT concat(CAST(l.event_id AS VARCHAR), ':', k.line_index, ':',"
    " string_split(l.run_id, '-')[-1]) AS rating_id, l.run_id, 'event' AS source,"
    " CAST(l.event_id AS VARCHAR) AS source_id, l.event_id, l.realm, l.billing_account_id,"
    " k.status, k.policy_id, k.policy_version, k.feature_code, k.meter_code, l.quantity_minor,"
    " k.price_id, k.unit_price_xusd, k.unit_quantity_minor, l.amount_xusd, l.occurred_at,"
    " u.started_at AS rated_at, k.line_index"
    " FROM rating_lines AS l LEFT JOIN (SELECT DISTINCT * FROM rating_line_kinds) AS k"
    " ON k.line_id = l.line_id"
    " LEFT JOIN (SELECT run_id, min(started_at) AS started_at FROM rating_runs GROUP BY run_id) AS u"
    " ON u.run_id = l.run_id"
)
RATINGS_VIEW = f"{_ROWS_VIEW} UNION ALL {_LINES_VIEW}"

# The usage report as it stands: for each UTC day, and each month, the rows of the latest
# publication that covered it (a publication that covers a day covers its month too; a day
# with no usage left has no rows); what no publication covered since the latest whole one
# keeps that one's rows. Publications from before `usage_report_scopes` cover nothing here:
# the first publication after them is whole. Same rule as the ratings view for its version.
USAGE_LATEST_VIEW_VERSION = "tollgate usage_reports_latest view 1"
USAGE_LATEST_VIEW = (
    "WITH scopes AS (SELECT s.run_id, s.day, s.whole, p.published_at"
    " FROM usage_report_scopes AS s JOIN usage_report_runs AS p ON p.run_id = s.run_id),"
    " whole AS (SELECT run_id, published_at FROM scopes WHERE whole"
    " ORDER BY published_at DESC, run_id DESC LIMIT 1),"
    " later AS (SELECT * FROM scopes WHERE NOT whole AND day IS NOT NULL"
    " AND published_at >= coalesce((SELECT published_at FROM whole), TIMESTAMPTZ '-infinity')"
    " AND run_id <> coalesce((SELECT run_id FROM whole), '')),"
    " days AS (SELECT day AS period_start, arg_max(run_id, (published_at, run_id)) AS run_id"
    " FROM later GROUP BY 1),"
    " months AS (SELECT CAST(date_trunc('month', day) AS DATE) AS period_start,"
    " arg_max(run_id, (published_at, run_id)) AS run_id FROM later GROUP BY 1),"
    " covered AS (SELECT 'day' AS period, * FROM days UNION ALL SELECT 'month', * FROM months)"
    " SELECT u.* FROM usage_reports AS u WHERE u.run_id = (SELECT run_id FROM whole)"
    " AND NOT EXISTS (SELECT 1 FROM covered AS c WHERE c.period = u.period"
    " AND c.period_start = u.period_start)"
    " UNION ALL SELECT u.* FROM usage_reports AS u JOIN covered AS c ON u.run_id = c.run_id"
    " AND u.period = c.period AND u.period_start = c.period_start"
)


def lake_paths(data_dir: Path) -> tuple[Path, Path]:
    """(catalog file, data folder) of the lake under a data folder."""
    root = DataFolder(data_dir).lake
    return root / "catalog.sqlite", root / "data"


def _load_extensions(conn: duckdb.DuckDBPyConnection) -> None:
    import duckdb_extension_ducklake
    import duckdb_extension_sqlite

    for module, name in ((duckdb_extension_ducklake, "ducklake"), (duckdb_extension_sqlite, "sqlite")):
        try:
            conn.execute(f"LOAD {name}")
        except duckdb.Error:
            version = duckdb.__version__
            path = Path(module.__file__).parent / "extensions" / f"v{version}" / f"{name}.duckdb_extension"
            conn.execute(f"INSTALL '{path}'")
            conn.execute(f"LOAD {name}")


@contextmanager
def transaction(conn: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """BEGIN ... COMMIT around the block; ROLLBACK when it raises (or when COMMIT does)."""
    conn.execute("BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except duckdb.Error:
            pass  # a failed COMMIT has already ended the transaction
        raise


def table_folder(conn: duckdb.DuckDBPyConnection, table: str, alias: str = "lake") -> Path | None:
    """The folder DuckLake keeps the data files of `alias`.main.`table` in (as its catalog
    records it), or None when that is not a path under the lake's data path."""
    meta = f"__ducklake_metadata_{alias}"
    row = conn.execute(
        "SELECT m.value, s.path, s.path_is_relative, t.path, t.path_is_relative"
        f" FROM {meta}.ducklake_table AS t"
        f" JOIN {meta}.ducklake_schema AS s ON s.schema_id = t.schema_id"
        f" JOIN {meta}.ducklake_metadata AS m ON m.key = 'data_path'"
        " WHERE t.table_name = ? AND t.end_snapshot IS NULL"
        " AND s.end_snapshot IS NULL AND s.schema_name = 'main'", [table]).fetchone()
    if row is None or not (row[2] and row[4]) or not row[0]:
        return None
    return Path(str(row[0])) / str(row[1]) / str(row[3])


def _lock_file(data_dir: Path, name: str) -> int:
    """Open (creating it) the lock file `name` in the lake's folder; the caller closes it."""
    folder = lake_paths(Path(data_dir).resolve())[0].parent
    folder.mkdir(parents=True, exist_ok=True)
    return os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)


@contextmanager
def compaction_turn(data_dir: Path) -> Iterator[None]:
    """Hold the lake for the compaction: the exporter starts no round while this is held,
    and the one under way (if any) is waited for.

    The compaction's merge reads a snapshot, writes for minutes, then commits; the exporter
    commits every second or two. In SQLite's WAL mode a transaction whose snapshot another
    commit has passed cannot commit ("database is locked", at once), so under steady
    ingestion every try of the merge failed and was retried, each writing the merged files
    again (17 GB in 10 minutes of a 4.6 GB lake). Two locks in the lake's folder: the
    compaction takes `compaction.intent` and then `compaction.turn`, both exclusive; the
    exporter starts a round only if it can take `compaction.intent` shared, and holds
    `compaction.turn` shared for the round (`export_turn`)."""
    intent = _lock_file(data_dir, "compaction.intent")
    try:
        fcntl.flock(intent, fcntl.LOCK_EX)
        turn = _lock_file(data_dir, "compaction.turn")
        try:
            fcntl.flock(turn, fcntl.LOCK_EX)  # the exporter's round under way ends first
            yield
        finally:
            os.close(turn)
    finally:
        os.close(intent)


@contextmanager
def export_turn(data_dir: Path) -> Iterator[bool]:
    """Yield True, holding the exporter's turn for one round, unless the compaction holds or
    wants the lake (`compaction_turn`): then yield False at once, and the round is skipped."""
    intent = _lock_file(data_dir, "compaction.intent")
    try:
        try:
            fcntl.flock(intent, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        turn = _lock_file(data_dir, "compaction.turn")
        try:
            fcntl.flock(turn, fcntl.LOCK_SH)
            fcntl.flock(intent, fcntl.LOCK_UN)
            yield True
        finally:
            os.close(turn)
    finally:
        os.close(intent)


def with_lake_retry(step: Callable[[], T], *, attempts: int = 50, pause: float = 0.05) -> T:
    """Run `step`, retrying while another process holds the SQLite catalog."""
    for attempt in range(attempts):
        try:
            return step()
        except duckdb.Error as exc:
            text = str(exc).lower()
            if attempt + 1 == attempts or not ("locked" in text or "busy" in text or "conflict" in text):
                raise
            time.sleep(pause * (1 + attempt % 10))
    raise AssertionError("unreachable")


def attach_lake(conn: duckdb.DuckDBPyConnection, data_dir: Path, *, read_only: bool = False,
                alias: str = "lake") -> None:
    """Attach the lake to `conn` as `alias`, creating its folder and tables when writable.

    The folder is resolved first, so every attach names the data folder the same way:
    DuckLake refuses a DATA_PATH other than the one its catalog recorded at creation."""
    catalog, data = lake_paths(Path(data_dir).resolve())
    _load_extensions(conn)
    conn.execute("SET TimeZone = 'UTC'")
    if read_only and not catalog.exists():
        raise FileNotFoundError(f"no lake at {catalog.parent}; start the service or apply a catalog first")
    catalog.parent.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    # A writable attach keeps the catalog in SQLite's WAL mode (the mode stays in the file;
    # a read-only attach may not set it). In the rollback-journal mode a reader's open
    # transaction (a sweep's, or an analyst's `tollgate sql`) made a lake commit fail with
    # "database is locked" after its busy wait, and DuckDB's SQLite handle of that failed
    # commit then held the catalog's PENDING lock until the process ended: every later lake
    # connection of every process waited or failed (the export and the sweeps stopped).
    # In WAL mode readers never block a commit. docs/operations.md, "The lake's catalog".
    options = f"DATA_PATH '{data}/'" + (", READ_ONLY" if read_only else ", META_JOURNAL_MODE 'WAL'")
    attach = f"ATTACH 'ducklake:sqlite:{catalog}' AS {alias} ({options})"
    try:
        with_lake_retry(lambda: conn.execute(attach))
    except duckdb.Error as exc:
        if not (read_only and "readonly database" in str(exc) and _roll_back_dead_write(catalog)):
            raise
        with_lake_retry(lambda: conn.execute(attach))
    if not read_only:
        _upgrade(conn, alias)
        for table, columns in LAKE_TABLES.items():
            create = f"CREATE TABLE IF NOT EXISTS {alias}.{table} ({columns})"
            with_lake_retry(functools.partial(conn.execute, create))
        _add_kind_prices(conn, alias)
        _add_usage_days(conn, alias)
        _ensure_view(conn, alias, "ratings", RATINGS_VIEW, RATINGS_VIEW_VERSION)
        _ensure_view(conn, alias, "usage_reports_latest", USAGE_LATEST_VIEW, USAGE_LATEST_VIEW_VERSION)


def _ensure_view(conn: duckdb.DuckDBPyConnection, alias: str, name: str, sql: str,
                 version: str) -> None:
    """(Re)create the lake's view `name` when its comment is not `version`."""
    if _view_comment(conn, alias, name) == version:
        return

    def create() -> None:
        with transaction(conn):
            conn.execute(f"CREATE OR REPLACE VIEW {alias}.{name} AS {sql}")
            conn.execute(f"COMMENT ON VIEW {alias}.{name} IS '{version}'")
    with_lake_retry(create)


def _roll_back_dead_write(catalog: Path) -> bool:
    """Let SQLite roll back what a killed writer left half done in the lake's catalog.

    A process killed inside a lake commit leaves a hot rollback journal next to the catalog,
    and a read-only connection may not roll it back: every read-only attach (`tollgate sql`,
    the flows' reads) then fails with "attempt to write a readonly database" until a writer
    opens the lake. SQLite rolls a journal back only when no live process holds the write
    lock, so a read here restores the last committed state and never touches a live write.
    False when there is no journal to roll back."""
    journal = catalog.with_name(catalog.name + "-journal")
    if not journal.exists():
        return False
    log.warning("rolling back an unfinished write to %s left by a stopped process", catalog)
    with closing(sqlite3.connect(catalog, timeout=10)) as db:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return True


def _listed(conn: duckdb.DuckDBPyConnection, alias: str, name: str, *, view: bool) -> tuple[str | None] | None:
    """The lake's view (with its comment) or table of that name, or None.

    On a cursor closed at once: listing DuckLake's catalog leaves a read lock on its SQLite
    file until the connection's next statement, and an idle process holding it makes every
    other process's commit fail with "database is locked"."""
    listing, column, comment = (("duckdb_views()", "view_name", "comment") if view
                                else ("duckdb_tables()", "table_name", "NULL"))
    quoted = [text.replace("'", "''") for text in (alias, name)]
    with conn.cursor() as cursor:
        return cursor.execute(f"SELECT {comment} FROM {listing} WHERE database_name = '{quoted[0]}'"
                              f" AND {column} = '{quoted[1]}'").fetchone()


def _exists(conn: duckdb.DuckDBPyConnection, alias: str, name: str, *, view: bool) -> bool:
    return _listed(conn, alias, name, view=view) is not None


def _view_comment(conn: duckdb.DuckDBPyConnection, alias: str, name: str) -> str | None:
    """The comment of a view of the lake (None: no such view, or no comment)."""
    row = _listed(conn, alias, name, view=True)
    return None if row is None else row[0]


def _upgrade(conn: duckdb.DuckDBPyConnection, alias: str) -> None:
    """A lake written before `ratings` became a view holds its rows in a table of that name:
    it becomes `rating_rows`, with the line_id column (NULL: every old row is described).
    Checked again inside each attempt: another process may have upgraded it meanwhile."""
    def rename() -> None:
        if not _exists(conn, alias, "ratings", view=False) or _exists(conn, alias, "rating_rows", view=False):
            return
        try:
            with transaction(conn):
                conn.execute(f"ALTER TABLE {alias}.ratings RENAME TO rating_rows")
                conn.execute(f"ALTER TABLE {alias}.rating_rows ADD COLUMN line_id BIGINT")
        except duckdb.Error:
            if _exists(conn, alias, "rating_rows", view=False):
                return  # another process upgraded it first
            raise
    with_lake_retry(rename)


def _add_usage_days(conn: duckdb.DuckDBPyConnection, alias: str) -> None:
    """Create lake.usage_days with the rollup of every rating row the lake holds (none in a
    new lake), in one transaction: a concurrent attach that creates it first wins, and this
    one then finds it there."""
    def add() -> None:
        if _exists(conn, alias, "usage_days", view=False):
            return
        rows = (f"(SELECT r.* FROM {alias}.rating_rows AS r WHERE r.source = 'gate_commit'"
                f" OR r.run_id IN (SELECT run_id FROM {alias}.rating_runs"
                " WHERE kind IN ('sweep', 'rerate', 'aggregate')))")
        try:
            with transaction(conn):
                conn.execute(f"CREATE TABLE {alias}.usage_days ({usage_days.COLUMNS})")
                conn.execute(usage_days.rollup_lines_sql(alias, "TRUE"))
                conn.execute(usage_days.rollup_rows_sql(alias, rows))
        except duckdb.Error:
            if _exists(conn, alias, "usage_days", view=False):
                return  # another process added it first
            raise
    with_lake_retry(add)


def _add_kind_prices(conn: duckdb.DuckDBPyConnection, alias: str) -> None:
    """A lake from before rating_lines has line kinds without the price columns: add them
    (NULL for the old kinds, whose rows spell out their price)."""
    def add() -> None:
        with conn.cursor() as cursor:
            have = {row[0] for row in cursor.execute(
                "SELECT column_name FROM duckdb_columns() WHERE database_name = ?"
                " AND table_name = 'rating_line_kinds'", [alias]).fetchall()}
        wanted = [("price_id", "VARCHAR"), ("unit_price_xusd", "BIGINT"),
                  ("unit_quantity_minor", "BIGINT")]
        missing = [(name, kind) for name, kind in wanted if name not in have]
        if not missing:
            return
        try:
            with transaction(conn):
                for name, kind in missing:
                    conn.execute(f"ALTER TABLE {alias}.rating_line_kinds ADD COLUMN {name} {kind}")
        except duckdb.Error:
            with conn.cursor() as cursor:
                now = {row[0] for row in cursor.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE database_name = ?"
                    " AND table_name = 'rating_line_kinds'", [alias]).fetchall()}
            if all(name in now for name, _ in wanted):
                return  # another process added them first
            raise
    with_lake_retry(add)


def connect_lake(data_dir: Path, *, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A new in-memory DuckDB connection with the lake attached as `lake`."""
    conn = duckdb.connect()
    attach_lake(conn, data_dir, read_only=read_only)
    return conn
