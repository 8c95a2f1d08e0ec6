"""Rating runs over the lake (the rating rules; docs/architecture.md): the sweep, re-rating and aggregate days,
with events put in the lake by the real outbox and exporter and amounts worked out by hand."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pytest

from batch.aggregate_days import _candidate_days, close_aggregate_days
from batch.rating_plan import RatingPlan
from batch.rating_runs import RatingLock, current_ratings_sql
from batch.rerate import rerate
from batch.sweep import sweep
from core.clock import ManualClock
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
from warehouse.lake import connect_lake, table_folder

pytestmark = pytest.mark.lake

TOKENS_IN = {"payload_int": "usage.input_tokens", "default": 0}
TOKENS_OUT = {"payload_int": "usage.output_tokens", "default": 0}
PRICES = (price("tokens.in", 150, 1000, "2026-01-01T00:00:00Z")
          + price("tokens.out", 600, 1000, "2026-01-01T00:00:00Z", rounding="ceil")
          + price("calls", 2000, 1, "2026-01-01T00:00:00Z")
          + price("seats", 1_000_000, 1, "2026-01-01T00:00:00Z"))
LLM_V1 = single("llm.completion", "llm.chat", {"tokens.in": TOKENS_IN, "tokens.out": TOKENS_OUT})
# Version 2 bills output tokens only, so which version rated an event shows in its lines.
LLM_V2 = single("llm.completion", "llm.chat", {"tokens.out": TOKENS_OUT})
SEATS = aggregate("seats.snapshot", "team.seats", "seats", {"op": "max", "of": {"payload": "seats"}})


def llm(account: str, occurred_at: str, tokens_in: int, tokens_out: int = 0) -> Any:
    return event(account, "llm.completion", occurred_at,
                 {"usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}},
                 subject=f"{occurred_at}/{tokens_in}/{tokens_out}")


@pytest.fixture()
def lake(tmp_path: Path) -> Iterator[tuple[Path, LakeFeed, duckdb.DuckDBPyConnection]]:
    feed = LakeFeed(tmp_path)
    conn = connect_lake(tmp_path)
    yield tmp_path, feed, conn
    conn.close()
    feed.close()


def lock(data_dir: Path) -> RatingLock:
    return RatingLock(data_dir / "lake" / "rating.lock")


def rows(conn: duckdb.DuckDBPyConnection, sql: str,
         params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    return conn.execute(sql, params or []).fetchall()


def current(conn: duckdb.DuckDBPyConnection, where: str = "TRUE") -> list[tuple[Any, ...]]:
    """(source_id, status, policy_id, policy_version, meter_code, quantity, amount) of the
    current event ratings, ordered."""
    return rows(conn, "SELECT source_id, status, policy_id, policy_version, meter_code,"
                " quantity_minor, amount_xusd"
                f" FROM ({current_ratings_sql()}) WHERE source = 'event' AND {where} ORDER BY ALL")


def test_a_late_event_is_rated_under_the_version_of_its_business_time(lake: Any) -> None:
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1),
                        ("v2", "2026-11-10T00:00:00Z", LLM_V2)),
        prices=PRICES))
    [recent] = feed.add(llm("acct_a", "2026-11-15T09:00:00Z", 1000, 1000))
    assert [r.events for r in sweep(conn, plan, lock(data_dir))] == [1]
    # Arrives after v2 took effect (and after a sweep), but happened under v1.
    [late] = feed.add(llm("acct_a", "2026-11-05T09:00:00Z", 2500, 10))
    assert [r.events for r in sweep(conn, plan, lock(data_dir))] == [1]

    assert current(conn) == sorted([
        # v1: 2500 tokens in at 150 per 1000 (floor) = 300; 10 out at 600 per 1000 (ceil) = 600
        (late, "rated", "llm", "v1", "tokens.in", 2500, 300),
        (late, "rated", "llm", "v1", "tokens.out", 10, 600),
        # v2: output tokens only
        (recent, "rated", "llm", "v2", "tokens.out", 1000, 600),
    ])


def test_the_carry_runs_in_business_time_order_within_a_run(lake: Any) -> None:
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)), prices=PRICES))
    # Exported out of business-time order; carried per (account, meter, price row).
    second = llm("acct_a", "2026-11-02T00:00:00Z", 600)
    first = llm("acct_a", "2026-11-01T00:00:00Z", 500)
    other = llm("acct_b", "2026-11-01T12:00:00Z", 999)
    third = llm("acct_a", "2026-11-03T00:00:00Z", 900)
    feed.add(second, first)
    feed.add(other, third)
    sweep(conn, plan, lock(data_dir))
    amounts = dict(rows(conn, f"SELECT source_id, amount_xusd FROM ({current_ratings_sql()})"
                               " WHERE meter_code = 'tokens.in'"))
    # acct_a: 500 -> A(500)=0; 500+600=1100 -> 150; 1100+900=2000 -> 300-150 = 150.
    assert amounts[first.event_id] == 0
    assert amounts[second.event_id] == 150
    assert amounts[third.event_id] == 150
    assert amounts[other.event_id] == 0  # acct_b carries on its own
    # Many small lines cost what one line of the total costs: A(2000) = 300.
    assert sum(amounts[e.event_id] for e in (first, second, third)) == 300


def test_every_swept_event_gets_a_row_and_none_is_dropped(lake: Any) -> None:
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=(policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1))
                  + policy("big-llm", ("v1", "2026-01-01T00:00:00Z", single(
                      "llm.completion", "llm.chat", {"tokens.in": TOKENS_IN},
                      where={"gt": [{"payload": "usage.input_tokens"}, 5000]})))
                  + policy("seats", ("v1", "2026-01-01T00:00:00Z", SEATS))
                  + policy("late-calls", ("v1", "2027-01-01T00:00:00Z", single(
                      "api.call", "api.search", {"calls": {"const": 1}})))),
        prices=PRICES))
    small, big, seats, unknown, early_call = feed.add(
        llm("acct_a", "2026-11-01T00:00:00Z", 100),
        llm("acct_a", "2026-11-01T00:00:01Z", 9000),
        event("acct_a", "seats.snapshot", "2026-11-01T00:00:00Z", {"seats": 3}),
        event("acct_a", "something.else", "2026-11-01T00:00:00Z", {}),
        # its only policy takes effect later: nothing is in force at its business time
        event("acct_a", "api.call", "2026-11-01T00:00:00Z", {}))
    [run] = sweep(conn, plan, lock(data_dir))
    assert run.events == 5
    assert current(conn) == sorted([
        (small, "rated", "llm", "v1", "tokens.in", 100, 0),
        (small, "rated", "llm", "v1", "tokens.out", 0, 0),
        (big, "quarantined", "big-llm", "v1", None, None, None),
        (big, "quarantined", "llm", "v1", None, None, None),
        (seats, "deferred", "seats", "v1", None, None, None),
        (unknown, "skipped_no_policy", None, None, None, None, None),
        (early_call, "skipped_no_policy", None, None, None, None, None),
    ])
    assert sweep(conn, plan, lock(data_dir)) == []  # nothing left to rate


def test_a_meter_without_a_price_costs_nothing(lake: Any) -> None:
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)),
        prices=price("tokens.in", 150, 1000, "2026-01-01T00:00:00Z")))
    [one] = feed.add(llm("acct_a", "2026-11-01T00:00:00Z", 4000, 70))
    sweep(conn, plan, lock(data_dir))
    assert rows(conn, "SELECT meter_code, price_id, unit_price_xusd, amount_xusd FROM lake.ratings"
                " ORDER BY line_index") == [
        ("tokens.in", "tokens.in@2026-01-01T00:00:00Z", 150, 600),
        ("tokens.out", None, None, 0)]
    assert one


def _sweep_in_a_process(data_dir: str, catalog_text: str, start: Any, results: Any) -> None:
    from pipelines.catalog import load_catalog

    conn = connect_lake(Path(data_dir))
    start.wait()
    runs = sweep(conn, RatingPlan.from_catalog(load_catalog(catalog_text)),
                 RatingLock(Path(data_dir) / "lake" / "rating.lock"), chunk_events=7)
    results.put(sum(r.events for r in runs))
    conn.close()


def test_two_sweeps_at_once_rate_each_event_exactly_once(lake: Any) -> None:
    data_dir, feed, conn = lake
    text = catalog_toml(policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)),
                        prices=PRICES)
    apply_catalog(data_dir, text)
    accounts = ["acct_a", "acct_b"]
    ids = feed.add(*(llm(accounts[i % 2], f"2026-11-01T00:{i // 60:02d}:{i % 60:02d}Z", 100 + i)
                     for i in range(40)))
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=_sweep_in_a_process, args=(str(data_dir), text, start, results))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    # One found all 40 pending; the other waited for the lock, then found none.
    assert sorted(results.get(timeout=5) for _ in workers) == [0, 40]
    per_event = rows(conn, "SELECT source_id, count(DISTINCT run_id), count(*) FROM lake.ratings"
                     " GROUP BY source_id")
    assert len(per_event) == 40 and {eid for eid, _, _ in per_event} == set(ids)
    assert all(runs == 1 and lines == 2 for _, runs, lines in per_event)


def test_a_rerate_appends_reversals_and_new_lines_and_keeps_the_old_run(lake: Any) -> None:
    data_dir, feed, conn = lake
    policies = policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1))
    plan = apply_catalog(data_dir, catalog_toml(policies=policies, prices=PRICES))
    inside, outside = feed.add(llm("acct_a", "2026-11-05T00:00:00Z", 3000),
                               llm("acct_a", "2026-12-05T00:00:00Z", 3000))
    [first] = sweep(conn, plan, lock(data_dir))
    # A new price row for input tokens, in force from before the events.
    plan = apply_catalog(data_dir, catalog_toml(policies=policies, prices=PRICES + price(
        "tokens.in", 200, 1000, "2026-10-01T00:00:00Z")))
    [run] = rerate(conn, plan, lock(data_dir),
                   occurred_from=datetime(2026, 11, 1, tzinfo=timezone.utc),
                   occurred_to=datetime(2026, 12, 1, tzinfo=timezone.utc))
    assert run.events == 1
    assert rows(conn, f"SELECT status, meter_code, quantity_minor, amount_xusd, price_id FROM lake.ratings"
                f" WHERE run_id = '{run.run_id}' ORDER BY status, meter_code") == [
        ("rated", "tokens.in", 3000, 600, "tokens.in@2026-10-01T00:00:00Z"),
        ("rated", "tokens.out", 0, 0, "tokens.out@2026-01-01T00:00:00Z"),
        ("reversal", "tokens.in", -3000, -450, "tokens.in@2026-01-01T00:00:00Z"),
        ("reversal", "tokens.out", 0, 0, "tokens.out@2026-01-01T00:00:00Z")]
    assert current(conn, "meter_code = 'tokens.in'") == [
        (inside, "rated", "llm", "v1", "tokens.in", 3000, 600),
        (outside, "rated", "llm", "v1", "tokens.in", 3000, 450)]  # out of range: untouched
    assert rows(conn, "SELECT count(*) FROM lake.ratings WHERE run_id = ?", [first.run_id]) == [(4,)]
    # Summing every row of the completed runs gives the current amounts too.
    assert rows(conn, "SELECT sum(amount_xusd) FROM lake.ratings WHERE source_id = ?", [inside]) == [(600,)]


def test_a_rerate_can_be_limited_to_accounts_and_policies(lake: Any) -> None:
    data_dir, feed, conn = lake
    policies = (policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1))
                + policy("calls", ("v1", "2026-01-01T00:00:00Z", single(
                    "api.call", "api.search", {"calls": {"const": 1}}))))
    plan = apply_catalog(data_dir, catalog_toml(policies=policies, prices=PRICES))
    a_llm, b_llm, a_call = feed.add(llm("acct_a", "2026-11-05T00:00:00Z", 1000),
                                    llm("acct_b", "2026-11-05T00:00:00Z", 1000),
                                    event("acct_a", "api.call", "2026-11-05T00:00:00Z", {}))
    sweep(conn, plan, lock(data_dir))
    [run] = rerate(conn, plan, lock(data_dir), occurred_from=datetime(2026, 11, 1, tzinfo=timezone.utc),
                   occurred_to=datetime(2026, 12, 1, tzinfo=timezone.utc),
                   accounts=["acct_a"], policy_ids=["llm"])
    assert {r[0] for r in rows(conn, f"SELECT source_id FROM lake.ratings WHERE run_id = '{run.run_id}'")} == {a_llm}
    assert b_llm and a_call


def test_an_aggregate_day_closes_after_its_allowance_and_a_late_event_rerates_it(lake: Any) -> None:
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("seats", ("v1", "2026-01-01T00:00:00Z", SEATS)), prices=PRICES,
        lateness_seconds=3600))
    lateness = {"acme": 3600}
    for seats, at in ((3, "2026-11-01T08:00:00Z"), (5, "2026-11-01T12:00:00Z"), (4, "2026-11-01T23:00:00Z")):
        feed.add(event("acct_a", "seats.snapshot", at, {"seats": seats}))
    feed.add(event("acct_b", "seats.snapshot", "2026-11-01T10:00:00Z", {"seats": 2}))
    day = "2026-11-01"

    almost = datetime(2026, 11, 2, 0, 59, 59, tzinfo=timezone.utc)
    runs = close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness, now=almost)
    assert [r.kind for r in runs] == ["sweep"]  # swept, but the day is still open

    closed = datetime(2026, 11, 2, 1, 0, 0, tzinfo=timezone.utc)
    [run] = close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness, now=closed)
    assert (run.kind, run.events) == ("aggregate", 2)
    aggregate_rows = ("SELECT source_id, status, meter_code, quantity_minor, amount_xusd, occurred_at"
                      " FROM lake.ratings WHERE run_id = ? ORDER BY ALL")
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    assert rows(conn, aggregate_rows, [run.run_id]) == [
        (f"acct_a/seats.snapshot/{day}", "rated", "seats", 5, 5_000_000, start),
        (f"acct_b/seats.snapshot/{day}", "rated", "seats", 2, 2_000_000, start)]
    assert close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness, now=closed) == []

    # A late snapshot for the closed day: swept, then the day of acct_a alone is re-rated.
    feed.add(event("acct_a", "seats.snapshot", "2026-11-01T20:00:00Z", {"seats": 7}))
    sweep_run, again = close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness,
                                            now=datetime(2026, 11, 3, tzinfo=timezone.utc))
    assert (sweep_run.kind, sweep_run.events, again.kind, again.events) == ("sweep", 1, "aggregate", 1)
    assert rows(conn, aggregate_rows, [again.run_id]) == [
        (f"acct_a/seats.snapshot/{day}", "rated", "seats", 7, 7_000_000, start),
        (f"acct_a/seats.snapshot/{day}", "reversal", "seats", -5, -5_000_000, start)]
    assert rows(conn, f"SELECT source_id, quantity_minor, amount_xusd FROM ({current_ratings_sql()})"
                " WHERE status = 'rated' ORDER BY ALL") == [
        (f"acct_a/seats.snapshot/{day}", 7, 7_000_000),
        (f"acct_b/seats.snapshot/{day}", 2, 2_000_000)]


def test_a_close_reads_only_the_days_closed_or_rated_since_the_last_one(lake: Any) -> None:
    """A close does not read the history: only days that closed since the last close and
    days of events a batch run rated since it looked are candidates."""
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("seats", ("v1", "2026-01-01T00:00:00Z", SEATS)), prices=PRICES))
    lateness = {"acme": 7200}
    clock = ManualClock(datetime(2026, 11, 3, 0, 50, tzinfo=timezone.utc))
    feed.add(event("acct_a", "seats.snapshot", "2026-11-01T08:00:00Z", {"seats": 3}),
             event("acct_b", "seats.snapshot", "2026-11-01T09:00:00Z", {"seats": 2}),
             event("acct_b", "seats.snapshot", "2026-11-02T09:00:00Z", {"seats": 4}))

    def close() -> list[Any]:
        return close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness,
                                    now=clock.now(), clock=clock)

    def candidates() -> list[tuple[Any, ...]]:
        if _candidate_days(conn, lateness, clock.now()) is None:
            return []
        return rows(conn, "SELECT billing_account_id, strftime(usage_day, '%m-%d')"
                    " FROM _aggregate_candidates ORDER BY ALL")

    sweep(conn, plan, lock(data_dir), clock=clock)  # the schedule's sweep, at 00:50
    clock.set(datetime(2026, 11, 3, 1, tzinfo=timezone.utc))  # 11-01 closed, 11-02 not yet
    [run] = close()
    assert run.events == 2
    clock.advance(15 * 60)
    # 11-01 is rated and nothing of it changed: not read again. 11-02 closes at 02:00.
    assert candidates() == [("acct_b", "11-02")]
    clock.set(datetime(2026, 11, 3, 2, tzinfo=timezone.utc))
    [run] = close()
    assert run.events == 1

    # A late event for 11-01 of acct_a, and one of a day still open: a sweep rates both.
    feed.add(event("acct_a", "seats.snapshot", "2026-11-01T20:00:00Z", {"seats": 6}),
             event("acct_c", "seats.snapshot", "2026-11-03T01:00:00Z", {"seats": 1}))
    clock.advance(15 * 60)
    sweep(conn, plan, lock(data_dir), clock=clock)
    clock.advance(60)
    # acct_a's 11-01 is read again, acct_b's is not; 11-02, which closed at the last close's
    # instant, is read again within the margin; 11-03 is open.
    assert candidates() == [("acct_a", "11-01"), ("acct_b", "11-02")]
    [run] = close()
    assert run.events == 1
    assert rows(conn, f"SELECT source_id, quantity_minor FROM ({current_ratings_sql()})"
                " WHERE status = 'rated' ORDER BY ALL") == [
        ("acct_a/seats.snapshot/2026-11-01", 6), ("acct_b/seats.snapshot/2026-11-01", 2),
        ("acct_b/seats.snapshot/2026-11-02", 4)]


class _CrashBeforeSecondRunCommits:
    """A connection that fails the way a killed process would, inside the lake transaction
    of the second run, after its rating rows were added."""

    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self._conn = conn
        self._runs = 0

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.startswith("INSERT INTO lake.rating_runs"):
            self._runs += sql.count("(?")  # rows in this statement
            if self._runs >= 2:
                raise RuntimeError("killed mid-run")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.parametrize("commits", ["one run each", "runs together"])
def test_a_run_that_dies_mid_way_leaves_nothing_and_the_next_sweep_resumes(
        lake: Any, monkeypatch: Any, commits: str) -> None:
    # A sweep commits the runs it has ready together (one transaction: all or none), at
    # least every COMMIT_SECONDS; with 0, each run in its own.
    import batch.sweep as sweep_module

    if commits == "one run each":
        monkeypatch.setattr(sweep_module, "COMMIT_SECONDS", 0.0)
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)), prices=PRICES))
    ids = feed.add(*(llm(account, f"2026-11-01T00:00:{i:02d}Z", 100 + i)
                     for i in range(10) for account in ("acct_a", "acct_b")))
    # One chunk per account; the second run dies before its commit (and the first with it
    # when they commit together).
    with pytest.raises(RuntimeError, match="killed"):
        sweep(_CrashBeforeSecondRunCommits(conn), plan, lock(data_dir), chunk_events=10)
    [(runs, rated)] = rows(conn, "SELECT count(DISTINCT run_id), count(DISTINCT source_id) FROM lake.ratings")
    kept = 1 if commits == "one run each" else 0
    assert (runs, rated) == (kept, 10 * kept)
    assert rows(conn, "SELECT count(*) FROM lake.rating_runs") == [(kept,)]
    # The lines files pyarrow wrote for a run that died are gone with it; those of a
    # committed run are the table's.
    folder = table_folder(conn, "rating_lines")
    assert folder is not None
    on_disk = {path.name for path in folder.glob("*.parquet")}
    tracked = {name for (name,) in rows(
        conn, "SELECT f.path FROM __ducklake_metadata_lake.ducklake_data_file AS f"
        " JOIN __ducklake_metadata_lake.ducklake_table AS t USING (table_id)"
        " WHERE t.table_name = 'rating_lines'")}
    assert on_disk == tracked and len(on_disk) == kept

    resumed = sweep(conn, plan, lock(data_dir), chunk_events=10)
    assert sum(run.events for run in resumed) == 20 - 10 * kept
    per_event = dict(rows(conn, "SELECT source_id, count(DISTINCT run_id) FROM lake.ratings GROUP BY ALL"))
    assert sorted(per_event) == sorted(ids) and set(per_event.values()) == {1}


def test_a_sweep_skips_what_a_later_rerate_rated_and_what_any_run_rated_without_export(lake: Any) -> None:
    """The sweep looks up only the runs since its watermark for exported events, and every
    run for an event loaded without an export id: neither kind is ever rated twice."""
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)),
                                                prices=PRICES))
    [old] = feed.add(llm("acct_a", "2026-11-05T00:00:00Z", 1000))
    assert [r.events for r in sweep(conn, plan, lock(data_dir))] == [1]
    # Exported after the watermark, then rated by a rerate before any sweep saw it.
    [new] = feed.add(llm("acct_a", "2026-11-06T00:00:00Z", 2000))
    [run] = rerate(conn, plan, lock(data_dir), occurred_from=datetime(2026, 11, 6, tzinfo=timezone.utc),
                   occurred_to=datetime(2026, 11, 7, tzinfo=timezone.utc))
    assert run.events == 1
    # Loaded by hand, without an export id: rated by the next sweep, then never again.
    loose = str(uuid.uuid4())
    conn.execute("INSERT INTO lake.events SELECT * REPLACE (CAST(? AS UUID) AS event_id, NULL AS export_id)"
                 " FROM lake.events WHERE event_id = ?", [loose, old])
    assert sum(r.events for r in sweep(conn, plan, lock(data_dir))) == 1
    assert sum(r.events for r in sweep(conn, plan, lock(data_dir))) == 0
    per_event = dict(rows(conn, "SELECT source_id, count(DISTINCT run_id) FROM lake.ratings"
                                " WHERE status = 'rated' GROUP BY source_id"))
    assert per_event == {old: 1, new: 1, loose: 1}


def test_an_aggregate_day_split_by_a_new_version_keeps_its_rating_ids_unique(lake: Any) -> None:
    """A version taking effect mid-day gives the day a line of each version, both with
    line_index 0: their rows (and, once the day is re-rated, their reversals) need distinct ids."""
    data_dir, feed, conn = lake
    seats_sum = aggregate("seats.snapshot", "team.seats", "seats", {"op": "sum", "of": {"payload": "seats"}})
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("seats", ("v1", "2026-01-01T00:00:00Z", SEATS),
                        ("v2", "2026-11-01T12:00:00Z", seats_sum)), prices=PRICES))
    lateness = {"acme": 7200}
    feed.add(event("acct_a", "seats.snapshot", "2026-11-01T06:00:00Z", {"seats": 4}),
             event("acct_a", "seats.snapshot", "2026-11-01T16:00:00Z", {"seats": 5}))
    closed = datetime(2026, 11, 3, tzinfo=timezone.utc)
    [_, run] = close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness, now=closed)
    day = "acct_a/seats.snapshot/2026-11-01"
    assert rows(conn, "SELECT policy_version, line_index, quantity_minor, amount_xusd FROM lake.ratings"
                " WHERE run_id = ? ORDER BY ALL", [run.run_id]) == [
        ("v1", 0, 4, 4_000_000),   # max of the morning under v1
        ("v2", 0, 5, 5_000_000)]   # sum of the afternoon under v2
    feed.add(event("acct_a", "seats.snapshot", "2026-11-01T17:00:00Z", {"seats": 2}))  # late
    [_, again] = close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness, now=closed)
    assert rows(conn, "SELECT status, policy_version, amount_xusd FROM lake.ratings WHERE run_id = ?"
                " ORDER BY ALL", [again.run_id]) == [
        ("rated", "v1", 4_000_000), ("rated", "v2", 7_000_000),
        ("reversal", "v1", -4_000_000), ("reversal", "v2", -5_000_000)]
    assert rows(conn, "SELECT count(*), count(DISTINCT rating_id) FROM lake.ratings WHERE source_id = ?",
                [day]) == [(6, 6)]


def test_a_day_deferred_under_a_policy_the_catalog_dropped_waits_and_is_named(
        lake: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Days whose events were deferred under a version the applied catalog no longer has are
    neither billed short nor given an empty run on every close: they stay deferred, are
    named, and are rated once the catalog has the version again."""
    data_dir, feed, conn = lake
    with_seats = catalog_toml(policies=policy("seats", ("v1", "2026-01-01T00:00:00Z", SEATS)),
                              prices=PRICES)
    plan = apply_catalog(data_dir, with_seats)
    lateness = {"acme": 7200}
    feed.add(event("acct_a", "seats.snapshot", "2026-11-01T08:00:00Z", {"seats": 3}))
    closed = datetime(2026, 11, 3, tzinfo=timezone.utc)
    runs = close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness,
                                now=datetime(2026, 11, 1, 12, tzinfo=timezone.utc))
    assert [r.kind for r in runs] == ["sweep"]  # deferred; the day is still open

    desks = aggregate("desk.snapshot", "team.seats", "seats", {"op": "max", "of": {"payload": "desks"}})
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("desks", ("v1", "2026-01-01T00:00:00Z", desks)), prices=PRICES))
    with caplog.at_level("WARNING", logger="tollgate.rating"):
        for _ in range(2):
            assert close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness, now=closed) == []
    assert "acme:acct_a/seats.snapshot/2026-11-01" in caplog.text
    assert rows(conn, "SELECT count(*) FROM lake.rating_runs WHERE kind = 'aggregate'") == [(0,)]
    assert rows(conn, "SELECT status FROM lake.ratings WHERE source = 'event'") == [("deferred",)]

    plan = apply_catalog(data_dir, with_seats)
    [run] = close_aggregate_days(conn, plan, lock(data_dir), lateness=lateness, now=closed)
    assert rows(conn, "SELECT source_id, quantity_minor, amount_xusd FROM lake.ratings WHERE run_id = ?",
                [run.run_id]) == [("acct_a/seats.snapshot/2026-11-01", 3, 3_000_000)]


