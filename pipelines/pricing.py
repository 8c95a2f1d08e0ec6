"""Exact, carry-aware pricing of metered quantities.

This module owns the pricing rule of the wire contract and nothing else: given a
price row ``{unit_price_xusd, unit_quantity_minor, rounding}`` it turns a
quantity (in minor units) into an amount in xusd (micro-USD), and it owns the
*carry* that makes many small commits cost exactly what one large commit of the
same total would cost. It also owns choosing which price row is in force at an
instant (:func:`select_price`). It does no I/O and keeps no state: the caller
stores ``remainder_after`` per (account, meter, price row) and passes it back in
as ``carried`` on the next line.

Money is exact integers only (no floats anywhere).

The rule
--------
For a row with price ``p`` per block of ``u`` minor units, the price of a
cumulative quantity ``x`` is ``A(x) = p * R(x / u)``: the contract rounds the
number of *blocks* (not the money), with ``R`` the row's rounding mode applied to
the exact rational ``x / u`` (``floor``, ``ceil``, or ``nearest`` = round half
up, so half a block counts as a block). A line of quantity ``q`` on top of carry
``c`` is charged ``A(c + q) - A(c)`` and leaves carry ``(c + q) mod u``.

Invariant
---------
The carry equals the cumulative quantity committed so far modulo ``u``; and
because ``A(x + u) == A(x) + p`` exactly for every mode (adding ``u`` adds
exactly one whole block before rounding), ``A(c + q) - A(c)`` equals
``A(C + q) - A(C)`` for the true cumulative ``C``. The per-line amounts
therefore telescope: for any split of ``Q`` into ``q1..qn`` applied in order
from carry 0, their sum is ``A(Q) - A(0) = A(Q) = quote(row, Q)``, and the
stored carry always lies in ``[0, u)``.

Example: 150 xusd per 1000 tokens, floor; 999 tokens then 1 token.

>>> row = PriceRow("tok@2024", "tokens", 150, 1000, "floor", "2024-01-01T00:00:00Z")
>>> a = price_line(row, 999, 0)
>>> (a.amount_xusd, a.remainder_after)
(0, 999)
>>> b = price_line(row, 1, a.remainder_after)
>>> (b.amount_xusd, b.remainder_after)
(150, 0)
>>> a.amount_xusd + b.amount_xusd == quote(row, 1000)
True

Bounds
------
Quantities and carries must fit in signed 64-bit (``0 <= q <= 2**63 - 1``), as
they do on the wire and in storage. The product ``blocks * p`` may
exceed 64 bits, with ``blocks`` up to about ``2**63`` (when
``u == 1``) and ``p`` up to ``2**63 - 1``. That is fine because Python ints are
unbounded, but a port to a fixed-width language must use 128-bit (or wider)
arithmetic there, and callers storing an amount in a 64-bit column must check
it fits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Final

from core.constants import INT64_MAX

__all__ = [
    "INT64_MAX",
    "ROUNDING_MODES",
    "PriceRow",
    "PricedLine",
    "price_line",
    "quote",
    "select_price",
]

ROUNDING_MODES: Final[frozenset[str]] = frozenset({"floor", "nearest", "ceil"})

# Strict RFC 3339 date-time (section 5.6): a full date, a time with seconds and
# an explicit offset. datetime.fromisoformat alone would also accept date-only
# and naive strings, which cannot be ordered against offset-bearing ones.
_RFC3339: Final[re.Pattern[str]] = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d+))?([Zz]|[+-]\d{2}:\d{2})"
)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    # bool is an int subclass and floats must never enter money arithmetic, so
    # both are rejected explicitly instead of being silently coerced.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi} (signed 64-bit), got {value}")
    return value


@dataclass(frozen=True, slots=True)
class PriceRow:
    """One row of a meter's price list, in force from ``effective_at``."""

    price_id: str  # stable id of the row (meter + effective_at); part of the carry key
    meter_code: str
    unit_price_xusd: int  # >= 0, price of one block
    unit_quantity_minor: int  # >= 1, block size in minor units
    rounding: str  # "floor" | "nearest" | "ceil"
    effective_at: str  # RFC 3339 with Z or an offset

    def __post_init__(self) -> None:
        # Validate at construction so a bad row fails where it is loaded, not
        # deep inside a commit.
        _check_int("unit_price_xusd", self.unit_price_xusd, 0, INT64_MAX)
        _check_int("unit_quantity_minor", self.unit_quantity_minor, 1, INT64_MAX)
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(
                f"rounding must be one of {sorted(ROUNDING_MODES)}, got {self.rounding!r}"
            )
        _instant_key(self.effective_at)


@dataclass(frozen=True, slots=True)
class PricedLine:
    """The result of pricing one line against a row and the carried remainder."""

    price_id: str
    quantity_minor: int
    unit_price_xusd: int
    unit_quantity_minor: int
    rounding: str
    carried: int  # carry state this line started from
    amount_xusd: int  # what this line is charged
    remainder_after: int  # carry to store for the next line of (account, meter, price row)


