"""Rating DSL v1 (wire contract, section 5): every form in both back ends, load-time refusals
with their paths, and property tests that the DuckDB SQL agrees with the Python evaluator."""

from __future__ import annotations

import importlib
import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.rating import (
    DslError,
    DslErrors,
    EventFacts,
    Intent,
    PolicyDoc,
    bind_params,
    compile_aggregate_sql,
    compile_intents,
    compile_match,
    evaluate,
    evaluate_aggregate,
    parse_policy,
    rate_sql,
    validate_policy,
)
from tests.conftest import examples

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
DAY_1, DAY_2 = "2026-11-01T12:00:00.000000Z", "2026-11-02T00:00:00.000000Z"
PARAMS = {"p_num": 5, "p_text": "12", "p_flag": True, "p_float": 2.5}
TEXT_COLUMNS = ("billing_account_id", "semantic_kind", "event_type", "occurred_at", "subject_ref")

LLM_POLICY = """
{"dsl_version": "v1", "engine": "single",
 "match": {"event_type": "llm.completion",
           "where": {"gt": [{"payload": "usage.input_tokens"}, 0]}},
 "emit": {"intents": [{"feature_code": "llm.chat",
   "meters": [{"meter_code": "llm.input_tokens",
               "quantity_minor": {"payload_int": "usage.input_tokens", "default": 0}},
              {"meter_code": "llm.output_tokens",
               "quantity_minor": {"payload_int": "usage.output_tokens", "default": 0}}]}]}}
"""
SEATS_POLICY = """
{"dsl_version": "v1", "engine": "aggregate",
 "match": {"event_type": "seats.snapshot"},
 "emit": {"intents": [{"feature_code": "api.search",
   "meters": [{"meter_code": "api.calls", "quantity_minor":
               {"agg": {"op": "max", "of": {"payload": "seats"}, "default": 0}}}]}]}}
"""


@pytest.fixture(scope="module")
def duck() -> Iterator[duckdb.DuckDBPyConnection]:
    connection = duckdb.connect()
    yield connection
    connection.close()


def event(payload: dict[str, Any] | None = None, **fields: Any) -> EventFacts:
    facts: dict[str, Any] = {
        "billing_account_id": "acct-1",
        "semantic_kind": "usage",
        "event_type": "t.a",
        "occurred_at": DAY_1,
        "subject_ref": "sub-1",
        "payload": payload or {},
        "labels": {},
    }
    return EventFacts(**(facts | fields))


