"""`lake.usage_days`: every rating run's lines summed per account, UTC day and line kind,
written in the same lake transaction as the lines, so that a usage report reads a row per
day instead of a row per line (POST /mgt/v1/reports/usage; `warehouse.usage_query`).

    run_id, realm, billing_account_id, day DATE, feature_code, meter_code, price_id,
    quantity_minor HUGEINT, amount_xusd HUGEINT, lines BIGINT, sources BIGINT

Rows come from the batch runs (sweeps, rerates, aggregate days; their reversals with negated
sums and counts, so a sum over every row of the completed batch runs is the sum of the
current ratings, as for the lines themselves) and from the gate's commit lines (run `gate`,
one rollup row group per export). Inline ratings are not rolled up: they are provisional,
and a report adds those of events no sweep has reached from the lines themselves. `lines`
counts lines (a reversal -1); `sources` counts line 0s: events, aggregate days, commits.

A lake written before this table gets it, with the rollup of every row it already holds,
on its next writable attach (`warehouse.lake`).
"""

from __future__ import annotations

__all__ = ["COLUMNS", "rollup_lines_sql", "rollup_rows_sql", "utc_day_sql"]

COLUMNS = """
    run_id VARCHAR, realm VARCHAR, billing_account_id VARCHAR, day DATE, feature_code VARCHAR,
    meter_code VARCHAR, price_id VARCHAR, quantity_minor HUGEINT, amount_xusd HUGEINT,
    lines BIGINT, sources BIGINT"""



def utc_day_sql(column: str) -> str:
    """SQL for the UTC day of the TIMESTAMPTZ `column`, as days since 1970-01-01, in integer
    arithmetic (a cast through the time zone library costs ten times the scan), floored:
    DuckDB's `//` truncates toward zero, which put an instant before 1970 on the day after
    its own (1969-12-31T23:00Z on 1970-01-01). The rollups make it a DATE after the sums."""
    return (f"((epoch_us({column}) - CASE WHEN epoch_us({column}) < 0 THEN 86399999999 ELSE 0 END)"
            " // 86400000000)")


def rollup_lines_sql(alias: str, runs_where: str) -> str:
    """INSERT the rollup of the sweep lines (`rating_lines`) of the runs `runs_where` picks
    (a condition on the column run_id)."""
    return f"""
        INSERT INTO {alias}.usage_days
        SELECT l.run_id, l.realm, l.billing_account_id, DATE '1970-01-01' + CAST(l.day AS INTEGER),
               k.feature_code, k.meter_code, k.price_id, sum(l.q), sum(l.a), sum(l.n),
               sum(CASE WHEN k.line_index = 0 THEN l.n ELSE 0 END)
        FROM (SELECT run_id, realm, billing_account_id, {utc_day_sql("occurred_at")} AS day, line_id,
                     sum(quantity_minor)::HUGEINT AS q, sum(amount_xusd)::HUGEINT AS a, count(*) AS n
              FROM {alias}.rating_lines WHERE {runs_where} GROUP BY ALL) AS l
        JOIN (SELECT DISTINCT line_id, status, feature_code, meter_code, price_id, line_index
              FROM {alias}.rating_line_kinds) AS k ON k.line_id = l.line_id
        WHERE k.status = 'rated'
        GROUP BY ALL"""


def rollup_rows_sql(alias: str, source: str) -> str:
    """INSERT the rollup of rating rows (columns of `rating_rows`) read from `source`: a
    table, a registered relation or a parenthesised SELECT."""
    return f"""
        INSERT INTO {alias}.usage_days
        WITH described AS (
            SELECT r.run_id, r.realm, r.billing_account_id, {utc_day_sql("r.occurred_at")} AS day,
                   r.price_id, r.quantity_minor, r.amount_xusd,
                   CASE WHEN r.line_id IS NULL THEN r.status ELSE k.status END AS status,
                   CASE WHEN r.line_id IS NULL THEN r.feature_code ELSE k.feature_code END AS feature_code,
                   CASE WHEN r.line_id IS NULL THEN r.meter_code ELSE k.meter_code END AS meter_code,
                   CASE WHEN r.line_id IS NULL THEN r.line_index ELSE k.line_index END AS line_index
            FROM {source} AS r
            LEFT JOIN (SELECT DISTINCT line_id, status, feature_code, meter_code, line_index
                       FROM {alias}.rating_line_kinds) AS k ON k.line_id = r.line_id
        )
        SELECT run_id, realm, billing_account_id, DATE '1970-01-01' + CAST(day AS INTEGER), feature_code,
               meter_code, price_id, sum(quantity_minor)::HUGEINT, sum(amount_xusd)::HUGEINT,
               sum(CASE status WHEN 'reversal' THEN -1 ELSE 1 END),
               sum(CASE WHEN line_index = 0 THEN (CASE status WHEN 'reversal' THEN -1 ELSE 1 END) ELSE 0 END)
        FROM described WHERE status IN ('rated', 'reversal')
        GROUP BY ALL"""
