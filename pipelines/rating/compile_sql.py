"""Owns compiling a policy tree to DuckDB SQL; the results must agree with `evaluate` exactly.

The input relation has the columns billing_account_id, semantic_kind, event_type, occurred_at,
subject_ref (VARCHAR), payload and labels (VARCHAR holding JSON text). Every compiled value is a
pair of SQL expressions: its kind (DuckDB's json_type name, NULL when missing or JSON null) and
its text; predicates never yield NULL, so NOT and the connectives stay two-valued.
Quantities are BIGINT built in HUGEINT and saturated to signed 64-bit at every step, so no
arithmetic can overflow or raise. `source` arguments are trusted SQL (a relation name or a
parenthesised query); everything taken from a document is quoted.

How an event's values are read is the `Reader`'s business: `compile_match` and
`compile_intents` take one, and call it for every payload or label path and event field a
policy reads and for every integer or number coercion of a value read from the payload or
the labels. The default, `INLINE`, reads the JSON where it is used (`json_type` /
`json_extract_string` of the column at each reference) and coerces as compiled here; a
caller that reads the paths once per row elsewhere (the batch engine does) passes a reader
that names those columns and gives the coercions a shortcut, and gets SQL that reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias

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
    EventField,
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

__all__ = [
    "INLINE",
    "CompiledIntent",
    "InlineReader",
    "JsonColumn",
    "JsonPath",
    "Reader",
    "SqlValue",
    "compile_aggregate_sql",
    "compile_intents",
    "compile_match",
    "json_path_sql",
    "rate_sql",
]

JsonColumn: TypeAlias = Literal["payload", "labels"]
JsonPath: TypeAlias = tuple[str | int, ...]  # int parts index arrays

_NUMERIC = "'BIGINT', 'UBIGINT', 'DOUBLE'"
_ORDER_OPS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
_RATED_COLUMNS = "intent_index, feature_code, meter_code, quantity_minor, feature_quantity_minor"


@dataclass(frozen=True, slots=True)
class CompiledIntent:
    feature_code: str
    feature_quantity_sql: str | None  # BIGINT >= 0
    meters: tuple[tuple[str, str], ...]  # (meter_code, BIGINT >= 0 expression)
    labels: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class SqlValue:
    """A value read from an event, as two SQL expressions: its kind (DuckDB's json_type name,
    NULL when missing or JSON null) and its text (NULL when missing)."""

    kind: str
    text: str


class Reader(Protocol):
    """How compiled SQL reads an event's values. Whatever it returns must agree on every row
    with what `InlineReader` returns: the compiled SQL's results may not depend on it."""

    def json(self, column: JsonColumn, path: JsonPath) -> SqlValue:
        """The value at `path` of `column` (payload or labels, VARCHAR holding JSON text)."""
        ...

    def field(self, name: EventField) -> SqlValue:
        """The value of an event column read as `{event: name}`."""
        ...

    def integer(self, column: JsonColumn, path: JsonPath, coerced: str) -> str:
        """The integer coercion (BIGINT or NULL) of the value `json(column, path)` read;
        `coerced` is the general one, over that value's kind and text."""
        ...

    def number(self, column: JsonColumn, path: JsonPath, coerced: str) -> str:
        """The ordering coercion (DOUBLE or NULL) of that value; `coerced` is the general one."""
        ...


class InlineReader:
    """Reads a path where it is used: every reference parses the column's JSON again."""

    def json(self, column: JsonColumn, path: JsonPath) -> SqlValue:
        json_path = json_path_sql(path)
        return SqlValue(
            f"NULLIF(json_type({column}, {json_path}), 'NULL')",
            f"json_extract_string({column}, {json_path})",
        )

    def field(self, name: EventField) -> SqlValue:
        return SqlValue(f"CASE WHEN {name} IS NOT NULL THEN 'VARCHAR' END", name)

    def integer(self, column: JsonColumn, path: JsonPath, coerced: str) -> str:
        return coerced

    def number(self, column: JsonColumn, path: JsonPath, coerced: str) -> str:
        return coerced