@pytest.mark.parametrize("kinds", ["table", "distinct pairs", "inserted"])
def test_a_sweep_writes_narrow_lines_that_read_like_every_other_rating(lake: Any, monkeypatch: Any,
                                                                     kinds: str) -> None:
    # 700 + 700 input tokens at 150 per 1000 (floor) in occurred_at order: 0 then 150.
    import batch.run_writer as run_writer_module

    if kinds == "distinct pairs":  # as for a catalog of many realms
        monkeypatch.setattr(run_writer_module, "_DENSE_KINDS", 0)
    if kinds == "inserted":  # a lake whose catalog does not name the table's folder
        monkeypatch.setattr(run_writer_module, "table_folder", lambda conn, table: None)
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)), prices=PRICES))
    second, first = feed.add(llm("acct_a", "2026-11-01T00:00:02Z", 700),
                             llm("acct_a", "2026-11-01T00:00:01Z", 700))
    [run] = sweep(conn, plan, lock(data_dir))
    assert rows(conn, "SELECT count(*) FROM lake.rating_lines") == [(4,)]
    folder = table_folder(conn, "rating_lines")
    assert folder is not None
    written = [path.name for path in folder.glob(f"{run.run_id}-*.parquet")]
    assert len(written) == (0 if kinds == "inserted" else 1)  # pyarrow's file, or DuckDB's
    assert rows(conn, "SELECT count(*) FROM lake.rating_rows WHERE run_id = ?", [run.run_id]) == [(0,)]
    started = rows(conn, "SELECT started_at FROM lake.rating_runs WHERE run_id = ?", [run.run_id])[0][0]
    tag = run.run_id.rsplit("-", 1)[-1]
    assert rows(conn, "SELECT rating_id, source, source_id, realm, billing_account_id, status,"
                " policy_id, policy_version, feature_code, meter_code, quantity_minor, price_id,"
                " unit_price_xusd, unit_quantity_minor, amount_xusd, rated_at, line_index"
                " FROM lake.ratings WHERE meter_code = 'tokens.in' ORDER BY occurred_at") == [
        (f"{first}:0:{tag}", "event", first, "acme", "acct_a", "rated", "llm", "v1", "llm.chat",
         "tokens.in", 700, "tokens.in@2026-01-01T00:00:00Z", 150, 1000, 0, started, 0),
        (f"{second}:0:{tag}", "event", second, "acme", "acct_a", "rated", "llm", "v1", "llm.chat",
         "tokens.in", 700, "tokens.in@2026-01-01T00:00:00Z", 150, 1000, 150, started, 0)]
    assert (run.events, run.lines) == (2, 4)


