"""Usage charts (batch/usage_charts.py): publish-usage-reports draws a PNG per account and
month beside its Parquet files and lists them in an artifact, and redraws a chart exactly
when its usage changes; `tollgate report` prints a month's usage with totals worked out by
hand and writes the chart. Events reach the lake by the real outbox and exporter."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from PIL import Image

from batch.usage_charts import MonthUsage, format_usd, month_usages, publish_charts
from tests.conftest import tollgate
from tests.lake_events import LakeFeed, apply_catalog, catalog_toml, event, policy, price, single

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKENS = {"tokens.in": {"payload_int": "usage.input_tokens", "default": 0},
          "tokens.out": {"payload_int": "usage.output_tokens", "default": 0}}
POLICIES = (policy("llm", ("v1", "2026-01-01T00:00:00Z", single("llm.completion", "llm.chat", TOKENS)))
            + policy("calls", ("v1", "2026-01-01T00:00:00Z", single(
                "api.call", "api.search", {"calls": {"const": 1}}))))
# 150 xusd per 1000 input tokens, 600 per 1000 output tokens (a block begun is a block),
# 2000 per call.
PRICES = (price("tokens.in", 150, 1000, "2026-01-01T00:00:00Z")
          + price("tokens.out", 600, 1000, "2026-01-01T00:00:00Z", rounding="ceil")
          + price("calls", 2000, 1, "2026-01-01T00:00:00Z"))


def llm(account: str, at: str, tokens_in: int, tokens_out: int) -> Any:
    return event(account, "llm.completion", at,
                 {"usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}},
                 subject=f"{at}/{tokens_in}/{tokens_out}")


def call(account: str, at: str) -> Any:
    return event(account, "api.call", at, {}, subject=at)


def charts_of(data_dir: Path) -> dict[str, bytes]:
    root = data_dir / "reports" / "charts"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.png"))}


def assert_png(data: bytes, path: Path) -> None:
    assert data.startswith(PNG_SIGNATURE)
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1100, 850)


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.lake
@pytest.mark.prefect
def test_publish_draws_a_chart_per_account_and_month_that_changes_with_the_usage(
        tmp_path: Path, prefect_api: None) -> None:
    from prefect.artifacts import Artifact

    from flows.rating import rate_events
    from flows.reports import publish_usage_reports

    feed = LakeFeed(tmp_path)
    try:
        apply_catalog(tmp_path, catalog_toml(policies=POLICIES, prices=PRICES))
        feed.add(llm("acct_a", "2026-10-31T23:00:00Z", 1000, 0),
                 llm("acct_a", "2026-11-01T10:00:00Z", 2000, 100),
                 call("acct_a", "2026-11-01T11:00:00Z"),
                 llm("acct_a", "2026-11-03T09:00:00Z", 4000, 1000),
                 call("acct_b", "2026-11-02T08:00:00Z"))
        assert rate_events(data_dir=str(tmp_path))["events"] == 5
        first = publish_usage_reports(data_dir=str(tmp_path))
        root = tmp_path / "reports" / "charts"
        assert first["charts"] == {"folder": str(root), "charts": 3, "drawn": 3, "removed": 0}
        drawn = charts_of(tmp_path)
        assert sorted(drawn) == ["acme/acct_a/2026-10.png", "acme/acct_a/2026-11.png",
                                 "acme/acct_b/2026-11.png"]
        for name, data in drawn.items():
            assert_png(data, root / name)
        # Beside the Parquet reports; the artifact links each chart, with its month's total.
        assert (tmp_path / "reports" / "usage_day.parquet").exists()
        artifact = Artifact.get("usage-charts")
        assert artifact is not None and isinstance(artifact.data, str)
        assert first["run_id"] in artifact.data and "3 of 3 charts" in artifact.data
        for name in drawn:
            assert (root / name).as_uri() in artifact.data
        # acct_a in November: 300 + 600 + 2000 on the 1st, 600 + 600 on the 3rd.
        assert "| 2026-11 | acme | acct_a | 0.0041 |" in artifact.data

        # The same usage: the same files, not drawn again.
        again = publish_usage_reports(data_dir=str(tmp_path))
        assert again["charts"]["drawn"] == 0 and charts_of(tmp_path) == drawn

        # More usage for acct_a in November: that chart, and only that one, changes.
        feed.add(call("acct_a", "2026-11-03T12:00:00Z"))
        assert rate_events(data_dir=str(tmp_path))["events"] == 1
        third = publish_usage_reports(data_dir=str(tmp_path))
        assert third["charts"] == {"folder": str(root), "charts": 3, "drawn": 1, "removed": 0}
        now = charts_of(tmp_path)
        assert sorted(now) == sorted(drawn)
        assert now["acme/acct_a/2026-11.png"] != drawn["acme/acct_a/2026-11.png"]
        assert_png(now["acme/acct_a/2026-11.png"], root / "acme/acct_a/2026-11.png")
        assert {k: v for k, v in now.items() if k != "acme/acct_a/2026-11.png"} == {
            k: v for k, v in drawn.items() if k != "acme/acct_a/2026-11.png"}

        # The report command: acct_a's November as a report published now holds it.
        out = tmp_path / "out" / "acct_a.png"
        r = tollgate("report", "--account", "acct_a", "--month", "2026-11", "--out", str(out),
                     data_dir=tmp_path)
        assert r.stderr == ""
        lines = [line.rstrip() for line in r.stdout.splitlines()]
        assert lines[0] == "Usage of acct_a (realm acme) in November 2026, UTC: 0.0061 USD"
        rows = [re.split(r"\s{2,}", line) for line in lines if re.match(r"(20|total|llm|api)", line)]
        assert rows == [
            ["2026-11-01", "calls", "1", "1", "0.0020"],
            ["2026-11-01", "tokens.in", "2,000", "1", "0.0003"],
            ["2026-11-01", "tokens.out", "100", "1", "0.0006"],
            ["2026-11-03", "calls", "1", "1", "0.0020"],
            ["2026-11-03", "tokens.in", "4,000", "1", "0.0006"],
            ["2026-11-03", "tokens.out", "1,000", "1", "0.0006"],
            ["total", "6", "0.0061"],
            ["api.search", "2", "0.0040", "65.6%"],
            ["llm.chat", "4", "0.0021", "34.4%"],
            ["total", "6", "0.0061", "100.0%"]]
        assert lines[-1] == f"chart: {out}"
        assert_png(out.read_bytes(), out)
        # Drawn from the same usage as the published chart: the same picture.
        assert out.read_bytes() == now["acme/acct_a/2026-11.png"]

        # An account the lake does not know, a month without usage, a month that is not one.
        for args, code, message in [
                (["--account", "acct_nobody"], 2, "no account 'acct_nobody' in the lake"),
                (["--account", "acct_a", "--realm", "globex"], 2,
                 "account 'acct_a' is not in realm 'globex'; its realms: acme"),
                (["--account", "acct_a", "--month", "2026-12"], 1,
                 "acct_a (realm acme) has no usage in 2026-12; months with usage: 2026-10, 2026-11"),
                (["--account", "acct_a", "--month", "2026-13"], 2, "is not a month")]:
            r = tollgate("report", *args, data_dir=tmp_path, check=False)
            assert r.returncode == code and r.stdout == "", (args, r.stdout, r.stderr)
            assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("tollgate: ")
            assert message in r.stderr, r.stderr
    finally:
        feed.close()


def usage(account: str, month: date, amounts: dict[tuple[int, str, str], int]) -> MonthUsage:
    rows = [{"period_start": month.replace(day=day), "realm": "acme", "billing_account_id": account,
             "feature_code": feature, "meter_code": meter, "amount_xusd": amount}
            for (day, feature, meter), amount in amounts.items()]
    [found] = month_usages(pa.Table.from_pylist(rows))
    return found


def test_a_chart_no_longer_reported_is_removed_and_ids_stay_one_folder(tmp_path: Path) -> None:
    kept = usage("acct_a", date(2026, 11, 1), {(1, "llm.chat", "tokens.in"): 450})
    odd = usage("team/a:1", date(2026, 10, 1), {(31, "api.search", "calls"): 2_000_000})
    first = publish_charts(tmp_path, [kept, odd])
    assert (first.drawn, first.kept, first.removed) == (2, 0, 0)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png")) == [
        "acme/acct_a/2026-11.png", "acme/team%2Fa%3A1/2026-10.png"]
    second = publish_charts(tmp_path, [kept])
    assert (second.drawn, second.kept, second.removed) == (0, 1, 1)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png")) == [
        "acme/acct_a/2026-11.png"]
    assert not (tmp_path / "acme" / "team%2Fa%3A1").exists()
    # A publication of October alone: its chart comes back, November's is neither drawn nor
    # removed, and the listing still holds both with their totals.
    third = publish_charts(tmp_path, [odd], months=[date(2026, 10, 1)])
    assert (third.drawn, third.kept, third.removed) == (1, 0, 0)
    assert sorted((c.account, c.month, c.total_xusd) for c, _ in third.charts) == [
        ("acct_a", date(2026, 11, 1), 450), ("team/a:1", date(2026, 10, 1), 2_000_000)]
    # And October with no usage left: only its chart goes.
    fourth = publish_charts(tmp_path, [], months=[date(2026, 10, 1)])
    assert (fourth.drawn, fourth.kept, fourth.removed) == (0, 0, 1)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png")) == [
        "acme/acct_a/2026-11.png"]


def test_amounts_read_in_usd_exactly() -> None:
    assert [format_usd(x) for x in (0, 1, 450, 2_000_000, 1_234_567_891)] == [
        "0.00", "0.000001", "0.00045", "2.00", "1,234.567891"]
    assert format_usd(450, 6) == "0.000450"
    with pytest.raises(ValueError):
        format_usd(450, 2)
    month = usage("acct_a", date(2026, 11, 1), {(1, "llm.chat", "tokens.in"): 300,
                                               (1, "llm.chat", "tokens.out"): 600,
                                               (2, "api.search", "calls"): 2000})
    assert month.days == ((date(2026, 11, 1), "tokens.in", 300),
                          (date(2026, 11, 1), "tokens.out", 600),
                          (date(2026, 11, 2), "calls", 2000))
    assert month.features == (("api.search", 2000), ("llm.chat", 900))
    assert month.total_xusd == 2900


def _published(data_dir: Path, run_id: str) -> list[tuple[Any, ...]]:
    from warehouse.lake import connect_lake

    conn = connect_lake(data_dir, read_only=True)
    try:
        return conn.execute(
            "SELECT period, period_start, realm, billing_account_id, feature_code, meter_code,"
            " quantity_minor, amount_xusd, event_count, line_count FROM lake.usage_reports"
            " WHERE run_id = ? ORDER BY ALL", [run_id]).fetchall()
    finally:
        conn.close()


def _standing(data_dir: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(the rows of lake.usage_reports_latest, the report of every month computed now)."""
    from batch.usage_reports import build_usage_report
    from warehouse.lake import connect_lake

    conn = connect_lake(data_dir, read_only=True)
    try:
        columns = ("period, period_start, realm, billing_account_id, feature_code, meter_code,"
                   " quantity_minor, amount_xusd, event_count, line_count")
        view = conn.execute(f"SELECT {columns} FROM lake.usage_reports_latest ORDER BY ALL").fetchall()
        conn.register("now_rows", build_usage_report(conn, "now", datetime.now(timezone.utc)))
        fresh = conn.execute(f"SELECT {columns} FROM now_rows ORDER BY ALL").fetchall()
        return view, fresh
    finally:
        conn.close()


