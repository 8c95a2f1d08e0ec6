"""Usage from the lake, summed over the current ratings and the gate's commits: the read side
of POST /mgt/v1/reports/usage.

Rows are never updated in the lake; a re-rating appends reversals and new rows. So the
current usage of a slice is a plain sum, with no "latest run per event" step:

- every row of the completed batch runs (sweeps, rerates, aggregate days): each reversal
  negates the row it cancels, so their sum is the sum of the current rows (docs/analysts.md,
  "Sums");
- every gate commit line (run `gate`, final when written);
- the inline rows (provisional: an event row of a run that is not a batch run) of events
  that no batch run has rated yet.

The first two are read from `lake.usage_days` (`warehouse.usage_days`: a row per run,
account, UTC day and line kind, written with the lines) for the whole UTC days of the range,
and from the lines themselves only for a partial first or last day. The third looks only at
events beyond the sweeps' watermark (the greatest export id a completed sweep had read,
`batch.sweep`), so its cost follows the sweep's lag, not the lake's history. A month of one
account is then ~30 x kinds rollup rows, however many events it had.

Counts follow the same rule: a reversal counts -1, so `line_count` and `commit_count` count
current lines and current sources (events, aggregate days, commits: their line 0).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
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

# A UTC day in integers (days since 1970-01-01) from a TIMESTAMPTZ: a cast through the time
# zone library costs ten times the scan.
_DAY = "epoch_us({t}.occurred_at) // 86400000000"
_KINDS = ("(SELECT DISTINCT line_id, status, feature_code, meter_code, price_id, line_index"
          " FROM lake.rating_line_kinds)")
_BATCH_RUNS = ("SELECT run_id, started_at, params FROM lake.rating_runs"
               " WHERE status = 'completed' AND kind IN ('sweep', 'rerate', 'aggregate')")
# The sweeps' watermark and when its sweep read the lake (as `batch.sweep` reads them): an
# event exported beyond it can only have been rated by a run that started after that read,
# less the sweep's clock margin of an hour.
_MARK = ("SELECT CAST(json_extract_string(params, '$.through_export_id') AS BIGINT) AS through,"
         " coalesce(CAST(json_extract_string(params, '$.through_read_at') AS TIMESTAMPTZ), started_at)"
         " - INTERVAL 1 HOUR AS since FROM batch_runs WHERE json_extract_string(params, '$.through_export_id')"
         " IS NOT NULL ORDER BY 1 DESC, 2 DESC LIMIT 1")

# Per part, rows of (day, billing_account_id, feature_code, meter_code, price_id,
# quantity_minor, amount_xusd, lines, sources). {days}: the whole days, {edges}: the
# partial ones (a condition on occurred_at, alias given), {scope}: realm, range and accounts.
_PARTS = """
WITH batch_runs AS ({batch_runs}),
kinds AS {kinds},
mark AS ({mark}),
rolled AS (
    SELECT CAST(u.day - DATE '1970-01-01' AS BIGINT) AS day, u.billing_account_id, u.feature_code,
           u.meter_code, u.price_id, u.quantity_minor, u.amount_xusd, u.lines, u.sources
    FROM {usage_days} AS u
    WHERE {days} AND (u.run_id = 'gate' OR u.run_id IN (SELECT run_id FROM batch_runs))
),
edge_swept AS (
    SELECT s.day, s.billing_account_id, k.feature_code, k.meter_code, k.price_id, s.q, s.a, s.n,
           CASE WHEN k.line_index = 0 THEN s.n ELSE 0 END
    FROM (SELECT {day_l} AS day, l.billing_account_id, l.line_id, sum(l.quantity_minor)::HUGEINT AS q,
                 sum(l.amount_xusd)::HUGEINT AS a, count(*) AS n
          FROM lake.rating_lines AS l WHERE {edges_l} GROUP BY ALL) AS s
    JOIN kinds AS k ON k.line_id = s.line_id
    WHERE k.status = 'rated'
),
stored AS (
    SELECT r.*, {day_r} AS day,
           CASE WHEN r.line_id IS NULL THEN r.status ELSE k.status END AS kstatus,
           CASE WHEN r.line_id IS NULL THEN r.feature_code ELSE k.feature_code END AS kfeature,
           CASE WHEN r.line_id IS NULL THEN r.meter_code ELSE k.meter_code END AS kmeter,
           CASE WHEN r.line_id IS NULL THEN r.line_index ELSE k.line_index END AS kindex,
           CASE WHEN r.source = 'gate_commit' THEN 'gate'
                WHEN r.run_id IN (SELECT run_id FROM batch_runs) THEN 'batch' ELSE 'inline' END AS origin
    FROM lake.rating_rows AS r LEFT JOIN kinds AS k ON k.line_id = r.line_id
    WHERE {edges_r}
),
candidates AS (
    SELECT e.event_id, e.created_at FROM lake.events AS e
    WHERE {scope_e} AND e.export_id > coalesce((SELECT through FROM mark), -1)
),
inline_rows AS (
    SELECT r.*, {day_r} AS day,
           CASE WHEN r.line_id IS NULL THEN r.status ELSE k.status END AS kstatus,
           CASE WHEN r.line_id IS NULL THEN r.feature_code ELSE k.feature_code END AS kfeature,
           CASE WHEN r.line_id IS NULL THEN r.meter_code ELSE k.meter_code END AS kmeter,
           CASE WHEN r.line_id IS NULL THEN r.line_index ELSE k.line_index END AS kindex
    FROM lake.rating_rows AS r LEFT JOIN kinds AS k ON k.line_id = r.line_id
    WHERE {scope_r} AND r.source = 'event' AND r.run_id NOT IN (SELECT run_id FROM batch_runs)
      AND r.rated_at >= (SELECT coalesce(min(created_at), TIMESTAMPTZ 'infinity') FROM candidates)
      AND r.event_id IN (SELECT event_id FROM candidates)
),
recent_runs AS (
    SELECT run_id FROM batch_runs
    WHERE (SELECT since FROM mark) IS NULL OR started_at >= (SELECT since FROM mark)
),
rated_lately AS (
    SELECT event_id FROM lake.rating_lines
    WHERE run_id IN (SELECT run_id FROM recent_runs) AND event_id IN (SELECT event_id FROM inline_rows)
    UNION
    SELECT event_id FROM lake.rating_rows
    WHERE run_id IN (SELECT run_id FROM recent_runs) AND event_id IN (SELECT event_id FROM inline_rows)
),
lines AS (
    SELECT * FROM rolled
    UNION ALL SELECT * FROM edge_swept
    UNION ALL
    SELECT day, billing_account_id, kfeature, kmeter, price_id, quantity_minor, amount_xusd,
           CASE kstatus WHEN 'reversal' THEN -1 ELSE 1 END,
           CASE WHEN kindex = 0 THEN (CASE kstatus WHEN 'reversal' THEN -1 ELSE 1 END) ELSE 0 END
    FROM stored WHERE origin <> 'inline' AND kstatus IN ('rated', 'reversal')
    UNION ALL
    SELECT day, billing_account_id, kfeature, kmeter, price_id, quantity_minor, amount_xusd,
           CASE kstatus WHEN 'reversal' THEN -1 ELSE 1 END,
           CASE WHEN kindex = 0 THEN (CASE kstatus WHEN 'reversal' THEN -1 ELSE 1 END) ELSE 0 END
    FROM inline_rows
    WHERE kstatus IN ('rated', 'reversal') AND event_id NOT IN (SELECT event_id FROM rated_lately)
),
daily AS (
    SELECT day, billing_account_id, feature_code, meter_code, price_id, sum(quantity_minor) AS quantity_minor,
           sum(amount_xusd) AS amount_xusd, sum(lines) AS lines, sum(sources) AS sources
    FROM lines GROUP BY ALL
)
"""


_EMPTY_ROLLUP = ("SELECT ''::VARCHAR AS run_id, ''::VARCHAR AS realm, ''::VARCHAR AS billing_account_id,"
                 " DATE '1970-01-01' AS day, ''::VARCHAR AS feature_code, ''::VARCHAR AS meter_code,"
                 " ''::VARCHAR AS price_id, 0::HUGEINT AS quantity_minor, 0::HUGEINT AS amount_xusd,"
                 " 0::BIGINT AS lines, 0::BIGINT AS sources")


def _has_rollup(conn: duckdb.DuckDBPyConnection) -> bool:
    with conn.cursor() as cur:
        return cur.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = 'lake'"
                           " AND table_name = 'usage_days'").fetchone() == (1,)


def _midnight(moment: datetime, *, up: bool) -> datetime:
    day = datetime(moment.year, moment.month, moment.day, tzinfo=timezone.utc)
    return day + timedelta(days=1) if up and day < moment else day


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



def query_usage(conn: duckdb.DuckDBPyConnection, usage: UsageSlice, *,
                rollup: bool | None = None) -> list[dict[str, Any]]:
    """The slice's rows: one dict per group, dimension values as text (the bucket as a UTC
    datetime) and metrics as Python ints (exact; the sums are HUGEINTs). `rollup`: read
    lake.usage_days for whole days (None: when the lake has it)."""
    start, end = usage.start.astimezone(timezone.utc), usage.end.astimezone(timezone.utc)
    first, last = _midnight(start, up=True), _midnight(end, up=False)
    rolled = _has_rollup(conn) if rollup is None else rollup
    if first >= last or not rolled:  # no whole day, or a lake not yet given its rollup
        first = last = start
    accounts = dict(usage.filters).get("billing_account_id")
    account_marks = ", ".join("?" for _ in accounts or ())

    def scope(t: str, column: str, low: Any, high: Any) -> tuple[str, list[Any]]:
        where = f"{t}.realm = ? AND {t}.{column} >= ? AND {t}.{column} < ?"
        params: list[Any] = [usage.realm, low, high]
        if accounts is not None:
            where += f" AND {t}.billing_account_id IN ({account_marks})"
            params.extend(accounts)
        return where, params

    def edges(t: str) -> tuple[str, list[Any]]:
        """The partial days: [start, first) and [last, end), each empty when aligned."""
        low, low_params = scope(t, "occurred_at", start, first)
        high, high_params = scope(t, "occurred_at", last, end)
        return f"(({low}) OR ({high}))", low_params + high_params

    days_where, days_params = scope("u", "day", first.date(), last.date())
    edges_l, edges_l_params = edges("l")
    edges_r, edges_r_params = edges("r")
    scope_e, scope_e_params = scope("e", "occurred_at", start, end)
    scope_r, scope_r_params = scope("r", "occurred_at", start, end)
    # A lake from before lake.usage_days gets it on the next writable attach (the service's
    # exporter attaches at start); until then every day is summed from the lines.
    usage_days = "lake.usage_days" if rolled else f"(SELECT * FROM ({_EMPTY_ROLLUP}) WHERE FALSE)"
    sql = _PARTS.format(usage_days=usage_days, batch_runs=_BATCH_RUNS, kinds=_KINDS, mark=_MARK, days=days_where,
                        day_l=_DAY.format(t="l"), day_r=_DAY.format(t="r"), edges_l=edges_l,
                        edges_r=edges_r, scope_e=scope_e, scope_r=scope_r)
    # Placeholders bind in order of appearance.
    params: list[Any] = [*days_params, *edges_l_params, *edges_r_params, *scope_e_params, *scope_r_params]
    params.append([f for f, _ in usage.families])
    params.append([fam for _, fam in usage.families])
    dims = [d for d in usage.group_by if not (d == "bucket_start" and usage.collapse_buckets)]
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
