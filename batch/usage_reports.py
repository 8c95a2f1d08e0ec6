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
Each publication is a new set of rows under its own run_id; readers take the latest.

`account_month_usage` gives the day rows of one account and month as a report published now
would (`tollgate report`); `account_realms` and `account_months` say where an account has
any.
"""

from __future__ import annotations

from datetime import date, datetime, timezone

import duckdb
import pyarrow as pa

from batch.rating_plan import sql_instant
from batch.rating_runs import current_ratings_sql

__all__ = ["REPORT_COLUMNS", "account_month_usage", "account_months", "account_realms",
           "build_usage_report"]

REPORT_COLUMNS = (
    "period, period_start, realm, billing_account_id, feature_code, meter_code, quantity_minor, "
    "amount_xusd, event_count, line_count, run_id, published_at"
)


def build_usage_report(conn: duckdb.DuckDBPyConnection, run_id: str,
                       published_at: datetime) -> pa.Table:
    """The report rows (columns of REPORT_COLUMNS), ordered for reading."""
    period_rows = [_period_sql(period) for period in ("day", "month")]
    return conn.execute(
        f"SELECT period, period_start, realm, billing_account_id, feature_code, meter_code,"
        f" quantity_minor, amount_xusd, event_count, line_count, '{run_id}' AS run_id,"
        f" {sql_instant(published_at)} AS published_at"
        f" FROM ({' UNION ALL '.join(period_rows)})"
        " ORDER BY period, period_start, realm, billing_account_id, feature_code, meter_code"
    ).to_arrow_table()


def account_month_usage(conn: duckdb.DuckDBPyConnection, realm: str, account: str,
                        month: date) -> pa.Table:
    """The day rows a report published now would hold for one account of `realm` and the UTC
    month that starts at `month`: the columns of REPORT_COLUMNS up to line_count, ordered."""
    start = datetime(month.year, month.month, 1, tzinfo=timezone.utc)
    end = datetime(month.year + month.month // 12, month.month % 12 + 1, 1, tzinfo=timezone.utc)
    where = (f"realm = $realm AND billing_account_id = $account"
             f" AND occurred_at >= {sql_instant(start)} AND occurred_at < {sql_instant(end)}")
    return conn.execute(
        f"SELECT * FROM ({_period_sql('day', where)})"
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


def _period_sql(period: str, where: str = "TRUE") -> str:
    """The usage of the current `rated` lines that match `where`, per `period` (day or
    month), realm, account, feature and meter."""
    return (
        f"SELECT '{period}' AS period,"
        f" CAST(date_trunc('{period}', occurred_at AT TIME ZONE 'UTC') AS DATE) AS period_start,"
        " realm, billing_account_id, feature_code, meter_code,"
        " CAST(sum(quantity_minor) AS BIGINT) AS quantity_minor,"
        " CAST(sum(amount_xusd) AS BIGINT) AS amount_xusd,"
        " count(DISTINCT concat(source, ':', source_id)) AS event_count,"
        " count(*) AS line_count"
        f" FROM ({current_ratings_sql()}) WHERE status = 'rated' AND ({where}) GROUP BY ALL")
