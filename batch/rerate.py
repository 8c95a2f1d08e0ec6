"""Re-rating (backfill): rate a range of events again under the catalog applied now.

`rerate(conn, plan, lock, occurred_from=..., occurred_to=...)` picks the events with
`occurred_from <= occurred_at < occurred_to`, optionally only of some accounts, and rates
them again with the sweep's SQL. With `policy_ids`, only the events whose current rating or
whose new rating comes from one of those policies are affected. For each affected event the
new run holds:

- a `reversal` row for each `rated` line of its current batch rating (same line, quantity and
  amount negated), so that summing every row of the completed runs still gives the current
  values; marker rows (skipped, quarantined, deferred) carry no amounts and need none;
- its new rows, priced with a carry that starts from 0 in this run.

The previous runs stay as they were. Like the sweep, the work is split into chunks by account
hash, one run (one lake transaction) per chunk, under the rating lock. An event rated only
inline so far is simply rated: inline ratings are provisional and never reversed.

Aggregate days are not re-rated here: the `deferred` rows this run writes make their days
newer than their aggregate lines, so the next `close_aggregate_days` rates those days again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime

import duckdb

from batch.chunks import CHUNK_EVENTS, plan_chunks
from batch.rating_plan import LINE_CATALOG, RatingPlan, priced_sql, sql_instant, sql_text
from batch.rating_runs import (
    RatingLock,
    RunSummary,
    current_batch_sql,
    new_run_id,
    reversal_rows_sql,
    write_run,
)
from batch.run_writer import event_rows_sql
from batch.sweep import Progress
from core.clock import SYSTEM_CLOCK, Clock

__all__ = ["rerate"]

_NEW = "_rerate_new"
_CURRENT = "_rerate_current"
_AFFECTED = "_rerate_affected"


def rerate(conn: duckdb.DuckDBPyConnection, plan: RatingPlan, lock: RatingLock, *,
           occurred_from: datetime, occurred_to: datetime,
           accounts: Sequence[str] | None = None, policy_ids: Sequence[str] | None = None,
           chunk_events: int = CHUNK_EVENTS, progress: Progress | None = None,
           clock: Clock = SYSTEM_CLOCK) -> list[RunSummary]:
    """Re-rate the events in [occurred_from, occurred_to); one run per chunk of accounts."""
    if occurred_to <= occurred_from:
        raise ValueError("occurred_to must be after occurred_from")
    listed_accounts = None if accounts is None else ", ".join(sql_text(a) for a in accounts)

    def in_range(alias: str) -> str:
        sql = (f"{alias}.occurred_at >= {sql_instant(occurred_from)}"
               f" AND {alias}.occurred_at < {sql_instant(occurred_to)}")
        if listed_accounts is not None:
            sql += f" AND {alias}.billing_account_id IN ({listed_accounts or 'NULL'})"
        return sql

    params: dict[str, object] = {
        "occurred_from": occurred_from.isoformat(), "occurred_to": occurred_to.isoformat(),
        "accounts": list(accounts) if accounts is not None else None,
        "policy_ids": list(policy_ids) if policy_ids is not None else None,
    }
    with lock:
        plan.install(conn)
        chunks = plan_chunks(conn, in_range('e'), chunk_events)
        total = sum(c.events for c in chunks)
        runs: list[RunSummary] = []
        done = 0
        for chunk in chunks:
            began = time.monotonic()
            started_at = clock.now()
            events = (f"(SELECT e.* FROM lake.events AS e WHERE {in_range('e')}"
                      f" AND {chunk.where('e')})")
            conn.execute(f"CREATE OR REPLACE TEMP TABLE {_NEW} AS"
                         f" {priced_sql('(' + plan.lines_sql(events) + ')')}")
            where = f"r.event_id IS NOT NULL AND {in_range('r')} AND {chunk.where('r')}"
            conn.execute(f"CREATE OR REPLACE TEMP TABLE {_CURRENT} AS {current_batch_sql(where)}")
            if policy_ids is None:
                affected = f"SELECT DISTINCT event_id FROM {_NEW}"
            else:
                listed = ", ".join(sql_text(p) for p in policy_ids) or "NULL"
                affected = (
                    f"SELECT n.event_id FROM {_NEW} AS n JOIN {LINE_CATALOG} AS c"
                    f" ON c.line_key = n.line_key WHERE c.policy_id IN ({listed})"
                    f" UNION SELECT event_id FROM {_CURRENT} WHERE policy_id IN ({listed})")
            conn.execute(f"CREATE OR REPLACE TEMP TABLE {_AFFECTED} AS {affected}")
            count = conn.execute(f"SELECT count(*) FROM {_AFFECTED}").fetchone()
            affected_events = int(count[0]) if count else 0
            if affected_events:
                run_id = new_run_id("rerate", started_at)
                new_rows = event_rows_sql(
                    run_id, started_at,
                    f"(SELECT * FROM {_NEW} WHERE event_id IN (SELECT event_id FROM {_AFFECTED}))")
                reversals = reversal_rows_sql(
                    run_id, sql_instant(started_at),
                    f"(SELECT * FROM {_CURRENT} WHERE event_id IN (SELECT event_id FROM {_AFFECTED}))")
                rows = f"{reversals} UNION ALL {new_rows}"
                summary = write_run(conn, run_id=run_id, kind="rerate", started_at=started_at, clock=clock,
                                    params=params, rows_sql=rows, events=affected_events)
                runs.append(RunSummary(summary.run_id, summary.kind, summary.events,
                                       summary.lines, time.monotonic() - began))
            for table in (_NEW, _CURRENT, _AFFECTED):
                conn.execute(f"DROP TABLE IF EXISTS {table}")
            done += chunk.events
            if progress is not None:
                progress(done, total)
        return runs
