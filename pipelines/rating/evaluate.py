"""Owns the Python reference semantics of the rating DSL: one event (single engine) or one group
of events (aggregate engine) in, usage intents out. `compile_sql` must agree with this module.

Values are plain JSON values; JSON null and a missing path are the same thing here (None).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeGuard

from core.constants import INT64_MAX, INT64_MIN
from pipelines.rating.parse import bind_params
from pipelines.rating.tree import (
    INTEGER_PATTERN,
    NUMBER_PATTERN,
    Agg,
    AllOf,
    AnyOf,
    Compare,
    Const,
    Div,
    EventLeaf,
    EventValue,
    Exists,
    In,
    IntExpr,
    LabelInt,
    LabelValue,
    LiteralValue,
    Mul,
    Not,
    ParamValue,
    PayloadInt,
    PayloadValue,
    PolicyDoc,
    Predicate,
    Rounding,
    Scalar,
    Value,
)

__all__ = ["EventFacts", "Intent", "evaluate", "evaluate_aggregate"]

_ORDER: dict[str, Callable[[float, float], bool]] = {
    "gt": operator.gt,
    "gte": operator.ge,
    "lt": operator.lt,
    "lte": operator.le,
}
_NUMBER = re.compile(NUMBER_PATTERN)
_INTEGER = re.compile(INTEGER_PATTERN)
# More digits than any HUGEINT holds: the value saturates without building a huge int.
_SATURATING_DIGITS = 39


@dataclass(frozen=True, slots=True)
class EventFacts:
    billing_account_id: str
    semantic_kind: str
    event_type: str
    occurred_at: str  # RFC 3339 UTC, e.g. 2026-11-01T12:00:00.000000Z
    subject_ref: str | None
    payload: Mapping[str, object]
    labels: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Intent:
    feature_code: str
    feature_quantity_minor: int | None
    meters: tuple[tuple[str, int], ...]  # (meter_code, quantity_minor), in document order
    labels: Mapping[str, str]


def evaluate(
    policy: PolicyDoc, event: EventFacts, params: Mapping[str, object] | None = None
) -> list[Intent] | None:
    """The intents one event yields under a single-engine policy, or None when it does not match."""
    if policy.engine != "single":
        raise ValueError("evaluate() rates single-engine policies; use evaluate_aggregate()")
    bound = bind_params(policy, params)
    if not _matches(policy, event, bound):
        return None
    return _intents(policy, lambda leaf: _read_event(leaf, event))


def evaluate_aggregate(
    policy: PolicyDoc, events: list[EventFacts], params: Mapping[str, object] | None = None
) -> list[Intent]:
    """The intents of one group (account, event type, UTC day); empty when no event matches."""
    if policy.engine != "aggregate":
        raise ValueError("evaluate_aggregate() rates aggregate-engine policies; use evaluate()")
    bound = bind_params(policy, params)
    matched = [event for event in events if _matches(policy, event, bound)]
    if not matched:
        return []
    return _intents(policy, lambda leaf: _read_group(leaf, matched, bound))


def _matches(policy: PolicyDoc, event: EventFacts, params: Mapping[str, Scalar]) -> bool:
    where = policy.match.where
    return event.event_type == policy.match.event_type and (
        where is None or _holds(where, event, params)
    )


def _intents(policy: PolicyDoc, read: Callable[[EventLeaf], int]) -> list[Intent]:
    return [
        Intent(
            feature_code=spec.feature_code,
            feature_quantity_minor=(
                None
                if spec.feature_quantity is None
                else max(0, _quantity(spec.feature_quantity, read))
            ),
            meters=tuple((m.meter_code, max(0, _quantity(m.quantity, read))) for m in spec.meters),
            labels=dict(spec.labels),
        )
        for spec in policy.intents
    ]


def _holds(node: Predicate, event: EventFacts, params: Mapping[str, Scalar]) -> bool:
    match node:
        case AllOf(items):
            return all(_holds(item, event, params) for item in items)
        case AnyOf(items):
            return any(_holds(item, event, params) for item in items)
        case Not(item):
            return not _holds(item, event, params)
        case Exists(value):
            return _value(value, event, params) is not None
        case In(value, options):
            found = _value(value, event, params)
            return any(_equal(found, option.value) for option in options)
        case Compare(op, left, right):
            return _compare(op, _value(left, event, params), _value(right, event, params))


def _compare(op: str, left: object, right: object) -> bool:
    if op in ("eq", "ne"):
        return _equal(left, right) == (op == "eq")
    if op in ("prefix", "contains"):
        if not (isinstance(left, str) and isinstance(right, str)):
            return False
        return left.startswith(right) if op == "prefix" else right in left
    a, b = _number(left), _number(right)
    return a is not None and b is not None and _ORDER[op](a, b)


def _value(node: Value, event: EventFacts, params: Mapping[str, Scalar]) -> object:
    match node:
        case LiteralValue(value):
            return value
        case PayloadValue(path):
            return _walk(event.payload, path)
        case LabelValue(key):
            return event.labels.get(key)
        case EventValue(field):
            return getattr(event, field)
        case ParamValue(name):
            return params[name]


def _walk(document: object, path: tuple[str | int, ...]) -> object:
    # Like JSONPath: an int part only indexes an array, a str part only names an object key.
    current = document
    for part in path:
        if isinstance(part, int):
            current = current[part] if isinstance(current, list) and part < len(current) else None
        else:
            current = current.get(part) if isinstance(current, Mapping) else None
    return current


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(number: float) -> float | None:
    return number if math.isfinite(number) else None


def _double(value: float) -> float | None:
    try:
        return _finite(float(value))
    except OverflowError:  # an int beyond the double range
        return None


def _equal(left: object, right: object) -> bool:
    if _is_number(left) and _is_number(right):
        a = _double(left)
        return a is not None and a == _double(right)
    same_type = type(left) is type(right)  # bool and str only: JSON gives no subclasses
    return same_type and isinstance(left, bool | str) and left == right


def _number(value: object) -> float | None:
    """Coercion for ordering predicates: numbers, booleans and numeric-like strings, as doubles."""
    if isinstance(value, bool):
        return float(value)
    if _is_number(value):
        return _double(value)
    if isinstance(value, str) and (found := _NUMBER.fullmatch(value)):
        return _finite(float(found[1]))
    return None


def _clamp(number: int) -> int:
    # int(): a JSON boolean reaches here as bool, and a quantity must be a plain int
    return max(INT64_MIN, min(INT64_MAX, int(number)))


def _integer(value: object) -> int | None:
    """Coercion for integer expressions: integers and integer strings stay exact; fractions and
    exponents pass through a double and truncate toward zero; all saturate to signed 64-bit."""
    if isinstance(value, int):  # bool included: True is 1
        return _clamp(value)
    if isinstance(value, str) and (found := _INTEGER.fullmatch(value)):
        digits = found[1].lstrip("+-").lstrip("0") or "0"
        negative = found[1].startswith("-")
        if len(digits) >= _SATURATING_DIGITS:
            return INT64_MIN if negative else INT64_MAX
        # The digits without leading zeros: int() refuses text of more than 4300 digits.
        return _clamp(-int(digits) if negative else int(digits))
    number = _number(value)
    return None if number is None else _clamp(int(number))


def _quantity(node: IntExpr, read: Callable[[EventLeaf], int]) -> int:
    match node:
        case Const(value):
            return value
        case Mul(left, right):
            return _clamp(_quantity(left, read) * _quantity(right, read))
        case Div(left, right, rounding):
            return _divide(_quantity(left, read), _quantity(right, read), rounding)
        case PayloadInt() | LabelInt() | Agg():
            return read(node)


def _divide(a: int, b: int, rounding: Rounding) -> int:
    if b == 0:
        return 0
    if rounding == "floor":
        return _clamp(a // b)
    if rounding == "ceil":
        return _clamp(-(-a // b))
    return _clamp((2 * a + b) // (2 * b))  # floor(a/b + 1/2): halves go toward +infinity


def _read_event(leaf: EventLeaf, event: EventFacts) -> int:
    if isinstance(leaf, PayloadInt):
        found = _integer(_walk(event.payload, leaf.path))
    elif isinstance(leaf, LabelInt):
        found = _integer(event.labels.get(leaf.key))
    else:
        raise TypeError("agg needs the aggregate engine")
    return leaf.default if found is None else found


def _read_group(leaf: EventLeaf, events: list[EventFacts], params: Mapping[str, Scalar]) -> int:
    if not isinstance(leaf, Agg):
        raise TypeError(f"{type(leaf).__name__} needs the single engine")
    if leaf.of is None:
        return len(events)
    values = [_value(leaf.of, event, params) for event in events]
    if leaf.op == "count":
        return sum(value is not None for value in values)
    if leaf.op == "count_distinct":
        return len({key for value in values if (key := _distinct_key(value)) is not None})
    numbers = [n for value in values if (n := _integer(value)) is not None]
    if not numbers:
        return leaf.default
    if leaf.op == "sum":
        return _clamp(sum(numbers))
    if leaf.op == "avg":
        total = sum(numbers)
        quotient = abs(total) // len(numbers)  # truncates toward zero, like SQL's //
        return quotient if total >= 0 else -quotient
    return min(numbers) if leaf.op == "min" else max(numbers)


def _distinct_key(value: object) -> tuple[str, object] | None:
    # Scalars only, under the same equality as eq: 1 and 1.0 are one value, "1" another; a
    # number beyond the double range equals nothing under eq, so it is skipped, as in SQL.
    if _is_number(value):
        number = _double(value)
        return None if number is None else ("n", number)
    if isinstance(value, bool | str):
        return type(value).__name__, value
    return None
