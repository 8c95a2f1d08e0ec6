"""Aggregate days: rate aggregate-engine policies per account, event type and UTC day.

The sweep gives an event matched by one aggregate policy a `deferred` row (its policy and
version). `close_aggregate_days(conn, plan, lock, lateness=..., now=...)` then, under the
rating lock and right after a sweep (so every exported event has been looked at):

1. finds the days that are closed, `day + 1 day + lateness_allowance_seconds <= now` (the
   realm's setting), and that are new or changed: an event of the day (account, event type)
   whose current rating is newer than the day's last aggregate lines, or a day with deferred
   events and no aggregate lines yet. A late event for a closed day is swept into a new
   `deferred` row, which is exactly such a change;
2. rates each of those days with `compile_aggregate_sql` over its currently deferred events,
   one group per policy version (a day split by a new version gives lines of both);
3. writes one `aggregate` run: a `reversal` of the day's previous aggregate lines, if any,
   and the new lines, priced with the price row in force at the start of the day and the
   carry of the run (per account and price row, in day order).

Each close reads only the days that may need it, not the history: the closed days of the
events rated by runs that started since the last close looked (`lake.aggregate_closes`, less
`MARGIN`), and the days that closed since its instant. The rest of the lake is left unread: a close's cost
follows the days it rates, and every 15 minutes it once scanned every event ever deferred
(2 GB of the scheduler's memory on an hour of full-speed traffic; docs/measurements.md, "An
hour at full speed"). A close that leaves days waiting for a policy version records no mark,
so they stay candidates until they are rated. A lake without a mark is read whole once.

An aggregate line has source `event`, `source_id` f"{account}/{event_type}/{day}" (day as
YYYY-MM-DD), no event_id, occurred_at the start of its day, and `line_index` the line's place
in its policy's document (lines of one intent naming one meter twice are added up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb

from batch.chunks import CHUNK_EVENTS
from batch.rating_plan import (
    RatingPlan,
    amounts_sql,
    described_sql,
    priced_sql,
    sql_instant,
    sql_text,
)
from batch.rating_runs import (
    RatingLock,
    RunSummary,
    batch_runs_sql,
    current_batch_sql,
    new_run_id,
    rating_id_sql,
    reversal_rows_sql,
    write_run,
)
from batch.sweep import sweep_locked
from core.clock import SYSTEM_CLOCK, Clock
from core.constants import INT64_MAX
from pipelines.rating import compile_aggregate_sql

__all__ = ["close_aggregate_days"]

log = logging.getLogger("tollgate.rating")

_EVENTS = "_aggregate_events"
_DAYS = "_aggregate_days"
_LINES = "_aggregate_lines"
_PREVIOUS = "_aggregate_previous"
_LATENESS = "_aggregate_lateness"
_VERSIONS = "_aggregate_versions"
_CANDIDATES = "_aggregate_candidates"
_DEFERRED = "_aggregate_deferred"
_DEFAULT_LATENESS = 7200  # seconds, for a realm the lateness map does not name
# Rows rated this long before the last close's look are read again: the clocks of the
# processes that rate may differ by this much.
MARGIN = timedelta(minutes=2)
_DAY = "CAST(r.occurred_at AT TIME ZONE 'UTC' AS DATE)"


def close_aggregate_days(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, lock: RatingLock, *,
                         lateness: Mapping[str, int], now: datetime | None = None,
                         chunk_events: int = CHUNK_EVENTS,
                         scratch: Path | None = None,
                         clock: Clock = SYSTEM_CLOCK) -> list[RunSummary]:
    """Sweep, then rate the closed days that are new or changed. `lateness` maps each realm
    to its lateness allowance in seconds. Returns the runs written (sweep runs included)."""
    moment = now or clock.now()
    with lock:
        runs = sweep_locked(conn, plan, chunk_events=chunk_events, scratch=scratch, clock=clock)
        run = _rate_days(conn, plan, lateness, moment, clock)
        return runs + ([run] if run is not None else [])


def _rate_days(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, lateness: Mapping[str, int],
               now: datetime, clock: Clock) -> RunSummary | None:
    """`_rate_closed_days`, with its scratch tables dropped however it ends."""
    try:
        return _rate_closed_days(conn, plan, lateness, now, clock)
    finally:
        for table in (_EVENTS, _DAYS, _LINES, _PREVIOUS, _LATENESS, _VERSIONS, _CANDIDATES,
                      _DEFERRED):
            conn.execute(f"DROP TABLE IF EXISTS {table}")


def _candidate_days(conn: duckdb.DuckDBPyConnection, lateness: Mapping[str, int],
                    now: datetime) -> tuple[str, str] | None:
    """Fill `_CANDIDATES` (realm, billing_account_id, usage_day) with the days this close
    must look at and `_DEFERRED` with the ids of their events ever deferred, and return the
    ranges of occurred_at that keep a read of lake.ratings (alias r) and of lake.events
    (alias x) to their files; None: no day to look at.

    A closed day needs a close only when (1) it closed since the last close's instant, or (2)
    a batch run that started since the last close looked rated one of its events. Each is
    read with conditions on stored columns that reach the scans of both tables under the
    ratings view: (1) a range of occurred_at, which DuckLake's file statistics use to skip
    every file of other days (a day's events are in the files of the minutes they arrived
    in); (2) the run ids themselves, found in lake.rating_runs (one row a run), since a
    sweep's lines carry no rated_at of their own. A lake without a mark is read whole."""
    mark = conn.execute("SELECT max(closed_at), max(looked_through) FROM lake.aggregate_closes").fetchone()
    closed_before, looked_through = (mark or (None, None))
    allowances = [*lateness.values(), _DEFAULT_LATENESS]
    # Every event of a closed day occurred before this (its day ended a lateness before now).
    closed_hi = now - timedelta(seconds=min(allowances))
    base = f"r.source = 'event' AND r.event_id IS NOT NULL AND r.occurred_at < {sql_instant(closed_hi)}"
    reads = [base]
    if closed_before is not None and looked_through is not None:
        # (1): a day that closed after `closed_before` began after this.
        newly = closed_before - timedelta(days=1, seconds=max(allowances)) - MARGIN
        reads = [f"{base} AND r.occurred_at >= {sql_instant(newly)}"]
        runs = [row[0] for row in conn.execute(
            f"SELECT run_id FROM ({batch_runs_sql()}) WHERE started_at > ? ORDER BY run_id",
            [looked_through - MARGIN]).fetchall()]
        if runs:  # (2)
            reads.append(f"{base} AND r.run_id IN ({', '.join(sql_text(r) for r in runs)})")
    conn.execute(
        f"CREATE OR REPLACE TEMP TABLE {_CANDIDATES} AS " + " UNION ".join(
            f"SELECT r.realm, r.billing_account_id, {_DAY} AS usage_day FROM lake.ratings AS r"
            f" WHERE {where}" for where in reads))
    span = conn.execute(f"SELECT min(usage_day), max(usage_day) FROM {_CANDIDATES}").fetchone()
    if span is None or span[0] is None:
        return None
    low = sql_instant(datetime.combine(span[0], datetime.min.time(), timezone.utc))
    high = sql_instant(datetime.combine(span[1], datetime.min.time(), timezone.utc) + timedelta(days=1))
    # The candidate days' events that were ever deferred, by plain joins on tables of their
    # own (correlated EXISTS filters on the ratings view's scans spilled without end).
    conn.execute(
        f"CREATE OR REPLACE TEMP TABLE {_DEFERRED} AS SELECT DISTINCT r.event_id"
        f" FROM lake.ratings AS r JOIN {_CANDIDATES} AS c ON c.realm = r.realm"
        f" AND c.billing_account_id = r.billing_account_id AND c.usage_day = {_DAY}"
        f" WHERE r.source = 'event' AND r.status = 'deferred'"
        f" AND r.occurred_at >= {low} AND r.occurred_at < {high}")
    return f"r.occurred_at >= {low} AND r.occurred_at < {high}", f"x.occurred_at >= {low} AND x.occurred_at < {high}"


