"""Usage reports: current ratings summed per period, account, feature and meter.

`build_usage_report(conn, run_id, published_at)` reads the current ratings
(`rating_runs.current_ratings_sql`: batch ratings, inline ratings not yet superseded, and gate
commit lines) and returns one row per (period, period_start, realm, billing_account_id,
feature_code, meter_code) with

    quantity_minor  the sum of the `rated` lines' quantities
    amount_xusd     the sum of their amounts
    event_count     distinct sources behind those lines: an event, a gate commit, or an
                    aggregate day (one source however many lines it has)
    line_count      rated lines

for `period` in (day, month), by the UTC day and month of the line's occurred_at (a commit's
time for gate lines). Skipped, quarantined and deferred rows carry no usage and are left out.
Each publication is a new set of rows under its own run_id. A publication covers the UTC
days whose current ratings may have changed since the one before (`changed_days`: the
rating rows, lines and runs the lake gained since that publication's snapshot, read from
DuckLake's change feed) and the months that hold them, or every day and month when there is
no publication to follow or its snapshot has expired. Readers take, for each day and each
month, the latest publication that covered it (the view `lake.usage_reports_latest`,
`warehouse.lake`). So a publication reads the ratings of the days that changed and the
published day rows of their months, not the lake's history.

`account_month_usage` gives the day rows of one account and month as a report published now
would (`tollgate report`); `account_realms` and `account_months` say where an account has
any.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime, timedelta, timezone

import duckdb
import pyarrow as pa

from batch.rating_plan import sql_instant, sql_text
from batch.rating_runs import BATCH_KINDS, current_ratings_sql
from warehouse.lake import transaction, with_lake_retry
from warehouse.usage_days import utc_day_sql

__all__ = ["REPORT_COLUMNS", "REPORT_ORDER", "account_month_usage", "account_months",
           "account_realms", "build_usage_report", "changed_days", "current_snapshot",
           "day_range_sql", "in_months_sql", "last_snapshot", "publish_report"]

REPORT_COLUMNS = (
    "period, period_start, realm, billing_account_id, feature_code, meter_code, quantity_minor, "
    "amount_xusd, event_count, line_count, run_id, published_at"
)
# The order in which report rows are read and written.
REPORT_ORDER = "period, period_start, realm, billing_account_id, feature_code, meter_code"


def publish_report(conn: duckdb.DuckDBPyConnection, run_id: str,
                   published_at: datetime) -> tuple[pa.Table, list[date] | None]:
    """Publish into the lake the rows of the days that changed since the last publication
    (and of their months), with the publication's row and its scopes, in one transaction;
    returns the rows and the days (None: every day and month)."""
    # The snapshot first: what lands while the report is read is published again next time.
    snapshot = current_snapshot(conn)
    days = changed_days(conn, last_snapshot(conn), snapshot)
    report = build_usage_report(conn, run_id, published_at, days)
    periods = {"day": 0, "month": 0}
    for period in report.column("period").to_pylist():
        periods[period] += 1
    scopes: list[tuple[str, int, date | None, bool]] = (
        [(run_id, snapshot, None, True)] if days is None else
        [(run_id, snapshot, d, False) for d in days] or [(run_id, snapshot, None, False)])

    def write() -> None:
        # The rows, the publication's own row and what it covers land together: an empty
        # publication still says that it happened and which snapshot it read.
        with transaction(conn):
            conn.execute(f"INSERT INTO lake.usage_reports ({REPORT_COLUMNS})"
                         f" SELECT {REPORT_COLUMNS} FROM _publication")
            conn.execute("INSERT INTO lake.usage_report_runs VALUES (?, ?, ?, ?)",
                         [run_id, published_at, periods["day"], periods["month"]])
            conn.executemany("INSERT INTO lake.usage_report_scopes VALUES (?, ?, ?, ?)", scopes)
    conn.register("_publication", report)
    try:
        with_lake_retry(write)
    finally:
        conn.unregister("_publication")
    return report, days


def last_snapshot(conn: duckdb.DuckDBPyConnection) -> int | None:
    """The lake snapshot the latest publication read (None: none recorded one)."""
    row = conn.execute(
        "SELECT s.snapshot_id FROM lake.usage_report_scopes AS s JOIN lake.usage_report_runs AS p"
        " ON p.run_id = s.run_id ORDER BY p.published_at DESC, s.run_id DESC LIMIT 1").fetchone()
    return None if row is None or row[0] is None else int(row[0])


def build_usage_report(conn: duckdb.DuckDBPyConnection, run_id: str,
                       published_at: datetime, days: Sequence[date] | None = None) -> pa.Table:
    """The report rows (columns of REPORT_COLUMNS), ordered for reading.

    `days` None: every day and month, from the current ratings. Else the UTC days listed,
    from their own current ratings, and the whole of each month that holds one of them: its
    other days' rows as the report stands (`lake.usage_reports_latest`) summed with the new
    ones. A source lies in one day (an event's, a commit's, an aggregate day's), so a month's
    distinct sources are the sum of its days'."""
    stamp = f"'{run_id}' AS run_id, {sql_instant(published_at)} AS published_at"
    if days is None or not days:
        # Every day, or none (the optimizer drops the scans of a FALSE condition).
        occurred = "TRUE" if days is None else "FALSE"
        period_rows = [_period_sql(period, occurred=occurred) for period in ("day", "month")]
        return conn.execute(
            f"SELECT period, period_start, realm, billing_account_id, feature_code, meter_code,"
            f" quantity_minor, amount_xusd, event_count, line_count, {stamp}"
            f" FROM ({' UNION ALL '.join(period_rows)}) ORDER BY {REPORT_ORDER}").to_arrow_table()
    listed = sorted(set(days))
    new_days = conn.execute(
        f"SELECT period, period_start, realm, billing_account_id, feature_code, meter_code,"
        f" quantity_minor, amount_xusd, event_count, line_count"
        f" FROM ({_period_sql('day', occurred=day_range_sql(listed))})").to_arrow_table()
    months = sorted({d.replace(day=1) for d in listed})
    conn.register("_report_new_days", new_days)
    try:
        return conn.execute(
            f"WITH kept AS (SELECT period_start, realm, billing_account_id, feature_code, meter_code,"
            f" quantity_minor, amount_xusd, event_count, line_count FROM lake.usage_reports_latest"
            f" WHERE period = 'day' AND {in_months_sql('period_start', months)}"
            f" AND period_start NOT IN ({_dates(listed)})),"
            f" days AS (SELECT * EXCLUDE (period) FROM _report_new_days UNION ALL SELECT * FROM kept)"
            f" SELECT *, {stamp} FROM _report_new_days"
            f" UNION ALL SELECT 'month', CAST(date_trunc('month', period_start) AS DATE),"
            f" realm, billing_account_id, feature_code, meter_code,"
            f" CAST(sum(quantity_minor) AS BIGINT), CAST(sum(amount_xusd) AS BIGINT),"
            f" CAST(sum(event_count) AS BIGINT), CAST(sum(line_count) AS BIGINT), {stamp}"
            f" FROM days GROUP BY 2, 3, 4, 5, 6 ORDER BY {REPORT_ORDER}").to_arrow_table()
    finally:
        conn.unregister("_report_new_days")


def _dates(days: Sequence[date]) -> str:
    return ", ".join(f"DATE '{d.isoformat()}'" for d in days)


def in_months_sql(column: str, months: Sequence[date]) -> str:
    """`column` (a DATE) in one of the months starting at `months`: a range, then the list."""
    last = max(months)
    end = date(last.year + last.month // 12, last.month % 12 + 1, 1)
    return (f"{column} >= DATE '{min(months).isoformat()}' AND {column} < DATE '{end.isoformat()}'"
            f" AND CAST(date_trunc('month', {column}) AS DATE) IN ({_dates(months)})")


def day_range_sql(days: Sequence[date], column: str = "r.occurred_at") -> str:
    """A condition on `column` (a TIMESTAMPTZ) that holds on the UTC days `days`: a range the
    scans can skip files by, then the days themselves."""
    if not days:
        return "FALSE"
    start = datetime(min(days).year, min(days).month, min(days).day, tzinfo=timezone.utc)
    last = max(days)
    end = datetime(last.year, last.month, last.day, tzinfo=timezone.utc) + timedelta(days=1)
    return (f"{column} >= {sql_instant(start)} AND {column} < {sql_instant(end)}"
            f" AND {utc_day_sql(column)} IN ({', '.join(str(_epoch_day(d)) for d in sorted(set(days)))})")


_EPOCH_DAY = date(1970, 1, 1)


def _epoch_day(day: date) -> int:
    return (day - _EPOCH_DAY).days


def current_snapshot(conn: duckdb.DuckDBPyConnection) -> int:
    """The lake's current snapshot id."""
    row = conn.execute("SELECT id FROM lake.current_snapshot()").fetchone()
    return int(row[0]) if row else 0


_BATCH_KINDS = ", ".join(f"'{kind}'" for kind in BATCH_KINDS)


def changed_days(conn: duckdb.DuckDBPyConnection, since: int | None, until: int) -> list[date] | None:
    """The UTC days whose current ratings may differ between the lake's snapshots `since`
    and `until`, in order; None when it cannot be told (no `since`, or its snapshots have
    expired): then every day.

    A day changes when the lake gains a rating row or line of it (an inline rating, a gate
    commit line, a batch run's line or reversal), or when a batch run that rated it is
    recorded or completes: a run's lines can land in the lake before the run is marked
    completed, and only then do they become current (superseding the inline rows of their
    events). The feed of each table is read from `since` + 1 through `until`: rows the
    compaction merged are not changes, and what it costs follows what changed."""
    if since is None:
        return None
    if since >= until:
        return []
    day = utc_day_sql("occurred_at")
    try:
        found: set[int] = set()
        for table in ("rating_rows", "rating_lines"):
            found.update(row[0] for row in conn.execute(
                f"SELECT DISTINCT {day} FROM lake.table_changes('{table}', {since + 1}, {until})"
                " WHERE change_type IN ('insert', 'delete', 'update_postimage')").fetchall())
        runs = [row[0] for row in conn.execute(
            f"SELECT DISTINCT run_id FROM lake.table_changes('rating_runs', {since + 1}, {until})"
            f" WHERE kind IN ({_BATCH_KINDS})").fetchall()]
    except duckdb.InvalidInputException:
        return None  # the snapshot after `since` has expired: the changes are unknown
    if runs:
        listed = ", ".join(sql_text(run) for run in runs)
        for table in ("rating_rows", "rating_lines"):
            found.update(row[0] for row in conn.execute(
                f"SELECT DISTINCT {day} FROM lake.{table} WHERE run_id IN ({listed})").fetchall())
    return sorted(_EPOCH_DAY + timedelta(days=int(n)) for n in found if n is not None)


def account_month_usage(conn: duckdb.DuckDBPyConnection, realm: str, account: str,
                        month: date) -> pa.Table:
    """The day rows a report published now would hold for one account of `realm` and the UTC
    month that starts at `month`: the columns of REPORT_COLUMNS up to line_count, ordered."""
    start = datetime(month.year, month.month, 1, tzinfo=timezone.utc)
    end = datetime(month.year + month.month // 12, month.month % 12 + 1, 1, tzinfo=timezone.utc)
    where = (f"realm = $realm AND billing_account_id = $account"
             f" AND occurred_at >= {sql_instant(start)} AND occurred_at < {sql_instant(end)}")
    return conn.execute(
        f"SELECT * FROM ({_period_sql('day', where, _month_sql(month))})"
        " ORDER BY period_start, feature_code, meter_code",
        {"realm": realm, "account": account}).to_arrow_table()


def account_realms(conn: duckdb.DuckDBPyConnection, account: str) -> list[str]:
    """The realms in whose events or ratings the lake knows `account`, in order."""
    return [row[0] for row in conn.execute(
        "SELECT realm FROM lake.events WHERE billing_account_id = $account"
        " UNION SELECT realm FROM lake.ratings WHERE billing_account_id = $account ORDER BY 1",
        {"account": account}).fetchall()]


def account_months(conn: duckdb.DuckDBPyConnection, realm: str, account: str) -> list[date]:
    """The first days of the UTC months in which `account` of `realm` has usage, in order."""
    where = "realm = $realm AND billing_account_id = $account"
    return [row[0] for row in conn.execute(
        f"SELECT DISTINCT CAST(date_trunc('month', period_start) AS DATE)"
        f" FROM ({_period_sql('day', where)}) ORDER BY 1",
        {"realm": realm, "account": account}).fetchall()]


def _month_sql(month: date, column: str = "r.occurred_at") -> str:
    start = datetime(month.year, month.month, 1, tzinfo=timezone.utc)
    end = datetime(month.year + month.month // 12, month.month % 12 + 1, 1, tzinfo=timezone.utc)
    return f"{column} >= {sql_instant(start)} AND {column} < {sql_instant(end)}"


def _period_sql(period: str, where: str = "TRUE", occurred: str = "TRUE") -> str:
    """The usage of the current `rated` lines that match `where`, per `period` (day or
    month), realm, account, feature and meter; `occurred` (a condition on `r.occurred_at`)
    narrows the current ratings read (`current_ratings_sql`)."""
    return (
        f"SELECT '{period}' AS period,"
        f" CAST(date_trunc('{period}', occurred_at AT TIME ZONE 'UTC') AS DATE) AS period_start,"
        " realm, billing_account_id, feature_code, meter_code,"
        " CAST(sum(quantity_minor) AS BIGINT) AS quantity_minor,"
        " CAST(sum(amount_xusd) AS BIGINT) AS amount_xusd,"
        " count(DISTINCT concat(source, ':', source_id)) AS event_count,"
        " count(*) AS line_count"
        f" FROM ({current_ratings_sql(occurred)}) WHERE status = 'rated' AND ({where}) GROUP BY ALL")