def test_quantities_too_large_for_int64_sums_are_priced_in_sql_instead(lake: Any) -> None:
    # Two lines of 2^60 tokens: their running sum (2^61) is past what the numpy carry takes,
    # so the run is priced by the SQL window (HUGEINT) into rating_rows: same amounts.
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)),
        prices=price("tokens.in", 1, 2 ** 40, "2026-01-01T00:00:00Z")))
    feed.add(llm("acct_a", "2026-11-01T00:00:01Z", 2 ** 60 + 5),
             llm("acct_a", "2026-11-01T00:00:02Z", 2 ** 60 - 5))
    [run] = sweep(conn, plan, lock(data_dir))
    assert rows(conn, "SELECT count(*) FROM lake.rating_lines") == [(0,)]
    assert run.events == 2
    assert rows(conn, "SELECT quantity_minor, amount_xusd FROM lake.ratings"
                " WHERE meter_code = 'tokens.in' ORDER BY occurred_at") == [
        (2 ** 60 + 5, 2 ** 20), (2 ** 60 - 5, 2 ** 20)]


@pytest.mark.parametrize("stage", ["memory", "passes", "parquet"])
def test_a_sweep_of_many_chunks_carries_each_account_whole(lake: Any, monkeypatch: Any,
                                                           stage: str) -> None:
    # Rated events wait between the scan and their runs in memory; past the memory budget
    # they are rated in passes over ranges of accounts that fit, and an account too big
    # for memory waits in Parquet files. Each account's lines land in one run every way.
    # The stages and the memory estimate are patched where the sweep looks them up (its own
    # namespace: it imports them from batch.staging).
    import batch.staging as staging_module
    import batch.sweep as sweep_module

    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)), prices=PRICES))
    stages: list[str] = []
    for name in ("memory_stage", "parquet_stage"):
        def counted(*args: Any, name: str = name, real: Any = getattr(sweep_module, name)) -> Any:  # noqa: B008 (binds this name's function)
            stages.append(name)
            return real(*args)
        monkeypatch.setattr(sweep_module, name, counted)
    width = staging_module.stage_width
    if stage == "passes":
        # A budget of 10 events (each account has 4).
        monkeypatch.setattr(sweep_module, "stage_width", lambda *args: 100.0)
        monkeypatch.setattr(sweep_module, "memory_limit", lambda conn: 100 * 10 * 4 // 3 + 4)
    if stage == "parquet":
        monkeypatch.setattr(sweep_module, "stage_width", lambda *args: 10.0 ** 12)
    accounts = [f"acct_{n}" for n in range(6)]
    feed.add(*(llm(account, f"2026-11-01T00:00:0{i}Z", 600) for account in accounts for i in range(4)))
    # The stage's estimate counts the realm's and the account's text.
    [(realm,)] = rows(conn, "SELECT DISTINCT realm FROM lake.events")
    assert width(conn, plan.slot_bytes(), "TRUE") == pytest.approx(
        (36 + plan.slot_bytes() + len(realm) + len("acct_0")) * 1.1)
    spill = data_dir / "lake" / "spill"
    runs = sweep(conn, plan, lock(data_dir), chunk_events=5, scratch=spill)
    assert len(runs) >= 3 and sum(r.events for r in runs) == 24
    # Per account, 600 tokens a time at 150 per 1000 (floor): 0, 150, 0, 150.
    got = rows(conn, "SELECT billing_account_id, list(amount_xusd ORDER BY occurred_at),"
               " count(DISTINCT run_id) FROM lake.ratings WHERE meter_code = 'tokens.in'"
               " GROUP BY ALL ORDER BY 1")
    assert got == [(account, [0, 150, 0, 150], 1) for account in accounts]
    assert spill.is_dir() and not list(spill.iterdir())  # the stage is gone
    if stage == "memory":
        assert stages == ["memory_stage"]
    elif stage == "passes":  # of at most 10 events: 2 accounts each
        assert len(stages) >= 3 and set(stages) == {"memory_stage"}
    else:
        assert set(stages) == {"parquet_stage"}


def test_a_sweep_rates_up_to_what_it_read_and_the_next_one_needs_no_anti_join(lake: Any, monkeypatch: Any) -> None:
    """Events exported after a sweep read the lake wait for the next sweep, so a completed
    sweep's runs hold nothing beyond its watermark: a steady sweep looks up no earlier run
    (the anti-join's rated side grew by every sweep of the last hour), and after a rerate it
    does again. Every event is rated exactly once throughout."""
    import batch.sweep as sweep_module

    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)),
                                                prices=PRICES))
    first = feed.add(*(llm(a, "2026-11-05T00:00:00Z", 1000) for a in ("acct_a", "acct_b")))
    assert sum(r.events for r in sweep(conn, plan, lock(data_dir))) == 2
    second = feed.add(*(llm(a, "2026-11-05T01:00:00Z", 2000) for a in ("acct_a", "acct_b")))
    third = feed.add(*(llm(a, "2026-11-05T02:00:00Z", 3000) for a in ("acct_a", "acct_b")))
    states: list[Any] = []
    real_state = sweep_module._state

    def read_before(events: list[str]) -> Any:
        """`_state` as a sweep that read the lake before the export of the events after `events`."""
        [(read,)] = rows(conn, "SELECT max(export_id) FROM lake.events WHERE list_contains(?, event_id::VARCHAR)",
                         [events])

        def state(c: Any) -> Any:
            now = real_state(c)
            states.append(dataclasses.replace(now, greatest=read, candidates=len(events)))
            return states[-1]
        return state

    for chunk_events, expected in ((1_000, second), (1, third)):  # one chunk, then chunks
        monkeypatch.setattr(sweep_module, "_state", read_before(expected))
        runs = sweep(conn, plan, lock(data_dir), chunk_events=chunk_events)
        assert sum(r.events for r in runs) == len(expected)
        assert states[-1].recent == 0  # no run since the watermark could hold a pending event
        [(rated,)] = rows(conn, "SELECT list(DISTINCT source_id ORDER BY source_id) FROM lake.ratings"
                                " WHERE list_contains(?, run_id)", [[r.run_id for r in runs]])
        assert rated == sorted(expected)
    monkeypatch.setattr(sweep_module, "_state", real_state)
    # Every run of a sweep records its bound; a watermark run's bound is its watermark.
    params = [json.loads(p) for (p,) in rows(conn, "SELECT params FROM lake.rating_runs WHERE kind = 'sweep'")]
    assert len(params) >= 3 and all(p.get("rates_through") is not None for p in params)
    assert all(p["rates_through"] == p["through_export_id"] for p in params if "through_export_id" in p)
    # A rerate since the watermark may hold events beyond it: the anti-join is back.
    [newest] = feed.add(llm("acct_a", "2026-11-06T00:00:00Z", 4000))
    rerate(conn, plan, lock(data_dir), occurred_from=datetime(2026, 11, 6, tzinfo=timezone.utc),
           occurred_to=datetime(2026, 11, 7, tzinfo=timezone.utc))
    assert real_state(conn).recent >= 1
    assert sum(r.events for r in sweep(conn, plan, lock(data_dir))) == 0
    per_event = dict(rows(conn, "SELECT source_id, count(DISTINCT run_id) FROM lake.ratings"
                                " WHERE status = 'rated' GROUP BY source_id"))
    assert sorted(per_event) == sorted([*first, *second, *third, newest]) and set(per_event.values()) == {1}


