"""Canonical request_hash and event_id (the events' rules; docs/architecture.md)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pipelines.canonical import canonical_json, event_id, request_hash
from pipelines.events import EventIn, ValidEvent, validate_event

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)


def accept(body: dict, account: str = "acct", realm: str = "acme") -> ValidEvent:
    item = msgspec.json.decode(json.dumps(body).encode(), type=EventIn)
    result = validate_event(item, realm=realm, billing_account_id=account, now=NOW, max_future_skew_seconds=300)
    assert isinstance(result, ValidEvent), result
    return result


BASE = {"semantic_kind": "activity", "event_type": "llm.completion",
        "occurred_at": "2026-11-01T12:00:00Z", "subject_ref": "job-1",
        "payload": {"usage": {"input_tokens": 10, "output_tokens": 5}, "model": "m1"}}


def test_key_order_and_spacing_do_not_change_the_hash() -> None:
    reordered = {"payload": {"model": "m1", "usage": {"output_tokens": 5, "input_tokens": 10}},
                 "subject_ref": "job-1", "occurred_at": "2026-11-01T12:00:00Z",
                 "event_type": "llm.completion", "semantic_kind": "activity"}
    spaced = json.dumps(BASE, indent=4).encode()
    a = accept(BASE)
    b = accept(reordered)
    c = validate_event(msgspec.json.decode(spaced, type=EventIn), realm="acme", billing_account_id="acct",
                       now=NOW, max_future_skew_seconds=300)
    assert isinstance(c, ValidEvent)
    assert a.request_hash == b.request_hash == c.request_hash
    assert a.event_id == b.event_id == c.event_id


def test_equal_instants_in_other_offsets_give_one_hash() -> None:
    a = accept(BASE)
    b = accept({**BASE, "occurred_at": "2026-11-01T13:00:00+01:00"})
    c = accept({**BASE, "occurred_at": "2026-11-01T07:00:00.000000-05:00"})
    assert a.occurred_at == b.occurred_at == c.occurred_at == "2026-11-01T12:00:00.000000Z"
    assert a.request_hash == b.request_hash == c.request_hash


def test_changed_facts_give_a_new_identity() -> None:
    base = accept(BASE)
    for change in ({"semantic_kind": "outcome"}, {"event_type": "llm.other"},
                   {"occurred_at": "2026-11-01T12:00:00.000001Z"}, {"subject_ref": "job-2"},
                   {"payload": {"usage": {"input_tokens": 11, "output_tokens": 5}, "model": "m1"}}):
        other = accept({**BASE, **change})
        assert other.request_hash != base.request_hash, change
        assert other.event_id != base.event_id
    assert accept(BASE, account="other").request_hash != base.request_hash


def test_labels_are_not_part_of_the_identity() -> None:
    assert accept({**BASE, "labels": {"env": "prod"}}).request_hash == accept(BASE).request_hash


def test_empty_subject_ref_means_absent() -> None:
    without = {k: v for k, v in BASE.items() if k != "subject_ref"}
    assert accept({**BASE, "subject_ref": ""}).request_hash == accept(without).request_hash


def test_non_object_payload_becomes_empty_object() -> None:
    assert accept({**BASE, "payload": [1, 2]}).payload == {}
    assert accept({**BASE, "payload": "text"}).request_hash == accept({**BASE, "payload": {}}).request_hash


def test_integral_floats_hash_like_integers() -> None:
    assert canonical_json({"a": 1.0, "b": [2.0, 2.5]}) == b'{"a":1,"b":[2,2.5]}'


def test_event_id_is_a_uuid_bound_to_realm_and_account() -> None:
    rh = accept(BASE).request_hash
    assert event_id("acme", "acct", rh) == event_id("acme", "acct", rh)
    assert event_id("acme", "acct", rh) != event_id("globex", "acct", rh)
    assert len(event_id("acme", "acct", rh)) == 36


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5))
def test_canonical_json_is_stable_under_reencoding(payload: dict) -> None:
    once = canonical_json(payload)
    assert canonical_json(msgspec.json.decode(once)) == once
    assert request_hash("a", "activity", "t", "x", None, payload) == request_hash(
        "a", "activity", "t", "x", None, msgspec.json.decode(once))


def test_integral_numbers_are_ints_below_1e21_and_numbers_beyond_a_double_are_refused() -> None:
    import msgspec
    import pytest

    from pipelines.canonical import float_hook

    decode = msgspec.json.Decoder(float_hook=float_hook).decode
    assert decode(b"[1e16, 1.0, 2.5, 1e21]") == [10_000_000_000_000_000, 1, 2.5, 1e21]
    assert canonical_json(decode(b'{"q": 1e16}'), floats_normalized=True) == b'{"q":10000000000000000}'
    for text in (b'{"q": 1e400}', b'{"q": -1e400}'):
        with pytest.raises(msgspec.ValidationError):
            decode(text)
