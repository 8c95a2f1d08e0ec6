"""Usage reports, lake compaction and `tollgate sql`, over the real pieces: events and gate
commits sent over HTTP to the real service, real Prefect flow runs, the real lake."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
from prefect.artifacts import Artifact
from prefect.testing.utilities import prefect_test_harness

from flows.compaction import compact_lake
from flows.rating import close_aggregate_days, rate_events, rerate
from flows.reports import publish_usage_reports
from tests.conftest import Service, make_service, tollgate
from tests.lake_events import aggregate, catalog_toml, policy, price, single
from warehouse.lake import LAKE_TABLES, connect_lake

pytestmark = [pytest.mark.server, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parent.parent

TOKENS = {"tokens.in": {"payload_int": "usage.input_tokens", "default": 0},
          "tokens.out": {"payload_int": "usage.output_tokens", "default": 0}}
LLM = policy("llm", ("v1", "2026-01-01T00:00:00Z", single("llm.completion", "llm.chat", TOKENS)))
CALLS = policy("calls", ("v1", "2026-01-01T00:00:00Z", single("api.call", "api.search", {"calls": {"const": 1}})))
OTHERS = (policy("dup-a", ("v1", "2026-01-01T00:00:00Z", single("dup.thing", "api.search", {"calls": {"const": 1}})))
          + policy("dup-b", ("v1", "2026-01-01T00:00:00Z", single("dup.thing", "api.search", {"calls": {"const": 2}})))
          + policy("seats", ("v1", "2026-01-01T00:00:00Z", aggregate(
              "seats.snapshot", "team.seats", "seats", {"op": "max", "of": {"payload": "seats"}}))))
PRICES = (price("tokens.in", 150, 1000, "2026-01-01T00:00:00Z")
          + price("tokens.out", 600, 1000, "2026-01-01T00:00:00Z", rounding="ceil")
          + price("calls", 2000, 1, "2026-01-01T00:00:00Z")
          + price("seats", 1000, 1, "2026-01-01T00:00:00Z"))

# The current ratings as docs/analysts.md defines them (a second definition, independent of
# the flows' SQL), summed as a usage report must sum them.
GUIDE_CURRENT = """
WITH latest AS (
    SELECT realm, source, source_id, arg_max(run_id, (run_id <> 'inline', rated_at)) AS run_id
    FROM lake.ratings GROUP BY ALL
), current_ratings AS (
    SELECT r.* FROM lake.ratings r JOIN latest USING (realm, source, source_id, run_id)
    WHERE r.status <> 'reversal'
)
"""
EXPECTED = GUIDE_CURRENT + """
SELECT period, CAST(date_trunc(period, occurred_at) AS DATE) AS period_start, billing_account_id,
       feature_code, meter_code, CAST(sum(quantity_minor) AS BIGINT), CAST(sum(amount_xusd) AS BIGINT),
       count(DISTINCT (source, source_id)), count(*)