def test_a_backlog_past_a_rounds_size_is_rated_in_rounds_of_export_ids(lake: Any) -> None:
    """A sweep meeting more events than a round holds (what its memory allows) rates them a
    prefix of export ids at a time, each round ending with its own watermark: as the sweeps
    of the minutes the backlog piled up in would have, carry included. Every event once."""
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)), prices=PRICES))
    exports = [feed.add(*(llm("acct_a", f"2026-11-01T00:0{n}:0{i}Z", 600) for i in range(3)))
               for n in range(3)]
    seen: list[tuple[int, int]] = []
    runs = sweep(conn, plan, lock(data_dir), chunk_events=2, round_events=4,
                 progress=lambda done, total: seen.append((done, total)))
    assert sum(r.events for r in runs) == 9
    marks = rows(conn, "SELECT CAST(json_extract_string(params, '$.through_export_id') AS BIGINT)"
                       " FROM lake.rating_runs WHERE json_extract_string(params, '$.through_export_id')"
                       " IS NOT NULL ORDER BY 1")
    assert marks == rows(conn, "SELECT DISTINCT export_id FROM lake.events ORDER BY 1")  # a round each
    # Each round's runs hold one export's events.
    per_run = rows(conn, "SELECT count(DISTINCT e.export_id) FROM lake.ratings AS r"
                         " JOIN lake.events AS e ON e.event_id = r.source_id GROUP BY r.run_id")
    assert per_run and {n for (n,) in per_run} == {1}
    # 600 tokens a time at 150 per 1000 (floor), carried within a round, from 0 in each.
    got = rows(conn, "SELECT list(amount_xusd ORDER BY occurred_at) FROM lake.ratings"
                     " WHERE meter_code = 'tokens.in'")
    assert got == [([0, 150, 0] * 3,)]
    assert seen[-1] == (9, 9) and all(total == 9 for _, total in seen)
    per_event = dict(rows(conn, "SELECT source_id, count(*) FROM lake.ratings WHERE meter_code = 'tokens.in'"
                                " GROUP BY ALL"))
    assert sorted(per_event) == sorted(i for ids in exports for i in ids) and set(per_event.values()) == {1}
    assert sweep(conn, plan, lock(data_dir), chunk_events=2, round_events=4) == []


