"""The remainder carry of a rating run's lines, vectorized with numpy.

A run charges each priced line `A(cum_after) - A(cum_before)`, where `cum` is the running
quantity of its (account, price row) in `occurred_at` order (tie-break event_id, then line
key), starting from 0 in the run, and `A(x) = unit_price * R(x / unit)` with the row's block
rounding: exactly what `pipelines.pricing.price_line` charges line by line, and what
`batch.rating_plan.amounts_sql` computes with a DuckDB window.

The window sorts every line with all its columns, and cost the sweep as much as reading
and rating the events. Here only what orders a line is sorted: one 64-bit key per line
(the carry group's number above the microseconds since the earliest line), lines whose keys
tie are then put in (event_id, line) order among themselves, and the running sums are one
`cumsum`. Lines whose price row has a block of one unit need no running sum (A is linear).

Integers only, in int64: `carry_shares` first checks that no running sum, rounding term or
amount can leave int64 (a cheap bound over the whole run) and raises `CarryOutOfRange` when
one might; the caller then prices that run with the SQL window, in HUGEINT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["CarryOutOfRange", "PriceTerms", "account_numbers", "carry_amounts", "carry_shares", "contiguous",
           "micros", "uuid_words"]

# Bounds for the int64 fast path, with a margin below 2^63 for the rounding terms.
_SUM_LIMIT = 2 ** 60
_AMOUNT_LIMIT = 2 ** 62
# From this many lines the carry runs on two threads.
_SPLIT_LINES = 200_000


class CarryOutOfRange(Exception):
    """A run whose sums or amounts might not fit int64: price it in HUGEINT instead."""


@dataclass(frozen=True)
class PriceTerms:
    """The terms of every price row, indexed by the plan's price key: R(x / u) = (a*x + b) // d."""

    unit_price: np.ndarray  # int64
    unit_quantity: np.ndarray  # int64
    a: np.ndarray  # int64
    b: np.ndarray  # int64
    d: np.ndarray  # int64; 0 when a*u does not fit (never the fast path)

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, int, int, int | None]]) -> PriceTerms:
        """`rows[k]` = (unit_price, unit_quantity, a, b, d) of price key k."""
        columns = list(zip(*rows, strict=True)) if rows else [(), (), (), (), ()]
        as_array = [np.array([v or 0 for v in column], dtype=np.int64) for column in columns]
        return cls(*as_array)


def _int64(column: pa.ChunkedArray | pa.Array, fill: int) -> np.ndarray:
    filled = pc.fill_null(column, fill)
    if isinstance(filled, pa.ChunkedArray):
        filled = filled.combine_chunks()
    result: np.ndarray = filled.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return result


