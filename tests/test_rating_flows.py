"""The rating flows end to end: events sent over HTTP to the real service reach the lake, real
Prefect flow runs sweep, re-rate and publish them, and every amount is worked out by hand.
Also inline rating of single events, and the schedules `tollgate serve` runs."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
from prefect.artifacts import Artifact
from prefect.testing.utilities import prefect_test_harness

from cli.main import main as tollgate_main
from flows.compaction import compact_lake
from flows.rating import rate_events, rerate
from flows.reports import _ARTIFACTS, publish_usage_reports
from tests.conftest import Service, make_service, processes_of, tollgate
from tests.lake_events import catalog_toml, policy, price, single
from warehouse.lake import connect_lake
from warehouse.operational import open_operational

pytestmark = [pytest.mark.server, pytest.mark.prefect]

TOKENS = {"tokens.in": {"payload_int": "usage.input_tokens", "default": 0},
          "tokens.out": {"payload_int": "usage.output_tokens", "default": 0}}
POLICIES = (policy("llm", ("v1", "2026-01-01T00:00:00Z", single("llm.completion", "llm.chat", TOKENS)))
            + policy("calls", ("v1", "2026-01-01T00:00:00Z", single(
                "api.call", "api.search", {"calls": {"const": 1}}))))
PRICES = (price("tokens.in", 150, 1000, "2026-01-01T00:00:00Z")
          + price("tokens.out", 600, 1000, "2026-01-01T00:00:00Z", rounding="ceil")
          + price("calls", 2000, 1, "2026-01-01T00:00:00Z"))


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    with prefect_test_harness(server_startup_timeout=120):
        yield


def start_service(tmp: Path, monkeypatch: pytest.MonkeyPatch, *, schedules: str = "off",
                  prices: str = PRICES) -> Service:
    monkeypatch.setenv("TOLLGATE_SCHEDULES", schedules)
    catalog = tmp / "catalog.toml"
    catalog.write_text(catalog_toml(policies=POLICIES, prices=prices))
    svc = make_service(tmp / "data", catalog)
    svc.start()
    return svc


def llm(at: str, tokens_in: int, tokens_out: int) -> dict[str, Any]:
    return {"semantic_kind": "activity", "event_type": "llm.completion", "occurred_at": at,
            "payload": {"usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}}}


def lake_query(data_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = connect_lake(data_dir, read_only=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def wait_for_lake_events(data_dir: Path, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    seen = -1
    while time.monotonic() < deadline:
        try:
            seen = lake_query(data_dir, "SELECT count(*) FROM lake.events")[0][0]
        except (duckdb.Error, FileNotFoundError):
            seen = -1
        if seen == count:
            return
        time.sleep(0.2)
    raise AssertionError(f"the lake holds {seen} events, expected {count}")


def send_events(svc: Service) -> None:
    """acct_a: three completions (two single, one in a batch); acct_b: one completion, one
    API call and one event no policy matches (batch)."""
    for body in (llm("2026-11-01T10:00:00Z", 700, 100), llm("2026-11-01T11:00:00Z", 800, 950)):
        assert svc.post("/mgt/v1/events", body, account="acct_a").status_code == 201
    reply = svc.post("/mgt/v1/events/batch", {"events": [llm("2026-11-01T12:00:00Z", 1500, 0)]},
                     account="acct_a")
    assert reply.json()["data"]["accepted_count"] == 1
    reply = svc.post("/mgt/v1/events/batch", {"events": [
        llm("2026-11-02T09:00:00Z", 5000, 0),
        {"semantic_kind": "activity", "event_type": "api.call", "occurred_at": "2026-11-02T09:30:00Z",
         "payload": {}},
        {"semantic_kind": "outcome", "event_type": "unknown.thing", "occurred_at": "2026-11-02T10:00:00Z",
         "payload": {}}]}, account="acct_b")
    assert reply.json()["data"]["accepted_count"] == 3
    wait_for_lake_events(svc.data_dir, 6)


REPORT = ("SELECT period, CAST(period_start AS VARCHAR), billing_account_id, feature_code, meter_code,"
          " quantity_minor, amount_xusd, event_count, line_count FROM lake.usage_reports"
          " WHERE run_id = '{run_id}' ORDER BY ALL")


def artifact_rows(key: str) -> tuple[list[tuple[str, ...]], str]:
    """A table artifact's (period_start, account, meter, amount) rows, and its description."""
    artifact = Artifact.get(key)
    assert artifact is not None and isinstance(artifact.data, str)
    rows = [(r["period_start"], r["billing_account_id"], r["meter_code"], r["amount_xusd"])
            for r in json.loads(artifact.data)]
    return rows, artifact.description or ""


