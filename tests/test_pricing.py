"""Tests for pipelines.pricing: the carry-aware pricing rule of the wire contract."""

from __future__ import annotations

import doctest
import math
from datetime import datetime, timezone
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines import pricing
from pipelines.pricing import INT64_MAX, PriceRow, price_line, quote, select_price
from tests.conftest import examples

MODES: tuple[str, ...] = ("floor", "nearest", "ceil")
T0 = "2024-01-01T00:00:00Z"


def row_of(price: int, unit: int, rounding: str, *, pid: str = "tokens@2024") -> PriceRow:
    return PriceRow(pid, "tokens", price, unit, rounding, T0)


def commit_all(row: PriceRow, quantities: list[int]) -> tuple[list[int], list[int]]:
    """Apply quantities in order from carry 0, as the store would; return amounts, carries."""
    carry = 0
    amounts: list[int] = []
    carries: list[int] = []
    for q in quantities:
        line = price_line(row, q, carry)
        amounts.append(line.amount_xusd)
        carry = line.remainder_after
        carries.append(carry)
    return amounts, carries


def exact_rounding(value: Fraction, rounding: str) -> int:
    # Independent oracle on exact rationals (Fraction, never float).
    if rounding == "floor":
        return math.floor(value)
    if rounding == "ceil":
        return math.ceil(value)
    return math.floor(value + Fraction(1, 2))  # half up


# --- examples computed by hand: 150 xusd per 1000 tokens -------------------------------


def test_floor_999_tokens_cost_nothing_then_1_token_completes_the_block_for_150() -> None:
    row = row_of(150, 1000, "floor")
    first = price_line(row, 999, 0)
    assert (first.amount_xusd, first.remainder_after) == (0, 999)
    second = price_line(row, 1, first.remainder_after)
    assert (second.amount_xusd, second.remainder_after) == (150, 0)


def test_ceil_1_token_costs_a_whole_block_then_999_more_cost_nothing() -> None:
    row = row_of(150, 1000, "ceil")
    first = price_line(row, 1, 0)
    assert (first.amount_xusd, first.remainder_after) == (150, 1)
    second = price_line(row, 999, first.remainder_after)
    assert (second.amount_xusd, second.remainder_after) == (0, 0)
    # The next token opens a new block.
    assert price_line(row, 1, second.remainder_after).amount_xusd == 150


def test_nearest_rounds_blocks_half_up_on_the_cumulative_total() -> None:
    row = row_of(150, 1000, "nearest")
    # The contract rounds blocks, not money: 500 tokens = 0.5 block -> 1 block (half up) -> 150,
    # not 500 * 150 / 1000 = 75.
    assert quote(row, 500) == 150
    # 499 -> 0.499 -> 0; 1499 -> 1.499 -> 1; 1500 -> 1.5 -> 2 blocks.
    assert [quote(row, q) for q in (0, 499, 1499, 1500)] == [0, 0, 150, 300]
    # 499, then 1 (reaches half a block), then 999 (1499: still 1 block), then 1 (1.5 -> 2).
    amounts, carries = commit_all(row, [499, 1, 999, 1])
    assert amounts == [0, 150, 0, 150]
    assert carries == [499, 500, 499, 500]
    assert sum(amounts) == quote(row, 1500)


def test_nearest_half_is_charged_up_once_and_not_again_on_completion() -> None:
    row = row_of(1, 2, "nearest")  # 1 xusd per 2 units: 1 unit is exactly 0.5
    first = price_line(row, 1, 0)
    second = price_line(row, 1, first.remainder_after)
    assert (first.amount_xusd, second.amount_xusd) == (1, 0)
    assert second.remainder_after == 0


def test_priced_line_echoes_the_row_terms_and_quantity() -> None:
    row = row_of(150, 1000, "floor")
    line = price_line(row, 2500, 700)
    assert line.quantity_minor == 2500
    assert line.carried == 700
    assert line.unit_price_xusd == 150
    assert line.unit_quantity_minor == 1000
    assert line.rounding == "floor"
    assert line.price_id == "tokens@2024"
    # A(3200) - A(700) = 450 - 0.
    assert (line.amount_xusd, line.remainder_after) == (450, 200)


def test_zero_quantity_costs_nothing_and_keeps_the_carry() -> None:
    for mode in MODES:
        line = price_line(row_of(150, 1000, mode), 0, 123)
        assert (line.amount_xusd, line.remainder_after) == (0, 123)


def test_quote_is_price_line_from_zero_carry() -> None:
    row = row_of(150, 1000, "ceil")
    assert quote(row, 1001) == price_line(row, 1001, 0).amount_xusd == 300