@pytest.mark.lake
@pytest.mark.prefect
def test_a_publication_covers_the_days_that_changed_and_the_view_is_the_whole_report(
        tmp_path: Path, prefect_api: None) -> None:
    """Publications follow the lake's change feed: the first covers every day, one with
    nothing new covers none, one after a new rating on October 31st covers that day and
    October's month rows; the view
    `usage_reports_latest` is, after each, the report of every month computed afresh, and so
    is `reports/usage_day.parquet`. Once the snapshot after the last publication has expired
    the changes cannot be told, and the next publication covers every day again."""
    import pyarrow.parquet as pq

    from flows.rating import rate_events
    from flows.reports import publish_usage_reports
    from warehouse.lake import connect_lake

    feed = LakeFeed(tmp_path)
    try:
        apply_catalog(tmp_path, catalog_toml(policies=POLICIES, prices=PRICES))
        feed.add(llm("acct_a", "2026-10-30T10:00:00Z", 1000, 0),
                 llm("acct_a", "2026-11-01T10:00:00Z", 2000, 100),
                 call("acct_b", "2026-11-02T08:00:00Z"))
        assert rate_events(data_dir=str(tmp_path))["events"] == 3
        first = publish_usage_reports(data_dir=str(tmp_path))
        # Days and months: acct_a's tokens in and out on Oct 30 and Nov 1, acct_b's call on Nov 2.
        assert first["days"] is None and first["rows"] == {"day": 5, "month": 5}
        view, fresh = _standing(tmp_path)
        assert view == fresh and len(view) == 10

        second = publish_usage_reports(data_dir=str(tmp_path))
        assert second["days"] == [] and second["rows"] == {"day": 0, "month": 0}
        assert second["report_rows"] == {"day": 5, "month": 5}
        assert _standing(tmp_path)[0] == view  # nothing changed: the view still reads the first

        feed.add(call("acct_b", "2026-10-31T23:59:59Z"))
        assert rate_events(data_dir=str(tmp_path))["events"] == 1
        third = publish_usage_reports(data_dir=str(tmp_path))
        # October 31st, and October's month rows (Oct 30's usage as published, plus the 31st).
        assert third["days"] == ["2026-10-31"]
        assert {(r[0], str(r[1]), r[3]) for r in _published(tmp_path, third["run_id"])} == {
            ("day", "2026-10-31", "acct_b"), ("month", "2026-10-01", "acct_a"),
            ("month", "2026-10-01", "acct_b")}
        view, fresh = _standing(tmp_path)
        assert view == fresh and ("month", date(2026, 10, 1), "acme", "acct_b", "api.search",
                                  "calls", 1, 2000, 1, 1) in view
        latest = pq.read_table(tmp_path / "reports" / "usage_day.parquet")
        assert sorted((r["period_start"], r["billing_account_id"], r["meter_code"], r["amount_xusd"])
                      for r in latest.to_pylist()) == sorted(
            (r[1], r[3], r[5], r[7]) for r in fresh if r[0] == "day")

        # A publication whose charts failed after its lake commit (here: October's chart of
        # acct_b gone, and the folder's marker still at the second publication): the next
        # one, with nothing new, draws the months published since the marker again.
        root = tmp_path / "reports" / "charts"
        (root / "acme" / "acct_b" / "2026-10.png").unlink()
        (root / ".charted.json").write_text(json.dumps({"run_id": second["run_id"]}))
        caught_up = publish_usage_reports(data_dir=str(tmp_path))
        assert caught_up["days"] == [] and caught_up["charts"]["drawn"] == 1
        assert (root / "acme" / "acct_b" / "2026-10.png").exists()
        assert sorted(charts_of(tmp_path)) == ["acme/acct_a/2026-10.png", "acme/acct_a/2026-11.png",
                                               "acme/acct_b/2026-10.png", "acme/acct_b/2026-11.png"]

        # Snapshots expire (the exporter's TOLLGATE_LAKE_SNAPSHOT_HOURS): with the one after
        # the last publication gone, the next covers every month.
        feed.add(call("acct_a", "2026-11-05T12:00:00Z"))
        assert rate_events(data_dir=str(tmp_path))["events"] == 1
        lake = connect_lake(tmp_path)
        try:
            lake.execute("CALL ducklake_expire_snapshots('lake', older_than => now())")
        finally:
            lake.close()
        fourth = publish_usage_reports(data_dir=str(tmp_path))
        assert fourth["days"] is None
        view, fresh = _standing(tmp_path)
        assert view == fresh and len([r for r in view if r[0] == "day"]) == 7
    finally:
        feed.close()


def test_an_instant_before_1970_is_on_its_own_utc_day() -> None:
    """DuckDB's `//` truncates: the day number of 1969-12-31T12:00Z must be -1, not 0, or a
    publication would look for that day's ratings on January 1st."""
    import duckdb

    from batch.usage_reports import day_range_sql
    from warehouse.usage_days import utc_day_sql

    conn = duckdb.connect()
    conn.execute("SET TimeZone = 'UTC'")
    conn.execute("CREATE TABLE r (occurred_at TIMESTAMPTZ)")
    conn.execute("INSERT INTO r VALUES ('1969-12-31 00:00:00+00'), ('1969-12-31 12:00:00+00'),"
                 " ('1969-12-31 23:59:59.999999+00'), ('1970-01-01 00:00:00+00')")
    days = conn.execute(f"SELECT {utc_day_sql('occurred_at')} FROM r ORDER BY 1").fetchall()
    assert days == [(-1,), (-1,), (-1,), (0,)]
    found = conn.execute(f"SELECT count(*) FROM r WHERE {day_range_sql([date(1969, 12, 31)])}").fetchone()
    assert found == (3,)