def document(
    where: dict[str, Any] | None = None,
    quantity: dict[str, Any] | None = None,
    *,
    engine: str = "single",
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    meter = {"meter_code": "m", "quantity_minor": quantity or {"const": 1}}
    doc: dict[str, Any] = {
        "dsl_version": "v1",
        "engine": engine,
        "match": {"event_type": "t.a"},
        "emit": {"intents": [{"feature_code": "f", "meters": [meter]}]},
    }
    if where is not None:
        doc["match"]["where"] = where
    if params is not None:
        doc["params"] = params
    return doc


@contextmanager
def registered(duck: duckdb.DuckDBPyConnection, events: list[EventFacts]) -> Iterator[None]:
    """The events as the relation `events`, in the rating input's column layout."""
    columns = {name: [getattr(facts, name) for facts in events] for name in TEXT_COLUMNS}
    columns["payload"] = [json.dumps(facts.payload) for facts in events]
    columns["labels"] = [json.dumps(facts.labels) for facts in events]
    table = pa.table(
        {"row_index": pa.array(range(len(events)), pa.int32())}
        | {name: pa.array(values, pa.string()) for name, values in columns.items()}
    )
    duck.register("events", table)
    try:
        yield
    finally:
        duck.unregister("events")


def rate_in_sql(
    duck: duckdb.DuckDBPyConnection,
    policy: PolicyDoc,
    events: list[EventFacts],
    params: dict[str, Any] | None = None,
) -> list[list[Intent] | None]:
    with registered(duck, events):
        match = compile_match(policy, params)
        flags = duck.execute(f"SELECT {match} FROM events ORDER BY row_index").fetchall()
        rows = duck.execute(
            "SELECT row_index, intent_index, meter_code, quantity_minor, feature_quantity_minor"
            f" FROM ({rate_sql(policy, 'events', params)})"
        ).fetchall()
    rated: dict[int, dict[tuple[int, str], tuple[int, int | None]]] = defaultdict(dict)
    for row_index, intent_index, meter_code, quantity, feature_quantity in rows:
        rated[row_index][(intent_index, meter_code)] = (quantity, feature_quantity)
    results: list[list[Intent] | None] = []
    for row_index, (matched,) in enumerate(flags):
        assert matched is (row_index in rated), "compile_match disagrees with rate_sql"
        results.append(intents_from_rows(policy, rated[row_index], params) if matched else None)
    return results


def intents_from_rows(
    policy: PolicyDoc,
    rows: dict[tuple[int, str], tuple[int, int | None]],
    params: dict[str, Any] | None,
) -> list[Intent]:
    return [
        Intent(
            feature_code=intent.feature_code,
            feature_quantity_minor=rows[(index, intent.meters[0][0])][1],
            meters=tuple((code, rows[(index, code)][0]) for code, _ in intent.meters),
            labels=intent.labels,
        )
        for index, intent in enumerate(compile_intents(policy, params))
    ]


def rate_both(
    duck: duckdb.DuckDBPyConnection,
    policy: PolicyDoc,
    events: list[EventFacts],
    params: dict[str, Any] | None = None,
) -> list[list[Intent] | None]:
    in_python = [evaluate(policy, facts, params) for facts in events]
    assert rate_in_sql(duck, policy, events, params) == in_python
    return in_python


def matches(duck: duckdb.DuckDBPyConnection, where: dict[str, Any], facts: EventFacts) -> bool:
    return rate_both(duck, parse_policy(document(where, params=PARAMS)), [facts])[0] is not None


def quantity(duck: duckdb.DuckDBPyConnection, expression: dict[str, Any], facts: EventFacts) -> int:
    (intents,) = rate_both(duck, parse_policy(document(quantity=expression)), [facts])
    assert intents is not None
    return intents[0].meters[0][1]


def aggregate_both(
    duck: duckdb.DuckDBPyConnection,
    policy: PolicyDoc,
    events: list[EventFacts],
    params: dict[str, Any] | None = None,
) -> dict[tuple[str, str, str], list[Intent]]:
    groups: dict[tuple[str, str, str], list[EventFacts]] = defaultdict(list)
    for facts in events:
        groups[(facts.billing_account_id, facts.event_type, facts.occurred_at[:10])].append(facts)
    in_python = {
        key: intents
        for key, members in groups.items()
        if (intents := evaluate_aggregate(policy, members, params))
    }
    with registered(duck, events):
        rows = duck.execute(
            "SELECT billing_account_id, event_type, CAST(usage_day AS VARCHAR), intent_index,"
            " meter_code, quantity_minor, feature_quantity_minor"
            f" FROM ({compile_aggregate_sql(policy, 'events', params)})"
        ).fetchall()
    rated: dict[tuple[str, str, str], dict[tuple[int, str], tuple[int, int | None]]]
    rated = defaultdict(dict)
    for account, event_type, day, intent_index, meter_code, amount, feature_amount in rows:
        rated[(account, event_type, day)][(intent_index, meter_code)] = (amount, feature_amount)
    in_sql = {key: intents_from_rows(policy, found, params) for key, found in rated.items()}
    assert in_sql == in_python
    return in_python


# --- documents that must load --------------------------------------------------------------


def test_the_contract_examples_parse_and_rate(duck: duckdb.DuckDBPyConnection) -> None:
    llm = parse_policy(LLM_POLICY)
    calls = [
        event({"usage": {"input_tokens": 120, "output_tokens": "30"}}, event_type="llm.completion"),
        event({"usage": {"input_tokens": 0, "output_tokens": 9}}, event_type="llm.completion"),
        event({"usage": {"input_tokens": 5}}, event_type="other"),
    ]
    assert rate_both(duck, llm, calls) == [
        [Intent("llm.chat", None, (("llm.input_tokens", 120), ("llm.output_tokens", 30)), {})],
        None,
        None,
    ]
    seats = parse_policy(json.loads(SEATS_POLICY))
    snapshots = [
        event({"seats": 3}, event_type="seats.snapshot"),
        event({"seats": "7"}, event_type="seats.snapshot"),
        event({"seats": 4}, event_type="seats.snapshot", occurred_at=DAY_2),
        event({"seats": 99}, event_type="seats.snapshot", billing_account_id="acct-2"),
    ]
    assert aggregate_both(duck, seats, snapshots) == {
        ("acct-1", "seats.snapshot", "2026-11-01"): [
            Intent("api.search", None, (("api.calls", 7),), {})
        ],
        ("acct-1", "seats.snapshot", "2026-11-02"): [
            Intent("api.search", None, (("api.calls", 4),), {})
        ],
        ("acct-2", "seats.snapshot", "2026-11-01"): [
            Intent("api.search", None, (("api.calls", 99),), {})
        ],
    }


def test_rate_sql_yields_one_row_per_event_intent_and_meter(
    duck: duckdb.DuckDBPyConnection,
) -> None:
    doc = document()
    doc["emit"]["intents"] = [
        {
            "feature_code": "f.one",
            "feature_quantity_minor": {"payload_int": "n"},
            "labels": {"tier": "gold"},
            "meters": [
                {"meter_code": "m.a", "quantity_minor": {"payload_int": "n"}},
                {"meter_code": "m.b", "quantity_minor": {"const": 2}},
            ],
        },
        {
            "feature_code": "f.two",
            "meters": [{"meter_code": "m.a", "quantity_minor": {"const": 3}}],
        },
    ]
    policy = parse_policy(doc)
    assert rate_both(duck, policy, [event({"n": 4})]) == [
        [
            Intent("f.one", 4, (("m.a", 4), ("m.b", 2)), {"tier": "gold"}),
            Intent("f.two", None, (("m.a", 3),), {}),
        ]
    ]
    with registered(duck, [event({"n": 4})]):
        result = duck.execute(rate_sql(policy, "events"))
        columns = [column[0] for column in result.description]
        assert len(result.fetchall()) == 3
    assert columns[0] == "row_index"
    assert columns[-5:] == [
        "intent_index",
        "feature_code",
        "meter_code",
        "quantity_minor",
        "feature_quantity_minor",
    ]


# --- predicates ---------------------------------------------------------------------------

P, L = {"payload": "v"}, {"label": "k"}


@pytest.mark.parametrize(
    ("where", "payload", "expected"),
    [
        ({"all": []}, {}, True),
        ({"any": []}, {}, False),
        ({"all": [{"exists": P}, {"eq": [P, 1]}]}, {"v": 1}, True),
        ({"all": [{"exists": P}, {"eq": [P, 2]}]}, {"v": 1}, False),
        ({"any": [{"eq": [P, 2]}, {"eq": [P, 1]}]}, {"v": 1}, True),
        ({"not": {"eq": [P, 1]}}, {"v": 1}, False),
        ({"not": {"exists": P}}, {}, True),
        # eq / ne / in compare strictly: JSON types must match, numbers by value
        ({"eq": [P, 1]}, {"v": 1.0}, True),
        ({"eq": [P, 1]}, {"v": "1"}, False),
        ({"eq": [P, 1]}, {"v": True}, False),
        ({"eq": [P, True]}, {"v": True}, True),
        ({"eq": [P, "abc"]}, {"v": "abc"}, True),
        ({"eq": [P, "it's"]}, {"v": "it's"}, True),
        ({"eq": [P, {"payload": "w"}]}, {"v": {"a": 1}, "w": {"a": 1}}, False),
        ({"eq": [P, {"payload": "w"}]}, {}, False),
        ({"ne": [P, 1]}, {"v": "1"}, True),
        ({"ne": [P, 1]}, {"v": 1}, False),
        ({"ne": [P, 1]}, {}, True),
        ({"ne": [P, 1]}, {"v": None}, True),
        ({"in": [P, ["a", 2, False]]}, {"v": 2.0}, True),
        ({"in": [P, ["a", 2, False]]}, {"v": "2"}, False),
        ({"in": [P, ["a", 2, False]]}, {"v": False}, True),
        ({"in": [P, []]}, {"v": 1}, False),
        # ordering predicates coerce numeric-like strings and booleans
        ({"gt": [P, 5]}, {"v": "12"}, True),
        ({"gt": [P, 5]}, {"v": " 12.5e0\n"}, True),
        ({"gt": [P, 5]}, {"v": "abc"}, False),
        ({"lte": [P, 5]}, {"v": "abc"}, False),
        ({"gt": [P, 0]}, {"v": True}, True),
        ({"gte": [P, 1]}, {"v": True}, True),
        ({"lt": [P, 1]}, {"v": False}, True),
        ({"lt": [P, "1e3"]}, {"v": 999}, True),
        ({"gt": [P, 0]}, {}, False),
        ({"gt": [P, 0]}, {"v": [1]}, False),
        ({"gt": [P, 0]}, {"v": "0x10"}, False),
        ({"gte": [P, 2.5]}, {"v": 2.5}, True),
        # exists: present and not JSON null
        ({"exists": P}, {"v": None}, False),
        ({"exists": P}, {"v": {}}, True),
        ({"exists": {"payload": "v.0"}}, {"v": [0]}, True),
        ({"exists": {"payload": "v.0"}}, {"v": {"0": 1}}, False),
        # prefix / contains need two strings
        ({"prefix": [P, "ab"]}, {"v": "abc"}, True),
        ({"prefix": [P, "bc"]}, {"v": "abc"}, False),
        ({"prefix": [P, "1"]}, {"v": 12}, False),
        ({"contains": [P, "b"]}, {"v": "abc"}, True),
        ({"contains": [P, ""]}, {"v": "abc"}, True),
        ({"contains": [P, "z"]}, {"v": "abc"}, False),
    ],
)
def test_every_predicate_form_agrees_in_both_back_ends(
    duck: duckdb.DuckDBPyConnection, where: dict[str, Any], payload: dict[str, Any], expected: bool
) -> None:
    assert matches(duck, where, event(payload)) is expected


@pytest.mark.parametrize(
    ("where", "facts", "expected"),
    [
        ({"eq": [{"payload": "a.b.1.c"}, 7]}, event({"a": {"b": [{}, {"c": 7}]}}), True),
        ({"eq": [{"payload": "q\"k.it's"}, 7]}, event({'q"k': {"it's": 7}}), True),
        ({"eq": [{"payload": "x y.b\\s"}, 7]}, event({"x y": {"b\\s": 7}}), True),
        ({"eq": [{"payload": "a.b"}, 7]}, event({"a.b": 7}), False),
        ({"eq": [L, "us"]}, event(labels={"k": "us"}), True),
        ({"gt": [L, 10]}, event(labels={"k": "12"}), True),
        ({"exists": L}, event(labels={}), False),
        ({"eq": [{"event": "subject_ref"}, "sub-1"]}, event(), True),
        ({"exists": {"event": "subject_ref"}}, event(subject_ref=None), False),
        ({"ne": [{"event": "subject_ref"}, "sub-1"]}, event(subject_ref=None), True),
        ({"prefix": [{"event": "occurred_at"}, "2026-11-01"]}, event(), True),
        ({"gt": [{"event": "occurred_at"}, 0]}, event(), False),
        ({"eq": [{"event": "event_type"}, "t.a"]}, event(), True),
        ({"eq": [{"event": "semantic_kind"}, "usage"]}, event(), True),
        ({"eq": [{"event": "billing_account_id"}, "acct-1"]}, event(), True),
        ({"eq": [P, {"param": "p_num"}]}, event({"v": 5}), True),
        ({"gt": [P, {"param": "p_text"}]}, event({"v": 13}), True),
        ({"eq": [P, {"param": "p_flag"}]}, event({"v": True}), True),
    ],
)
def test_every_value_form_agrees_in_both_back_ends(
    duck: duckdb.DuckDBPyConnection, where: dict[str, Any], facts: EventFacts, expected: bool
) -> None:
    assert matches(duck, where, facts) is expected


def test_params_read_document_defaults_overridden_by_params_passed_in(
    duck: duckdb.DuckDBPyConnection,
) -> None:
    policy = parse_policy(document({"eq": [P, {"param": "p_num"}]}, params=PARAMS))
    facts = [event({"v": 5}), event({"v": 9})]
    assert [r is not None for r in rate_both(duck, policy, facts)] == [True, False]
    assert [r is not None for r in rate_both(duck, policy, facts, {"p_num": 9})] == [False, True]
    assert bind_params(policy, {"p_num": 9})["p_text"] == "12"
    with pytest.raises(DslError, match=r"^params\.p_nope: not declared"):
        bind_params(policy, {"p_nope": 1})
    with pytest.raises(DslError, match=r"^params\.p_num: expected a literal"):
        bind_params(policy, {"p_num": [1]})


def test_literal_text_is_escaped_in_sql(duck: duckdb.DuckDBPyConnection) -> None:
    where = {"in": [P, ["x'); DROP TABLE events; --", "a\x00b", "\\'"]]}
    for text in ["x'); DROP TABLE events; --", "a\x00b", "\\'"]:
        assert matches(duck, where, event({"v": text}))
    policy = parse_policy(document() | {"match": {"event_type": "it's"}})
    assert rate_both(duck, policy, [event(event_type="it's")])[0] is not None


# --- integer expressions --------------------------------------------------------------------


def div(a: int, b: int, rounding: str) -> dict[str, Any]:
    return {"div": [{"const": a}, {"const": b}], "rounding": rounding}


@pytest.mark.parametrize(
    ("expression", "payload", "expected"),
    [
        ({"payload_int": "v"}, {"v": 12}, 12),
        ({"payload_int": "v"}, {"v": 12.7}, 12),
        ({"payload_int": "v"}, {"v": "12.7"}, 12),
        ({"payload_int": "v"}, {"v": " 1e3 "}, 1000),
        ({"payload_int": "v"}, {"v": "+0042"}, 42),
        ({"payload_int": "v"}, {"v": True}, 1),
        ({"payload_int": "v"}, {"v": False}, 0),
        ({"payload_int": "v"}, {"v": 9007199254740993}, 9007199254740993),
        ({"payload_int": "v"}, {"v": "9223372036854775807"}, INT64_MAX),
        ({"payload_int": "v"}, {"v": "9" * 60}, INT64_MAX),
        ({"payload_int": "v"}, {"v": 2**70}, INT64_MAX),
        ({"payload_int": "v"}, {"v": 1e300}, INT64_MAX),
        ({"payload_int": "v", "default": 5}, {}, 5),
        ({"payload_int": "v", "default": 5}, {"v": None}, 5),
        ({"payload_int": "v", "default": 5}, {"v": "abc"}, 5),
        ({"payload_int": "v", "default": 5}, {"v": {"a": 1}}, 5),
        ({"payload_int": "v"}, {}, 0),
        ({"payload_int": "v"}, {"v": -12}, 0),
        ({"payload_int": "v"}, {"v": -12.7}, 0),
        ({"const": 17}, {}, 17),
        ({"const": "17"}, {}, 17),
        ({"const": -17}, {}, 0),
        ({"mul": [{"payload_int": "v"}, {"const": 3}]}, {"v": "4"}, 12),
        ({"mul": [{"payload_int": "v"}, {"const": -1}]}, {"v": -12.7}, 12),
        ({"mul": [{"const": INT64_MAX}, {"const": INT64_MAX}]}, {}, INT64_MAX),
        ({"mul": [{"mul": [{"const": INT64_MIN}, {"const": 2}]}, {"const": -1}]}, {}, INT64_MAX),
        (div(7, 2, "floor"), {}, 3),
        (div(7, 2, "ceil"), {}, 4),
        (div(7, 2, "nearest"), {}, 4),
        (div(5, 2, "nearest"), {}, 3),
        (div(7, 3, "nearest"), {}, 2),
        (div(-7, -2, "floor"), {}, 3),
        (div(-7, -2, "ceil"), {}, 4),
        (div(-5, -2, "nearest"), {}, 3),
        (div(-7, 2, "ceil"), {}, 0),
        (div(7, 0, "floor"), {}, 0),
        (div(INT64_MIN, -1, "floor"), {}, INT64_MAX),
        ({"div": [{"payload_int": "v"}, {"const": 1000}], "rounding": "ceil"}, {"v": 1001}, 2),
    ],
)
def test_every_integer_expression_agrees_in_both_back_ends(
    duck: duckdb.DuckDBPyConnection,
    expression: dict[str, Any],
    payload: dict[str, Any],
    expected: int,
) -> None:
    assert quantity(duck, expression, event(payload)) == expected


@pytest.mark.parametrize(
    ("a", "b", "floor", "nearest", "ceil"),
    [(5, 2, 2, 3, 3), (-5, 2, -3, -2, -2), (5, -2, -3, -2, -2), (-5, -2, 2, 3, 3), (4, 2, 2, 2, 2)],
)
def test_div_rounding_floor_nearest_half_up_and_ceil(
    duck: duckdb.DuckDBPyConnection, a: int, b: int, floor: int, nearest: int, ceil: int
) -> None:
    # (a + 10b) / b is a/b + 10, which keeps negative quotients visible past the clamp to 0.
    for rounding, expected in (("floor", floor), ("nearest", nearest), ("ceil", ceil)):
        assert quantity(duck, div(a + 10 * b, b, rounding), event()) == expected + 10


def test_division_by_a_constant_in_bigint_equals_the_hugeint_division_and_python(
    duck: duckdb.DuckDBPyConnection,
) -> None:
    # The sweep divides by a constant in BIGINT; every edge of BIGINT, both signs, exact
    # multiples and halves must round exactly as the general (HUGEINT) division and Python.
    evaluate_module = importlib.import_module("pipelines.rating.evaluate")
    from pipelines.rating import compile_sql

    divisors = [1, 2, 3, 7, 1000, 1024, 2**62, INT64_MAX - 1, INT64_MAX]
    numerators = sorted({n + d for n in (INT64_MIN, -2048, -1024, -7, -3, 0, 3, 7, 1024, 2**62, INT64_MAX)
                         for d in (-2, -1, 0, 1, 2) if INT64_MIN <= n + d <= INT64_MAX}
                        | {-(2**62), -(2**62) - 1, -512, 512, 1536, -1536, -1500, 1500})
    rows = ", ".join(f"({n})" for n in numerators)
    for rounding in ("floor", "ceil", "nearest"):
        for divisor in divisors:
            fast = compile_sql._divide_by_constant("x", divisor, rounding)
            general = compile_sql._divide("x", f"CAST({divisor} AS BIGINT)", rounding)
            got = duck.execute(f"SELECT x, {fast}, {general} FROM (VALUES {rows}) AS t(x) ORDER BY x").fetchall()
            assert len(got) == len(numerators)
            for x, in_bigint, in_hugeint in got:
                expected = evaluate_module._divide(x, divisor, rounding)
                assert (in_bigint, in_hugeint) == (expected, expected), (x, divisor, rounding)


def test_label_int_reads_labels(duck: duckdb.DuckDBPyConnection) -> None:
    facts = event(labels={"k": " 42 ", "n": "x"})
    assert quantity(duck, {"label_int": "k"}, facts) == 42
    assert quantity(duck, {"label_int": "n", "default": 3}, facts) == 3


def test_feature_quantity_minor_clamps_to_0(duck: duckdb.DuckDBPyConnection) -> None:
    doc = document()
    doc["emit"]["intents"][0]["feature_quantity_minor"] = {"payload_int": "v"}
    (intents,) = rate_both(duck, parse_policy(doc), [event({"v": -3})])
    assert intents is not None and intents[0].feature_quantity_minor == 0


# --- aggregate engine -------------------------------------------------------------------------


def agg(op: str, of: Any = None, default: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"op": op}
    if of is not None:
        body["of"] = of
    if default is not None:
        body["default"] = default
    return {"agg": body}


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (agg("count"), 5),
        (agg("count", P), 4),
        (agg("count_distinct", P), 2),  # 2 == 2.0, "2" is another value, null and {} skipped
        (agg("sum", P), 2 + 2 + 2),  # "2", 2, 2.0 as integers; {} is skipped
        (agg("avg", P), 2),
        (agg("min", P), 2),
        (agg("max", P), 2),
        (agg("sum", {"payload": "missing"}, 9), 9),
        (agg("sum", {"payload": "missing"}), 0),
        (agg("avg", {"payload": "w"}), 3),  # (7 - 1) // 2; "x" is skipped
        (agg("min", {"payload": "w"}), 0),  # -1 clamps only at the end
        ({"mul": [agg("max", {"payload": "w"}), {"const": 10}]}, 70),
        ({"div": [agg("sum", {"payload": "w"}), agg("count")], "rounding": "ceil"}, 2),
    ],
)
def test_every_aggregate_op_agrees_in_both_back_ends(
    duck: duckdb.DuckDBPyConnection, expression: dict[str, Any], expected: int
) -> None:
    policy = parse_policy(document(quantity=expression, engine="aggregate"))
    group = [
        event({"v": 2, "w": 7}),
        event({"v": 2.0, "w": "-1"}),
        event({"v": "2", "w": "x"}),
        event({"v": None}),
        event({"v": {}}),
    ]
    (intents,) = aggregate_both(duck, policy, group).values()
    assert intents[0].meters[0][1] == expected