def test_intermediate_products_beyond_64_bit_are_exact() -> None:
    row = row_of(INT64_MAX, 1, "floor")
    assert quote(row, INT64_MAX) == INT64_MAX * INT64_MAX  # ~2**126, exact
    line = price_line(row_of(INT64_MAX, 2, "ceil"), INT64_MAX, 1)
    # Carry 1 + INT64_MAX = 2**63 = exactly 2**62 blocks; carry 1 alone was 1 block (ceil).
    assert line.amount_xusd == INT64_MAX * (2**62 - 1)
    assert line.remainder_after == 0


# --- properties ------------------------------------------------------------------------

price_rows = st.builds(
    row_of,
    st.integers(0, 10**7),
    st.integers(1, 10**6),
    st.sampled_from(MODES),
)
splits = st.lists(st.integers(0, 10**7), max_size=50)


@pytest.mark.parametrize("rounding", MODES)
@settings(max_examples=examples(300), deadline=None)
@given(price=st.integers(0, 10**7), unit=st.integers(1, 10**6), quantities=splits)
def test_sum_of_split_commits_equals_one_commit_of_the_total(
    rounding: str, price: int, unit: int, quantities: list[int]
) -> None:
    row = row_of(price, unit, rounding)
    amounts, _ = commit_all(row, quantities)
    assert sum(amounts) == price_line(row, sum(quantities), 0).amount_xusd


@settings(max_examples=examples(300), deadline=None)
@given(row=price_rows, quantities=splits)
def test_carry_stays_in_zero_to_unit_quantity_and_is_the_cumulative_modulo_the_unit(
    row: PriceRow, quantities: list[int]
) -> None:
    _, carries = commit_all(row, quantities)
    total = 0
    for q, carry in zip(quantities, carries, strict=False):
        total += q
        assert 0 <= carry < row.unit_quantity_minor
        assert carry == total % row.unit_quantity_minor


@settings(max_examples=examples(300), deadline=None)
@given(row=price_rows, quantities=splits)
def test_every_prefix_of_commits_is_charged_the_quote_of_its_total(
    row: PriceRow, quantities: list[int]
) -> None:
    amounts, _ = commit_all(row, quantities)
    total = charged = 0
    for q, amount in zip(quantities, amounts, strict=False):
        total += q
        charged += amount
        assert amount >= 0  # a commit never credits
        assert charged == quote(row, total)


@settings(max_examples=examples(500), deadline=None)
@given(row=price_rows, quantity=st.integers(0, INT64_MAX))
def test_quote_is_the_unit_price_times_the_rounded_exact_number_of_blocks(
    row: PriceRow, quantity: int
) -> None:
    blocks = exact_rounding(Fraction(quantity, row.unit_quantity_minor), row.rounding)
    assert quote(row, quantity) == row.unit_price_xusd * blocks


# --- validation ------------------------------------------------------------------------


def test_negative_quantity_is_rejected() -> None:
    with pytest.raises(ValueError, match="quantity_minor must be >= 0"):
        price_line(row_of(150, 1000, "floor"), -1, 0)


def test_quantity_beyond_signed_64_bit_is_rejected() -> None:
    with pytest.raises(ValueError, match="signed 64-bit"):
        price_line(row_of(150, 1000, "floor"), INT64_MAX + 1, 0)


def test_non_int_quantities_are_rejected() -> None:
    row = row_of(150, 1000, "floor")
    with pytest.raises(ValueError, match="must be an int"):
        price_line(row, 1.0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an int"):
        price_line(row, True, 0)


def test_carry_outside_zero_to_unit_quantity_is_rejected() -> None:
    row = row_of(150, 1000, "floor")
    with pytest.raises(ValueError, match="carried must be in"):
        price_line(row, 1, 1000)
    with pytest.raises(ValueError, match="carried must be >= 0"):
        price_line(row, 1, -1)


def test_unit_quantity_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="unit_quantity_minor must be >= 1"):
        row_of(150, 0, "floor")


def test_negative_unit_price_is_rejected() -> None:
    with pytest.raises(ValueError, match="unit_price_xusd must be >= 0"):
        row_of(-1, 1000, "floor")


def test_unknown_rounding_is_rejected() -> None:
    with pytest.raises(ValueError, match="rounding must be one of"):
        row_of(150, 1000, "half_even")


@pytest.mark.parametrize(
    "bad", ["2024-01-01", "2024-01-01T00:00:00", "2024-13-01T00:00:00Z", "yesterday"]
)
def test_effective_at_must_be_rfc3339_with_an_offset(bad: str) -> None:
    with pytest.raises(ValueError, match="RFC 3339"):
        PriceRow("p", "tokens", 1, 1, "floor", bad)


