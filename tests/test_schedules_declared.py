"""The flows' schedules are declared once (`core.schedules`): prefect.yaml and the README's
flow table say what that declaration says, and the service's scheduler runs it."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import yaml

from core.schedules import DEPLOYMENTS, SCHEDULED, scheduled_with_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_declares_exactly_the_deployments_and_schedules_of_core_schedules() -> None:
    declared = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    assert [d["name"] for d in declared] == [d.flow for d in DEPLOYMENTS]
    for entry, deployment in zip(declared, DEPLOYMENTS, strict=True):
        assert entry["entrypoint"] == deployment.entrypoint, deployment.flow
        assert entry["description"] == deployment.description, deployment.flow
        assert (entry.get("schedules") or []) == deployment.prefect_schedules(), deployment.flow


def test_the_readme_flow_table_shows_each_schedule_as_declared() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z-]+)` \|.*\| ([^|]+) \|$", readme, re.MULTILINE))
    assert {d.flow: d.describe() for d in DEPLOYMENTS} == {k: v.strip() for k, v in rows.items()}


def test_a_daily_schedule_falls_on_its_time_of_day() -> None:
    [compact] = [d for d in SCHEDULED if d.flow == "compact-lake"]
    before = datetime(2026, 11, 1, 3, 0, tzinfo=timezone.utc)
    after = datetime(2026, 11, 1, 3, 30, tzinfo=timezone.utc)
    assert compact.seconds_to_next(before) == 30 * 60
    assert compact.seconds_to_next(after) == 24 * 60 * 60  # just ran: tomorrow's
    rate = next(d for d in SCHEDULED if d.flow == "rate-events")
    assert rate.seconds_to_next(before) == 60


def test_an_interval_given_replaces_a_time_of_day_and_a_mistake_is_ignored(caplog) -> None:
    found = {d.flow: d for d in scheduled_with_overrides("compact-lake=43200, nope=3, rate-events=x")}
    assert (found["compact-lake"].every_seconds, found["compact-lake"].daily_at) == (43200, None)
    assert found["rate-events"].every_seconds == 60
    assert "'nope=3' ignored" in caplog.text and "'rate-events=x' ignored" in caplog.text
