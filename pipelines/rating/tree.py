"""Owns the typed tree of a rating policy and the vocabulary both back ends share: operators,
integer limits and the text patterns for numbers and codes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

Scalar: TypeAlias = str | int | float | bool
Engine: TypeAlias = Literal["single", "aggregate"]
CompareOp: TypeAlias = Literal["eq", "ne", "gt", "gte", "lt", "lte", "prefix", "contains"]
Rounding: TypeAlias = Literal["floor", "nearest", "ceil"]
AggOp: TypeAlias = Literal["count", "sum", "avg", "min", "max", "count_distinct"]
EventField: TypeAlias = Literal[
    "subject_ref", "occurred_at", "event_type", "semantic_kind", "billing_account_id"
]

ENGINES: tuple[Engine, ...] = ("single", "aggregate")
COMPARE_OPS: tuple[CompareOp, ...] = ("eq", "ne", "gt", "gte", "lt", "lte", "prefix", "contains")
ROUNDINGS: tuple[Rounding, ...] = ("floor", "nearest", "ceil")
AGG_OPS: tuple[AggOp, ...] = ("count", "sum", "avg", "min", "max", "count_distinct")
EVENT_FIELDS: tuple[EventField, ...] = (
    "subject_ref",
    "occurred_at",
    "event_type",
    "semantic_kind",
    "billing_account_id",
)


# Both back ends read numeric text with these exact patterns (Python `re` and DuckDB's RE2 agree
# on this subset); group 1 is the number without the surrounding ASCII whitespace.
NUMBER_PATTERN = r"^[ \t\n\r]*([+-]?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)[ \t\n\r]*$"
INTEGER_PATTERN = r"^[ \t\n\r]*([+-]?[0-9]+)[ \t\n\r]*$"
CODE_PATTERN = r"[a-z0-9][a-z0-9._/@:-]{0,126}[a-z0-9]|[a-z0-9]"


@dataclass(frozen=True, slots=True)
class LiteralValue:
    value: Scalar


@dataclass(frozen=True, slots=True)
class PayloadValue:
    path: tuple[str | int, ...]  # int parts index arrays


@dataclass(frozen=True, slots=True)
class LabelValue:
    key: str


@dataclass(frozen=True, slots=True)
class EventValue:
    field: EventField


@dataclass(frozen=True, slots=True)
class ParamValue:
    name: str


Value: TypeAlias = LiteralValue | PayloadValue | LabelValue | EventValue | ParamValue


@dataclass(frozen=True, slots=True)
class AllOf:
    items: tuple[Predicate, ...]


@dataclass(frozen=True, slots=True)
class AnyOf:
    items: tuple[Predicate, ...]


@dataclass(frozen=True, slots=True)
class Not:
    item: Predicate


@dataclass(frozen=True, slots=True)
class Compare:
    op: CompareOp
    left: Value
    right: Value


@dataclass(frozen=True, slots=True)
class In:
    value: Value
    options: tuple[LiteralValue, ...]


@dataclass(frozen=True, slots=True)
class Exists:
    value: Value


Predicate: TypeAlias = AllOf | AnyOf | Not | Compare | In | Exists


@dataclass(frozen=True, slots=True)
class PayloadInt:
    path: tuple[str | int, ...]
    default: int


@dataclass(frozen=True, slots=True)
class LabelInt:
    key: str
    default: int


@dataclass(frozen=True, slots=True)
class Const:
    value: int


@dataclass(frozen=True, slots=True)
class Mul:
    left: IntExpr
    right: IntExpr


@dataclass(frozen=True, slots=True)
class Div:
    left: IntExpr
    right: IntExpr
    rounding: Rounding


@dataclass(frozen=True, slots=True)
class Agg:
    op: AggOp
    of: Value | None  # None only for count: every matched event counts
    default: int


IntExpr: TypeAlias = PayloadInt | LabelInt | Const | Mul | Div | Agg
# The leaves that read events: the single engine reads one event, the aggregate engine a group.
EventLeaf: TypeAlias = PayloadInt | LabelInt | Agg


@dataclass(frozen=True, slots=True)
class Meter:
    meter_code: str
    quantity: IntExpr


@dataclass(frozen=True, slots=True)
class IntentSpec:
    feature_code: str
    feature_quantity: IntExpr | None
    meters: tuple[Meter, ...]
    labels: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Match:
    event_type: str
    where: Predicate | None


@dataclass(frozen=True, slots=True)
class PolicyDoc:
    engine: Engine
    params: tuple[tuple[str, Scalar], ...]  # document defaults, in document order
    match: Match
    intents: tuple[IntentSpec, ...]