# --- select_price ----------------------------------------------------------------------


def row_at(pid: str, effective_at: str, meter: str = "tokens") -> PriceRow:
    return PriceRow(pid, meter, 1, 1, "floor", effective_at)


ROWS: list[PriceRow] = [
    row_at("jan", "2024-01-01T00:00:00Z"),
    row_at("mar", "2024-03-01T00:00:00+02:00"),  # = 2024-02-29T22:00:00Z
    row_at("feb", "2024-02-01T00:00:00-05:00"),  # = 2024-02-01T05:00:00Z (list is unsorted)
    row_at("other", "2024-02-15T00:00:00Z", meter="requests"),
]


def test_select_price_picks_the_latest_row_effective_at_or_before_at() -> None:
    assert select_price(ROWS, "tokens", "2024-01-15T00:00:00Z").price_id == "jan"  # type: ignore[union-attr]
    assert select_price(ROWS, "tokens", "2024-02-20T00:00:00Z").price_id == "feb"  # type: ignore[union-attr]
    assert select_price(ROWS, "tokens", "2025-01-01T00:00:00Z").price_id == "mar"  # type: ignore[union-attr]


def test_select_price_is_inclusive_of_effective_at() -> None:
    assert select_price(ROWS, "tokens", "2024-01-01T00:00:00Z").price_id == "jan"  # type: ignore[union-attr]


def test_select_price_compares_offsets_as_instants_not_strings() -> None:
    # "feb" starts at 05:00Z: 04:59:59Z is still jan, 00:00-05:00 (same instant) is feb.
    assert select_price(ROWS, "tokens", "2024-02-01T04:59:59Z").price_id == "jan"  # type: ignore[union-attr]
    assert select_price(ROWS, "tokens", "2024-02-01T00:00:00-05:00").price_id == "feb"  # type: ignore[union-attr]
    # "mar" starts 2024-02-29T22:00Z although its string says March.
    assert select_price(ROWS, "tokens", "2024-02-29T23:00:00Z").price_id == "mar"  # type: ignore[union-attr]
    assert select_price(ROWS, "tokens", "2024-02-29T21:59:59.999999999Z").price_id == "feb"  # type: ignore[union-attr]


def test_select_price_keeps_sub_microsecond_precision() -> None:
    rows = [row_at("a", "2024-01-01T00:00:00.0000001Z"), row_at("b", "2024-01-01T00:00:00.0000002Z")]
    assert select_price(rows, "tokens", "2024-01-01T00:00:00.00000015Z").price_id == "a"  # type: ignore[union-attr]
    assert select_price(rows, "tokens", "2024-01-01T00:00:00.00000020Z").price_id == "b"  # type: ignore[union-attr]


def test_select_price_returns_none_when_no_row_is_before_at() -> None:
    assert select_price(ROWS, "tokens", "2023-12-31T23:59:59Z") is None


def test_select_price_returns_none_for_an_unknown_meter() -> None:
    assert select_price(ROWS, "bytes", "2025-01-01T00:00:00Z") is None
    assert select_price([], "tokens", "2025-01-01T00:00:00Z") is None


def test_select_price_filters_by_meter() -> None:
    assert select_price(ROWS, "requests", "2024-02-15T00:00:00Z").price_id == "other"  # type: ignore[union-attr]


def test_select_price_rejects_two_different_rows_in_force_from_the_same_instant() -> None:
    rows = [row_at("x", "2024-01-01T01:00:00+01:00"), row_at("y", "2024-01-01T00:00:00Z")]
    with pytest.raises(ValueError, match="ambiguous"):
        select_price(rows, "tokens", "2024-06-01T00:00:00Z")
    # A later row supersedes the tie, so it is not ambiguous any more.
    later = [*rows, row_at("z", "2024-02-01T00:00:00Z")]
    assert select_price(later, "tokens", "2024-06-01T00:00:00Z").price_id == "z"  # type: ignore[union-attr]


def test_select_price_rejects_a_malformed_at() -> None:
    with pytest.raises(ValueError, match="RFC 3339"):
        select_price(ROWS, "tokens", "2024-02-01")


# --- docs ------------------------------------------------------------------------------


def test_module_doctests_run() -> None:
    result = doctest.testmod(pricing, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_inline_rating_writes_years_before_1000_with_four_digits() -> None:
    # glibc's strftime("%Y") gives "1-01-01" for year 1, which no RFC 3339 parser accepts.
    from writer.events.inline_rating import _rfc3339

    text = _rfc3339(datetime(1, 1, 1, tzinfo=timezone.utc))
    assert text == "0001-01-01T00:00:00.000000Z"
    assert select_price(ROWS, "tokens", text) is None  # parsed: before every row