def test_count_distinct_counts_present_scalars_under_eq(duck: duckdb.DuckDBPyConnection) -> None:
    policy = parse_policy(document(quantity=agg("count_distinct", P), engine="aggregate"))
    group = [event({"v": v}) for v in (0, 0.0, -0.0, "0", False, [0], {"a": 0}, None)]
    # 0, 0.0 and -0.0 are one number; "0" and false are values of their own types.
    (intents,) = aggregate_both(duck, policy, group).values()
    assert intents[0].meters[0][1] == 3


def test_aggregate_groups_by_account_event_type_and_utc_day(
    duck: duckdb.DuckDBPyConnection,
) -> None:
    policy = parse_policy(document({"gt": [P, 0]}, agg("count"), engine="aggregate"))
    group = [
        event({"v": 1}),
        event({"v": 1}, occurred_at="2026-11-01T23:59:59.999999Z"),
        event({"v": 1}, occurred_at=DAY_2),
        event({"v": 0}, occurred_at=DAY_2),
        event({"v": 0}, billing_account_id="acct-2"),
        event({"v": 1}, event_type="t.b"),
    ]
    assert {key: i[0].meters[0][1] for key, i in aggregate_both(duck, policy, group).items()} == {
        ("acct-1", "t.a", "2026-11-01"): 2,
        ("acct-1", "t.a", "2026-11-02"): 1,
    }


