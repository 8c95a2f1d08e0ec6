"""Every event validation rule of the events' rules, and label typing."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import msgspec
import pytest

from pipelines.events import EventIn, FieldError, ValidEvent, validate_event

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)
GOOD = {"semantic_kind": "outcome", "event_type": "job.done", "occurred_at": "2026-11-22T11:00:00Z"}


def check(body: dict[str, Any]) -> ValidEvent | list[FieldError]:
    item = msgspec.json.decode(json.dumps(body).encode(), type=EventIn)
    return validate_event(item, realm="acme", billing_account_id="acct", now=NOW, max_future_skew_seconds=300)


def faults(body: dict[str, Any]) -> dict[str, str]:
    result = check(body)
    assert isinstance(result, list), f"expected faults, got {result}"
    return {e.field: e.code for e in result}


def test_a_good_event_is_valid() -> None:
    assert isinstance(check(GOOD), ValidEvent)


@pytest.mark.parametrize(("change", "field", "code"), [
    ({"semantic_kind": None}, "semantic_kind", "VALIDATION.REQUIRED"),
    ({"semantic_kind": "usage"}, "semantic_kind", "VALIDATION.INVALID_VALUE"),
    ({"event_type": None}, "event_type", "VALIDATION.REQUIRED"),
    ({"event_type": "   "}, "event_type", "VALIDATION.REQUIRED"),
    ({"event_type": 7}, "event_type", "VALIDATION.INVALID_TYPE"),
    ({"event_type": "x" * 129}, "event_type", "VALIDATION.TOO_LONG"),
    ({"subject_ref": "s" * 257}, "subject_ref", "VALIDATION.TOO_LONG"),
    ({"subject_ref": 5}, "subject_ref", "VALIDATION.INVALID_TYPE"),
    ({"occurred_at": None}, "occurred_at", "VALIDATION.REQUIRED"),
    ({"occurred_at": "2026-11-22T11:00:00"}, "occurred_at", "VALIDATION.INVALID_TIMESTAMP"),
    ({"occurred_at": "2026-13-01T00:00:00Z"}, "occurred_at", "VALIDATION.INVALID_TIMESTAMP"),
    ({"occurred_at": "yesterday"}, "occurred_at", "VALIDATION.INVALID_TIMESTAMP"),
    ({"occurred_at": 1700000000}, "occurred_at", "VALIDATION.INVALID_TIMESTAMP"),
    ({"occurred_at": "2026-11-22T12:05:01Z"}, "occurred_at", "VALIDATION.IN_FUTURE"),
    ({"labels": ["a"]}, "labels", "VALIDATION.INVALID_TYPE"),
    ({"labels": {f"k{i}": i for i in range(33)}}, "labels", "VALIDATION.TOO_MANY"),
    ({"labels": {"1bad": "x"}}, "labels.1bad", "VALIDATION.INVALID_VALUE"),
    ({"labels": {"k" * 65: "x"}}, "labels." + "k" * 65, "VALIDATION.INVALID_VALUE"),
    ({"labels": {"env": "x" * 257}}, "labels.env", "VALIDATION.TOO_LONG"),
    ({"labels": {"env": {"nested": 1}}}, "labels.env", "VALIDATION.INVALID_TYPE"),
    ({"labels": {"env": None}}, "labels.env", "VALIDATION.INVALID_TYPE"),
    ({"labels": {"Env": "a", "env": "b"}}, "labels.env", "VALIDATION.DUPLICATE_KEY"),
])
def test_each_rule_names_its_field_and_code(change: dict[str, Any], field: str, code: str) -> None:
    assert faults({**GOOD, **change}).get(field) == code


def test_every_fault_of_an_event_is_reported_together() -> None:
    found = faults({"semantic_kind": "x", "event_type": "", "occurred_at": "nope", "subject_ref": "s" * 300})
    assert set(found) == {"semantic_kind", "event_type", "occurred_at", "subject_ref"}


def test_limits_are_inclusive() -> None:
    ok = check({**GOOD, "event_type": "x" * 128, "subject_ref": "s" * 256,
                "occurred_at": "2026-11-22T12:05:00Z",
                "labels": {f"k{i}": "v" * 256 for i in range(32)}})
    assert isinstance(ok, ValidEvent)


def test_event_type_is_trimmed_and_label_keys_lower_cased() -> None:
    ok = check({**GOOD, "event_type": "  job.done ", "labels": {"Region": "EU", "Tier.Level": 2}})
    assert isinstance(ok, ValidEvent)
    assert ok.event_type == "job.done"
    assert ok.labels == {"region": "EU", "tier.level": 2}


def test_occurred_at_is_normalized_to_utc_microseconds() -> None:
    ok = check({**GOOD, "occurred_at": "2026-11-22T13:00:00.1234567+02:00"})
    assert isinstance(ok, ValidEvent)
    assert ok.occurred_at == "2026-11-22T11:00:00.123457Z"


LABELS = {
    "plain": ("text", "value_text", "plain"),
    "run": ("uuid", "value_uuid", "0b3c2a6e-8f1d-4c1e-9a55-3f1d2e4b5c6d"),
    "upper": ("text", "value_text", "0B3C2A6E-8F1D-4C1E-9A55-3F1D2E4B5C6D"),  # not the canonical form
    "nodash": ("text", "value_text", "0b3c2a6e8f1d4c1e9a553f1d2e4b5c6d"),
    "yes": ("bool", "value_bool", True),
    "no": ("bool", "value_bool", False),
    "count": ("number", "value_number", 3),
    "ratio": ("number", "value_number", 2.5),
}


def test_label_values_are_typed_into_exactly_one_slot(tmp_path) -> None:
    import uuid

    from api.events.views import to_record
    from warehouse.operational import open_operational
    from warehouse.outbox import EventOutbox
    from warehouse.writer import Transaction

    ok = check({**GOOD, "labels": {k: v[2] for k, v in LABELS.items()}})
    assert isinstance(ok, ValidEvent)
    conn = open_operational(tmp_path / "op.duckdb")
    outbox = EventOutbox(conn)
    conn.execute("BEGIN")
    tx = Transaction(conn, NOW)
    outbox.stage(tx, "acme", to_record(ok), "single")
    tx.flush()
    tx.commit()
    conn.execute("COMMIT")
    rows = conn.execute("SELECT key, slot, value_text, value_uuid, value_bool, value_number FROM event_labels").fetchall()
    assert len(rows) == len(LABELS)
    slots = ("value_text", "value_uuid", "value_bool", "value_number")
    for key, slot, *values in rows:
        expected_slot, column, value = LABELS[key]
        assert slot == expected_slot, key
        filled = {name: v for name, v in zip(slots, values, strict=False) if v is not None}
        expected = uuid.UUID(value) if column == "value_uuid" else value
        assert filled == {column: expected}, key


def test_a_single_event_is_handed_to_the_inline_rater_only_once_its_group_is_durable(tmp_path) -> None:
    from api.events.views import to_record
    from warehouse.operational import open_operational
    from warehouse.outbox import EventOutbox
    from warehouse.writer import Transaction
    from writer.events.ingest import IngestHandler
    from writer.ops import IngestOp

    ok = check(GOOD)
    assert isinstance(ok, ValidEvent)
    conn = open_operational(tmp_path / "op.duckdb")
    handler = IngestHandler(EventOutbox(conn))
    tx = Transaction(conn, NOW)
    outcome = handler.apply(tx, IngestOp("acme", "single", [to_record(ok)]))
    tx.flush()
    assert outcome()[0].accepted
    assert handler.accepted_singles == []          # decided, not durable: a rollback rates nothing
    conn.execute("BEGIN")
    tx.commit()
    conn.execute("COMMIT")
    assert [event.event_id for _, event in handler.accepted_singles] == [to_record(ok).event_id]
    conn.close()


def _view_select(sql: str) -> str:
    """The SELECT of the last `CREATE VIEW event_labels AS ...` in a migration."""
    return sql.rsplit("CREATE VIEW event_labels AS", 1)[1].strip().rstrip(";")


def test_the_label_view_types_every_kind_of_value_as_its_first_form_did(tmp_path: Any) -> None:
    """Migration 6 rewrote the view to parse each event's labels once; the rows it gives, for
    every kind of value validation lets a label hold, and for the nested, null and list values
    it refuses, are the rows migration 5's form gave. The SELECT is taken from the file the
    way the lake exporter takes it (`LakeExporter._labels_query`)."""
    import duckdb

    from warehouse.export import LakeExporter
    from warehouse.operational import MIGRATIONS, open_operational

    first = _view_select(dict(MIGRATIONS)[5])
    conn = open_operational(tmp_path / "op.duckdb")
    current = LakeExporter(tmp_path)._labels_query(conn)
    assert "json_each" in current
    labels = [
        {"n": 1, "neg": -3, "big": 18446744073709551615, "huge": 184467440737095516150,
         "f": 1.5, "e": 1e300, "t": True, "no": False, "s": "eu-west", "empty": "",
         "u": "0000001c-d82d-8c40-bac4-bbb2fd9db42d", "U": "0000001C-D82D-8C40-BAC4-BBB2FD9DB42D",
         "almost": "0000001c-d82d-8c40-bac4-bbb2fd9db42", "q": 'say "hi"', "null": None,
         "list": [1, 2], "obj": {"x": 1}, "é": "ü"},
        {},
        {"only": "one"},
    ]
    mem = duckdb.connect()
    mem.execute("CREATE TABLE events (event_id UUID, realm VARCHAR, billing_account_id VARCHAR, labels JSON)")
    for i, doc in enumerate(labels):
        mem.execute("INSERT INTO events VALUES (?, 'acme', 'acct', ?)",
                    [f"00000000-0000-0000-0000-{i:012d}", json.dumps(doc)])
    old = mem.execute(f"SELECT * FROM ({first}) ORDER BY ALL").fetchall()
    new = mem.execute(f"SELECT * FROM ({current}) ORDER BY ALL").fetchall()
    assert len(old) == sum(len(doc) for doc in labels)
    assert new == old
    slots = {row[3]: row[4] for row in new}
    assert (slots["u"], slots["U"], slots["s"], slots["t"], slots["n"], slots["obj"]) == \
        ("uuid", "text", "text", "bool", "number", "number")
