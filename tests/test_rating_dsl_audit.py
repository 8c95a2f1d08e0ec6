"""Rating DSL v1 (wire contract, section 5) at its edges: inputs on which a back end crashed or
the two disagreed, documents accepted or refused without the path of their fault, and a few
contract rules pinned in both back ends and in the sweep's rewritten SQL."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from batch.rating_plan import PlannedVersion, RatingPlan, described_sql
from pipelines.rating import (
    DslError,
    EventFacts,
    bind_params,
    evaluate,
    parse_policy,
    validate_policy,
)
from tests.test_rating_dsl import aggregate_both, document, event, matches, quantity, rate_both

INT64_MAX = 2**63 - 1
P = {"payload": "v"}
Q = "$.emit.intents[0].meters[0].quantity_minor"


@pytest.fixture(scope="module")
def duck() -> Iterator[duckdb.DuckDBPyConnection]:
    connection = duckdb.connect()
    yield connection
    connection.close()


def paths(doc: Any) -> list[str]:
    return [error.path for error in validate_policy(doc)]


# --- defects: a crash or a disagreement ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("0" * 5000 + "7", 7), ("-" + "0" * 5000 + "7", -7), ("+" + "0" * 4400 + "12", 12)],
)
def test_integer_text_with_thousands_of_leading_zeros_reads_as_its_value(
    duck: duckdb.DuckDBPyConnection, text: str, value: int
) -> None:
    # Python's int() refuses text of more than 4300 digits, leading zeros included.
    assert quantity(duck, {"payload_int": "v"}, event({"v": text})) == max(0, value)
    policy = parse_policy(document(quantity={"agg": {"op": "sum", "of": P}}, engine="aggregate"))
    (intents,) = aggregate_both(duck, policy, [event({"v": text}), event({"v": 10})]).values()
    assert intents[0].meters[0][1] == value + 10


def test_const_text_of_thousands_of_digits_is_refused_or_read_not_raised() -> None:
    assert paths(document(quantity={"const": "1" * 5000})) == [f"{Q}.const"]
    policy = parse_policy(document(quantity={"const": "0" * 5000 + "9"}))
    assert evaluate(policy, event()) is not None
    assert evaluate(policy, event())[0].meters[0][1] == 9  # type: ignore[index]


def test_count_distinct_skips_numbers_beyond_the_double_range_in_both_back_ends(
    duck: duckdb.DuckDBPyConnection,
) -> None:
    # eq finds such a number equal to nothing, so it has no value to count (SQL skipped it,
    # Python counted every one of them as one value).
    policy = parse_policy(
        document(quantity={"agg": {"op": "count_distinct", "of": P}}, engine="aggregate")
    )
    group = [event({"v": 10**400}), event({"v": -(10**400)}), event({"v": 1}), event({"v": 1.0})]
    (intents,) = aggregate_both(duck, policy, group).values()
    assert intents[0].meters[0][1] == 1


def test_json_text_nested_too_deep_is_refused_at_the_root() -> None:
    for text in ("[" * 100_000, '{"a":' * 100_000):
        (error,) = validate_policy(text)
        assert error.path == "$" and error.message.startswith("not valid JSON")


W = "$.match.where"


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        (document({"eq": [P, "\ud800"]}), f"{W}.eq[1]"),
        (document({"in": [P, ["a", "x\udc00"]]}), f"{W}.in[1][1]"),
        (document({"exists": {"payload": "a.\ud800"}}), f"{W}.exists.payload"),
        (document({"exists": {"label": "\udfff"}}), f"{W}.exists.label"),
        (document(quantity={"payload_int": "\ud800"}), f"{Q}.payload_int"),
        (document(params={"p": "\ud800"}), "$.params.p"),
        (document() | {"match": {"event_type": "t\ud800"}}, "$.match.event_type"),
    ],
)
def test_a_lone_surrogate_is_refused_with_its_path_not_sent_to_duckdb(
    doc: dict[str, Any], path: str
) -> None:
    # JSON text may escape one ("\ud800"); DuckDB's SQL text cannot carry it, so the whole
    # sweep query failed with UnicodeEncodeError.
    assert paths(doc) == [path]
    assert paths(json.dumps(doc)) == [path]


def test_a_lone_surrogate_is_refused_as_a_param_passed_in() -> None:
    policy = parse_policy(document({"eq": [P, {"param": "p"}]}, params={"p": "x"}))
    with pytest.raises(DslError, match=r"^params\.p: must be valid Unicode"):
        bind_params(policy, {"p": "\ud800"})


def test_a_param_whose_value_is_refused_is_reported_once_at_params() -> None:
    doc = document({"eq": [P, {"param": "p"}]}, params={"p": None})
    assert paths(doc) == ["$.params.p"]


# --- contract rules pinned in both back ends ------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "value", "expected"),
    [
        # prefix / contains are plain text tests: LIKE's wildcards and escape mean nothing
        ({"prefix": [P, "a%"]}, "abc", False),
        ({"prefix": [P, "a_"]}, "abc", False),
        ({"prefix": [P, "a%"]}, "a%c", True),
        ({"contains": [P, "_"]}, "abc", False),
        ({"contains": [P, "\\%"]}, "x\\%y", True),
        ({"contains": [P, "\\"]}, "%", False),
        ({"contains": [P, "'"]}, "it's", True),
        ({"prefix": [P, "é"]}, "e\u0301", False),  # code points, no normalization
        ({"contains": [P, "😀"]}, "a😀b", True),
        # eq is strict and typed
        ({"eq": [P, "1"]}, 1, False),
        ({"eq": [P, 1]}, 1.0, True),
        ({"eq": [P, True]}, 1, False),
        ({"eq": [P, "é"]}, "e\u0301", False),
        ({"eq": [P, {"payload": "w"}]}, [1], False),  # w is [1] too: arrays equal nothing
        # ordering predicates: numeric-like text and booleans, anything else is false
        ({"gt": [P, 11]}, " 12 ", True),
        ({"gt": [P, 999]}, "1e3", True),
        ({"gt": [P, 0]}, "0x10", False),
        ({"gt": [P, 0]}, "NaN", False),
        ({"lt": [P, 0]}, "-inf", False),
        ({"gte": [P, 0]}, "", False),
        ({"gte": [P, 0]}, "-0", True),
        ({"lte": [P, 0]}, -0.0, True),
        ({"gt": [P, 0]}, "1e400", False),
        ({"gt": [P, 0]}, 10**400, False),
        ({"gt": [P, INT64_MAX]}, 2**64, True),
        ({"gt": [P, 0]}, "1\u00a0", False),  # only ASCII space, tab, CR and LF are trimmed
    ],
)
def test_text_and_number_edges_agree_in_both_back_ends(
    duck: duckdb.DuckDBPyConnection, where: dict[str, Any], value: Any, expected: bool
) -> None:
    assert matches(duck, where, event({"v": value, "w": [1]})) is expected


def test_occurred_at_compares_as_its_rfc3339_text_not_as_an_instant(
    duck: duckdb.DuckDBPyConnection,
) -> None:
    at = {"event": "occurred_at"}
    facts = event(occurred_at="2026-11-01T12:00:00.000000Z")
    assert matches(duck, {"prefix": [at, "2026-11-01"]}, facts)
    assert matches(duck, {"eq": [at, "2026-11-01T12:00:00.000000Z"]}, facts)
    assert not matches(duck, {"eq": [at, "2026-11-01T12:00:00Z"]}, facts)
    assert not matches(duck, {"gt": [at, "2026-01-01T00:00:00.000000Z"]}, facts)


def test_div_rounds_negative_operands_before_the_clamp(duck: duckdb.DuckDBPyConnection) -> None:
    def div(a: int, b: int, rounding: str) -> dict[str, Any]:
        # mul by -1 turns the negative quotient positive, so the clamp to 0 cannot hide it
        inner = {"div": [{"const": a}, {"const": b}], "rounding": rounding}
        return {"mul": [inner, {"const": -1}]}

    assert quantity(duck, div(-7, 2, "floor"), event()) == 4
    assert quantity(duck, div(-7, 2, "ceil"), event()) == 3
    assert quantity(duck, div(-7, 2, "nearest"), event()) == 3  # -3.5 -> -3
    assert quantity(duck, div(7, -2, "nearest"), event()) == 3
    assert quantity(duck, div(-5, 1, "nearest"), event()) == 5
    assert rate_both(duck, parse_policy(document(quantity=div(-7, 0, "ceil"))), [event()])


def test_the_sweep_reads_payload_keys_with_their_case(duck: duckdb.DuckDBPyConnection) -> None:
    # The sweep reads payload paths with json_transform, whose struct fields match keys without
    # case; "a" must still not find "A".
    doc = document({"exists": {"payload": "a.b"}}, {"payload_int": "a.b"})
    plan = RatingPlan(
        [PlannedVersion(0, "r", "p", 0, "v1", datetime(2026, 1, 1, tzinfo=timezone.utc),
                        parse_policy(doc))],
        [],
    )
    plan.install(duck)
    payloads = [{"a": {"b": 5}}, {"A": {"b": 6}}, {"a": {"B": 7}}, {"A": {"b": 8}, "a": {"b": 9}}]
    rows = [
        {"event_id": str(uuid.UUID(int=i + 1)), "realm": "r", "billing_account_id": "acct-1",
         "semantic_kind": "activity", "event_type": "t.a", "subject_ref": None,
         "occurred_at": datetime(2026, 11, 1, 12, tzinfo=timezone.utc),
         "payload": json.dumps(payload), "labels": "{}"}
        for i, payload in enumerate(payloads)
    ]
    batch = pa.Table.from_pylist(rows)  # noqa: F841 (read by DuckDB below)
    duck.execute(
        "CREATE OR REPLACE TEMP TABLE audit_events AS SELECT event_id::UUID AS event_id, realm,"
        " billing_account_id, semantic_kind, event_type, occurred_at,"
        " subject_ref::VARCHAR AS subject_ref, payload::JSON AS payload, labels::JSON AS labels"
        " FROM batch"
    )
    got = duck.execute(
        "SELECT CAST(event_id AS VARCHAR), status, quantity_minor"
        f" FROM ({described_sql('(' + plan.lines_sql('audit_events') + ')')}) ORDER BY 1"
    ).fetchall()
    wanted = []
    for row, payload in zip(rows, payloads, strict=True):
        facts = EventFacts("acct-1", "activity", "t.a", "2026-11-01T12:00:00.000000Z", None,
                           payload, {})
        intents = evaluate(parse_policy(doc), facts)
        wanted.append((row["event_id"], "skipped_no_policy" if intents is None else "rated",
                       None if intents is None else intents[0].meters[0][1]))
    assert got == wanted
    assert [quantity for _, _, quantity in got] == [5, None, None, 9]


def test_a_meter_named_twice_in_one_intent_is_refused_at_the_second() -> None:
    # The single engine wrote two lines for it; the aggregate engine's day summed them into one.
    doc = {"dsl_version": "v1", "engine": "single", "match": {"event_type": "t.a"},
           "emit": {"intents": [{"feature_code": "f", "meters": [
               {"meter_code": "m", "quantity_minor": {"const": 1}},
               {"meter_code": "n", "quantity_minor": {"const": 1}},
               {"meter_code": "m", "quantity_minor": {"const": 2}}]}]}}
    faults = validate_policy(doc)
    assert [(f.path, f.message) for f in faults] == [
        ("$.emit.intents[0].meters[2].meter_code", "meter 'm' appears twice in this intent")]
    doc["emit"]["intents"][0]["meters"].pop()  # type: ignore[index]
    assert validate_policy(doc) == []


def test_in_with_thousands_of_string_options_is_one_list_and_agrees(duck: duckdb.DuckDBPyConnection) -> None:
    # Compiled as one equality per option, 5,000 options took about a minute to plan.
    options: list[Any] = [f"v{i}" for i in range(5000)] + ["it's", "nul\x00", 1, True, "v7"]
    began = time.monotonic()
    for value, found in [("v4999", True), ("v7", True), ("it's", True), ("nul\x00", True), (1.0, True),
                         (True, True), ("1", False), ("true", False), ("v5000", False), (None, False)]:
        assert matches(duck, {"in": [P, options]}, event({"v": value})) is found, value
    assert time.monotonic() - began < 120  # one equality per option took minutes here