# --- load-time refusals -------------------------------------------------------------------------


def with_quantity(expression: Any, engine: str = "single") -> dict[str, Any]:
    doc = document(engine=engine)
    doc["emit"]["intents"][0]["meters"].append(
        {"meter_code": "m.two", "quantity_minor": expression}
    )
    return doc


def with_where(predicate: Any) -> dict[str, Any]:
    return document({"all": [{"exists": P}, predicate]}, params={"p": 1})


Q = "$.emit.intents[0].meters[1].quantity_minor"
W = "$.match.where.all[1]"


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        (document() | {"dsl_version": "v2"}, "$.dsl_version"),
        (document() | {"engine": "batch"}, "$.engine"),
        ({k: v for k, v in document().items() if k != "engine"}, "$.engine"),
        (document() | {"extra": 1}, "$.extra"),
        (document() | {"match": {"where": {"all": []}}}, "$.match.event_type"),
        (document() | {"match": {"event_type": ""}}, "$.match.event_type"),
        (document() | {"params": [1]}, "$.params"),
        (document(params={"p": None}), "$.params.p"),
        (with_where({"gtt": [P, 1]}), f"{W}.gtt"),
        (with_where({"gt": [P, 1], "lt": [P, 2]}), W),
        (with_where({"gt": [P]}), f"{W}.gt"),
        (with_where({"gt": [P, 1, 2]}), f"{W}.gt"),
        (with_where({"gt": [P, {"pay": "v"}]}), f"{W}.gt[1].pay"),
        (with_where({"gt": [{"payload": "v", "label": "k"}, 1]}), f"{W}.gt[0]"),
        (with_where({"gt": [{"payload": "a..b"}, 1]}), f"{W}.gt[0].payload"),
        (with_where({"gt": [{"payload": "a.*"}, 1]}), f"{W}.gt[0].payload"),
        (with_where({"gt": [{"event": "payload"}, 1]}), f"{W}.gt[0].event"),
        (with_where({"gt": [P, {"param": "q"}]}), f"{W}.gt[1].param"),
        (with_where({"eq": [P, None]}), f"{W}.eq[1]"),
        (with_where({"eq": [P, [1]]}), f"{W}.eq[1]"),
        (with_where({"eq": [P, 2**64]}), f"{W}.eq[1]"),
        (with_where({"in": [P, 1]}), f"{W}.in"),
        (with_where({"in": [P, [1, P]]}), f"{W}.in[1][1]"),
        (with_where({"all": {"exists": P}}), f"{W}.all"),
        (with_where({"not": {"nope": P}}), f"{W}.not.nope"),
        (with_quantity({"payload_integer": "v"}), f"{Q}.payload_integer"),
        (with_quantity({"payload_int": "v", "dflt": 1}), f"{Q}.dflt"),
        (with_quantity({"payload_int": "v", "default": "1"}), f"{Q}.default"),
        (with_quantity({"const": 1.5}), f"{Q}.const"),
        (with_quantity({"const": 2**63}), f"{Q}.const"),
        (with_quantity(3), Q),
        (with_quantity({"mul": [{"const": 1}]}), f"{Q}.mul"),
        (with_quantity({"mul": [{"const": 1}, {"payload": "v"}]}), f"{Q}.mul[1].payload"),
        (with_quantity({"div": [{"const": 1}, {"const": 2}]}), f"{Q}.rounding"),
        (with_quantity({"div": [{"const": 1}, {"const": 2}], "rounding": "up"}), f"{Q}.rounding"),
        (with_quantity(agg("count")), f"{Q}.agg"),
        (with_quantity({"payload_int": "v"}, "aggregate"), f"{Q}.payload_int"),
        (with_quantity(agg("median", P), "aggregate"), f"{Q}.agg.op"),
        (with_quantity(agg("sum"), "aggregate"), f"{Q}.agg.of"),
        (with_quantity(agg("count", default=1), "aggregate"), f"{Q}.agg.default"),
        (with_quantity({"agg": {"op": "max", "of": P, "by": 1}}, "aggregate"), f"{Q}.agg.by"),
        (document() | {"emit": {"intents": []}}, "$.emit.intents"),
        (document() | {"emit": {}}, "$.emit.intents"),
        (
            document() | {"emit": {"intents": [{"feature_code": "f", "meters": {}}]}},
            "$.emit.intents[0].meters",
        ),
        (
            document() | {"emit": {"intents": [{"feature_code": "f", "meters": []}]}},
            "$.emit.intents[0].meters",
        ),
        (
            document()
            | {
                "emit": {
                    "intents": [
                        {
                            "feature_code": "LLM Chat",
                            "meters": [{"meter_code": "m", "quantity_minor": {"const": 1}}],
                        }
                    ]
                }
            },
            "$.emit.intents[0].feature_code",
        ),
        (
            document()
            | {
                "emit": {
                    "intents": [
                        {
                            "feature_code": "f",
                            "meters": [{"meter_code": "m.", "quantity_minor": {"const": 1}}],
                        }
                    ]
                }
            },
            "$.emit.intents[0].meters[0].meter_code",
        ),
        (
            document()
            | {"emit": {"intents": [{"feature_code": "f", "meters": [{"meter_code": "m"}]}]}},
            "$.emit.intents[0].meters[0].quantity_minor",
        ),
        (
            document()
            | {
                "emit": {
                    "intents": [
                        {
                            "feature_code": "f",
                            "labels": {"a": 1},
                            "meters": [{"meter_code": "m", "quantity_minor": {"const": 1}}],
                        }
                    ]
                }
            },
            "$.emit.intents[0].labels",
        ),
        ([], "$"),
    ],
)
def test_an_invalid_document_is_refused_at_load_time_with_the_path_of_the_fault(
    doc: Any, path: str
) -> None:
    assert [error.path for error in validate_policy(doc)] == [path]
    with pytest.raises(DslErrors) as refused:
        parse_policy(doc)
    assert [error.path for error in refused.value.errors] == [path]