INLINE = InlineReader()


@dataclass(frozen=True, slots=True)
class _Read:
    """Where a value was read from, so that its coercions go through the reader that read it."""

    reader: Reader
    column: JsonColumn
    path: JsonPath


@dataclass(frozen=True, slots=True)
class _SqlValue:
    kind: str
    text: str
    read: _Read | None = None  # None for literals, params and event fields


def _sql_str(text: str) -> str:
    quoted = "'" + text.replace("'", "''") + "'"
    if "\x00" not in text:
        return quoted
    # DuckDB's parser ends a literal at NUL, so NUL travels as chr(0).
    return "(" + quoted.replace("\x00", "' || chr(0) || '") + ")"


def json_path_sql(path: JsonPath) -> str:
    """The SQL string literal of the JSONPath of `path` ('$."a"[0]')."""
    parts = (
        f"[{part}]"
        if isinstance(part, int)
        else '."' + part.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for part in path
    )
    return _sql_str("$" + "".join(parts))


def _literal(value: Scalar) -> _SqlValue:
    if isinstance(value, bool):
        return _SqlValue("'BOOLEAN'", "'true'" if value else "'false'")
    if isinstance(value, str):
        return _SqlValue("'VARCHAR'", _sql_str(value))
    return _SqlValue("'DOUBLE'", f"'{value!r}'")  # repr round-trips a double exactly


def _json_value(column: JsonColumn, path: JsonPath, reader: Reader) -> _SqlValue:
    read = reader.json(column, path)
    return _SqlValue(read.kind, read.text, _Read(reader, column, path))


def _value(node: Value, params: Mapping[str, Scalar], reader: Reader) -> _SqlValue:
    match node:
        case LiteralValue(value):
            return _literal(value)
        case ParamValue(name):
            return _literal(params[name])
        case PayloadValue(path):
            return _json_value("payload", path, reader)
        case LabelValue(key):
            return _json_value("labels", (key,), reader)
        case EventValue(field):
            read = reader.field(field)
            return _SqlValue(read.kind, read.text)


def _parsed(value: _SqlValue) -> str:
    return f"TRY_CAST(regexp_extract({value.text}, {_sql_str(NUMBER_PATTERN)}, 1) AS DOUBLE)"


def _number(value: _SqlValue) -> str:
    """DOUBLE or NULL: the ordering coercion of `evaluate._number`."""
    parsed = _parsed(value)
    coerced = (
        f"CASE WHEN {value.kind} = 'BOOLEAN' THEN CAST({value.text} = 'true' AS DOUBLE)"
        f" WHEN {value.kind} IN ({_NUMERIC}, 'VARCHAR') AND isfinite({parsed}) THEN {parsed} END"
    )
    read = value.read
    return coerced if read is None else read.reader.number(read.column, read.path, coerced)


def _clamp(hugeint: str) -> str:
    # DuckDB's greatest/least skip NULLs, so callers only ever pass a non-NULL value.
    return f"CAST(least(greatest({hugeint}, {INT64_MIN}), {INT64_MAX}) AS BIGINT)"


def _integer(value: _SqlValue) -> str:
    """BIGINT or NULL: the integer coercion of `evaluate._integer`."""
    digits = f"regexp_extract({value.text}, {_sql_str(INTEGER_PATTERN)}, 1)"
    # Too many digits for HUGEINT is the only way the cast fails, so it saturates by sign.
    exact = _clamp(
        f"COALESCE(TRY_CAST({digits} AS HUGEINT),"
        f" CASE WHEN starts_with({digits}, '-') THEN {INT64_MIN} ELSE {INT64_MAX} END)"
    )
    parsed = _parsed(value)
    # Doubles are cut to +-1e19 first: exactly representable, and beyond signed 64-bit anyway.
    truncated = _clamp(f"CAST(least(greatest(trunc({parsed}), -1e19), 1e19) AS HUGEINT)")
    coerced = (
        f"CASE WHEN {value.kind} = 'BOOLEAN' THEN CAST({value.text} = 'true' AS BIGINT)"
        f" WHEN {value.kind} IN ({_NUMERIC}, 'VARCHAR') THEN"
        f" CASE WHEN regexp_full_match({value.text}, {_sql_str(INTEGER_PATTERN)}) THEN {exact}"
        f" WHEN isfinite({parsed}) THEN {truncated} END END"
    )
    read = value.read
    return coerced if read is None else read.reader.integer(read.column, read.path, coerced)