def test_events_sent_over_http_are_swept_priced_and_reported_then_backfilled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: None) -> None:
    svc = start_service(tmp_path, monkeypatch)
    try:
        send_events(svc)
        swept = rate_events(data_dir=str(svc.data_dir))
        assert swept["events"] == 6
        assert rate_events(data_dir=str(svc.data_dir))["events"] == 0  # nothing left

        amounts = lake_query(svc.data_dir, (
            "SELECT billing_account_id, meter_code, list(amount_xusd ORDER BY occurred_at)"
            f" FROM lake.ratings WHERE run_id IN ({', '.join(repr(r) for r in swept['runs'])})"
            " AND status = 'rated' GROUP BY ALL ORDER BY ALL"))
        assert amounts == [
            # tokens.in at 150 per 1000, floor, carried: 700 -> 0, 1500 -> 150, 3000 -> 450
            ("acct_a", "tokens.in", [0, 150, 300]),
            # tokens.out at 600 per 1000, ceil: 100 -> 1 block, 1050 -> 2 blocks, + 0
            ("acct_a", "tokens.out", [600, 600, 0]),
            ("acct_b", "calls", [2000]),
            ("acct_b", "tokens.in", [750]),
            ("acct_b", "tokens.out", [0])]
        assert lake_query(svc.data_dir, "SELECT status, count(*) FROM lake.ratings"
                          f" WHERE run_id = '{swept['runs'][0]}' AND status <> 'rated' GROUP BY ALL") == [
            ("skipped_no_policy", 1)]

        first = publish_usage_reports(data_dir=str(svc.data_dir))
        report = lake_query(svc.data_dir, REPORT.format(run_id=first["run_id"]))
        assert report == sorted([
            ("day", "2026-11-01", "acct_a", "llm.chat", "tokens.in", 3000, 450, 3, 3),
            ("day", "2026-11-01", "acct_a", "llm.chat", "tokens.out", 1050, 1200, 3, 3),
            ("day", "2026-11-02", "acct_b", "api.search", "calls", 1, 2000, 1, 1),
            ("day", "2026-11-02", "acct_b", "llm.chat", "tokens.in", 5000, 750, 1, 1),
            ("day", "2026-11-02", "acct_b", "llm.chat", "tokens.out", 0, 0, 1, 1),
            ("month", "2026-11-01", "acct_a", "llm.chat", "tokens.in", 3000, 450, 3, 3),
            ("month", "2026-11-01", "acct_a", "llm.chat", "tokens.out", 1050, 1200, 3, 3),
            ("month", "2026-11-01", "acct_b", "api.search", "calls", 1, 2000, 1, 1),
            ("month", "2026-11-01", "acct_b", "llm.chat", "tokens.in", 5000, 750, 1, 1),
            ("month", "2026-11-01", "acct_b", "llm.chat", "tokens.out", 0, 0, 1, 1)])
        monthly = pq.read_table(svc.data_dir / "reports" / "usage_month.parquet").to_pylist()
        assert {(r["billing_account_id"], r["meter_code"]): r["amount_xusd"] for r in monthly} == {
            ("acct_a", "tokens.in"): 450, ("acct_a", "tokens.out"): 1200,
            ("acct_b", "calls"): 2000, ("acct_b", "tokens.in"): 750, ("acct_b", "tokens.out"): 0}
        # The artifacts: the day rows and the month rows, newest first, each under its cap.
        days, about = artifact_rows("usage-report-days")
        assert days == [("2026-11-02", "acct_b", "calls", "2000"), ("2026-11-02", "acct_b", "tokens.in", "750"),
                        ("2026-11-02", "acct_b", "tokens.out", "0"), ("2026-11-01", "acct_a", "tokens.in", "450"),
                        ("2026-11-01", "acct_a", "tokens.out", "1200")]
        assert first["run_id"] in about and "5 of 5 rows, newest first (at most 1000 shown)" in about
        months, about = artifact_rows("usage-report")
        assert [(r[1], r[2], r[3]) for r in months] == [
            ("acct_a", "tokens.in", "450"), ("acct_a", "tokens.out", "1200"), ("acct_b", "calls", "2000"),
            ("acct_b", "tokens.in", "750"), ("acct_b", "tokens.out", "0")]
        assert {r[0] for r in months} == {"2026-11-01"} and "(at most 500 shown)" in about

        # Backfill: a new price row for input tokens, in force from before the events.
        catalog = tmp_path / "catalog-2.toml"
        catalog.write_text(catalog_toml(policies=POLICIES, prices=PRICES + price(
            "tokens.in", 300, 1000, "2026-10-01T00:00:00Z")))
        tollgate("catalog", "apply", str(catalog), data_dir=svc.data_dir)
        backfill = rerate(occurred_from="2026-11-01T00:00:00Z", occurred_to="2026-11-02T00:00:00Z",
                          accounts=["acct_a"], data_dir=str(svc.data_dir))
        assert backfill["events"] == 3
        monkeypatch.setitem(_ARTIFACTS, "day", ("usage-report-days", "Daily usage", 3))
        second = publish_usage_reports(data_dir=str(svc.data_dir))
        days, about = artifact_rows("usage-report-days")   # cut at 3 rows: the newest day's
        assert [r[0] for r in days] == ["2026-11-02"] * 3 and "3 of 5 rows" in about
        # The backfill changed November 1st alone: that day's rows and November's month rows.
        assert second["days"] == ["2026-11-01"] and second["rows"] == {"day": 2, "month": 5}
        month = [row for row in lake_query(svc.data_dir, REPORT.format(run_id=second["run_id"]))
                 if row[0] == "month"]
        assert month == [
            # 700 -> 0, 1500 -> 300, 3000 -> 900 at 300 per 1000
            ("month", "2026-11-01", "acct_a", "llm.chat", "tokens.in", 3000, 900, 3, 3),
            ("month", "2026-11-01", "acct_a", "llm.chat", "tokens.out", 1050, 1200, 3, 3),
            # acct_b is outside the backfill and keeps its amounts
            ("month", "2026-11-01", "acct_b", "api.search", "calls", 1, 2000, 1, 1),
            ("month", "2026-11-01", "acct_b", "llm.chat", "tokens.in", 5000, 750, 1, 1),
            ("month", "2026-11-01", "acct_b", "llm.chat", "tokens.out", 0, 0, 1, 1)]
        # The old run is still there, untouched, and the earlier report too.
        assert lake_query(svc.data_dir, "SELECT count(*), sum(amount_xusd) FROM lake.ratings"
                          f" WHERE run_id = '{swept['runs'][0]}'") == [(10, 450 + 1200 + 2000 + 750)]
        assert len(lake_query(svc.data_dir, REPORT.format(run_id=first["run_id"]))) == 10
        assert lake_query(svc.data_dir, "SELECT kind, status, events FROM lake.rating_runs"
                          " WHERE kind IN ('sweep', 'rerate') AND events > 0 ORDER BY finished_at") == [
            ("sweep", "completed", 6), ("rerate", "completed", 3)]

        # Compaction keeps every current row while it merges files and drops old snapshots.
        report_rows = lake_query(svc.data_dir, REPORT.format(run_id=second["run_id"]))
        compacted = compact_lake(data_dir=str(svc.data_dir), retention_hours=0)
        assert compacted["expired_snapshots"] > 0
        assert lake_query(svc.data_dir, REPORT.format(run_id=second["run_id"])) == report_rows
    finally:
        svc.stop()