def test_every_fault_is_reported_in_document_order() -> None:
    doc = with_where({"gt": [{"payload": ""}, {"param": "nope"}]})
    doc["dsl_version"] = "v0"
    doc["emit"]["intents"][0]["meters"][0]["meter_code"] = "Bad Code"
    errors = validate_policy(json.dumps(doc))
    assert [error.path for error in errors] == [
        "$.dsl_version",
        f"{W}.gt[0].payload",
        f"{W}.gt[1].param",
        "$.emit.intents[0].meters[0].meter_code",
    ]
    assert str(errors[2]) == f"{W}.gt[1].param: param 'nope' is not defined in $.params"
    with pytest.raises(DslErrors, match=r"^\$\.dsl_version: must be 'v1'\n"):
        parse_policy(doc)


def test_text_that_is_not_json_is_refused_at_the_root() -> None:
    (error,) = validate_policy("{not json")
    assert error.path == "$" and error.message.startswith("not valid JSON")


def test_keys_that_are_not_identifiers_are_quoted_in_paths() -> None:
    (error,) = validate_policy(document() | {"odd key": 1})
    assert (
        str(error)
        == '$["odd key"]: unknown key; expected one of dsl_version, engine, params, match, emit'
    )


def test_each_back_end_refuses_the_other_engine() -> None:
    single, aggregate = parse_policy(document()), parse_policy(document(engine="aggregate"))
    with pytest.raises(ValueError, match="evaluate_aggregate"):
        evaluate(aggregate, event())
    with pytest.raises(ValueError, match="use evaluate"):
        evaluate_aggregate(single, [event()])
    with pytest.raises(ValueError, match="compile_aggregate_sql"):
        rate_sql(aggregate, "events")
    with pytest.raises(ValueError, match="rate_sql"):
        compile_aggregate_sql(single, "events")