def uuid_words(column: pa.ChunkedArray | pa.Array, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The big-endian (high, low) 64-bit words of the UUIDs at `rows`: their order is the
    order DuckDB gives UUIDs (that of their canonical text)."""
    taken = column.take(pa.array(rows))
    if isinstance(taken, pa.ChunkedArray):
        taken = taken.combine_chunks()
    if isinstance(taken, pa.ExtensionArray):
        taken = taken.storage
    if pa.types.is_fixed_size_binary(taken.type):
        raw = np.frombuffer(taken.buffers()[1], dtype=np.uint8,
                            count=16 * (taken.offset + len(taken)))[16 * taken.offset:]
        words = raw.view(">u8").reshape(-1, 2).astype(np.uint64)
        return words[:, 0], words[:, 1]
    # Text UUIDs: their canonical form orders the same way.
    ints = [int(str(text).replace("-", ""), 16) for text in taken.to_pylist()]
    return (np.array([i >> 64 for i in ints], dtype=np.uint64),
            np.array([i & (2 ** 64 - 1) for i in ints], dtype=np.uint64))


def contiguous(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """`column` as one array (its chunks combined)."""
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


# (positions of lines) -> (high, low) words of their event ids and their line keys
TieBreak = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def carry_shares(accounts: np.ndarray, occurred: np.ndarray, quantity: pa.Array,
                 price_key: np.ndarray, terms: PriceTerms, tie_break: TieBreak) -> pa.Array:
    """amount_xusd of each line, given per line: its account's number (any numbering of
    the accounts), occurred_at in microseconds, quantity (NULL for none), price key (-1
    for none), and `tie_break` for lines of one group at one instant. NULL without a
    quantity, 0 without a price row, else its share of its (account, price row)'s running
    total."""
    n = len(quantity)
    has_quantity = np.asarray(quantity.is_valid()) if n else np.zeros(0, dtype=bool)
    amount = np.zeros(n, dtype=np.int64)
    rows = len(terms.unit_price)
    if not n or not rows:
        return pa.array(amount, type=pa.int64(), mask=~has_quantity)
    q = _int64(quantity, 0)
    # Bounds, exact in Python integers over the price rows: a running sum is at most
    # max(q) * n, an amount at most price * (q // u + 2).
    top = int(q.max())
    if top * n >= _SUM_LIMIT:
        raise CarryOutOfRange("running quantities beyond int64")
    for p, u, d in zip(terms.unit_price.tolist(), terms.unit_quantity.tolist(), terms.d.tolist(),
                       strict=True):
        if p * (top // max(u, 1) + 2) >= _AMOUNT_LIMIT or not d:
            raise CarryOutOfRange("amounts or a block beyond int64")
    priced = (price_key >= 0) & has_quantity
    if not priced.any():
        return pa.array(amount, type=pa.int64(), mask=~has_quantity)
    # A price row of one-unit blocks (R(x) = x) charges p * q whatever came before: its
    # lines need no order and no running sum.
    linear_row = (terms.a == 1) & (terms.b == 0) & (terms.d == 1)
    if linear_row.any():
        linear = priced & linear_row[np.maximum(price_key, 0)]
        if linear.any():
            at = np.flatnonzero(linear)
            amount[at] = terms.unit_price[price_key[at]] * q[at]
            priced &= ~linear
            if not priced.any():
                return pa.array(amount, type=pa.int64(), mask=~has_quantity)
    # Carry groups are (account, price row): the accounts split into independent parts,
    # carried on threads of their own (numpy leaves the GIL in its loops): the other core
    # idles otherwise while the carry runs.
    parts = 2 if n >= _SPLIT_LINES else 1
    chosen = [np.flatnonzero(priced & ((accounts % parts) == part)) for part in range(parts)]
    work = [rows_ for rows_ in chosen if len(rows_)]

    def carry_part(rows_: np.ndarray) -> None:
        _carry_part(rows_, accounts, occurred, q, price_key, terms, tie_break, amount)

    if len(work) > 1:
        with ThreadPoolExecutor(len(work)) as pool:
            list(pool.map(carry_part, work))
    else:
        for rows_ in work:
            carry_part(rows_)
    return pa.array(amount, type=pa.int64(), mask=~has_quantity)


def _carry_part(rows: np.ndarray, accounts: np.ndarray, occurred: np.ndarray, q: np.ndarray,
                price_key: np.ndarray, terms: PriceTerms, tie_break: TieBreak,
                amount: np.ndarray) -> None:
    """Set `amount` at `rows` (priced lines, every line of their accounts' groups)."""
    price_rows = len(terms.unit_price)
    # Groups price row major, (price key, account), so each price row's lines are one slice
    # of the order, where its terms are scalars.
    width = int(accounts.max()) + 1
    group = price_key[rows] * width + accounts[rows]
    order, ordered_group = _carry_order(group, occurred[rows], rows, tie_break)
    q_sorted = q[rows][order]
    running = np.cumsum(q_sorted)
    starts = np.flatnonzero(np.r_[True, ordered_group[1:] != ordered_group[:-1]])
    before_group = running[starts] - q_sorted[starts]
    after = running - np.repeat(before_group, np.diff(np.r_[starts, len(order)]))
    before = after - q_sorted
    share = np.empty(len(order), dtype=np.int64)
    bounds = np.searchsorted(ordered_group, np.arange(price_rows + 1, dtype=np.int64) * width)
    for k in range(price_rows):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        if lo == hi:
            continue
        a, b, d, p = (int(terms.a[k]), int(terms.b[k]), int(terms.d[k]), int(terms.unit_price[k]))
        share[lo:hi] = p * ((a * after[lo:hi] + b) // d - (a * before[lo:hi] + b) // d)
    amount[rows[order]] = share


def _carry_order(group: np.ndarray, occurred: np.ndarray, rows: np.ndarray,
                 tie_break: TieBreak) -> tuple[np.ndarray, np.ndarray]:
    """(positions into `rows` in (group, occurred, event_id, line_key) order, their groups)."""
    lowest = int(occurred.min())
    shift = max((int(occurred.max()) - lowest).bit_length(), 1)
    if int(group.max()).bit_length() + shift <= 63:
        # One 64-bit key per line: the group above the microseconds since the earliest.
        key = (group << shift) | (occurred - lowest)
        order = np.argsort(key)
        ordered_key = key[order]
        # Lines of one group at the same instant: (event_id, line key) decides among them.
        same = ordered_key[1:] == ordered_key[:-1]
        if same.any():
            tied = np.zeros(len(order), dtype=bool)
            tied[:-1] = same
            tied[1:] |= same
            spots = np.flatnonzero(tied)
            order[spots] = _ties_ordered(order[spots], ordered_key[spots], rows, tie_break)
        return order, ordered_key >> shift
    high, low, line_key = tie_break(rows)
    order = np.lexsort((line_key, low, high, occurred, group))
    return order, group[order]


def _ties_ordered(tied: np.ndarray, keys: np.ndarray, rows: np.ndarray,
                  tie_break: TieBreak) -> np.ndarray:
    """`tied` (positions into `rows`, with their ascending sort `keys`) in (key, event_id,
    line key) order.

    Events at one instant are the common case, not the rare one (clients that send seconds
    put thousands of events of an account at each one), so this is one `argsort` of a packed
    64-bit key rather than a lexsort of four columns (a seventh of the time at millions of
    lines): the key's rank among the tied keys, then the event id's leading bits, then the
    line key. Lines whose rank and leading bits agree but whose event ids differ are put in
    order by a lexsort of just them."""
    high, low, line_key = tie_break(rows[tied])
    high, line_key = high.astype(np.uint64, copy=False), line_key.astype(np.int64, copy=False)
    rank = np.zeros(len(keys), dtype=np.int64)
    np.cumsum(keys[1:] != keys[:-1], out=rank[1:])
    line_bits = max(int(line_key.max()).bit_length(), 1)
    lead_bits = 63 - int(rank[-1]).bit_length() - line_bits
    if lead_bits < 16 or int(line_key.min()) < 0:
        return tied[np.lexsort((line_key, low, high, keys))]
    lead = (high >> np.uint64(64 - lead_bits)).astype(np.int64)
    prefix = (rank << lead_bits) | lead
    order = np.argsort((prefix << line_bits) | line_key)
    prefix, high, low = prefix[order], high[order], low[order]
    # A run of one prefix holds the lines of one event, unless two ids share their lead.
    same = prefix[1:] == prefix[:-1]
    clash = same & ((high[1:] != high[:-1]) | (low[1:] != low[:-1]))
    if clash.any():
        run = np.zeros(len(order), dtype=np.int64)
        np.cumsum(~same, out=run[1:])
        crowded = np.zeros(int(run[-1]) + 1, dtype=bool)
        crowded[run[1:][clash]] = True
        spots = np.flatnonzero(crowded[run])
        order[spots] = order[spots][np.lexsort((line_key[order[spots]], low[spots],
                                                high[spots], run[spots]))]
    return tied[order]


def account_numbers(accounts: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A number per distinct account (first come, first numbered)."""
    return np.asarray(pc.dictionary_encode(contiguous(accounts)).indices).astype(np.int64)


def micros(instants: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """TIMESTAMP values as int64 microseconds."""
    array = contiguous(instants)
    if array.type.unit != "us":
        array = array.cast(pa.timestamp("us", array.type.tz))
    return _int64(array.cast(pa.int64()), 0)


def carry_amounts(lines: pa.Table, terms: PriceTerms) -> pa.Array:
    """`carry_shares` of a table of lines (columns event_id, billing_account_id, occurred_at,
    line_key, quantity_minor, price_key)."""
    def tie_break(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        high, low = uuid_words(lines.column("event_id"), rows)
        return high, low, _int64(lines.column("line_key"), 0)[rows]

    if not lines.num_rows:
        return pa.array([], type=pa.int64())
    return carry_shares(account_numbers(lines.column("billing_account_id")),
                        micros(lines.column("occurred_at")),
                        contiguous(lines.column("quantity_minor")),
                        _int64(lines.column("price_key"), -1), terms, tie_break)