def _equal(left: _SqlValue, right: _SqlValue) -> str:
    return (
        f"COALESCE(CASE WHEN {left.kind} IN ({_NUMERIC}) AND {right.kind} IN ({_NUMERIC})"
        f" THEN {_number(left)} = {_number(right)}"
        f" WHEN {left.kind} IN ('VARCHAR', 'BOOLEAN') AND {left.kind} = {right.kind}"
        f" THEN {left.text} = {right.text} END, FALSE)"
    )


def _predicate(node: Predicate, params: Mapping[str, Scalar], reader: Reader) -> str:
    match node:
        case AllOf(items):
            return (
                "(" + " AND ".join(_predicate(i, params, reader) for i in items) + ")" if items else "TRUE"
            )
        case AnyOf(items):
            return (
                "(" + " OR ".join(_predicate(i, params, reader) for i in items) + ")" if items else "FALSE"
            )
        case Not(item):
            return f"(NOT {_predicate(item, params, reader)})"
        case Exists(value):
            return f"({_value(value, params, reader).kind} IS NOT NULL)"
        case In(value, options):
            found = _value(value, params, reader)
            # String options are one IN list (exact text equality, as eq's); a list of thousands
            # compiled one equality each took a minute to plan. Other options keep eq's form.
            texts = list(dict.fromkeys(_sql_str(o.value) for o in options if isinstance(o.value, str)))
            tests = [_equal(found, _literal(o.value)) for o in options if not isinstance(o.value, str)]
            if texts:
                tests.append(f"COALESCE({found.kind} = 'VARCHAR' AND {found.text} IN ({', '.join(texts)}), FALSE)")
            return "(" + " OR ".join(tests) + ")" if tests else "FALSE"
        case Compare(op, left_node, right_node):
            left, right = _value(left_node, params, reader), _value(right_node, params, reader)
            if op in ("eq", "ne"):
                return _equal(left, right) if op == "eq" else f"(NOT {_equal(left, right)})"
            if op in ("prefix", "contains"):
                test = "starts_with" if op == "prefix" else "contains"
                return (
                    f"COALESCE({left.kind} = 'VARCHAR' AND {right.kind} = 'VARCHAR'"
                    f" AND {test}({left.text}, {right.text}), FALSE)"
                )
            return f"COALESCE({_number(left)} {_ORDER_OPS[op]} {_number(right)}, FALSE)"


def _floor_div(numerator: str, denominator: str) -> str:
    # DuckDB's // and % truncate; subtracting the floored remainder makes the division exact.
    n, d = f"({numerator})", f"({denominator})"
    return f"(({n} - ((({n} % {d}) + {d}) % {d})) // {d})"


def _divide(left: str, right: str, rounding: Rounding) -> str:
    a, b = "div_args.a", "div_args.b"
    body = {
        "floor": _floor_div(a, b),
        "ceil": f"-{_floor_div(f'-{a}', b)}",
        "nearest": _floor_div(f"2 * {a} + {b}", f"2 * {b}"),  # floor(a/b + 1/2)
    }[rounding]
    # The lambda binds each operand once, so nested divisions do not repeat their operands' SQL.
    return _clamp(
        f"list_transform([{{'a': CAST({left} AS HUGEINT), 'b': CAST({right} AS HUGEINT)}}],"
        f" lambda div_args: CASE WHEN {b} = 0 THEN 0 ELSE {body} END)[1]"
    )