# --- property tests: SQL and Python agree ----------------------------------------------------

PAYLOAD_KEYS = ["a", "b", "n", "0", "x y", 'q"k', "it's", "b\\s", "a.b"]
PATH_PARTS = ["a", "b", "n", "0", "1", "x y", 'q"k', "it's", "b\\s"]
LABEL_KEYS = ["k", "n", "a.b", "it's", "*x"]

ints = st.one_of(
    st.integers(-1000, 1000),
    st.integers(INT64_MIN, INT64_MAX),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**53 + 1, INT64_MAX, INT64_MIN, 2**63, 2**64, -(2**64)]),
)
int64s = st.one_of(st.integers(-1000, 1000), st.integers(INT64_MIN, INT64_MAX))
floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([12.7, -12.7, 2.5, -2.5, 0.5, -0.0, 1e20, 9007199254740993.0]),
)
numeric_text = st.one_of(
    ints.map(str),
    floats.map(repr),
    st.tuples(
        st.sampled_from(["", " ", "\t", "\n "]),
        st.one_of(int64s.map(str), floats.map(repr)),
        st.sampled_from(["", " ", "\r\n"]),
    ).map("".join),
    st.sampled_from(
        [
            "+5",
            "007",
            "1e3",
            "1E-2",
            "-0",
            "12.70",
            "+1.5e+2",
            "9" * 45,
            "-" + "9" * 45,
            "1e400",
            "1" + "0" * 400,
        ]
    ),
)
other_text = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=4),
    st.sampled_from(
        [
            "abc",
            "",
            "1.",
            ".5",
            "0x10",
            "1_000",
            "١٢",
            "NaN",
            "inf",
            "12abc",
            "1 2",
            "true",
            "a'b",
            'a"b',
        ]
    ),
)
# A small universe makes payloads, labels and literals collide often, so eq, ordering and
# count_distinct meet equal values in different JSON spellings (1, 1.0, "1", true, -0.0).
colliding = st.one_of(
    st.sampled_from([0, 1, 2, 0.0, -0.0, 1.0, 2.5, -2.5, 12.7, True, False]),
    st.sampled_from(["1", " 1 ", "1e0", "-0", "+1", "abc", "ab", "", "true", "12.7", "-12.7"]),
    st.sampled_from(["9" * 45, "-" + "9" * 45]),
)
scalars = st.one_of(
    colliding,
    colliding,
    colliding,
    st.booleans(),
    st.none(),
    ints,
    floats,
    numeric_text,
    other_text,
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.dictionaries(st.sampled_from(PAYLOAD_KEYS), kids, max_size=3)
    ),
    max_leaves=6,
)
events = st.builds(
    EventFacts,
    billing_account_id=st.sampled_from(["acct-1", "acct-2"]),
    semantic_kind=st.sampled_from(["usage", "12"]),
    event_type=st.sampled_from(["t.a", "t.a", "t.b"]),
    occurred_at=st.sampled_from([DAY_1, DAY_2, "2026-11-01T23:59:59.999999Z"]),
    subject_ref=st.none() | st.sampled_from(["sub-1", "7", "sub-1/x"]),
    # "a" and "b" are usually present and usually scalars, so most paths find something.
    payload=st.builds(
        dict.__or__,
        st.dictionaries(st.sampled_from(PAYLOAD_KEYS), json_values, max_size=4),
        st.fixed_dictionaries({"a": scalars, "b": scalars | json_values}),
    ),
    labels=st.builds(
        dict.__or__,
        st.dictionaries(st.sampled_from(LABEL_KEYS), scalars, max_size=3),
        st.fixed_dictionaries({"k": scalars}),
    ),
)

