"""POST /mgt/v1/events and /events/batch against the events' rules, over real HTTP: the
edges of occurred_at, the canonical request_hash computed independently, and what a replay
and a refused batch leave stored."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import uuid
from typing import Any

import httpx
import pytest

from tests.conftest import Service

ACCT = "acct_events"


def event(**over: Any) -> dict[str, Any]:
    body = {"semantic_kind": "activity", "event_type": "audit.probe",
            "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": f"job-{uuid.uuid4()}",
            "payload": {"n": 1}}
    body.update(over)
    return body


def single(service: Service, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return service.post("/mgt/v1/events", raw=body, account=ACCT)
    return service.post("/mgt/v1/events", body, account=ACCT)


def batch(service: Service, body: Any) -> httpx.Response:
    return service.post("/mgt/v1/events/batch", body, account=ACCT)


def test_occurred_at_with_more_than_nine_fraction_digits_is_accepted(service: Service) -> None:
    # RFC 3339: time-secfrac = "." 1*DIGIT, any number of digits.
    r = single(service, event(occurred_at="2026-11-20T10:00:00.1234567891+01:00"))
    assert r.status_code == 201, r.text
    assert r.json()["data"]["occurred_at"] == "2026-11-20T09:00:00.123457Z"
    # The digits past the microsecond decide nothing but its rounding: one instant, one event.
    body = event(occurred_at="2026-11-20T10:00:00.0000004999999999Z")
    first = single(service, body)
    assert first.status_code == 201, first.text
    assert first.json()["data"]["occurred_at"] == "2026-11-20T10:00:00.000000Z"
    assert single(service, {**body, "occurred_at": "2026-11-20T10:00:00Z"}).status_code == 200


@pytest.mark.parametrize(("text", "normalized"), [
    ("2026-11-20t10:00:00z", "2026-11-20T10:00:00.000000Z"),
    ("2026-11-20T10:00:00+14:00", "2026-11-19T20:00:00.000000Z"),
    ("2026-11-20T10:00:00-12:00", "2026-11-20T22:00:00.000000Z"),
    ("2026-11-20T10:00:00-00:00", "2026-11-20T10:00:00.000000Z"),
    ("0001-01-01T00:00:00Z", "0001-01-01T00:00:00.000000Z"),
    ("2026-11-20T10:00:00+24:00", None),      # offset hours are 00-23
    ("2026-12-31T23:59:60Z", None),           # no UTC microsecond holds a leap second
    ("2026-11-20T10:00:00", None),            # no offset
    ("9999-12-31T23:59:59Z", None),           # in the future
])
def test_occurred_at_edges_are_normalized_or_refused_never_a_500(service: Service, text: str,
                                                                  normalized: str | None) -> None:
    r = single(service, event(occurred_at=text))
    if normalized is None:
        assert r.status_code == 422, r.text
        assert [e["field"] for e in r.json()["errors"]] == ["occurred_at"]
    else:
        assert r.status_code == 201, r.text
        assert r.json()["data"]["occurred_at"] == normalized


def test_request_hash_is_sha256_of_the_canonical_facts_and_absent_null_empty_subject_are_one(
        service: Service) -> None:
    # Keys by code point (U+FFFF before U+1F600; UTF-16 order would swap them), integral
    # numbers as integers, integers beyond 2^64 kept exact, UTF-8 unescaped.
    raw = (b'{"occurred_at": "2026-11-20T11:00:00+01:00", "event_type": "  audit.hash ",'
           b' "semantic_kind": "activity", "payload": {"\\ud83d\\ude00": 2, "\\uffff": 1,'
           b' "a": [1.0, 1e2, -0, 18446744073709551617, 0.5],'
           b' "B": {"z": "\\u00e9", "y": "\\u2028"}, "k": true, "n": null}}')
    facts = {"billing_account_id": ACCT, "semantic_kind": "activity", "event_type": "audit.hash",
             "occurred_at": "2026-11-20T10:00:00.000000Z", "subject_ref": None,
             "payload": {"\uffff": 1, "\U0001F600": 2, "a": [1, 100, 0, 2**64 + 1, 0.5],
                         "B": {"z": "é", "y": "\u2028"}, "k": True, "n": None}}
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False).encode()
    expected = base64.urlsafe_b64encode(hashlib.sha256(canonical).digest()).rstrip(b"=").decode()
    first = single(service, raw)
    assert first.status_code in (200, 201), first.text
    data = first.json()["data"]
    assert data["request_hash"] == expected
    assert data["event_type"] == "audit.hash" and data["subject_ref"] is None
    assert data["payload"] == facts["payload"]
    for subject in (b'"subject_ref": null, ', b'"subject_ref": "", '):
        again = single(service, raw.replace(b'{"occurred_at"', b'{' + subject + b'"occurred_at"'))
        assert again.status_code == 200, again.text
        assert again.json()["data"]["event_id"] == data["event_id"]


def test_a_single_replay_of_a_batch_event_returns_the_labels_and_created_at_of_the_batch(
        service: Service) -> None:
    body = event(labels={"Src": "batch"})
    r = batch(service, {"events": [body, {**body, "labels": {"src": "repeat"}}]})
    assert r.status_code == 207, r.text
    results = r.json()["data"]["results"]
    assert [x["status"] for x in results] == ["accepted", "duplicate"]
    replays = [single(service, {**body, "labels": {"src": f"single-{i}"}}) for i in range(2)]
    assert [x.status_code for x in replays] == [200, 200]
    a, b = (x.json()["data"] for x in replays)
    assert a == b
    assert a["event_id"] == results[0]["event_id"]
    assert a["labels"] == {"src": "batch"}


def test_a_batch_of_1001_writes_nothing_and_non_object_items_are_invalid(service: Service) -> None:
    items = [event() for _ in range(1001)]
    r = batch(service, {"events": items})
    assert (r.status_code, r.json()["code"]) == (422, "VALIDATION.BATCH_TOO_LARGE")
    assert single(service, items[0]).status_code == 201
    assert single(service, items[1000]).status_code == 201
    r = batch(service, {"events": [None, [], 7, "x", event(payload=None)]})
    assert r.status_code == 207, r.text
    data = r.json()["data"]
    assert [x["status"] for x in data["results"]] == ["invalid"] * 4 + ["accepted"]
    assert [x["error"]["field"] for x in data["results"][:4]] == [f"events[{i}]" for i in range(4)]
    assert (data["accepted_count"], data["duplicate_count"], data["invalid_count"],
            data["failed_count"]) == (1, 0, 4, 4)



def test_singles_and_batches_racing_on_one_event_accept_it_exactly_once(service: Service) -> None:
    from api.auth import sign_headers

    body = event()

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one(path: str, payload: Any) -> list[str]:
                data = json.dumps(payload).encode()
                headers = sign_headers(key_id=service.key.key_id, secret=service.key.secret,
                                       method="POST", path=path, body=data, realm="acme",
                                       billing_account_id=ACCT)
                r = await client.post(service.base_url + path, content=data, headers=headers)
                if path.endswith("/batch"):
                    assert r.status_code == 207, r.text
                    return [x["status"] for x in r.json()["data"]["results"][1:]]
                return [{201: "accepted", 200: "duplicate"}[r.status_code]]
            calls = [one("/mgt/v1/events", body) for _ in range(15)]
            calls += [one("/mgt/v1/events/batch", {"events": [event(), body, body]})
                      for _ in range(10)]
            return await asyncio.gather(*calls)

    statuses = [s for out in asyncio.run(run()) for s in out]
    assert sorted(statuses) == ["accepted"] + ["duplicate"] * 34


def test_a_label_number_beyond_the_range_of_a_double_is_invalid(service: Service) -> None:
    # The label's typed number slot is a double: 10**400 would read back as inf.
    body = {"semantic_kind": "activity", "event_type": "label.range", "occurred_at": "2026-11-01T00:00:00Z",
            "labels": {"big": 10 ** 400}}
    res = service.post("/mgt/v1/events", body, account=ACCT)
    assert res.status_code == 422, res.text
    assert [e["field"] for e in res.json()["errors"]] == ["labels.big"]
    body["labels"] = {"big": 2 ** 64 + 1}  # beyond 64 bits but a finite double: kept exactly
    res = service.post("/mgt/v1/events", body, account=ACCT)
    assert res.status_code == 201, res.text
    assert res.json()["data"]["labels"] == {"big": 2 ** 64 + 1}
