"""Usage from the lake, summed over the current ratings and the gate's commits: the read side
of POST /mgt/v1/reports/usage.

Rows are never updated in the lake; a re-rating appends reversals and new rows. So the
current usage of a slice is a plain sum, with no "latest run per event" step:

- every row of the batch runs (sweeps, rerates, aggregate days): each reversal negates the
  row it cancels, so their sum is the sum of the current rows (docs/analysts.md, "Sums");
- every gate commit line (run `gate`, final when written);
- the inline rows (provisional: an event row of a run that is not a batch run) of events
  that no batch run has rated yet;
  an event's batch rows have its occurred_at, so the check stays inside the time range.

A sweep's lines (`rating_lines`) are summed per (bucket, account, line kind) before their
kind is joined, so the per-row work is a scan and a hash aggregate. Counts follow the same
rule: a reversal counts -1, so `line_count` and `commit_count` count current lines and
current sources (events, aggregate days, commits: their line 0).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from warehouse.lake import connect_lake

__all__ = ["DIMENSIONS", "METRICS", "LakeReader", "UsageSlice", "query_usage"]

# Dimension -> the column of the summed lines that holds it. `pricing_fingerprint` is the
# price row's id: the lake keeps the row id on every priced line.
DIMENSIONS: dict[str, str] = {
    "bucket_start": "{bucket}",
    "billing_account_id": "billing_account_id",
    "feature_code": "feature_code",
    "feature_family_code": "feature_family_code",
    "meter_code": "meter_code",
    "pricing_fingerprint": "price_id",
}
METRICS: dict[str, str] = {
    "quantity_minor": "sum(quantity_minor)",
    "amount_xusd": "sum(amount_xusd)",
    "line_count": "sum(lines)",
    "commit_count": "sum(sources)",
    "distinct_billing_account_count": "count(DISTINCT CASE WHEN lines <> 0 THEN billing_account_id END)",
}

# The lines of one bucket and account, per kind; the sweeps' narrow lines first.
_LINES = """
WITH kinds AS (SELECT DISTINCT * FROM lake.rating_line_kinds),
swept AS (
    SELECT epoch_us(l.occurred_at) // 86400000000 AS day, l.billing_account_id,
           l.line_id, sum(l.quantity_minor) AS quantity_minor, sum(l.amount_xusd) AS amount_xusd,
           count(*) AS n
    FROM lake.rating_lines AS l
    WHERE {where_l}
    GROUP BY ALL
),
batch_runs AS (
    SELECT DISTINCT run_id FROM lake.rating_runs
    WHERE status = 'completed' AND kind IN ('sweep', 'rerate', 'aggregate')
),
stored AS (
    SELECT r.*, CASE WHEN r.line_id IS NULL THEN r.status ELSE k.status END AS kstatus,
           CASE WHEN r.line_id IS NULL THEN r.feature_code ELSE k.feature_code END AS kfeature,
           CASE WHEN r.line_id IS NULL THEN r.meter_code ELSE k.meter_code END AS kmeter,
           CASE WHEN r.line_id IS NULL THEN r.line_index ELSE k.line_index END AS kindex,
           CASE WHEN r.source = 'gate_commit' THEN 'gate'
                WHEN b.run_id IS NOT NULL THEN 'batch' ELSE 'inline' END AS origin
    FROM lake.rating_rows AS r LEFT JOIN kinds AS k ON k.line_id = r.line_id
    LEFT JOIN batch_runs AS b ON b.run_id = r.run_id
    WHERE {where_r}
),
inline_rated AS (SELECT event_id FROM stored WHERE origin = 'inline'),
superseded AS (
    SELECT DISTINCT event_id FROM lake.rating_lines AS l
    WHERE {where_l} AND l.event_id IN (SELECT event_id FROM inline_rated)
    UNION
    SELECT DISTINCT event_id FROM stored
    WHERE origin = 'batch' AND event_id IN (SELECT event_id FROM inline_rated)
),
lines AS (
    SELECT s.day, s.billing_account_id, k.feature_code, k.meter_code, k.price_id,
           s.quantity_minor, s.amount_xusd, s.n AS lines,
           CASE WHEN k.line_index = 0 THEN s.n ELSE 0 END AS sources
    FROM swept AS s JOIN kinds AS k ON k.line_id = s.line_id
    WHERE k.status = 'rated'
    UNION ALL
    SELECT epoch_us(occurred_at) // 86400000000, billing_account_id, kfeature, kmeter,
           price_id, quantity_minor, amount_xusd,
           CASE kstatus WHEN 'reversal' THEN -1 ELSE 1 END,
           CASE WHEN kindex = 0 THEN (CASE kstatus WHEN 'reversal' THEN -1 ELSE 1 END) ELSE 0 END
    FROM stored
    WHERE kstatus IN ('rated', 'reversal')
      AND (origin <> 'inline' OR event_id NOT IN (SELECT event_id FROM superseded))
),
daily AS (
    SELECT day, billing_account_id, feature_code, meter_code, price_id, sum(quantity_minor) AS quantity_minor,
           sum(amount_xusd) AS amount_xusd, sum(lines) AS lines, sum(sources) AS sources
    FROM lines GROUP BY ALL
)
"""


@dataclass(frozen=True, slots=True)
class UsageSlice:
    """What to sum: a realm, [start, end), buckets of a UTC day or month, the dimensions to
    group by (keys of DIMENSIONS, bucket_start among them unless `collapse_buckets`), the
    metrics (keys of METRICS) and equality filters per dimension."""

    realm: str
    start: datetime
    end: datetime
    granularity: str  # day | month
    group_by: tuple[str, ...]
    metrics: tuple[str, ...]
    filters: tuple[tuple[str, tuple[str, ...]], ...] = ()
    families: tuple[tuple[str, str], ...] = ()  # (feature code, family code) of the catalog
    collapse_buckets: bool = False  # every row's bucket is `start` (aggregate total / group_total)


class LakeReader:
    """One read-only attach of the lake for the process, opened on first use; each query
    runs on a cursor of its own in a worker thread (DuckDB releases the GIL while it runs)."""

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = data_dir
        self._conn: duckdb.DuckDBPyConnection | None = None
        self._lock = threading.Lock()

    def connection(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            if self._conn is None:
                conn = connect_lake(self._data_dir, read_only=True)
                conn.execute("SET threads = 2")
                self._conn = conn
            return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None



def query_usage(conn: duckdb.DuckDBPyConnection, usage: UsageSlice) -> list[dict[str, Any]]:
    """The slice's rows: one dict per group, dimension values as text (the bucket as a UTC
    datetime) and metrics as Python ints (exact; sums of BIGINTs are HUGEINTs)."""
    where_parts = ["{t}.realm = ?", "{t}.occurred_at >= ?", "{t}.occurred_at < ?"]
    base: list[Any] = [usage.realm, usage.start, usage.end]
    accounts = dict(usage.filters).get("billing_account_id")
    if accounts is not None:
        where_parts.append("{t}.billing_account_id IN (" + ", ".join("?" for _ in accounts) + ")")
        base.extend(accounts)
    where = " AND ".join(where_parts)
    sql = _LINES.format(where_l=where.format(t="l"), where_r=where.format(t="r"))
    # Placeholders bind in order of appearance: swept (l), stored (r), superseded (l), then
    # the catalog's feature -> family pairs, then the outer filters.
    params: list[Any] = base * 3
    params.append([f for f, _ in usage.families])
    params.append([fam for _, fam in usage.families])
    dims = [d for d in usage.group_by if not (d == "bucket_start" and usage.collapse_buckets)]
    # Lines are summed per UTC day in integers (a date_trunc of each TIMESTAMPTZ goes through
    # the time zone library: ten times the scan's cost); the days become buckets after.
    bucket = ("make_timestamp(day * 86400000000)" if usage.granularity == "day"
              else "date_trunc('month', make_timestamp(day * 86400000000))")
    select = [f"{DIMENSIONS[d].format(bucket=bucket)} AS {d}" for d in dims]
    filters = []
    for d, values in usage.filters:
        if d == "billing_account_id":
            continue
        filters.append(f"{DIMENSIONS[d]} IN (" + ", ".join("?" for _ in values) + ")")
        params.extend(values)
    metrics = [f"{METRICS[m]} AS {m}" for m in usage.metrics]
    outer = (f"SELECT {', '.join(select + metrics)} FROM daily LEFT JOIN"
             " (SELECT unnest(CAST(? AS VARCHAR[])) AS fcode, unnest(CAST(? AS VARCHAR[])) AS feature_family_code)"
             " AS families ON families.fcode = daily.feature_code"
             + (f" WHERE {' AND '.join(filters)}" if filters else "")
             + (" GROUP BY ALL ORDER BY " + ", ".join(str(i + 1) for i in range(len(dims))) if dims else ""))
    cur = conn.cursor()
    try:
        result = cur.execute(sql + outer, params).fetchall()
    finally:
        cur.close()
    names = dims + list(usage.metrics)
    rows = []
    for values in result:
        row: dict[str, Any] = dict(zip(names, values, strict=True))
        if usage.collapse_buckets:
            row["bucket_start"] = usage.start
        elif "bucket_start" in row and row["bucket_start"] is not None:
            row["bucket_start"] = row["bucket_start"].replace(tzinfo=timezone.utc)
        for m in usage.metrics:
            row[m] = int(row[m] or 0)
        rows.append(row)
    return rows