literals = st.one_of(colliding, colliding, colliding, int64s, floats, numeric_text, other_text)
parts = st.one_of(st.sampled_from(["a", "b"]), st.sampled_from(PATH_PARTS))
paths = st.one_of(parts, parts, st.lists(parts, min_size=2, max_size=3).map(".".join))
payload_values = paths.map(lambda path: {"payload": path})
values = st.one_of(
    payload_values,
    payload_values,
    literals,
    st.sampled_from(LABEL_KEYS).map(lambda key: {"label": key}),
    st.sampled_from(
        ["subject_ref", "occurred_at", "event_type", "semantic_kind", "billing_account_id"]
    ).map(lambda field: {"event": field}),
    st.sampled_from(sorted(PARAMS)).map(lambda name: {"param": name}),
)
LEAF_PREDICATES = ["eq", "ne", "gt", "gte", "lt", "lte", "prefix", "contains", "in", "exists"]


# Composite strategies with explicit sampled_from choices keep the forms evenly spread;
# st.recursive drifted toward the simplest leaf (exists) and hid back-end disagreements.
@st.composite
def predicates(draw: st.DrawFn, depth: int = 2) -> dict[str, Any]:
    op = draw(st.sampled_from(LEAF_PREDICATES + (["all", "any", "not"] if depth else [])))
    if op in ("all", "any"):
        return {op: draw(st.lists(predicates(depth - 1), max_size=3))}
    if op == "not":
        return {op: draw(predicates(depth - 1))}
    if op == "exists":
        return {op: draw(values)}
    if op == "in":
        return {op: [draw(values), draw(st.lists(literals, max_size=3))]}
    return {op: [draw(values), draw(values)]}