def test_rounds_after_a_sweep_that_died_hours_ago_rate_nothing_twice(lake: Any, monkeypatch: Any) -> None:
    """A sweep that died after committing one account's run (no watermark) leaves events
    beyond the watermark rated. Hours later a sweep in rounds must still look that run up in
    every round: a round that stops short of the events it read records the read time of
    the watermark the sweep started from, not its own (events past its bound were in the
    lake already at its own)."""
    import batch.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "COMMIT_SECONDS", 0.0)
    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)), prices=PRICES))
    clock = ManualClock(datetime(2026, 11, 27, 10, 0, tzinfo=timezone.utc))
    feed.add(llm("acct_a", "2026-11-01T00:00:00Z", 100))
    assert sum(r.events for r in sweep(conn, plan, lock(data_dir), clock=clock)) == 1
    ids = [i for n in range(1, 4) for i in feed.add(*(llm(a, f"2026-11-01T0{n}:00:00Z", 100 * n)
                                                       for a in ("acct_a", "acct_b")))]
    clock.advance(60)
    with pytest.raises(RuntimeError, match="killed"):
        sweep(_CrashBeforeSecondRunCommits(conn), plan, lock(data_dir), chunk_events=3, clock=clock)
    [(dead,)] = rows(conn, "SELECT count(*) FROM lake.ratings WHERE meter_code = 'tokens.in'") or [(0,)]
    assert dead == 4  # the first event, and one account's three
    clock.advance(3 * 3600)
    runs = sweep(conn, plan, lock(data_dir), chunk_events=1, round_events=2, clock=clock)
    assert sum(r.events for r in runs) == 3
    per_event = dict(rows(conn, "SELECT source_id, count(DISTINCT run_id) FROM lake.ratings"
                                " WHERE meter_code = 'tokens.in' GROUP BY ALL"))
    assert set(ids) <= set(per_event) and set(per_event.values()) == {1}


