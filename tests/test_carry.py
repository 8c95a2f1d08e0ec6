"""The sweep's numpy carry (`batch.carry`) charges exactly what the SQL window
(`rating_plan.amounts_sql`) charges, line for line: same running totals per account and
price row, same order (occurred_at, then event_id, then line), same block rounding; and it
refuses, rather than wraps, sums that might leave int64."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch import carry
from batch.carry import CarryOutOfRange, PriceTerms, carry_amounts
from batch.rating_plan import PlannedPrice, RatingPlan, amounts_sql
from tests.conftest import examples

START = datetime(2026, 11, 1, tzinfo=timezone.utc)

price_rows = st.lists(
    st.tuples(st.integers(0, 5_000), st.sampled_from([1, 2, 3, 7, 1000, 1024]),
              st.sampled_from(["floor", "ceil", "nearest"])),
    min_size=1, max_size=4)
# Instants from a handful (ties between lines of one account and price row are common), or
# across the whole calendar (too wide for the packed sort key: the lexsort path).
instants = st.one_of(
    st.integers(0, 1).map(lambda m: START + timedelta(minutes=m)),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31),
                 timezones=st.just(timezone.utc)))
lines = st.lists(
    st.tuples(st.integers(0, 39),  # event (several lines may share one)
              st.sampled_from(["acct_a", "acct_b", "acct_c"]),
              instants,
              st.integers(0, 2),  # line key
              st.one_of(st.integers(0, 50_000), st.none()),  # quantity
              st.integers(-1, 3)),  # price key, -1 for none
    min_size=1, max_size=80)


def _plan(rows: list[tuple[int, int, str]]) -> RatingPlan:
    return RatingPlan([], [PlannedPrice(k, "r", f"m{k}", f"p{k}", p, u, rounding, START, None)
                           for k, (p, u, rounding) in enumerate(rows)])


def _table(conn: duckdb.DuckDBPyConnection, drawn: list, events: list[str], prices: int) -> None:
    conn.execute("CREATE OR REPLACE TABLE lines (event_id UUID, realm VARCHAR,"
                 " billing_account_id VARCHAR, occurred_at TIMESTAMPTZ, line_key INTEGER,"
                 " quantity_minor BIGINT, price_key INTEGER)")
    values = [(events[event], account, at, line_key, quantity,
               None if key < 0 or key >= prices or quantity is None else key)
              for event, account, at, line_key, quantity, key in drawn]
    if values:
        conn.executemany("INSERT INTO lines VALUES (?, 'r', ?, ?, ?, ?, ?)", values)


@settings(max_examples=examples(150), deadline=None)
@given(price_rows, lines, st.booleans(), st.booleans(), st.booleans())
def test_the_numpy_carry_charges_what_the_sql_window_charges(rows: list, drawn: list,
                                                             lossless: bool, split: bool,
                                                             crowded: bool) -> None:
    conn = duckdb.connect()
    conn.execute("SET TimeZone = 'UTC'")
    plan = _plan(rows)
    plan.install(conn)
    # Lines of one event keep distinct line keys, as the plan's lines do.
    drawn = list({(d[0], d[3]): d for d in drawn}.values())
    events = [str(uuid.uuid4()) for _ in range(40)]
    if crowded:
        # Ids that share their leading bits (a sort key holds only the first bits of an id),
        # some differing only in the last bits of their first half, some only in the second.
        events = [f"7f3a91c2-5b04-4{e % 4:03x}-8000-{e // 4:012x}" for e in range(40)]
    _table(conn, drawn, events, len(rows))
    conn.execute(f"SET arrow_lossless_conversion = {lossless}")
    table = conn.sql("SELECT * FROM lines").to_arrow_table()
    # Big runs carry on two threads, half the accounts each: so small ones here, at random.
    saved = carry._SPLIT_LINES
    carry._SPLIT_LINES = 0 if split else saved
    try:
        got = carry_amounts(table, PriceTerms.of(plan.price_terms()))
    finally:
        carry._SPLIT_LINES = saved
    mine = table.append_column("amount_xusd", got)  # noqa: F841 (read by DuckDB below)
    wanted = conn.execute(
        f"SELECT CAST(event_id AS VARCHAR), line_key, amount_xusd FROM ({amounts_sql('lines', 'event_id, line_key')})"
        " ORDER BY 1, 2").fetchall()
    assert conn.execute("SELECT CAST(event_id AS VARCHAR), line_key, amount_xusd FROM mine"
                        " ORDER BY 1, 2").fetchall() == wanted
    conn.close()


def test_lines_at_one_instant_carry_in_event_id_order_then_line_order() -> None:
    # 600 + 600 tokens at 1000 per block, floor: the second line in order crosses the block.
    conn = duckdb.connect()
    conn.execute("SET TimeZone = 'UTC'")
    plan = _plan([(150, 1000, "floor")])
    plan.install(conn)
    low, high = "00000000-0000-4000-8000-000000000001", "ffffffff-0000-4000-8000-000000000001"
    _table(conn, [(1, "acct_a", START, 0, 600, 0), (0, "acct_a", START, 1, 600, 0),
                  (0, "acct_a", START, 0, 600, 0)], [low, high], 1)
    conn.execute("SET arrow_lossless_conversion = true")
    table = conn.sql("SELECT * FROM lines").to_arrow_table()
    got = carry_amounts(table, PriceTerms.of(plan.price_terms())).to_pylist()
    # In order: (low, line 0) 600 -> 0; (low, line 1) 1200 -> 150; (high, line 0) 1800 -> 0.
    assert got == [0, 150, 0]


def test_sums_that_might_leave_int64_are_refused_not_wrapped() -> None:
    conn = duckdb.connect()
    plan = _plan([(1, 1000, "floor")])
    _table(conn, [(0, "acct_a", START, 0, 2 ** 59, 0), (1, "acct_a", START, 0, 2 ** 59, 0)],
           [str(uuid.uuid4()), str(uuid.uuid4())], 1)
    with pytest.raises(CarryOutOfRange):
        carry_amounts(conn.sql("SELECT * FROM lines").to_arrow_table(),
                      PriceTerms.of(plan.price_terms()))


def test_no_lines_and_no_price_rows_cost_nothing() -> None:
    empty = pa.table({"event_id": pa.array([], pa.string()), "billing_account_id": pa.array([], pa.string()),
                      "occurred_at": pa.array([], pa.timestamp("us", "UTC")),
                      "line_key": pa.array([], pa.int32()), "quantity_minor": pa.array([], pa.int64()),
                      "price_key": pa.array([], pa.int32())})
    assert carry_amounts(empty, PriceTerms.of([])).to_pylist() == []
    unpriced = pa.table({"event_id": [str(uuid.uuid4())], "billing_account_id": ["a"],
                         "occurred_at": pa.array([START], pa.timestamp("us", "UTC")),
                         "line_key": pa.array([0], pa.int32()),
                         "quantity_minor": pa.array([None], pa.int64()),
                         "price_key": pa.array([None], pa.int32())})
    assert carry_amounts(unpriced, PriceTerms.of([(1, 1, 1, 0, 1)])).to_pylist() == [None]


@pytest.mark.parametrize("ids", ["random", "crowded", "one-word"])
@pytest.mark.parametrize("instants", [1, 7, 5_000])
def test_the_carry_order_is_group_instant_event_id_line_whatever_the_ties(ids: str, instants: int) -> None:
    # Thousands of lines at each instant (clients that send seconds), and ids whose leading
    # bits agree, so that the packed sort key alone cannot order them.
    rng = np.random.default_rng(instants)
    events = 3_000
    if ids == "random":
        high = rng.integers(0, 2 ** 63, events, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    elif ids == "crowded":
        high = np.uint64(0x7F3A91C25B044000) + rng.integers(0, 4, events).astype(np.uint64)
    else:
        high = np.full(events, 0x7F3A91C25B044000, dtype=np.uint64)
    low = rng.integers(0, 2 ** 63, events, dtype=np.int64).astype(np.uint64)
    lines_of = rng.integers(1, 4, events)
    event = np.repeat(np.arange(events), lines_of)
    line_key = np.concatenate([np.arange(k) for k in lines_of]).astype(np.int64)
    rng.shuffle(order := np.arange(len(event)))
    event, line_key = event[order], line_key[order]
    group = rng.integers(0, 3, len(event)).astype(np.int64)
    occurred = 1_790_000_000_000_000 + rng.integers(0, instants, len(event)) * 1_000_000
    rows = np.arange(len(event))

    def tie_break(at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return high[event[at]], low[event[at]], line_key[at]

    got, groups = carry._carry_order(group, occurred, rows, tie_break)
    wanted = np.lexsort((line_key, low[event], high[event], occurred, group))
    assert (got == wanted).all()
    assert (groups == group[wanted]).all()
