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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import duckdb

from warehouse.lake import connect_lake
from warehouse.usage_days import utc_day_sql

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

# Each part yields rows of (day, billing_account_id, feature_code, meter_code, price_id,
# quantity_minor, amount_xusd, lines, sources); only the parts a slice needs are written
# into its query. {scope}: realm, range and accounts of a table alias.
_ROLLED = """
    SELECT CAST(u.day - DATE '1970-01-01' AS BIGINT), u.billing_account_id, u.feature_code,
           u.meter_code, u.price_id, u.quantity_minor, u.amount_xusd, u.lines, u.sources
    FROM lake.usage_days AS u
    WHERE {scope} AND (u.run_id = 'gate' OR u.run_id IN (SELECT run_id FROM batch_runs))"""
_SWEPT = """
    SELECT s.day, s.billing_account_id, k.feature_code, k.meter_code, k.price_id, s.q, s.a, s.n,
           CASE WHEN k.line_index = 0 THEN s.n ELSE 0 END
    FROM (SELECT {day} AS day, l.billing_account_id, l.line_id, sum(l.quantity_minor)::HUGEINT AS q,
                 sum(l.amount_xusd)::HUGEINT AS a, count(*) AS n
          FROM lake.rating_lines AS l WHERE {scope} GROUP BY ALL) AS s
    JOIN kinds AS k ON k.line_id = s.line_id
    WHERE k.status = 'rated'"""
# Rows of rating_rows (`{which}`: the batch runs' and the gate's, or given inline events'),
# described by their kind when they name one.
_STORED = """
    SELECT {day}, r.billing_account_id,
           CASE WHEN r.line_id IS NULL THEN r.feature_code ELSE k.feature_code END,
           CASE WHEN r.line_id IS NULL THEN r.meter_code ELSE k.meter_code END,
           r.price_id, r.quantity_minor, r.amount_xusd, {sign},
           CASE WHEN (CASE WHEN r.line_id IS NULL THEN r.line_index ELSE k.line_index END) = 0
                THEN {sign} ELSE 0 END
    FROM lake.rating_rows AS r LEFT JOIN kinds AS k ON k.line_id = r.line_id
    WHERE {scope} AND {which}
      AND (CASE WHEN r.line_id IS NULL THEN r.status ELSE k.status END) IN ('rated', 'reversal')"""
_SIGN = ("(CASE (CASE WHEN r.line_id IS NULL THEN r.status ELSE k.status END)"
         " WHEN 'reversal' THEN -1 ELSE 1 END)")
_NOT_INLINE = "(r.source = 'gate_commit' OR r.run_id IN (SELECT run_id FROM batch_runs))"
# The inline rows that may be current: those of events beyond the sweeps' watermark.
_WATERMARK = f"WITH batch_runs AS ({_BATCH_RUNS}) SELECT * FROM ({_MARK})"
# Its value is written into the query as a literal, so the lake prunes files by their export
# id statistics (a subquery's value is not known when the scan is planned: 76 ms of 10 M
# events scanned against 1 ms).
_INLINE_CANDIDATES = """
WITH batch_runs AS ({batch_runs}),
candidates AS (
    SELECT e.event_id, e.created_at FROM lake.events AS e WHERE {scope_e} AND e.export_id > {through}
)
SELECT DISTINCT r.event_id FROM lake.rating_rows AS r
WHERE {scope_r} AND r.source = 'event' AND r.run_id NOT IN (SELECT run_id FROM batch_runs)
  AND r.rated_at >= (SELECT coalesce(min(created_at), TIMESTAMPTZ 'infinity') FROM candidates)
  AND r.event_id IN (SELECT event_id FROM candidates)"""
# Of those, the events a batch run that started after the watermark's read has rated.
_RATED_LATELY = """
WITH batch_runs AS ({batch_runs}),
recent AS (SELECT run_id FROM batch_runs WHERE ? IS NULL OR started_at >= ?),
wanted AS (SELECT unnest(CAST(? AS UUID[])) AS event_id)
SELECT DISTINCT event_id FROM lake.rating_lines
WHERE run_id IN (SELECT run_id FROM recent) AND event_id IN (SELECT event_id FROM wanted)
UNION
SELECT DISTINCT event_id FROM lake.rating_rows
WHERE run_id IN (SELECT run_id FROM recent) AND event_id IN (SELECT event_id FROM wanted)"""