def test_a_sweep_in_rounds_ends_at_what_it_read_at_its_start(lake: Any, monkeypatch: Any) -> None:
    """Events exported while a sweep goes through its rounds wait for the next sweep: a
    sweep has an end, so it never holds the rating lock for as long as events keep coming."""
    import batch.sweep as sweep_module

    data_dir, feed, conn = lake
    plan = apply_catalog(data_dir, catalog_toml(
        policies=policy("llm", ("v1", "2026-01-01T00:00:00Z", LLM_V1)), prices=PRICES))
    exports = [feed.add(*(llm(a, f"2026-11-01T0{n}:00:00Z", 100) for a in ("acct_a", "acct_b")))
               for n in range(3)]
    [(second,)] = rows(conn, "SELECT max(export_id) FROM lake.events WHERE list_contains(?, event_id::VARCHAR)",
                       [exports[1]])
    real_state = sweep_module._state
    calls: list[int] = []

    def first_read_misses_the_last_export(c: Any) -> Any:
        state = real_state(c)
        calls.append(state.greatest)
        if len(calls) == 1:  # as if the last export landed right after the sweep's read
            return dataclasses.replace(state, greatest=second, candidates=4)
        return state

    monkeypatch.setattr(sweep_module, "_state", first_read_misses_the_last_export)
    runs = sweep(conn, plan, lock(data_dir), chunk_events=1, round_events=2)
    assert len(calls) >= 2 and calls[-1] > second  # a later round saw the last export
    assert sum(r.events for r in runs) == 4
    rated = {i for (i,) in rows(conn, "SELECT DISTINCT source_id FROM lake.ratings")}
    assert rated == {*exports[0], *exports[1]}
    monkeypatch.setattr(sweep_module, "_state", real_state)
    assert sum(r.events for r in sweep(conn, plan, lock(data_dir))) == 2
