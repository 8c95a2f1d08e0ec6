"""The sweep's SQL agrees with the reference: random events rated by `RatingPlan` in DuckDB give
the lines of `pipelines.rating.evaluate` (version in force at occurred_at, one policy or
quarantine or skip) and the amounts of `pipelines.pricing.price_line` with its carry."""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batch.carry import CarryOutOfRange, PriceTerms
from batch.rating_plan import PlannedPrice, RatingPlan, amounts_sql, described_sql, priced_sql
from batch.run_writer import slot_lines
from pipelines.catalog import load_catalog
from pipelines.pricing import PriceRow, price_line
from pipelines.rating import EventFacts, evaluate, parse_policy
from tests.conftest import examples
from tests.lake_events import catalog_toml, policy, price, single

V1_AT = "2026-01-01T00:00:00Z"
V2_AT = "2026-11-15T00:00:00Z"
POLICIES = (
    policy("llm",
           ("v1", V1_AT, single("llm.completion", "llm.chat", {
               "tokens.in": {"payload_int": "usage.input_tokens", "default": 0},
               "tokens.out": {"payload_int": "usage.output_tokens", "default": 7}},
               where={"gt": [{"payload": "usage.input_tokens"}, 0]})),
           ("v2", V2_AT, single("llm.completion", "llm.chat", {
               "tokens.in": {"div": [{"payload_int": "usage.input_tokens"}, {"const": 10}],
                             "rounding": "nearest"}},
               where={"any": [{"eq": [{"label": "tier"}, "gold"]},
                              {"in": [{"payload": "model"}, ["m1", "m2", 3]]}]})))
    + policy("calls", ("v1", V1_AT, single("api.call", "api.search", {
        "calls": {"mul": [{"label_int": "weight", "default": 1}, {"payload_int": "items.0.n"}]}},
        where={"all": [{"exists": {"payload": "items.0"}},
                       {"not": {"prefix": [{"event": "subject_ref"}, "test-"]}}]})))
    # Overlaps `llm` on purpose: both match a large completion, which is then quarantined.
    + policy("big", ("v1", V1_AT, single("llm.completion", "llm.chat", {
        "tokens.in": {"payload_int": "usage.input_tokens"}},
        where={"gte": [{"payload": "usage.input_tokens"}, "5000"]}))))
PRICES = (price("tokens.in", 150, 1000, V1_AT) + price("tokens.in", 170, 700, V2_AT, "nearest")
          + price("tokens.out", 600, 1000, V1_AT, "ceil") + price("calls", 2000, 1, V1_AT))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10_000),
                    st.sampled_from([0.5, 12.7, -3.0, 1e3, 5000.0]),
                    # Integers around the sweep's fast path (up to 18 characters of JSON
                    # text) and beyond int64 and uint64, and doubles written as integers.
                    st.sampled_from([10 ** 17 + 3, 10 ** 18 - 1, -(10 ** 17) - 3, 10 ** 18 + 7,
                                     2 ** 63 - 1, -(2 ** 63), 2 ** 64 - 1, 10 ** 25, 1e19, -0.0]),
                    st.sampled_from(["12", " 7 ", "x", "", "5000", "1e3", "m1", "gold", "3"]))
payloads = st.fixed_dictionaries({}, optional={
    "usage": st.one_of(scalars, st.fixed_dictionaries({}, optional={
        "input_tokens": scalars, "output_tokens": scalars})),
    "model": scalars,
    "items": st.one_of(scalars, st.lists(st.one_of(scalars, st.fixed_dictionaries(
        {}, optional={"n": scalars})), max_size=2)),
})
labels = st.fixed_dictionaries({}, optional={
    "tier": st.sampled_from(["gold", "silver", True, 3]),
    "weight": st.sampled_from([2, "3", "x", 1.5, False])})
events = st.lists(st.tuples(
    st.sampled_from(["llm.completion", "api.call", "other"]),
    st.sampled_from(["acct_a", "acct_b"]),
    st.integers(0, 60 * 24 * 60),  # minutes after 2026-10-20
    st.sampled_from([None, "test-1", "real"]),
    payloads, labels), min_size=1, max_size=25)

