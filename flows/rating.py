"""Rating flows: `rate-events` (the scheduled sweep), `rerate` (a manual backfill) and
`close-aggregate-days`. Thin: each opens the lake of its data folder, loads the applied
catalog, and calls the pipeline under the rating lock."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger

from flows.progress import RunProgress
from flows.workspace import (
    applied_catalog,
    open_lake,
    parse_instant,
    rating_lock,
    resolve_data_dir,
    scratch_dir,
)
from pipelines.aggregate_days import close_aggregate_days as close_days
from pipelines.rating_plan import RatingPlan
from pipelines.rating_runs import RunSummary
from pipelines.rerate import rerate as rerate_events
from pipelines.sweep import CHUNK_EVENTS, sweep
from warehouse.lake import with_lake_retry

__all__ = ["close_aggregate_days", "rate_events", "rerate"]

# A run that meets a lake busy with another writer (the service's exporter) starts over: runs
# land whole or not at all, so a retry can never rate an event twice.
_ATTEMPTS = 5


def _report(runs: list[RunSummary]) -> dict[str, Any]:
    return {"runs": [run.run_id for run in runs], "events": sum(r.events for r in runs),
            "lines": sum(r.lines for r in runs)}


@flow(name="rate-events", log_prints=False)
def rate_events(data_dir: str | None = None, chunk_events: int = CHUNK_EVENTS) -> dict[str, Any]:
    """Rate every event of the lake that no batch run has rated yet."""
    folder = resolve_data_dir(data_dir)
    conn = open_lake(folder)
    try:
        plan = RatingPlan.from_catalog(applied_catalog(folder, conn))
        runs = with_lake_retry(lambda: sweep(conn, plan, rating_lock(folder), chunk_events=chunk_events,
                                             scratch=scratch_dir(folder)), attempts=_ATTEMPTS)
    finally:
        conn.close()
    result = _report(runs)
    get_run_logger().info("rated %d events in %d runs (%d rows)", result["events"],
                          len(runs), result["lines"])
    return result


@flow(name="rerate")
def rerate(occurred_from: str, occurred_to: str, accounts: list[str] | None = None,
           policy_ids: list[str] | None = None, data_dir: str | None = None,
           chunk_events: int = CHUNK_EVENTS) -> dict[str, Any]:
    """Re-rate the events with occurred_from <= occurred_at < occurred_to (RFC 3339), of
    `accounts` and `policy_ids` when given, under the catalog applied now; then rate again
    the closed aggregate days this changed."""
    folder = resolve_data_dir(data_dir)
    conn = open_lake(folder)
    try:
        catalog = applied_catalog(folder, conn)
        plan = RatingPlan.from_catalog(catalog)
        progress = RunProgress(f"rerate {occurred_from} .. {occurred_to}", key="rerate-progress")
        runs = rerate_events(conn, plan, rating_lock(folder),
                             occurred_from=parse_instant(occurred_from),
                             occurred_to=parse_instant(occurred_to), accounts=accounts,
                             policy_ids=policy_ids, chunk_events=chunk_events, progress=progress)
        progress.finish()
        runs += with_lake_retry(lambda: close_days(
            conn, plan, rating_lock(folder), lateness=_lateness(catalog),
            scratch=scratch_dir(folder)), attempts=_ATTEMPTS)
    finally:
        conn.close()
    result = _report(runs)
    get_run_logger().info("re-rated %d events and days in %d runs", result["events"], len(runs))
    return result


@flow(name="close-aggregate-days")
def close_aggregate_days(data_dir: str | None = None, now: str | None = None) -> dict[str, Any]:
    """Sweep, then rate the aggregate days closed (day end + the realm's lateness allowance)
    that are new or changed by late events."""
    folder = resolve_data_dir(data_dir)
    moment = parse_instant(now) if now else datetime.now(timezone.utc)
    conn = open_lake(folder)
    try:
        catalog = applied_catalog(folder, conn)
        plan = RatingPlan.from_catalog(catalog)
        runs = with_lake_retry(lambda: close_days(
            conn, plan, rating_lock(folder), lateness=_lateness(catalog), now=moment,
            scratch=scratch_dir(folder)), attempts=_ATTEMPTS)
    finally:
        conn.close()
    result = _report(runs)
    get_run_logger().info("%d runs, %d aggregate days", len(runs),
                          sum(r.events for r in runs if r.kind == "aggregate"))
    return result


def _lateness(catalog: Any) -> dict[str, int]:
    return {realm_id: realm.settings.lateness_allowance_seconds
            for realm_id, realm in catalog.realms.items()}
