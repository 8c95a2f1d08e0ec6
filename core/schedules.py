"""The flows' deployments and schedules, declared once.

`tollgate serve`'s scheduler (`flows/scheduler.py`) runs these; `prefect.yaml` declares the
same deployments for a Prefect server of one's own, and the README's flow table shows them
(tests/test_schedules_declared.py holds both to this module).

A schedule runs its flow every `every_seconds`: from the scheduler's start (the first run
comes one interval after it), or, with `daily_at`, at that UTC time of day.

>>> [s.describe() for s in DEPLOYMENTS]
['every minute', 'every 15 minutes', 'hourly', 'daily at 03:30 UTC', 'manual']
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = ["DEPLOYMENTS", "SCHEDULED", "Deployment", "scheduled_with_overrides"]

log = logging.getLogger("tollgate.scheduler")

_DAY = 24 * 60 * 60.0


@dataclass(frozen=True, slots=True)
class Deployment:
    flow: str
    entrypoint: str
    description: str
    every_seconds: float | None = None  # None: run by hand only
    daily_at: tuple[int, int] | None = None  # (hour, minute) UTC; every_seconds is a day

    def describe(self) -> str:
        """The schedule in words, as the README's flow table shows it."""
        if self.every_seconds is None:
            return "manual"
        if self.daily_at is not None:
            hour, minute = self.daily_at
            return f"daily at {hour:02d}:{minute:02d} UTC"
        every = self.every_seconds
        for unit, seconds, alone in (("day", _DAY, "daily"), ("hour", 3600.0, "hourly"),
                                     ("minute", 60.0, "every minute")):
            if every % seconds == 0:
                count = int(every // seconds)
                return alone if count == 1 else f"every {count} {unit}s"
        return f"every {every:g} seconds"

    def prefect_schedules(self) -> list[dict[str, Any]]:
        """The `schedules:` of this deployment in prefect.yaml."""
        if self.every_seconds is None:
            return []
        if self.daily_at is not None:
            hour, minute = self.daily_at
            return [{"cron": f"{minute} {hour} * * *", "timezone": "UTC"}]
        return [{"interval": int(self.every_seconds)}]

    def seconds_to_next(self, now: datetime) -> float:
        """Seconds from `now` to this schedule's next run after a run at `now` (or after the
        scheduler's start)."""
        assert self.every_seconds is not None
        if self.daily_at is None:
            return self.every_seconds
        hour, minute = self.daily_at
        at = now.astimezone(timezone.utc).replace(hour=hour, minute=minute, second=0,
                                                  microsecond=0)
        if at <= now:
            at += timedelta(days=1)
        return (at - now).total_seconds()


DEPLOYMENTS: tuple[Deployment, ...] = (
    Deployment("rate-events", "flows/rating.py:rate_events",
               "Rate every event of the lake that no batch run has rated yet.", 60.0),
    Deployment("close-aggregate-days", "flows/rating.py:close_aggregate_days",
               "Rate aggregate policies per account, event type and closed UTC day.", 15 * 60.0),
    Deployment("publish-usage-reports", "flows/reports.py:publish_usage_reports",
               "Usage per day and month to lake.usage_reports, Parquet and two table artifacts"
               " (days, months).", 60 * 60.0),
    # At night, UTC: compaction rewrites files that sweeps and analysts read.
    Deployment("compact-lake", "flows/compaction.py:compact_lake",
               "Merge small lake files, expire old snapshots, delete unused files.", _DAY,
               daily_at=(3, 30)),
    Deployment("rerate", "flows/rating.py:rerate",
               "Manual backfill over an occurred_at range, optionally of accounts and policies."),
)

SCHEDULED: tuple[Deployment, ...] = tuple(d for d in DEPLOYMENTS if d.every_seconds is not None)


def scheduled_with_overrides(text: str) -> tuple[Deployment, ...]:
    """SCHEDULED with the intervals of TOLLGATE_SCHEDULE_SECONDS (`NAME=SECONDS,...`); an
    interval given replaces a time of day. A mistake is logged and that entry ignored.

    >>> [(d.flow, d.every_seconds) for d in scheduled_with_overrides("rate-events=5")][:2]
    [('rate-events', 5.0), ('close-aggregate-days', 900.0)]
    """
    found = {d.flow: d for d in SCHEDULED}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if name.strip() not in found or not 0 < seconds < math.inf:
            log.error("TOLLGATE_SCHEDULE_SECONDS: %r ignored (expected NAME=SECONDS with NAME"
                      " one of %s)", item, ", ".join(found))
            continue
        found[name.strip()] = replace(found[name.strip()], every_seconds=seconds, daily_at=None)
    return tuple(found.values())