@st.composite
def single_leaves(draw: st.DrawFn) -> dict[str, Any]:
    form = draw(st.sampled_from(["payload_int", "payload_int", "label_int", "const"]))
    if form == "const":
        return {"const": draw(st.one_of(int64s, st.integers(-20, 20).map(str)))}
    source = draw(paths if form == "payload_int" else st.sampled_from(LABEL_KEYS))
    default = draw(st.none() | int64s)
    return {form: source} | ({} if default is None else {"default": default})


@st.composite
def aggregate_leaves(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(["count", "sum", "avg", "min", "max", "count_distinct", "const"]))
    if op == "const":
        return {"const": draw(st.integers(-20, 20))}
    of = draw(values) if op != "count" or draw(st.booleans()) else None
    default = draw(int64s) if op in ("sum", "avg", "min", "max") and draw(st.booleans()) else None
    return agg(op, of, default)


@st.composite
def quantities(draw: st.DrawFn, engine: str, depth: int = 2) -> dict[str, Any]:
    form = draw(st.sampled_from(["leaf", "leaf", "mul", "div"] if depth else ["leaf"]))
    if form == "leaf":
        return draw(single_leaves() if engine == "single" else aggregate_leaves())
    a, b = draw(quantities(engine, depth - 1)), draw(quantities(engine, depth - 1))
    if form == "mul":
        return {"mul": [a, b]}
    return {"div": [a, b], "rounding": draw(st.sampled_from(["floor", "nearest", "ceil"]))}


@st.composite
def policies(draw: st.DrawFn, engine: str) -> dict[str, Any]:
    intents = []
    for i in range(draw(st.integers(1, 2))):
        meters = [
            {"meter_code": f"m{j}", "quantity_minor": draw(quantities(engine))}
            for j in range(draw(st.integers(1, 4)))
        ]
        intent: dict[str, Any] = {"feature_code": f"f{i}", "meters": meters}
        if draw(st.booleans()):
            intent["feature_quantity_minor"] = draw(quantities(engine))
        intents.append(intent)
    where = draw(st.none() | predicates())
    return document(where, engine=engine, params=PARAMS) | {"emit": {"intents": intents}}


overrides = st.dictionaries(st.sampled_from(sorted(PARAMS)), literals, max_size=2)
PROPERTY = settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@PROPERTY
@given(
    wheres=st.lists(predicates(), min_size=8, max_size=8),
    batch=st.lists(events, min_size=4, max_size=16),
    params=overrides,
)
def test_sql_and_python_agree_on_every_predicate(
    duck: duckdb.DuckDBPyConnection,
    wheres: list[dict[str, Any]],
    batch: list[EventFacts],
    params: dict[str, Any],
) -> None:
    # Many predicates per query: each is one column, so one example checks hundreds of pairs.
    policies = [parse_policy(document(where, params=PARAMS)) for where in wheres]
    columns = ", ".join(compile_match(policy, params) for policy in policies)
    with registered(duck, batch):
        in_sql = duck.execute(f"SELECT {columns} FROM events ORDER BY row_index").fetchall()
    assert in_sql == [
        tuple(evaluate(policy, facts, params) is not None for policy in policies) for facts in batch
    ]


@PROPERTY
@given(doc=policies("single"), batch=st.lists(events, min_size=4, max_size=16), params=overrides)
def test_sql_and_python_agree_on_match_and_every_quantity(
    duck: duckdb.DuckDBPyConnection,
    doc: dict[str, Any],
    batch: list[EventFacts],
    params: dict[str, Any],
) -> None:
    rate_both(duck, parse_policy(doc), batch, params)


@PROPERTY
@given(doc=policies("aggregate"), batch=st.lists(events, min_size=4, max_size=16), params=overrides)
def test_sql_and_python_agree_on_random_aggregate_groups(
    duck: duckdb.DuckDBPyConnection,
    doc: dict[str, Any],
    batch: list[EventFacts],
    params: dict[str, Any],
) -> None:
    aggregate_both(duck, parse_policy(doc), batch, params)


def test_a_boolean_read_as_an_integer_is_a_plain_int() -> None:
    from pipelines.rating import EventFacts, evaluate, parse_policy

    policy = parse_policy({"dsl_version": "v1", "engine": "single", "match": {"event_type": "t"},
                           "emit": {"intents": [{"feature_code": "f", "meters": [
                               {"meter_code": "m", "quantity_minor": {"payload_int": "a"}}]}]}})
    event = EventFacts("acct", "activity", "t", "2026-11-01T00:00:00.000000Z", None, {"a": True}, {})
    intents = evaluate(policy, event)
    assert intents is not None
    quantity = intents[0].meters[0][1]
    assert quantity == 1 and type(quantity) is int