START = datetime(2026, 10, 20, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def plan() -> RatingPlan:
    return RatingPlan.from_catalog(load_catalog(catalog_toml(policies=POLICIES, prices=PRICES)))


@pytest.fixture(scope="module")
def duck(plan: RatingPlan) -> Iterator[duckdb.DuckDBPyConnection]:
    conn = duckdb.connect()
    conn.execute("SET TimeZone = 'UTC'")
    plan.install(conn)
    yield conn
    conn.close()


def expected(plan: RatingPlan, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """(event_id, status, policy_id, version, meter, quantity, amount) by the reference."""
    catalog = load_catalog(catalog_toml(policies=POLICIES, prices=PRICES))
    realm = catalog.realms["acme"]
    out: list[tuple[Any, ...]] = []
    lines: list[tuple[Any, ...]] = []
    for row in rows:
        facts = EventFacts(row["billing_account_id"], "activity", row["event_type"],
                           row["occurred_at"].strftime("%Y-%m-%dT%H:%M:%S.%fZ"), row["subject_ref"],
                           json.loads(row["payload"]), json.loads(row["labels"]))
        matched = []
        for policy_id in sorted(realm.policies):
            versions = [v for v in realm.policies[policy_id].versions
                        if v.effective_at <= row["occurred_at"]]
            if not versions:
                continue
            version = max(versions, key=lambda v: v.effective_at)
            intents = evaluate(parse_policy(version.document), facts)
            if intents is not None:
                matched.append((policy_id, version.version, intents))
        if not matched:
            out.append((row["event_id"], "skipped_no_policy", None, None, None, None, None))
        elif len(matched) > 1:
            out.extend((row["event_id"], "quarantined", p, v, None, None, None) for p, v, _ in matched)
        else:
            policy_id, version, intents = matched[0]
            index = 0
            for intent in intents:
                for meter, quantity in intent.meters:
                    # int(): evaluate() hands back a payload boolean as bool, not as 1/0.
                    lines.append((row, policy_id, version, meter, int(quantity), index))
                    index += 1
    carry: dict[tuple[str, str, str], int] = defaultdict(int)
    rows_by_price = sorted(lines, key=lambda line: (line[0]["occurred_at"], line[0]["event_id"], line[5]))
    for row, policy_id, version, meter, quantity, _ in rows_by_price:
        in_force = [p for p in realm.prices if p.meter == meter and p.effective_at <= row["occurred_at"]]
        amount = 0
        if in_force:
            p = max(in_force, key=lambda p: p.effective_at)
            key = (row["billing_account_id"], meter, p.price_id)
            priced = price_line(PriceRow(p.price_id, meter, p.unit_price_xusd, p.unit_quantity_minor,
                                         p.rounding, "2026-01-01T00:00:00Z"), quantity, carry[key])
            carry[key] = priced.remainder_after
            amount = priced.amount_xusd
        out.append((row["event_id"], "rated", policy_id, version, meter, quantity, amount))
    return sorted(out, key=repr)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events)
def test_the_plan_rates_and_prices_like_the_reference(plan: RatingPlan, duck: duckdb.DuckDBPyConnection,
                                                      drawn: list[Any]) -> None:
    rows = [{"event_id": str(uuid.uuid4()), "realm": "acme", "billing_account_id": account,
             "semantic_kind": "activity", "event_type": event_type,
             "occurred_at": START + timedelta(minutes=minutes), "subject_ref": subject,
             "payload": json.dumps(payload), "labels": json.dumps(label_values)}
            for event_type, account, minutes, subject, payload, label_values in drawn]
    batch = pa.Table.from_pylist(rows)  # noqa: F841 (read by DuckDB below)
    duck.execute("CREATE OR REPLACE TEMP TABLE events AS SELECT event_id::UUID AS event_id, realm,"
                 " billing_account_id, semantic_kind, event_type, occurred_at, subject_ref::VARCHAR AS subject_ref,"
                 " payload::JSON AS payload, labels::JSON AS labels FROM batch")
    priced = f"({priced_sql('(' + plan.lines_sql('events') + ')')})"
    got = duck.execute(
        "SELECT CAST(event_id AS VARCHAR), status, policy_id, policy_version, meter_code,"
        f" quantity_minor, amount_xusd FROM ({described_sql('(' + amounts_sql(priced, 'event_id, line_key') + ')')})"
    ).fetchall()
    assert sorted(got, key=repr) == expected(plan, rows)
    # The sweep's route: one row per event with its lines in slots, carried in numpy.
    duck.execute("SET arrow_lossless_conversion = true")
    try:
        slotted = duck.sql(plan.slots_sql("events")).to_arrow_table()
    finally:
        duck.execute("SET arrow_lossless_conversion = false")
    try:
        lines = slot_lines(slotted, plan.slot_count(), PriceTerms.of(plan.price_terms()))
    except CarryOutOfRange:
        return  # the sweep prices such a run with the SQL window: what was checked above
    event_ids = slotted.column("event_id").to_pylist()
    swept = []
    for row, key, quantity, amount in zip(lines.parent.tolist(), lines.line_key.tolist(),
                                          lines.quantity.to_pylist(), lines.amount.to_pylist(),
                                          strict=True):
        spec = plan.lines[key]
        swept.append((str(event_ids[row]), spec.status, spec.policy_id, spec.policy_version,
                      spec.meter_code, quantity, amount))
    assert sorted(swept, key=repr) == expected(plan, rows)


@settings(max_examples=examples(100), deadline=None)
@given(st.sampled_from(["floor", "ceil", "nearest"]),
       st.sampled_from([1, 2, 7, 1000, 2**61 - 1, 2**61, 2**62 + 3]),
       st.integers(0, 3),
       st.lists(st.integers(0, 2**62), min_size=1, max_size=8))
def test_amounts_carry_exactly_even_beyond_64_bit_sums(rounding: str, unit: int, unit_price: int,
                                                       quantities: list[int]) -> None:
    row = PriceRow("p", "m", unit_price, unit, rounding, "2026-01-01T00:00:00Z")
    carried, wanted = 0, []
    for quantity in quantities:
        line = price_line(row, quantity, carried)
        carried = line.remainder_after
        wanted.append(line.amount_xusd)
    # lake.ratings stores amounts as BIGINT: a run with a larger one fails instead (ConversionException).
    assume(all(amount < 2**63 for amount in wanted))
    conn = duckdb.connect()
    RatingPlan([], [PlannedPrice(1, "r", "m", "p", unit_price, unit, rounding, START, None)]).install(conn)
    conn.execute("CREATE TABLE priced (billing_account_id VARCHAR, price_key INTEGER,"
                 " occurred_at BIGINT, event_id INTEGER, line_key INTEGER, quantity_minor BIGINT)")
    conn.executemany("INSERT INTO priced VALUES ('a', 1, ?, ?, 0, ?)",
                     [(i, i, q) for i, q in enumerate(quantities)])
    got = [amount for (amount,) in conn.execute(
        f"SELECT amount_xusd FROM ({amounts_sql('priced', 'event_id, line_key')}) ORDER BY occurred_at"
    ).fetchall()]
    conn.close()
    assert got == wanted


def _sql_tree(sql: str) -> Any:
    """DuckDB's own parse of `sql` (its serialized AST), so that the test reads the query's
    structure, not its text."""
    conn = duckdb.connect()
    try:
        row = conn.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()
    finally:
        conn.close()
    assert row is not None
    tree = json.loads(row[0])
    assert not tree["error"], tree
    return tree


def _nodes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for child in node.values():
            yield from _nodes(child)
    elif isinstance(node, list):
        for child in node:
            yield from _nodes(child)


def _leaf_paths(structure: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = []
    for key, child in structure.items():
        paths += [prefix + (key,)] if child == "JSON" else _leaf_paths(child, prefix + (key,))
    return paths


@pytest.mark.parametrize("query", ["slots_sql", "lines_sql"])
def test_the_benchmark_policies_read_each_payload_path_once_per_event(query: str) -> None:
    """The sweep's fast path for the benchmark's catalog: the payload is parsed once per
    event, in the layer that extracts every path the policies read into a column of its own,
    and the matches and quantities read those columns (an integer cast straight from their
    text first), never the payload. Reading the payload again at every use is what the
    rating would cost without it: the same results, several times the parsing."""
    from bench.rating import PATHS, catalog_text

    plan = RatingPlan.from_catalog(load_catalog(catalog_text()))
    nodes = list(_nodes(_sql_tree(getattr(plan, query)("events"))))
    json_calls = [n for n in nodes if n.get("class") == "FUNCTION"
                  and str(n.get("function_name", "")).startswith("json_")]
    assert json_calls

    def first_column(call: dict[str, Any]) -> str | None:
        first = call["children"][0]
        return first["column_names"][-1] if first.get("class") == "COLUMN_REF" else None

    # One read of the document per event: a json_transform of the payload into one struct
    # with a leaf for each distinct path, and nothing else reads the payload or the labels.
    document_reads = [c for c in json_calls if first_column(c) in ("payload", "labels")]
    assert [(c["function_name"], first_column(c)) for c in document_reads] == [
        ("json_transform", "payload")]
    structure = json.loads(document_reads[0]["children"][1]["value"]["value"])
    wanted = sorted(tuple(path.removeprefix("$.").split(".")) for path in PATHS)
    assert sorted(_leaf_paths(structure)) == wanted
    # Each leaf becomes one column, once.
    hoisted = sorted(n["alias"] for n in nodes if re.fullmatch(r"_j[0-9]+", n.get("alias") or ""))
    assert len(hoisted) == len(set(hoisted)) == len(PATHS)
    # The rated expressions read only those columns: every other JSON function's input is one.
    others = [c for c in json_calls if c not in document_reads]
    assert others and {first_column(c) for c in others} <= set(hoisted)
    # And every path's coercion tries the cast from its text first.
    shortcut = {first_column(n) for n in nodes if n.get("function_name") == "regexp_full_match"}
    assert set(hoisted) <= shortcut
