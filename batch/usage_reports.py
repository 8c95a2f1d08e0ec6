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
"""

from __future__ import annotations

from datetime import datetime

import duckdb
import pyarrow as pa

from batch.rating_plan import sql_instant
from batch.rating_runs import current_ratings_sql

__all__ = ["REPORT_COLUMNS", "build_usage_report"]

REPORT_COLUMNS = (
    "period, period_start, realm, billing_account_id, feature_code, meter_code, quantity_minor, "
    "amount_xusd, event_count, line_count, run_id, published_at"
)


def build_usage_report(conn: duckdb.DuckDBPyConnection, run_id: str,
                       published_at: datetime) -> pa.Table:
    """The report rows (columns of REPORT_COLUMNS), ordered for reading."""
    period_rows = []
    for period in ("day", "month"):
        period_rows.append(
            f"SELECT '{period}' AS period,"
            f" CAST(date_trunc('{period}', occurred_at AT TIME ZONE 'UTC') AS DATE) AS period_start,"
            " realm, billing_account_id, feature_code, meter_code,"
            " CAST(sum(quantity_minor) AS BIGINT) AS quantity_minor,"
            " CAST(sum(amount_xusd) AS BIGINT) AS amount_xusd,"
            " count(DISTINCT concat(source, ':', source_id)) AS event_count,"
            " count(*) AS line_count"
            f" FROM ({current_ratings_sql()}) WHERE status = 'rated' GROUP BY ALL")
    return conn.execute(
        f"SELECT period, period_start, realm, billing_account_id, feature_code, meter_code,"
        f" quantity_minor, amount_xusd, event_count, line_count, '{run_id}' AS run_id,"
        f" {sql_instant(published_at)} AS published_at"
        f" FROM ({' UNION ALL '.join(period_rows)})"
        " ORDER BY period, period_start, realm, billing_account_id, feature_code, meter_code"
    ).to_arrow_table()