def _blocks(x: int, unit: int, rounding: str) -> int:
    """R(x / unit): whole blocks charged for cumulative quantity x, in exact integers."""
    if rounding == "floor":
        return x // unit
    if rounding == "ceil":
        return -((-x) // unit)
    # nearest, half up: floor(x/unit + 1/2) == floor((2*x + unit) / (2*unit)).
    return (2 * x + unit) // (2 * unit)


def _amount(x: int, price: int, unit: int, rounding: str) -> int:
    """A(x) = price * R(x / unit): the price of cumulative quantity x."""
    # The product may exceed 64 bits; Python ints are exact.
    return price * _blocks(x, unit, rounding)


def price_line(row: PriceRow, quantity_minor: int, carried: int) -> PricedLine:
    """Price ``quantity_minor`` on top of the carried remainder ``carried``.

    Charges ``A(carried + q) - A(carried)`` and returns the new carry
    ``(carried + q) % unit_quantity_minor``. ``carried`` must be a value this
    function previously returned as ``remainder_after`` for the same
    (account, meter, price row), or 0 to start; it must lie in
    ``[0, unit_quantity_minor)``.

    >>> row = PriceRow("t", "tokens", 150, 1000, "ceil", "2024-01-01T00:00:00Z")
    >>> first = price_line(row, 1, 0)
    >>> (first.amount_xusd, first.remainder_after)
    (150, 1)
    >>> rest = price_line(row, 999, first.remainder_after)
    >>> (rest.amount_xusd, rest.remainder_after)
    (0, 0)
    """
    unit = row.unit_quantity_minor
    _check_int("quantity_minor", quantity_minor, 0, INT64_MAX)
    _check_int("carried", carried, 0, INT64_MAX)
    if carried >= unit:
        # A larger carry would still price correctly (A shifts by p per u), but
        # it means the caller stored something this module never produces:
        # most likely a carry from another row, so refuse rather than guess.
        raise ValueError(
            f"carried must be in [0, unit_quantity_minor={unit}), got {carried}"
        )
    price, rounding = row.unit_price_xusd, row.rounding
    after = carried + quantity_minor
    amount = _amount(after, price, unit, rounding) - _amount(carried, price, unit, rounding)
    return PricedLine(
        price_id=row.price_id,
        quantity_minor=quantity_minor,
        unit_price_xusd=price,
        unit_quantity_minor=unit,
        rounding=rounding,
        carried=carried,
        amount_xusd=amount,
        remainder_after=after % unit,
    )


def quote(row: PriceRow, quantity_minor: int) -> int:
    """Price of ``quantity_minor`` with no carry, for estimates at authorize time.

    Uses the same rounding as commits: it is exactly
    ``price_line(row, quantity_minor, 0).amount_xusd``, i.e. ``A(q)``. Note a
    later commit may be charged less or more than its quote because the commit
    starts from the stored carry, not from 0.

    >>> quote(PriceRow("t", "tokens", 150, 1000, "nearest", "2024-01-01T00:00:00Z"), 1500)
    300
    """
    return price_line(row, quantity_minor, 0).amount_xusd


def _instant_key(ts: str) -> tuple[datetime, str]:
    """Exact sort key for an RFC 3339 instant.

    datetime keeps only microseconds, so the fractional seconds are kept apart
    as a digit string with trailing zeros stripped: lexicographic order on such
    strings is numeric order of the fraction, so no precision is lost.
    """
    if not isinstance(ts, str):
        raise ValueError(f"timestamp must be an RFC 3339 string, got {ts!r}")
    m = _RFC3339.fullmatch(ts)
    if m is None:
        raise ValueError(f"not an RFC 3339 date-time with offset (Z or +hh:mm): {ts!r}")
    date, time, frac, offset = m.groups()
    offset = "+00:00" if offset in ("Z", "z") else offset
    try:
        whole = datetime.fromisoformat(f"{date}T{time}{offset}")
    except ValueError as exc:  # e.g. month 13, or a leap second (:60) Python cannot hold
        raise ValueError(f"invalid RFC 3339 date-time {ts!r}: {exc}") from None
    return whole.astimezone(timezone.utc), (frac or "").rstrip("0")


def select_price(rows: Sequence[PriceRow], meter_code: str, at: str) -> PriceRow | None:
    """The row of ``meter_code`` with the greatest ``effective_at <= at``, else None.

    Instants are compared as points in time, so ``...T01:00:00+01:00`` equals
    ``...T00:00:00Z``. Two rows of the meter in force from the same instant are
    ambiguous and raise ValueError rather than letting list order decide a price.

    >>> rows = [PriceRow("a", "m", 1, 1, "floor", "2024-01-01T00:00:00Z"),
    ...         PriceRow("b", "m", 2, 1, "floor", "2024-02-01T00:00:00+02:00")]
    >>> select_price(rows, "m", "2024-01-31T22:30:00Z").price_id
    'b'
    >>> select_price(rows, "m", "2023-12-31T23:59:59Z") is None
    True
    """
    at_key = _instant_key(at)
    best: PriceRow | None = None
    best_key: tuple[datetime, str] | None = None
    tied = False
    for row in rows:
        if row.meter_code != meter_code:
            continue
        key = _instant_key(row.effective_at)
        if key > at_key:
            continue
        if best_key is None or key > best_key:
            best, best_key, tied = row, key, False
        elif key == best_key and row != best:
            # An exact duplicate row is harmless; two different rows are not.
            tied = True
    if tied and best is not None:
        raise ValueError(
            f"ambiguous price for meter {meter_code!r}: several rows effective at "
            f"{best.effective_at!r}"
        )
    return best