def _divide_by_constant(left: str, divisor: int, rounding: Rounding) -> str:
    """`_divide` by a constant of at least 1, in BIGINT: nothing here can overflow (the
    quotient's magnitude is at most the numerator's, and a step of 1 is added only when the
    divisor is at least 2), so HUGEINT is not needed. HUGEINT division cost a sweep of the
    benchmark's policies ~0.1-0.2 CPU seconds per 5 M events over this."""
    x, c = "div_args", f"CAST({divisor} AS BIGINT)"
    floor = f"(({x} // {c}) - CAST(({x} % {c}) < 0 AS BIGINT))"
    if rounding == "floor":
        body = floor
    elif rounding == "ceil":
        body = f"(({x} // {c}) + CAST(({x} % {c}) > 0 AS BIGINT))"
    else:  # floor(x/c + 1/2): one more when the floored remainder r has 2r >= c
        r = f"(CASE WHEN ({x} % {c}) < 0 THEN ({x} % {c}) + {c} ELSE {x} % {c} END)"
        body = f"({floor} + CAST({r} >= {c} - {r} AS BIGINT))"
    return _clamp(f"list_transform([CAST({left} AS BIGINT)], lambda {x}: {body})[1]")


def _quantity(node: IntExpr, leaf: Callable[[EventLeaf], str]) -> str:
    match node:
        case Const(value):
            return f"CAST({value} AS BIGINT)"
        case Mul(left, right):
            a, b = _quantity(left, leaf), _quantity(right, leaf)
            return _clamp(f"CAST({a} AS HUGEINT) * CAST({b} AS HUGEINT)")
        case Div(left, Const(divisor), rounding) if 1 <= divisor <= INT64_MAX:
            return _divide_by_constant(_quantity(left, leaf), divisor, rounding)
        case Div(left, right, rounding):
            return _divide(_quantity(left, leaf), _quantity(right, leaf), rounding)
        case PayloadInt() | LabelInt() | Agg():
            return leaf(node)


def _leaf(node: EventLeaf, params: Mapping[str, Scalar], reader: Reader) -> str:
    match node:
        case PayloadInt(path, default):
            return f"COALESCE({_integer(_json_value('payload', path, reader))}, CAST({default} AS BIGINT))"
        case LabelInt(key, default):
            return f"COALESCE({_integer(_json_value('labels', (key,), reader))}, CAST({default} AS BIGINT))"
        case Agg():
            return _aggregate(node, params, reader)


def _aggregate(node: Agg, params: Mapping[str, Scalar], reader: Reader) -> str:
    if node.of is None:
        return "COUNT(*)"
    value = _value(node.of, params, reader)
    if node.op == "count":
        return f"COUNT({value.kind})"
    if node.op == "count_distinct":
        # + 0.0 folds -0.0 into 0.0, which Python's set already treats as one value.
        number = f"'n' || CAST(({_number(value)}) + 0.0 AS VARCHAR)"
        return (
            f"COUNT(DISTINCT CASE WHEN {value.kind} IN ({_NUMERIC}) THEN {number}"
            f" WHEN {value.kind} IN ('VARCHAR', 'BOOLEAN') THEN {value.kind} || {value.text} END)"
        )
    number = _integer(value)
    total = {
        "sum": f"SUM({number})",
        "avg": f"CAST(SUM({number}) AS HUGEINT) // COUNT({number})",  # // truncates
        "min": f"MIN({number})",
        "max": f"MAX({number})",
    }[node.op]
    return _clamp(f"COALESCE({total}, {node.default})")