def _has_rollup(conn: duckdb.DuckDBPyConnection) -> bool:
    with conn.cursor() as cur:
        return cur.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = 'lake'"
                           " AND table_name = 'usage_days'").fetchone() == (1,)


def _current_inline(conn: duckdb.DuckDBPyConnection,
                    scope: Callable[[str, str, Any, Any], tuple[str, list[Any]]],
                    start: datetime, end: datetime) -> list[str]:
    """The events of the slice whose inline rows are current: beyond the sweeps' watermark
    and not rated by a batch run since. Two small queries: their cost follows the sweep's
    lag (the events beyond the watermark), not the lake's history."""
    where_e, params_e = scope("e", "occurred_at", start, end)
    where_r, params_r = scope("r", "occurred_at", start, end)
    with conn.cursor() as cur:
        mark = cur.execute(_WATERMARK).fetchone()
        through, since = (int(mark[0]), mark[1]) if mark is not None and mark[0] is not None else (-1, None)
        found = cur.execute(_INLINE_CANDIDATES.format(batch_runs=_BATCH_RUNS, scope_e=where_e, scope_r=where_r,
                                                      through=through), params_e + params_r).fetchall()
        if not found:
            return []
        events = [str(row[0]) for row in found]
        rated = {str(row[0]) for row in cur.execute(_RATED_LATELY.format(batch_runs=_BATCH_RUNS),
                                                    [since, since, events]).fetchall()}
    return [e for e in events if e not in rated]


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
        self.rolled_up = False

    def connection(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            if self._conn is None:
                conn = connect_lake(self._data_dir, read_only=True)
                conn.execute("SET threads = 2")
                self._conn = conn
            return self._conn

    def query(self, usage: UsageSlice) -> list[dict[str, Any]]:
        """`query_usage` on this reader's attach; whether the lake has its rollup is asked
        until it has (a table that is never dropped), then no more."""
        conn = self.connection()
        if not self.rolled_up:
            self.rolled_up = _has_rollup(conn)
        return query_usage(conn, usage, rollup=self.rolled_up)

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
    if first >= last or not (_has_rollup(conn) if rollup is None else rollup):
        # No whole day, or a lake not yet given its rollup (the service's start adds it):
        # every day from the lines.
        first = last = start
    accounts = dict(usage.filters).get("billing_account_id")

    def scope(t: str, column: str, low: Any, high: Any) -> tuple[str, list[Any]]:
        where = f"{t}.realm = ? AND {t}.{column} >= ? AND {t}.{column} < ?"
        params: list[Any] = [usage.realm, low, high]
        if accounts is not None:
            where += f" AND {t}.billing_account_id IN ({', '.join('?' for _ in accounts)})"
            params.extend(accounts)
        return where, params

    parts: list[str] = []
    params: list[Any] = []
    if first < last:
        where, more = scope("u", "day", first.date(), last.date())
        parts.append(_ROLLED.format(scope=where))
        params += more
    for low, high in ((start, first), (last, end)) if first < last else ((start, end),):
        if low >= high:
            continue  # an aligned edge: nothing outside the whole days
        where, more = scope("l", "occurred_at", low, high)
        parts.append(_SWEPT.format(day=utc_day_sql("l.occurred_at"), scope=where))
        params += more
        where, more = scope("r", "occurred_at", low, high)
        parts.append(_STORED.format(day=utc_day_sql("r.occurred_at"), sign=_SIGN, scope=where, which=_NOT_INLINE))
        params += more
    inline = _current_inline(conn, scope, start, end)
    if inline:
        where, more = scope("r", "occurred_at", start, end)
        parts.append(_STORED.format(day=utc_day_sql("r.occurred_at"), sign=_SIGN, scope=where, which=(
            "r.source = 'event' AND r.run_id NOT IN (SELECT run_id FROM batch_runs)"
            " AND r.event_id IN (SELECT unnest(CAST(? AS UUID[])))")))
        params += [*more, inline]
    union = " UNION ALL ".join(parts)
    sql = (f"WITH batch_runs AS ({_BATCH_RUNS}), kinds AS {_KINDS},"
           f" lines (day, billing_account_id, feature_code, meter_code, price_id, quantity_minor,"
           f" amount_xusd, lines, sources) AS ({union}),"
           " daily AS (SELECT day, billing_account_id, feature_code, meter_code, price_id,"
           " sum(quantity_minor) AS quantity_minor, sum(amount_xusd) AS amount_xusd,"
           " sum(lines) AS lines, sum(sources) AS sources FROM lines GROUP BY ALL) ")
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
