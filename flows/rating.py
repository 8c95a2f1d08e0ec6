"""Rating flows: `rate-events` (the scheduled sweep), `rerate` (a manual backfill) and
`close-aggregate-days`. Thin: each opens the lake of its data folder, loads the applied
catalog, and calls the pipeline under the rating lock."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
from prefect import flow, get_run_logger

from batch.aggregate_days import close_aggregate_days as close_days
from batch.chunks import CHUNK_EVENTS
from batch.rating_plan import RatingPlan
from batch.rating_runs import RatingLock, RunSummary
from batch.rerate import rerate as rerate_events
from batch.sweep import sweep
from core.clock import SYSTEM_CLOCK
from flows.progress import RunProgress
from flows.workspace import (
    applied_catalog,
    close_lake,
    open_lake,
    parse_instant,
    rating_lock,
    resolve_data_dir,
    scratch_dir,
)
from pipelines.catalog import Catalog
from warehouse.lake import connect_lake, with_lake_retry

__all__ = ["check_rerate_params", "close_aggregate_days", "rate_events", "rerate",
           "rerate_arguments"]

# A run that meets a lake busy with another writer (the service's exporter) starts over: runs
# land whole or not at all, so a retry can never rate an event twice.
_ATTEMPTS = 5


class _SaidLock(RatingLock):
    """The rating lock; a run that finds it held says so in its log, then waits for it."""

    def __enter__(self) -> RatingLock:
        if self.timeout is None:
            self.timeout = 0
            try:
                return super().__enter__()
            except TimeoutError:
                get_run_logger().warning("another rating run holds %s; waiting for it to finish",
                                         self.path)
            finally:
                self.timeout = None
        return super().__enter__()


def _lock(folder: Path) -> RatingLock:
    return _SaidLock(rating_lock(folder).path)


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
        runs = with_lake_retry(lambda: sweep(conn, plan, _lock(folder), chunk_events=chunk_events,
                                             scratch=scratch_dir(folder)), attempts=_ATTEMPTS)
    finally:
        close_lake(conn)
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
        # Checked before anything is shown or written: a mistake is one line, and no run.
        start, end = rerate_arguments(conn, catalog, occurred_from, occurred_to, accounts,
                                      policy_ids)
        plan = RatingPlan.from_catalog(catalog)
        progress = RunProgress(f"rerate {occurred_from} .. {occurred_to}", key="rerate-progress")
        # A retry re-rates the chunks an interrupted attempt had finished in a new run, which
        # reverses theirs: current values stay one per event.
        runs = with_lake_retry(lambda: rerate_events(
            conn, plan, _lock(folder), occurred_from=start, occurred_to=end,
            accounts=accounts, policy_ids=policy_ids, chunk_events=chunk_events,
            progress=progress), attempts=_ATTEMPTS)
        progress.finish()
        after = with_lake_retry(lambda: close_days(
            conn, plan, _lock(folder), lateness=_lateness(catalog),
            scratch=scratch_dir(folder)), attempts=_ATTEMPTS)
    finally:
        close_lake(conn)
    # `events` counts the re-rated events only: the sweep that close-aggregate-days runs
    # first rates whatever was pending, which this backfill did not re-rate.
    result = _report(runs + after)
    result["events"] = sum(r.events for r in runs)
    result["swept_events"] = sum(r.events for r in after if r.kind == "sweep")
    result["aggregate_days"] = sum(r.events for r in after if r.kind == "aggregate")
    get_run_logger().info("re-rated %d events in %d runs; then swept %d pending events and rated"
                          " %d aggregate days", result["events"], len(runs),
                          result["swept_events"], result["aggregate_days"])
    return result


def _instant_param(name: str, text: object) -> datetime:
    try:
        return parse_instant(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name}={text!r} is not an RFC 3339 instant with an offset,"
                         " e.g. 2026-11-01T00:00:00Z") from None


def rerate_arguments(conn: duckdb.DuckDBPyConnection, catalog: Catalog, occurred_from: object,
                     occurred_to: object, accounts: object,
                     policy_ids: object) -> tuple[datetime, datetime]:
    """The range of a rerate, after checking its parameters against the applied catalog and
    the lake (`conn` has it attached as `lake`); ValueError naming the first mistake in one
    line. An account or policy is known when the catalog has it, or, for one since removed,
    when the lake has its events or a catalog once applied had the policy."""
    start = _instant_param("occurred_from", occurred_from)
    end = _instant_param("occurred_to", occurred_to)
    if end <= start:
        raise ValueError(f"occurred_to ({occurred_to}) must be after occurred_from ({occurred_from})")
    for name, values in (("accounts", accounts), ("policy_ids", policy_ids)):
        if values is not None and (not isinstance(values, list) or not values
                                   or not all(isinstance(v, str) for v in values)):
            raise ValueError(f"{name} must be a non-empty JSON list of ids, e.g."
                             f" --param '{name}=[\"...\"]' (leave it out for all)")
    if isinstance(accounts, list) and accounts:
        known = {a for realm in catalog.realms.values() for a in realm.accounts}
        missing = sorted(set(accounts) - known)
        if missing:
            found = conn.execute("SELECT DISTINCT billing_account_id FROM lake.events"
                                 " WHERE billing_account_id IN (SELECT unnest(?))", [missing]).fetchall()
            missing = sorted(set(missing) - {a for (a,) in found})
        if missing:
            raise ValueError(f"accounts: no account {', '.join(missing)} in the catalog or the lake")
    if isinstance(policy_ids, list) and policy_ids:
        known = {p for realm in catalog.realms.values() for p in realm.policies}
        known |= {p for (p,) in conn.execute(
            "SELECT DISTINCT policy_id FROM lake.catalog_policy_versions").fetchall()}
        missing = sorted(set(policy_ids) - known)
        if missing:
            raise ValueError(f"policy_ids: no policy {', '.join(missing)} in any applied catalog")
    return start, end


def check_rerate_params(data_dir: Path, params: Mapping[str, Any]) -> None:
    """`rerate_arguments` for `tollgate flows run rerate`, before a flow run is started."""
    def check() -> None:
        conn = connect_lake(data_dir, read_only=True)
        try:
            rerate_arguments(conn, applied_catalog(data_dir, conn), params.get("occurred_from"),
                             params.get("occurred_to"), params.get("accounts"),
                             params.get("policy_ids"))
        finally:
            conn.close()

    with_lake_retry(check)


@flow(name="close-aggregate-days")
def close_aggregate_days(data_dir: str | None = None, now: str | None = None) -> dict[str, Any]:
    """Sweep, then rate the aggregate days closed (day end + the realm's lateness allowance)
    that are new or changed by late events."""
    folder = resolve_data_dir(data_dir)
    moment = parse_instant(now) if now else SYSTEM_CLOCK.now()
    conn = open_lake(folder)
    try:
        catalog = applied_catalog(folder, conn)
        plan = RatingPlan.from_catalog(catalog)
        runs = with_lake_retry(lambda: close_days(
            conn, plan, _lock(folder), lateness=_lateness(catalog), now=moment,
            scratch=scratch_dir(folder)), attempts=_ATTEMPTS)
    finally:
        close_lake(conn)
    result = _report(runs)
    get_run_logger().info("%d runs, %d aggregate days", len(runs),
                          sum(r.events for r in runs if r.kind == "aggregate"))
    return result


def _lateness(catalog: Any) -> dict[str, int]:
    return {realm_id: realm.settings.lateness_allowance_seconds
            for realm_id, realm in catalog.realms.items()}
