"""The usage report's sums (warehouse.usage_query) against the current ratings, on a lake
with every kind of row: swept lines, a rerate's reversals and new rows, an aggregate day,
inline rows a sweep superseded and inline rows still current, and gate commit lines."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from batch.aggregate_days import close_aggregate_days
from batch.rating_runs import RatingLock, current_ratings_sql
from batch.rerate import rerate
from tests.lake_events import (
    LakeFeed,
    aggregate,
    apply_catalog,
    catalog_toml,
    event,
    policy,
    price,
    single,
)
from warehouse.lake import connect_lake
from warehouse.usage_days import rollup_rows_sql
from warehouse.usage_query import UsageSlice, query_usage

pytestmark = pytest.mark.lake

UTC = timezone.utc
TOKENS_IN = {"payload_int": "usage.input_tokens", "default": 0}
TOKENS_OUT = {"payload_int": "usage.output_tokens", "default": 0}
PRICES = (price("tokens.in", 150, 1000, "2026-01-01T00:00:00Z")
          + price("tokens.out", 600, 1000, "2026-01-01T00:00:00Z", rounding="ceil")
          + price("seats", 1_000_000, 1, "2026-01-01T00:00:00Z"))
POLICIES = (policy("llm", ("v1", "2026-01-01T00:00:00Z", single(
    "llm.completion", "llm.chat", {"tokens.in": TOKENS_IN, "tokens.out": TOKENS_OUT})))
    + policy("seats", ("v1", "2026-01-01T00:00:00Z", aggregate(
        "seats.snapshot", "team.seats", "seats", {"op": "max", "of": {"payload": "seats"}}))))


def llm(account: str, at: str, tokens_in: int, tokens_out: int = 0) -> Any:
    return event(account, "llm.completion", at, {"usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}},
                 subject=f"{account}/{at}/{tokens_in}/{tokens_out}")


def _inline(conn: Any, event_id: str, account: str, at: datetime, qty: int, amount: int, rid: str) -> None:
    conn.execute(
        "INSERT INTO lake.rating_rows (rating_id, run_id, source, source_id, event_id, realm, billing_account_id,"
        " status, policy_id, policy_version, feature_code, meter_code, quantity_minor, price_id, unit_price_xusd,"
        " unit_quantity_minor, amount_xusd, occurred_at, rated_at, line_index) VALUES"
        " (?, 'inline', 'event', ?, ?::UUID, 'acme', ?, 'rated', 'llm', 'v1', 'llm.chat', 'tokens.in', ?,"
        " 'tokens.in@2026-01-01T00:00:00Z', 150, 1000, ?, ?, ?, 0)",
        [rid, event_id, event_id, account, qty, amount, at, datetime.now(UTC)])  # rated after acceptance


def _gate_line(conn: Any, account: str, at: datetime, qty: int, amount: int) -> None:
    conn.execute(
        "INSERT INTO lake.rating_rows (rating_id, run_id, source, source_id, realm, billing_account_id, status,"
        " feature_code, meter_code, quantity_minor, price_id, unit_price_xusd, unit_quantity_minor, amount_xusd,"
        " occurred_at, rated_at, line_index) VALUES (?, 'gate', 'gate_commit', ?, 'acme', ?, 'rated',"
        " 'llm.chat', 'tokens.in', ?, 'tokens.in@2026-01-01T00:00:00Z', 150, 1000, ?, ?, ?, 0)",
        [f"cmt_{qty}.0", f"cmt_{qty}", account, qty, amount, at, at])
    # the exporter rolls its commit lines up as it writes them
    conn.execute(rollup_rows_sql("lake", f"(SELECT * FROM lake.rating_rows WHERE rating_id = 'cmt_{qty}.0')"))


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Any:
    data_dir: Path = tmp_path_factory.mktemp("usage")
    feed = LakeFeed(data_dir)
    conn = connect_lake(data_dir)
    lock = RatingLock(data_dir / "lake" / "rating.lock")
    plan = apply_catalog(data_dir, catalog_toml(policies=POLICIES, prices=PRICES, lateness_seconds=3600))
    swept = feed.add(llm("acct_a", "2026-11-05T10:00:00Z", 3000, 500),
                     llm("acct_a", "2026-11-05T11:00:00Z", 1200),
                     llm("acct_a", "2026-11-06T09:00:00Z", 999, 1),
                     llm("acct_b", "2026-11-05T12:00:00Z", 7000),
                     llm("acct_a", "2026-12-02T00:00:00Z", 4000),
                     event("acct_a", "seats.snapshot", "2026-11-05T08:00:00Z", {"seats": 3}),
                     event("acct_a", "seats.snapshot", "2026-11-05T09:00:00Z", {"seats": 6}))
    _inline(conn, swept[0], "acct_a", datetime(2026, 11, 5, 10, tzinfo=UTC), 3000, 450, "superseded")
    close_aggregate_days(conn, plan, lock, lateness={"acme": 3600}, now=datetime(2026, 11, 7, tzinfo=UTC))
    # A new input price from November on: the rerate reverses November's lines and rates again.
    plan = apply_catalog(data_dir, catalog_toml(policies=POLICIES, prices=PRICES + price(
        "tokens.in", 200, 1000, "2026-10-01T00:00:00Z")))
    rerate(conn, plan, lock, occurred_from=datetime(2026, 11, 1, tzinfo=UTC),
           occurred_to=datetime(2026, 11, 6, tzinfo=UTC))
    [late] = feed.add(llm("acct_a", "2026-11-06T15:00:00Z", 5000))  # not swept: inline only
    _inline(conn, late, "acct_a", datetime(2026, 11, 6, 15, tzinfo=UTC), 5000, 777, "current")
    _gate_line(conn, "acct_b", datetime(2026, 11, 6, 1, tzinfo=UTC), 4200, 630)
    yield conn
    conn.close()
    feed.close()


def reference(conn: Any, start: datetime, end: datetime) -> dict[tuple[Any, ...], tuple[int, int, int, int]]:
    got = conn.execute(
        f"SELECT date_trunc('day', occurred_at AT TIME ZONE 'UTC'), billing_account_id, feature_code, meter_code,"
        f" sum(quantity_minor), sum(amount_xusd), count(*), count(*) FILTER (WHERE line_index = 0)"
        f" FROM ({current_ratings_sql()}) WHERE status = 'rated' AND occurred_at >= ? AND occurred_at < ?"
        f" GROUP BY ALL", [start, end]).fetchall()
    return {(d.replace(tzinfo=UTC), a, f, m): (int(q), int(x), n, s) for d, a, f, m, q, x, n, s in got}


def slice_of(start: datetime, end: datetime, **kw: Any) -> UsageSlice:
    base: dict[str, Any] = dict(
        realm="acme", start=start, end=end, granularity="day",
        group_by=("bucket_start", "billing_account_id", "feature_code", "meter_code"),
        metrics=("quantity_minor", "amount_xusd", "line_count", "commit_count"),
        families=(("llm.chat", "llm"), ("team.seats", "team")))
    base.update(kw)
    return UsageSlice(**base)


def test_the_sums_are_those_of_the_current_ratings(lake: Any) -> None:
    start, end = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)
    got = {(r["bucket_start"], r["billing_account_id"], r["feature_code"], r["meter_code"]):
           (r["quantity_minor"], r["amount_xusd"], r["line_count"], r["commit_count"])
           for r in query_usage(lake, slice_of(start, end))}
    want = reference(lake, start, end)
    assert got == want
    # By hand: on 11-05 acct_a had 3000 + 1200 input tokens, rerated at 200 per 1000 with
    # floor and carry (600 + 200, 200 tokens carried), the superseded inline row not counted;
    # on 11-06 the swept 999 tokens (outside the rerate; priced by the first sweep after the
    # 200 it carried from 11-05: one block of 150) and the inline-only 5000 tokens at 777; the
    # seats day at its peak of 6 seats.
    nov5, nov6 = datetime(2026, 11, 5, tzinfo=UTC), datetime(2026, 11, 6, tzinfo=UTC)
    assert got[(nov5, "acct_a", "llm.chat", "tokens.in")][:2] == (4200, 800)
    assert got[(nov6, "acct_a", "llm.chat", "tokens.in")][:3] == (5999, 150 + 777, 2)
    assert got[(nov5, "acct_a", "team.seats", "seats")][:2] == (6, 6_000_000)
    assert got[(nov6, "acct_b", "llm.chat", "tokens.in")] == (4200, 630, 1, 1)


def test_partial_first_and_last_days_are_summed_from_the_lines(lake: Any) -> None:
    for start, end in ((datetime(2026, 11, 5, 10, 30, tzinfo=UTC), datetime(2026, 11, 6, 12, tzinfo=UTC)),
                       (datetime(2026, 11, 5, 10, 30, tzinfo=UTC), datetime(2026, 11, 5, 11, 30, tzinfo=UTC)),
                       (datetime(2026, 11, 4, 23, tzinfo=UTC), datetime(2026, 11, 7, 1, tzinfo=UTC))):
        got = {(r["bucket_start"], r["billing_account_id"], r["feature_code"], r["meter_code"]):
               (r["quantity_minor"], r["amount_xusd"], r["line_count"], r["commit_count"])
               for r in query_usage(lake, slice_of(start, end))}
        assert got == reference(lake, start, end), (start, end)
    # 10:30-11:30 on 11-05 holds only the 11:00 event of 1200 tokens (rerated: 200 xusd).
    by_meter = {r["meter_code"]: (r["quantity_minor"], r["amount_xusd"]) for r in query_usage(
        lake, slice_of(datetime(2026, 11, 5, 10, 30, tzinfo=UTC), datetime(2026, 11, 5, 11, 30, tzinfo=UTC),
                       group_by=("bucket_start", "meter_code")))}
    value = by_meter["tokens.in"]
    assert value == (1200, 200)


def test_the_rollup_holds_every_batch_and_gate_line(lake: Any) -> None:
    """lake.usage_days sums to the lines of the completed batch runs and the gate."""
    rolled = lake.execute("SELECT sum(amount_xusd), sum(lines) FROM lake.usage_days").fetchone()
    lines = lake.execute(
        "SELECT sum(amount_xusd), sum(CASE status WHEN 'reversal' THEN -1 ELSE 1 END) FROM lake.ratings"
        " WHERE status IN ('rated', 'reversal') AND run_id <> 'inline'").fetchone()
    assert rolled == lines


def test_totals_families_filters_and_months(lake: Any) -> None:
    start, end = datetime(2026, 11, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)
    everything = reference(lake, start, end)
    [total] = query_usage(lake, slice_of(start, end, group_by=("bucket_start",), collapse_buckets=True))
    assert total["amount_xusd"] == sum(v[1] for v in everything.values())
    assert total["bucket_start"] == start
    months = query_usage(lake, slice_of(start, end, granularity="month", group_by=("bucket_start",)))
    assert [m["bucket_start"] for m in months] == [start, datetime(2026, 12, 1, tzinfo=UTC)]
    families = {r["feature_family_code"]: r["amount_xusd"] for r in query_usage(lake, slice_of(
        start, end, group_by=("bucket_start", "feature_family_code"), collapse_buckets=True,
        filters=(("billing_account_id", ("acct_a",)),)))}
    want_a = {f: sum(v[1] for k, v in everything.items() if k[1] == "acct_a" and k[2] == code)
              for code, f in (("llm.chat", "llm"), ("team.seats", "team"))}
    assert families == want_a
    only_seats = query_usage(lake, slice_of(start, end, group_by=("bucket_start", "meter_code"),
                                            filters=(("feature_family_code", ("team",)),)))
    assert {r["meter_code"] for r in only_seats} == {"seats"}


def test_an_empty_range_has_no_rows(lake: Any) -> None:
    start, end = datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 2, 1, tzinfo=UTC)
    assert query_usage(lake, slice_of(start, end)) == []


def test_a_line_before_1970_is_summed_on_its_own_utc_day(tmp_path: Path) -> None:
    """The rollup's and the query's day numbers are floored: DuckDB's `//` truncates toward
    zero, which put 1969-12-31T23:00Z on 1970-01-01 in lake.usage_days and in the buckets."""
    feed = LakeFeed(tmp_path)
    conn = connect_lake(tmp_path)
    try:
        _gate_line(conn, "acct_old", datetime(1969, 12, 31, 23, tzinfo=UTC), 70, 11)
        _gate_line(conn, "acct_old", datetime(1970, 1, 1, 0, 30, tzinfo=UTC), 1, 1)
        days = conn.execute("SELECT day, sum(quantity_minor) FROM lake.usage_days"
                            " WHERE billing_account_id = 'acct_old' GROUP BY day ORDER BY day").fetchall()
        assert [(str(d), int(q)) for d, q in days] == [("1969-12-31", 70), ("1970-01-01", 1)]
        for start in (datetime(1969, 12, 30, tzinfo=UTC), datetime(1969, 12, 31, 22, tzinfo=UTC)):
            for rollup in (True, False):
                got = {(r["bucket_start"], r["quantity_minor"]) for r in query_usage(
                    conn, slice_of(start, datetime(1970, 1, 2, tzinfo=UTC), group_by=("bucket_start",),
                                   metrics=("quantity_minor",)), rollup=rollup)}
                assert got == {(datetime(1969, 12, 31, tzinfo=UTC), 70),
                               (datetime(1970, 1, 1, tzinfo=UTC), 1)}, (start, rollup)
    finally:
        conn.close()
        feed.close()


def test_a_lake_without_the_rollup_is_summed_from_its_lines(lake: Any) -> None:
    """A lake from before lake.usage_days, read before the service's first writable attach
    has added it: the same sums, from the lines."""
    for start, end in ((datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)),
                       (datetime(2026, 11, 5, 10, 30, tzinfo=UTC), datetime(2026, 11, 6, 12, tzinfo=UTC))):
        assert query_usage(lake, slice_of(start, end), rollup=False) == query_usage(lake, slice_of(start, end))


def test_an_older_lake_gets_its_rollup_on_the_next_writable_attach(tmp_path: Path) -> None:
    """The rollup of a lake from before lake.usage_days is made from the rows it holds."""
    feed = LakeFeed(tmp_path)
    conn = connect_lake(tmp_path)
    lock = RatingLock(tmp_path / "lake" / "rating.lock")
    plan = apply_catalog(tmp_path, catalog_toml(policies=POLICIES, prices=PRICES))
    feed.add(llm("acct_a", "2026-11-05T10:00:00Z", 3000, 500), llm("acct_b", "2026-11-06T10:00:00Z", 1000))
    close_aggregate_days(conn, plan, lock, lateness={"acme": 3600}, now=datetime(2026, 11, 7, tzinfo=UTC))
    _gate_line(conn, "acct_b", datetime(2026, 11, 6, 1, tzinfo=UTC), 4200, 630)
    made = conn.execute("SELECT * FROM lake.usage_days ORDER BY ALL").fetchall()
    assert made
    conn.execute("DROP TABLE lake.usage_days")
    conn.close()
    again = connect_lake(tmp_path)
    assert again.execute("SELECT * FROM lake.usage_days ORDER BY ALL").fetchall() == made
    again.close()
    feed.close()
