"""Prefect flows, thin: each runs the batch engine (`batch`) over the lake of one data folder.

    rate-events            the sweep of events not yet rated (every minute)
    rerate                 a manual backfill over an occurred_at range, accounts, policies
    close-aggregate-days   aggregate policies per account, event type and closed UTC day
    publish-usage-reports  usage per day and month to the lake, Parquet and two artifacts;
                           a chart per account and month (PNG) and their artifact
    compact-lake           merge files, expire snapshots, delete unused files

`FLOWS` names them and `flow_named` gives each; `prefect.yaml` declares their deployments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["FLOWS", "check_params", "flow_named"]

FLOWS: tuple[str, ...] = ("rate-events", "rerate", "close-aggregate-days",
                          "publish-usage-reports", "compact-lake")


def flow_named(name: str) -> Any:
    """The flow called `name` (imported on demand: importing Prefect takes a second)."""
    if name == "rate-events":
        from flows.rating import rate_events
        return rate_events
    if name == "rerate":
        from flows.rating import rerate
        return rerate
    if name == "close-aggregate-days":
        from flows.rating import close_aggregate_days
        return close_aggregate_days
    if name == "publish-usage-reports":
        from flows.reports import publish_usage_reports
        return publish_usage_reports
    if name == "compact-lake":
        from flows.compaction import compact_lake
        return compact_lake
    raise KeyError(f"no flow {name!r}; flows: {', '.join(FLOWS)}")


def check_params(name: str, data_dir: Path, params: dict[str, Any]) -> None:
    """Check a flow's parameters before a run is started (ValueError: the mistake, in one
    line); flows without a check pass."""
    if name == "rerate":
        from flows.rating import check_rerate_params
        check_rerate_params(data_dir, params)