FROM current_ratings, (VALUES ('day'), ('month')) AS p(period)
WHERE status = 'rated'
GROUP BY ALL ORDER BY ALL
"""
REPORT = ("SELECT period, period_start, billing_account_id, feature_code, meter_code, quantity_minor,"
          " amount_xusd, event_count, line_count FROM lake.usage_reports WHERE run_id = ? ORDER BY ALL")


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    with prefect_test_harness(server_startup_timeout=120):
        yield


def lake_query(data_dir: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    conn = connect_lake(data_dir, read_only=True)
    try:
        return conn.execute(sql, params or []).fetchall()
    finally:
        conn.close()


def wait_for_lake(data_dir: Path, sql: str, expected: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    seen: Any = None
    while time.monotonic() < deadline:
        try:
            seen = lake_query(data_dir, sql)[0][0]
        except (duckdb.Error, FileNotFoundError):
            seen = None
        if seen == expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"{sql}: {seen}, expected {expected}")


def write_catalog(path: Path, policies: str, prices: str = PRICES) -> Path:
    path.write_text(catalog_toml(policies=policies, prices=prices))
    return path


def start(tmp: Path, monkeypatch: pytest.MonkeyPatch, policies: str = LLM + CALLS + OTHERS) -> Service:
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "off")
    svc = make_service(tmp / "data", write_catalog(tmp / "catalog.toml", policies))
    svc.start()
    return svc


def llm(at: str, tokens_in: int, tokens_out: int) -> dict[str, Any]:
    return {"semantic_kind": "activity", "event_type": "llm.completion", "occurred_at": at,
            "payload": {"usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}}}


def other(event_type: str, at: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"semantic_kind": "activity", "event_type": event_type, "occurred_at": at,
            "payload": payload or {}}


def gate_commit(svc: Service, principal: str, quantity: int) -> None:
    lease = svc.post("/mgt/v1/gate/authorize", {"feature_code": "llm.chat",
                                                  "estimated_quantity_minor": str(quantity)},
                     principal=principal)
    assert lease.status_code in (200, 201), lease.text
    done = svc.post("/mgt/v1/gate/commits", {"lease_token": lease.json()["data"]["lease_token"],
                                              "feature_code": "llm.chat", "quantity_minor": str(quantity)},
                    principal=principal)
    assert done.status_code in (200, 201), done.text


def report_rows(data_dir: Path, run_id: str) -> list[tuple[Any, ...]]:
    return lake_query(data_dir, REPORT, [run_id])


# ---- usage reports -----------------------------------------------------------------------

def test_a_report_sums_the_current_ratings_once_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     prefect_api: None) -> None:
    svc = start(tmp_path, monkeypatch)
    try:
        # Single events are rated inline, then swept; the first is the last microsecond of
        # October (UTC), the second the first of November.
        for body in (llm("2026-10-31T23:59:59.999999Z", 700, 100), llm("2026-11-01T00:00:00Z", 800, 950)):
            assert svc.post("/mgt/v1/events", body, account="acct_a").status_code == 201
        reply = svc.post("/mgt/v1/events/batch", {"events": [
            llm("2026-11-01T12:00:00Z", 1500, 0),
        ]}, account="acct_a")
        assert reply.json()["data"]["accepted_count"] == 1
        reply = svc.post("/mgt/v1/events/batch", {"events": [
            other("api.call", "2026-11-02T09:30:00Z"),
            other("unknown.thing", "2026-11-02T10:00:00Z"),                  # skipped_no_policy
            other("dup.thing", "2026-11-02T11:00:00Z"),                      # quarantined
            other("seats.snapshot", "2026-11-03T08:00:00Z", {"seats": 3}),   # deferred, then the day
            other("seats.snapshot", "2026-11-03T15:00:00Z", {"seats": 5}),
        ]}, account="acct_b")
        assert reply.json()["data"]["accepted_count"] == 5
        wait_for_lake(svc.data_dir, "SELECT count(*) FROM lake.events", 8)
        assert rate_events(data_dir=str(svc.data_dir))["events"] == 8
        close_aggregate_days(data_dir=str(svc.data_dir))
        # Rated inline only (no sweep after it), and a gate commit of 4200 input tokens.
        assert svc.post("/mgt/v1/events", llm("2026-11-05T10:00:00Z", 4000, 100),
                        account="acct_b").status_code == 201
        gate_commit(svc, "p-a", 4200)
        wait_for_lake(svc.data_dir, "SELECT count(*) FROM lake.ratings WHERE run_id IN ('inline', 'gate')"
                                    " AND occurred_at >= '2026-11-05'", 3)

        first = publish_usage_reports(data_dir=str(svc.data_dir))
        rows = report_rows(svc.data_dir, first["run_id"])
        assert rows == lake_query(svc.data_dir, EXPECTED)
        by_key = {(r[0], str(r[1]), r[2], r[4]): r[5:] for r in rows}
        # The last microsecond of October is October's, in the day and the month reports.
        assert by_key[("day", "2026-10-31", "acct_a", "tokens.in")] == (700, 0, 1, 1)
        assert by_key[("month", "2026-10-01", "acct_a", "tokens.in")] == (700, 0, 1, 1)
        # Two events of two lines each on 2026-11-01 (800 + 1500 tokens, carried: 150 + 300);
        # the month adds the gate commit, one more source.
        assert by_key[("day", "2026-11-01", "acct_a", "tokens.in")] == (2300, 450, 2, 2)
        assert by_key[("month", "2026-11-01", "acct_a", "tokens.in")] == (6500, 1050, 3, 3)
        # The aggregate day counts once; skipped and quarantined events carry no usage.
        assert by_key[("day", "2026-11-03", "acct_b", "seats")] == (5, 5000, 1, 1)
        assert [r[5:] for r in rows if r[3] == "api.search"] == [(1, 2000, 1, 1)] * 2  # the call only
        # Inline and gate lines are in; the inline rows the sweep superseded are not.
        months = sum(r[6] for r in rows if r[0] == "month")
        assert months == sum(r[6] for r in rows if r[0] == "day")
        assert months == lake_query(svc.data_dir, GUIDE_CURRENT + "SELECT sum(amount_xusd) FROM current_ratings")[0][0]
        assert months < lake_query(svc.data_dir, "SELECT sum(amount_xusd) FROM lake.ratings")[0][0]
        [(committed,)] = lake_query(svc.data_dir, "SELECT CAST(occurred_at AS DATE) FROM lake.ratings"
                                                  " WHERE source = 'gate_commit'")
        assert by_key[("day", str(committed), "acct_a", "tokens.in")] == (4200, 600, 1, 1)  # 4 whole blocks

        # The Parquet files: the latest, and the run's own copy, hold the table's rows.
        for period in ("day", "month"):
            latest = pq.read_table(svc.data_dir / "reports" / f"usage_{period}.parquet").to_pylist()
            kept = pq.read_table(svc.data_dir / "reports" / first["run_id"] / f"usage_{period}.parquet").to_pylist()
            assert latest == kept
            assert sorted((r["period"], r["period_start"], r["billing_account_id"], r["feature_code"],
                           r["meter_code"], r["quantity_minor"], r["amount_xusd"], r["event_count"],
                           r["line_count"]) for r in latest) == [r for r in rows if r[0] == period]
        # The artifact: every month row, amounts as exact strings.
        artifact = Artifact.get("usage-report")
        assert artifact is not None and first["run_id"] in (artifact.description or "")
        shown = sorted((r["billing_account_id"], r["meter_code"], int(r["amount_xusd"]))
                       for r in json.loads(str(artifact.data)))
        assert shown == sorted((r[2], r[4], r[6]) for r in rows if r[0] == "month")
    finally:
        svc.stop()


def guide_block(heading: str) -> str:
    """The ```sql block of docs/analysts.md in the section of `heading`."""
    text = (ROOT / "docs" / "analysts.md").read_text()
    section = text.split(heading, 1)[1].split("\n### ", 1)[0]
    found = re.search(r"```sql\n(.*?)```", section, flags=re.DOTALL)
    assert found, f"no query under {heading}"
    return found.group(1)


def test_the_latest_report_is_found_as_the_guide_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      prefect_api: None) -> None:
    """A re-rating can take usage away from a day (here: the policy of API calls is gone, so
    acct_b's 2026-11-02 is left with nothing rated). The guide's way to read the latest
    report must not keep the earlier report's rows for it."""
    svc = start(tmp_path, monkeypatch, policies=LLM + CALLS)
    try:
        assert svc.post("/mgt/v1/events", llm("2026-11-01T10:00:00Z", 3000, 0), account="acct_a").status_code == 201
        reply = svc.post("/mgt/v1/events/batch", {"events": [other("api.call", "2026-11-02T09:30:00Z")]},
                         account="acct_b")
        assert reply.json()["data"]["accepted_count"] == 1
        wait_for_lake(svc.data_dir, "SELECT count(*) FROM lake.events", 2)
        rate_events(data_dir=str(svc.data_dir))
        first = publish_usage_reports(data_dir=str(svc.data_dir))
        assert ("day", "acct_b", 2000) in {(r[0], r[2], r[6]) for r in report_rows(svc.data_dir, first["run_id"])}

        tollgate("catalog", "apply", str(write_catalog(tmp_path / "catalog-2.toml", LLM, PRICES + price(
            "tokens.in", 300, 1000, "2026-10-01T00:00:00Z"))), data_dir=svc.data_dir)
        assert rerate(occurred_from="2026-11-01T00:00:00Z", occurred_to="2026-11-03T00:00:00Z",
                      data_dir=str(svc.data_dir))["events"] == 2
        second = publish_usage_reports(data_dir=str(svc.data_dir))
        expected = lake_query(svc.data_dir, EXPECTED)
        assert report_rows(svc.data_dir, second["run_id"]) == expected
        assert {r[2] for r in expected} == {"acct_a"}          # acct_b has nothing rated now

        conn = connect_lake(svc.data_dir, read_only=True)
        try:
            conn.execute("USE lake")
            guide = conn.execute(guide_block("### `usage_reports`")).fetchall()
            names = [d[0] for d in conn.description]
        finally:
            conn.close()
        columns = ["period", "period_start", "billing_account_id", "feature_code", "meter_code",
                   "quantity_minor", "amount_xusd", "event_count", "line_count"]
        assert sorted(tuple(row[names.index(c)] for c in columns) for row in guide) == expected

        # The latest Parquet files are the second report's; the first one's stay in its folder.
        month = pq.read_table(svc.data_dir / "reports" / "usage_month.parquet").to_pylist()
        assert {r["run_id"] for r in month} == {second["run_id"]}
        assert {r["billing_account_id"] for r in month} == {"acct_a"}
        assert {r["billing_account_id"] for r in pq.read_table(
            svc.data_dir / "reports" / first["run_id"] / "usage_month.parquet").to_pylist()} == {"acct_a", "acct_b"}

        # With no policy left, a re-rating leaves no usage at all: the publication after it has
        # no rows, and the guide's query must give nothing, not the previous report again.
        tollgate("catalog", "apply", str(write_catalog(tmp_path / "catalog-3.toml", "")), data_dir=svc.data_dir)
        rerate(occurred_from="2026-11-01T00:00:00Z", occurred_to="2026-11-03T00:00:00Z",
               data_dir=str(svc.data_dir))
        third = publish_usage_reports(data_dir=str(svc.data_dir))
        assert third["rows"] == {"day": 0, "month": 0}
        assert lake_query(svc.data_dir, "SELECT run_id, day_rows, month_rows FROM lake.usage_report_runs"
                                        " ORDER BY published_at") == [
            (run["run_id"], run["rows"]["day"], run["rows"]["month"]) for run in (first, second, third)]
        conn = connect_lake(svc.data_dir, read_only=True)
        try:
            conn.execute("USE lake")
            assert conn.execute(guide_block("### `usage_reports`")).fetchall() == []
        finally:
            conn.close()
    finally:
        svc.stop()


# ---- compaction --------------------------------------------------------------------------

def lake_state(data_dir: Path) -> dict[str, tuple[Any, ...]]:
    """Rows and an order-free checksum of every lake table (and the ratings view)."""
    return {table: lake_query(data_dir, f"SELECT count(*), sum(hash(t)::HUGEINT) FROM lake.{table} AS t")[0]
            for table in [*LAKE_TABLES, "ratings"]}


def test_compaction_while_the_service_exports_loses_and_repeats_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: None) -> None:
    svc = start(tmp_path, monkeypatch)
    accepted: list[int] = []
    failures: list[str] = []
    stop = threading.Event()

    def send() -> None:
        n = 0
        while not stop.is_set():
            batch = [llm(f"2026-11-{1 + k % 20:02d}T10:00:00Z", 100 * n + k, k) for k in range(25)]
            reply = svc.post("/mgt/v1/events/batch", {"events": batch}, account="acct_a")
            single_reply = svc.post("/mgt/v1/events", llm("2026-11-02T10:00:00Z", 5000 + n, 0), account="acct_b")
            if reply.status_code not in (201, 207) or single_reply.status_code != 201:
                failures.append(f"{reply.status_code} {single_reply.status_code}")
                return
            accepted.append(reply.json()["data"]["accepted_count"] + 1)
            n += 1
            time.sleep(0.02)

    def read() -> None:
        while not stop.is_set():
            result = tollgate("sql", "SELECT count(*) AS n FROM ratings", "--format", "json",
                              data_dir=svc.data_dir, check=False)
            if result.returncode != 0:
                failures.append(result.stderr)

    workers = [threading.Thread(target=send), threading.Thread(target=read)]
    try:
        for worker in workers:
            worker.start()
        compacted = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(1)
            compacted.append(compact_lake(data_dir=str(svc.data_dir), retention_hours=0))
        stop.set()
        for worker in workers:
            worker.join()
        assert not failures and compacted
        total = sum(accepted)
        wait_for_lake(svc.data_dir, "SELECT count(*) FROM lake.events", total)
        # Every event once; each single event's two inline lines once.
        assert lake_query(svc.data_dir, "SELECT count(DISTINCT event_id), count(DISTINCT seq) FROM lake.events") == [
            (total, total)]
        singles = len(accepted)
        wait_for_lake(svc.data_dir, "SELECT count(*) FROM lake.ratings WHERE run_id = 'inline'", 2 * singles)
        assert lake_query(svc.data_dir, "SELECT count(DISTINCT rating_id) FROM lake.ratings") == [(2 * singles,)]
    finally:
        stop.set()
        svc.stop()
    # With the service stopped, a compaction changes no table's rows.
    before = lake_state(svc.data_dir)
    final = compact_lake(data_dir=str(svc.data_dir), retention_hours=0)
    assert sum(c["merged_files"] for c in [*compacted, final]) > 0
    assert lake_state(svc.data_dir) == before


def test_compaction_expires_only_the_snapshots_older_than_the_retention(
        tmp_path: Path, prefect_api: None) -> None:
    from tests.lake_events import LakeFeed, apply_catalog, event

    apply_catalog(tmp_path, catalog_toml(policies=LLM, prices=PRICES))
    feed = LakeFeed(tmp_path)

    def add(day: int) -> None:  # 15 rows: more than DuckLake inlines, so a file each
        feed.add(*[event("acct_a", "llm.completion", f"2026-11-{day:02d}T{h:02d}:00:00Z",
                         {"usage": {"input_tokens": h}}) for h in range(15)])

    try:
        for day in (1, 2, 3):
            add(day)
        time.sleep(10)
        for day in (4, 5, 6):
            add(day)
    finally:
        feed.close()
    snapshots = lake_query(tmp_path, "SELECT snapshot_id, snapshot_time FROM lake.snapshots() ORDER BY 1")
    newest = snapshots[-1][1]
    recent = [(s, at) for s, at in snapshots if newest - at < timedelta(seconds=5)]
    old = [s for s, at in snapshots if newest - at > timedelta(seconds=9)]
    assert len(recent) >= 3 and old

    def as_of(version: int) -> tuple[Any, ...]:
        return lake_query(tmp_path, "SELECT count(*), sum(hash(e)::HUGEINT) FROM"
                                    f" (SELECT * FROM lake.events AT (VERSION => {version})) AS e")[0]

    seen = {version: as_of(version) for version, _ in recent}
    before = lake_state(tmp_path)
    # A retention that reaches 4 s before the first recent snapshot (10 s after the old ones).
    retention = datetime.now(timezone.utc) - recent[0][1] + timedelta(seconds=4)
    report = compact_lake(data_dir=str(tmp_path), retention_hours=retention / timedelta(hours=1))
    assert report["merged_files"] > 0 and report["expired_snapshots"] >= len(old)
    left = {s for (s,) in lake_query(tmp_path, "SELECT snapshot_id FROM lake.snapshots()")}
    assert set(seen) <= left and not set(old) & left
    assert {version: as_of(version) for version in seen} == seen
    assert lake_state(tmp_path) == before


# ---- tollgate sql ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lake as `tollgate catalog apply` leaves it (the queries below need no rows)."""
    return make_service(tmp_path_factory.mktemp("sql")).data_dir


def run_sql(data_dir: Path, query: str, fmt: str) -> subprocess.CompletedProcess[str]:
    return tollgate("sql", query, "--format", fmt, data_dir=data_dir, check=False)


@pytest.mark.parametrize("query", ["", "  ", "-- only a comment", ";"])
def test_a_query_with_no_statement_fails_in_one_line(lake_dir: Path, query: str) -> None:
    result = run_sql(lake_dir, query, "json")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "tollgate sql: no statement to run\n"


def test_a_comment_in_a_script_is_not_a_failure(lake_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "cli", "sql", "--format", "csv", "--data-dir", str(lake_dir)],
                            input="SELECT 1 AS one;\n-- a note;\nSELECT 2 AS two;\n-- the end\n",
                            capture_output=True, text=True, check=False,
                            env={**os.environ, "PATH": str(Path(sys.executable).parent)})  # no duckdb shell
    assert (result.returncode, result.stdout, result.stderr) == (0, "one\n1\ntwo\n2\n", "")


def test_decimals_print_every_digit_and_no_exponent(lake_dir: Path) -> None:
    query = ("SELECT CAST(0 AS DECIMAL(38, 10)) AS zero, CAST(0.0000001234 AS DECIMAL(38, 10)) AS small,"
             " CAST(-12345678901234567890.123456 AS DECIMAL(38, 6)) AS big")
    assert run_sql(lake_dir, query, "csv").stdout.splitlines() == [
        "zero,small,big", "0.0000000000,0.0000001234,-12345678901234567890.123456"]
    table = run_sql(lake_dir, query, "table").stdout.splitlines()
    assert table[2].split(" | ") == ["0.0000000000", "0.0000001234", "-12345678901234567890.123456"]
    assert json.loads(run_sql(lake_dir, query, "json").stdout, parse_float=Decimal) == [
        {"zero": Decimal(0), "small": Decimal("0.0000001234"), "big": Decimal("-12345678901234567890.123456")}]


def test_money_beyond_64_bits_nulls_unicode_and_times_print_exactly(lake_dir: Path) -> None:
    query = ("SELECT CAST(170141183460469231731687303715884105727 AS HUGEINT) AS amount_xusd,"
             " CAST(9223372036854775807 AS BIGINT) AS big, NULL AS nothing, 'Zürich ✓' AS name,"
             " TIMESTAMPTZ '2026-10-31 23:59:59.999999+00' AS at")
    rows = json.loads(run_sql(lake_dir, query, "json").stdout)
    assert rows == [{"amount_xusd": 170141183460469231731687303715884105727, "big": 9223372036854775807,
                     "nothing": None, "name": "Zürich ✓", "at": "2026-10-31T23:59:59.999999+00:00"}]
    assert run_sql(lake_dir, query, "csv").stdout.splitlines()[1] == (
        "170141183460469231731687303715884105727,9223372036854775807,,Zürich ✓,2026-10-31T23:59:59.999999+00:00")
    empty = run_sql(lake_dir, "SELECT amount_xusd FROM usage_reports WHERE false", "csv")
    assert (empty.returncode, empty.stdout) == (0, "amount_xusd\n")
    refused = run_sql(lake_dir, "INSERT INTO usage_reports (period) VALUES ('day')", "csv")
    assert refused.returncode == 1 and "read-only" in refused.stderr and "Traceback" not in refused.stderr


def test_lake_maintenance_calls_are_refused_before_they_write(lake_dir: Path) -> None:
    # On the read-only lake these fail only after writing Parquet files, left orphaned.
    data = lake_dir / "lake" / "data"
    before = sorted(p for p in data.rglob("*") if p.is_file())
    for call in ("CALL ducklake_merge_adjacent_files('lake')", "call lake.ducklake_flush_inlined_data('lake')"):
        refused = run_sql(lake_dir, call, "csv")
        assert refused.returncode == 1 and "read-only" in refused.stderr, refused.stderr
        assert "DUCKLAKE_" in refused.stderr.upper() and "refused" in refused.stderr
    assert sorted(p for p in data.rglob("*") if p.is_file()) == before
    snapshots = run_sql(lake_dir, "SELECT count(*) > 0 AS any FROM ducklake_snapshots('lake')", "csv")
    assert snapshots.stdout.splitlines() == ["any", "true"]  # reading them is fine