def test_tollgate_flows_run_passes_json_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               prefect_api: None, capsys: pytest.CaptureFixture[str]) -> None:
    svc = start_service(tmp_path, monkeypatch)
    try:
        send_events(svc)
        assert tollgate_main(["flows", "run", "rate-events", "--data-dir", str(svc.data_dir)]) == 0
        assert '"events": 6' in capsys.readouterr().out
        assert tollgate_main(["flows", "run", "rerate", "--data-dir", str(svc.data_dir),
                              "--param", "occurred_from=2026-11-02T00:00:00Z",
                              "--param", "occurred_to=2026-11-03T00:00:00Z",
                              "--param", 'accounts=["acct_b"]', "--param", 'policy_ids=["calls"]']) == 0
        assert '"events": 1' in capsys.readouterr().out  # only acct_b's API call
        # A batch event waiting for the sweep is rated by the sweep that follows a rerate, and
        # counted as swept, not as re-rated.
        reply = svc.post("/mgt/v1/events/batch", {"events": [llm("2026-11-03T09:00:00Z", 10, 0)]},
                         account="acct_b")
        assert reply.json()["data"]["accepted_count"] == 1
        wait_for_lake_events(svc.data_dir, 7)
        assert tollgate_main(["flows", "run", "rerate", "--data-dir", str(svc.data_dir),
                              "--param", "occurred_from=2026-11-02T00:00:00Z",
                              "--param", "occurred_to=2026-11-03T00:00:00Z",
                              "--param", 'policy_ids=["calls"]']) == 0
        out = capsys.readouterr().out
        assert '"events": 1' in out and '"swept_events": 1' in out
    finally:
        svc.stop()