def compile_match(
    policy: PolicyDoc, params: Mapping[str, object] | None = None, reader: Reader = INLINE
) -> str:
    """A never-NULL boolean SQL expression: the event type and the `where` predicate, reading
    the event's values through `reader`."""
    bound = bind_params(policy, params)
    event_type = f"event_type = {_sql_str(policy.match.event_type)}"
    where = policy.match.where
    return event_type if where is None else f"({event_type} AND {_predicate(where, bound, reader)})"


def compile_intents(
    policy: PolicyDoc, params: Mapping[str, object] | None = None, reader: Reader = INLINE
) -> list[CompiledIntent]:
    """Quantity expressions per intent: row-level for the single engine, aggregate functions
    (to be used under GROUP BY) for the aggregate engine; the event's values are read through
    `reader`."""
    bound = bind_params(policy, params)

    def compile_quantity(node: IntExpr) -> str:
        return f"greatest({_quantity(node, lambda leaf: _leaf(leaf, bound, reader))}, 0)"

    return [
        CompiledIntent(
            feature_code=spec.feature_code,
            feature_quantity_sql=(
                None if spec.feature_quantity is None else compile_quantity(spec.feature_quantity)
            ),
            meters=tuple((m.meter_code, compile_quantity(m.quantity)) for m in spec.meters),
            labels=dict(spec.labels),
        )
        for spec in policy.intents
    ]


def _rated_rows(intents: list[CompiledIntent], quantity: Callable[[str], str]) -> str:
    rows: list[str] = []
    for index, intent in enumerate(intents):
        feature = intent.feature_quantity_sql
        feature_sql = "CAST(NULL AS BIGINT)" if feature is None else quantity(feature)
        rows.extend(
            f"(CAST({index} AS INTEGER), {_sql_str(intent.feature_code)}, {_sql_str(meter_code)},"
            f" {quantity(meter_sql)}, {feature_sql})"
            for meter_code, meter_sql in intent.meters
        )
    return f"CROSS JOIN LATERAL (VALUES {', '.join(rows)}) AS rated({_RATED_COLUMNS})"


def rate_sql(policy: PolicyDoc, source: str, params: Mapping[str, object] | None = None) -> str:
    """One row per (matched event, intent, meter): every source column (row_index included when
    the source has one), then intent_index, feature_code, meter_code, quantity_minor and
    feature_quantity_minor (NULL when the intent has none)."""
    if policy.engine != "single":
        raise ValueError("rate_sql() rates single-engine policies; use compile_aggregate_sql()")
    rated = _rated_rows(compile_intents(policy, params), lambda sql: sql)
    return (
        f"SELECT src.*, rated.* FROM {source} AS src {rated} WHERE {compile_match(policy, params)}"
    )


def compile_aggregate_sql(
    policy: PolicyDoc, source: str, params: Mapping[str, object] | None = None
) -> str:
    """One row per (billing_account_id, event_type, usage_day, intent, meter) over the events
    that match; usage_day is the DATE of occurred_at's leading YYYY-MM-DD (the UTC day)."""
    if policy.engine != "aggregate":
        raise ValueError("compile_aggregate_sql() rates aggregate-engine policies; use rate_sql()")
    intents = compile_intents(policy, params)
    # Each aggregate becomes a column of the grouped query, which the rated rows then read.
    columns: dict[str, str] = {}

    def grouped_column(sql: str) -> str:
        return "grouped." + columns.setdefault(sql, f"q{len(columns)}")

    rated = _rated_rows(intents, grouped_column)
    aggregates = "".join(f", {sql} AS {name}" for sql, name in columns.items())
    grouped = (
        "SELECT billing_account_id, event_type,"
        f" CAST(substr(occurred_at, 1, 10) AS DATE) AS usage_day{aggregates}"
        f" FROM {source} WHERE {compile_match(policy, params)}"
        " GROUP BY billing_account_id, event_type, usage_day"
    )
    return (
        "SELECT grouped.billing_account_id, grouped.event_type, grouped.usage_day, rated.*"
        f" FROM ({grouped}) AS grouped {rated}"
    )