def _record_close(conn: duckdb.DuckDBPyConnection, now: datetime, looked: datetime,
                  days: int) -> None:
    """The mark the next close starts from (`_candidate_days`)."""
    conn.execute("INSERT INTO lake.aggregate_closes SELECT greatest(?, coalesce(max(closed_at), ?)),"
                 " ?, ? FROM lake.aggregate_closes", [now, now, looked, days])


def _rate_closed_days(conn: duckdb.DuckDBPyConnection, plan: RatingPlan,
                      lateness: Mapping[str, int], now: datetime,
                      clock: Clock) -> RunSummary | None:
    versions = [v for v in plan.versions if v.document.engine == "aggregate"]
    if not versions:
        return None
    began = time.monotonic()
    # Inside the rating lock and after its sweep: every batch run rated before this is in
    # the lake, and every later one starts after it.
    looked = clock.now()
    bounds = _candidate_days(conn, lateness, now)
    if bounds is None:
        _record_close(conn, now, looked, 0)
        return None
    in_days, events_in_days = bounds
    conn.execute(f"CREATE OR REPLACE TEMP TABLE {_LATENESS} (realm VARCHAR, seconds BIGINT)")
    if lateness:
        conn.executemany(f"INSERT INTO {_LATENESS} VALUES (?, ?)", list(lateness.items()))
    # Every event of those days that was ever deferred, with its current batch rating
    # (deferred or not: an event re-rated away from its aggregate policy changes its day too).
    once_deferred = f"{in_days} AND r.event_id IN (SELECT event_id FROM {_DEFERRED})"
    conn.execute(
        f"CREATE OR REPLACE TEMP TABLE {_EVENTS} AS SELECT c.realm, c.event_id, c.status,"
        " c.policy_id, c.policy_version, c.run_finished_at, x.billing_account_id, x.event_type,"
        " CAST(x.occurred_at AT TIME ZONE 'UTC' AS DATE) AS usage_day"
        f" FROM ({current_batch_sql(once_deferred)}) AS c"
        f" JOIN (SELECT * FROM lake.events AS x WHERE {events_in_days}) AS x"
        " ON x.event_id = c.event_id")
    day_key = "concat(billing_account_id, '/', event_type, '/', strftime(usage_day, '%Y-%m-%d'))"
    day_start = "(CAST(usage_day AS TIMESTAMP) AT TIME ZONE 'UTC')"
    conn.execute(
        f"CREATE OR REPLACE TEMP TABLE {_DAYS} AS"
        f" SELECT e.realm, billing_account_id, event_type, usage_day, {day_key} AS source_id,"
        " max(run_finished_at) AS changed_at, bool_or(status = 'deferred') AS has_deferred"
        f" FROM {_EVENTS} AS e LEFT JOIN {_LATENESS} AS l ON l.realm = e.realm"
        f" WHERE {day_start} + INTERVAL 1 DAY + to_seconds(coalesce(l.seconds, 7200))"
        f" <= {sql_instant(now)} GROUP BY ALL")
    # The days' previous aggregate lines; a day whose lines are newer than its events, or
    # that never had lines and has nothing deferred any more, needs nothing.
    previous = current_batch_sql(
        f"r.event_id IS NULL AND {in_days} AND EXISTS (SELECT 1 FROM {_DAYS} AS d"
        " WHERE d.realm = r.realm AND d.source_id = r.source_id)")
    conn.execute(f"CREATE OR REPLACE TEMP TABLE {_PREVIOUS} AS {previous}")
    conn.execute(
        f"DELETE FROM {_DAYS} AS d WHERE EXISTS (SELECT 1 FROM {_PREVIOUS} AS p"
        " WHERE p.realm = d.realm AND p.source_id = d.source_id"
        " AND p.run_finished_at >= d.changed_at)")
    conn.execute(
        f"DELETE FROM {_DAYS} AS d WHERE NOT d.has_deferred AND NOT EXISTS (SELECT 1 FROM"
        f" {_PREVIOUS} AS p WHERE p.realm = d.realm AND p.source_id = d.source_id)")
    # A day with events deferred under a version the catalog no longer has cannot be rated
    # whole: rating the rest would reverse its earlier lines and bill it short. It is left
    # as it is (its events stay `deferred`, nothing is dropped) until the catalog has that
    # version again or a rerate moves its events, and it is named here on every close.
    conn.execute(f"CREATE OR REPLACE TEMP TABLE {_VERSIONS} (realm VARCHAR, policy_id VARCHAR,"
                 " policy_version VARCHAR)")
    conn.executemany(f"INSERT INTO {_VERSIONS} VALUES (?, ?, ?)",
                     [(v.realm, v.policy_id, v.version) for v in versions])
    waiting = conn.execute(
        f"DELETE FROM {_DAYS} AS d WHERE EXISTS (SELECT 1 FROM {_EVENTS} AS e"
        " WHERE e.status = 'deferred' AND e.realm = d.realm"
        " AND e.billing_account_id = d.billing_account_id AND e.event_type = d.event_type"
        f" AND e.usage_day = d.usage_day AND NOT EXISTS (SELECT 1 FROM {_VERSIONS} AS v"
        " WHERE v.realm = e.realm AND v.policy_id = e.policy_id"
        " AND v.policy_version = e.policy_version)) RETURNING d.source_id, d.realm").fetchall()
    if waiting:
        log.warning("%d closed aggregate days wait for a policy version the applied catalog no"
                    " longer has, and stay unrated: %s", len(waiting),
                    ", ".join(f"{realm}:{day}" for day, realm in sorted(waiting)[:10])
                    + (" ..." if len(waiting) > 10 else ""))
    days = conn.execute(f"SELECT count(*) FROM {_DAYS}").fetchone()
    day_count = int(days[0]) if days else 0
    if not day_count:
        if not waiting:
            _record_close(conn, now, looked, 0)
        return None

    lines = []
    for version in versions:
        # The day's facts come from lake.events again, for the days being rated only.
        source = (
            "(SELECT x.billing_account_id, x.semantic_kind, x.event_type,"
            " strftime(x.occurred_at AT TIME ZONE 'UTC', '%Y-%m-%dT%H:%M:%S.%fZ') AS occurred_at,"
            " x.subject_ref, CAST(x.payload AS VARCHAR) AS payload,"
            " CAST(x.labels AS VARCHAR) AS labels"
            f" FROM {_EVENTS} AS e JOIN lake.events AS x ON x.event_id = e.event_id"
            " WHERE e.status = 'deferred'"
            f" AND e.realm = {sql_text(version.realm)}"
            f" AND e.policy_id = {sql_text(version.policy_id)}"
            f" AND e.policy_version = {sql_text(version.version)}"
            f" AND EXISTS (SELECT 1 FROM {_DAYS} AS d WHERE d.realm = e.realm"
            " AND d.billing_account_id = e.billing_account_id AND d.event_type = e.event_type"
            " AND d.usage_day = e.usage_day))")
        keys = []
        for intent_index, intent in enumerate(version.document.intents):
            for meter_index, meter in enumerate(intent.meters):
                first = next(i for i, m in enumerate(intent.meters) if m.meter_code == meter.meter_code)
                if first == meter_index:
                    key = plan.aggregate_line_key(version.key, intent_index, meter_index)
                    keys.append(f"({intent_index}, {sql_text(meter.meter_code)}, {key})")
        lines.append(
            f"SELECT {sql_text(version.realm)} AS realm, a.billing_account_id, a.event_type,"
            " a.usage_day, k.line_key, a.quantity_minor"
            f" FROM ({compile_aggregate_sql(version.document, source, plan.params)}) AS a"
            f" JOIN (VALUES {', '.join(keys)}) AS k(intent_index, meter_code, line_key)"
            " ON k.intent_index = a.intent_index AND k.meter_code = a.meter_code")
    conn.execute(
        f"CREATE OR REPLACE TEMP TABLE {_LINES} AS SELECT realm, billing_account_id,"
        f" {day_key} AS source_id, CAST(NULL AS UUID) AS event_id,"
        f" {day_start} AS occurred_at, line_key,"
        f" CAST(least(sum(quantity_minor), {INT64_MAX}) AS BIGINT) AS quantity_minor"
        f" FROM ({' UNION ALL '.join(lines)}) GROUP BY ALL")
    started_at = clock.now()
    run_id = new_run_id("aggregate", started_at)
    rated_at = sql_instant(started_at)
    priced = f"({priced_sql(_LINES)})"
    described = described_sql(f"({amounts_sql(priced, 'source_id, line_key')})")
    new_rows = (
        f"SELECT {rating_id_sql(run_id)}, '{run_id}', 'event', source_id, event_id, realm,"
        " billing_account_id, status, policy_id, policy_version, feature_code, meter_code,"
        " quantity_minor, price_id, unit_price_xusd, unit_quantity_minor, amount_xusd,"
        f" occurred_at, {rated_at}, line_index, CAST(NULL AS BIGINT) FROM ({described})")
    reversals = reversal_rows_sql(
        run_id, rated_at,
        f"(SELECT p.* FROM {_PREVIOUS} AS p JOIN {_DAYS} AS d"
        " ON d.realm = p.realm AND d.source_id = p.source_id)")
    summary = write_run(conn, run_id=run_id, kind="aggregate", started_at=started_at, clock=clock,
                        params={"closed_before": now.isoformat(), "days": day_count},
                        rows_sql=f"{reversals} UNION ALL {new_rows}", events=day_count)
    if not waiting:
        # After the run: a close killed in between reads these days again and finds their
        # lines newer than their events, so nothing is rated twice.
        _record_close(conn, now, looked, day_count)
    return RunSummary(summary.run_id, summary.kind, summary.events, summary.lines,
                      time.monotonic() - began)