@pytest.mark.parametrize(("params", "message"), [
    (["occurred_from=2026-13-01T00:00:00Z", "occurred_to=2026-12-01T00:00:00Z"],
     "occurred_from='2026-13-01T00:00:00Z' is not an RFC 3339 instant with an offset"),
    (["occurred_from=2026-11-01", "occurred_to=2026-12-01T00:00:00Z"],
     "occurred_from='2026-11-01' is not an RFC 3339 instant with an offset"),
    (["occurred_from=2026-12-01T00:00:00Z", "occurred_to=2026-11-01T00:00:00Z"],
     "occurred_to (2026-11-01T00:00:00Z) must be after occurred_from (2026-12-01T00:00:00Z)"),
    (["occurred_from=2026-11-01T00:00:00Z", "occurred_to=2026-12-01T00:00:00Z", 'policy_ids=["llm", "nope"]'],
     "policy_ids: no policy nope in any applied catalog"),
    (["occurred_from=2026-11-01T00:00:00Z", "occurred_to=2026-12-01T00:00:00Z", 'accounts=["acct_zz"]'],
     "accounts: no account acct_zz in the catalog or the lake"),
    (["occurred_from=2026-11-01T00:00:00Z", "occurred_to=2026-12-01T00:00:00Z", "accounts=acct_a"],
     "accounts must be a non-empty JSON list of ids"),
    (["occurred_from=2026-11-01T00:00:00Z"], "rerate needs --param occurred_to=..."),
])
def test_a_rerate_with_bad_parameters_is_one_line_and_writes_no_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], params: list[str], message: str) -> None:
    from tests.lake_events import LakeFeed, apply_catalog, event

    apply_catalog(tmp_path, catalog_toml(policies=POLICIES, prices=PRICES))
    feed = LakeFeed(tmp_path)
    try:
        feed.add(event("acct_a", "api.call", "2026-11-05T00:00:00Z", {}))
    finally:
        feed.close()
    argv = ["flows", "run", "rerate", "--data-dir", str(tmp_path)]
    for param in params:
        argv += ["--param", param]
    assert tollgate_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert lake_query(tmp_path, "SELECT count(*) FROM lake.rating_runs") == [(0,)]


def test_a_single_event_is_rated_inline_and_a_batch_event_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = start_service(tmp_path, monkeypatch)
    try:
        single_reply = svc.post("/mgt/v1/events", llm("2026-11-01T10:00:00Z", 2500, 1), account="acct_a")
        assert single_reply.status_code == 201
        unmatched = svc.post("/mgt/v1/events", {"semantic_kind": "activity", "event_type": "nope",
                                                "occurred_at": "2026-11-01T10:00:00Z", "payload": {}},
                             account="acct_a")
        assert unmatched.status_code == 201
        assert svc.post("/mgt/v1/events/batch", {"events": [llm("2026-11-01T11:00:00Z", 10, 0)]},
                        account="acct_a").status_code == 207
        # A replay is not new: it is not rated again.
        assert svc.post("/mgt/v1/events", llm("2026-11-01T10:00:00Z", 2500, 1),
                        account="acct_a").status_code == 200
    finally:
        svc.stop()
    conn = open_operational(svc.data_dir / "operational.duckdb")
    try:
        rows = conn.execute(
            "SELECT event_id::VARCHAR, status, policy_id, policy_version, feature_code, meter_code,"
            " quantity_minor, price_id, unit_price_xusd, unit_quantity_minor, amount_xusd,"
            " occurred_at, line_index FROM inline_ratings ORDER BY seq").fetchall()
        seqs = [s for (s,) in conn.execute("SELECT seq FROM inline_ratings ORDER BY seq").fetchall()]
    finally:
        conn.close()
    event_id = single_reply.json()["data"]["event_id"]
    at = rows[0][11]
    assert rows == [
        # priced on its own, without carry: 2500 at 150 per 1000 (floor); 1 at 600 (ceil)
        (event_id, "rated", "llm", "v1", "llm.chat", "tokens.in", 2500,
         "tokens.in@2026-01-01T00:00:00Z", 150, 1000, 300, at, 0),
        (event_id, "rated", "llm", "v1", "llm.chat", "tokens.out", 1,
         "tokens.out@2026-01-01T00:00:00Z", 600, 1000, 600, at, 1),
        (unmatched.json()["data"]["event_id"], "skipped_no_policy", None, None, None, None, None,
         None, None, None, None, at, 0)]
    assert at.isoformat().startswith("2026-11-01T10:00:00")
    assert seqs == sorted(set(seqs)) and len(seqs) == 3


def _scheduler_pids(data_dir: Path) -> list[int]:
    return processes_of(data_dir, "flows.scheduler")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_serve_runs_the_schedules_and_they_end_with_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    svc = start_service(tmp_path, monkeypatch, schedules="on")
    try:
        assert len(_scheduler_pids(svc.data_dir)) == 1
    finally:
        svc.stop()
    assert _scheduler_pids(svc.data_dir) == []
    # A killed service takes its scheduler with it.
    svc.start()
    [pid] = _scheduler_pids(svc.data_dir)
    svc.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _scheduler_pids(svc.data_dir):
        time.sleep(0.1)
    assert _scheduler_pids(svc.data_dir) == []
    assert pid and os.getpid()
