"""POST /mgt/v1/events and /events/batch over real HTTP on loopback (the events' rules; docs/architecture.md)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
from vlunaai import (
    RequestContext,
    ServiceClientOptions,
    ServiceKeyCredentials,
    VlunaAIConfig,
    create_service_client,
)

from tests.conftest import Service


def event(**over: Any) -> dict[str, Any]:
    body = {"semantic_kind": "activity", "event_type": "llm.completion",
            "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": f"job-{uuid.uuid4()}",
            "payload": {"usage": {"input_tokens": 1200, "output_tokens": 300}}}
    body.update(over)
    return body


def official_client(service: Service, base_suffix: str = "/mgt/v1") -> Any:
    return create_service_client(ServiceClientOptions(
        config=VlunaAIConfig(base_url=service.base_url + base_suffix, realm_id="acme"),
        service_key=ServiceKeyCredentials(key_id=service.key.key_id, secret=service.key.secret),
    ))


def test_official_client_records_an_event_unmodified(service: Service) -> None:
    async def run() -> None:
        client = official_client(service)
        ctx = RequestContext(billing_account_id="acct_events")
        body = event(labels={"Env": "prod", "run": "0b3c2a6e-8f1d-4c1e-9a55-3f1d2e4b5c6d", "retry": False, "n": 3})
        first = await client.record_billing_event(body=body, context=ctx)
        again = await client.record_billing_event(body=body, context=ctx)
        await client.close()
        assert first.ok and again.ok
        assert first.data is not None and again.data is not None
        assert first.data.event_id == again.data.event_id
        assert first.data.request_hash == again.data.request_hash
        assert first.data.labels.root == {"env": "prod", "run": "0b3c2a6e-8f1d-4c1e-9a55-3f1d2e4b5c6d",
                                          "retry": False, "n": 3}
    asyncio.run(run())


def test_official_client_records_a_batch_unmodified(service: Service) -> None:
    async def run() -> None:
        client = official_client(service)
        ctx = RequestContext(billing_account_id="acct_events")
        items = [event() for _ in range(3)]
        result = await client.record_billing_event_batch(body={"events": items}, context=ctx)
        await client.close()
        assert result.ok and result.data is not None
        assert result.data.accepted_count == 3 and result.data.failed_count == 0
        assert [r.index for r in result.data.results or []] == [0, 1, 2]
    asyncio.run(run())


def test_first_write_is_201_and_replay_200_with_the_same_identity(service: Service) -> None:
    body = event(labels={"env": "prod"})
    first = service.post("/mgt/v1/events", body, account="acct_events")
    assert first.status_code == 201, first.text
    replay = service.post("/mgt/v1/events", {**body, "labels": {"env": "staging"}}, account="acct_events")
    assert replay.status_code == 200, replay.text
    a, b = first.json()["data"], replay.json()["data"]
    assert a == b  # same identity, and the labels and created_at stored at first acceptance
    assert a["labels"] == {"env": "prod"}
    assert a["billing_account_id"] == "acct_events"
    assert first.headers["x-request-id"]
    assert set(a) == {"event_id", "request_hash", "billing_account_id", "semantic_kind", "event_type",
                      "occurred_at", "subject_ref", "payload", "labels", "created_at"}


def test_same_instant_in_another_offset_is_a_replay(service: Service) -> None:
    body = event(occurred_at="2026-11-20T10:00:00Z")
    assert service.post("/mgt/v1/events", body, account="acct_events").status_code == 201
    shifted = {**body, "occurred_at": "2026-11-20T12:00:00+02:00"}
    assert service.post("/mgt/v1/events", shifted, account="acct_events").status_code == 200


def test_a_body_supplied_account_is_not_used(service: Service) -> None:
    body = event(billing_account_id="acct_prepaid")
    r = service.post("/mgt/v1/events", body, account="acct_events")
    assert r.status_code == 201
    assert r.json()["data"]["billing_account_id"] == "acct_events"


def test_batch_reports_accepted_duplicate_invalid_and_in_batch_repeat(service: Service) -> None:
    existing = event()
    assert service.post("/mgt/v1/events", existing, account="acct_events").status_code == 201
    fresh = event()
    items = [fresh, existing, event(semantic_kind="nope"), fresh, "not an object", event(occurred_at="2026-11-20")]
    r = service.post("/mgt/v1/events/batch", {"events": items}, account="acct_events")
    assert r.status_code == 207, r.text
    data = r.json()["data"]
    assert [x["index"] for x in data["results"]] == list(range(6))
    assert [x["status"] for x in data["results"]] == ["accepted", "duplicate", "invalid", "duplicate",
                                                       "invalid", "invalid"]
    assert data["results"][3]["event_id"] == data["results"][0]["event_id"]
    assert data["results"][2]["error"]["code"] == "VALIDATION.INVALID_VALUE"
    assert data["results"][2]["error"]["field"] == "events[2].semantic_kind"  # a path in the request
    assert data["results"][5]["error"]["field"] == "events[5].occurred_at"
    assert (data["accepted_count"], data["duplicate_count"], data["invalid_count"], data["failed_count"]) == (1, 2, 3, 3)


def test_batch_limits(service: Service) -> None:
    too_many = service.post("/mgt/v1/events/batch", {"events": [event() for _ in range(1001)]}, account="acct_events")
    assert too_many.status_code == 422
    assert too_many.json()["code"] == "VALIDATION.BATCH_TOO_LARGE"
    empty = service.post("/mgt/v1/events/batch", {"events": []}, account="acct_events")
    assert empty.status_code == 422 and empty.json()["code"] == "VALIDATION.INVALID_INPUT"
    missing = service.post("/mgt/v1/events/batch", {"items": [event()]}, account="acct_events")
    assert missing.status_code == 422
    wrong = service.post("/mgt/v1/events/batch", {"events": {"a": 1}}, account="acct_events")
    assert wrong.status_code == 422 and wrong.json()["errors"][0]["field"] == "events"
    # exactly 1000 is fine
    ok = service.post("/mgt/v1/events/batch", {"events": [event() for _ in range(1000)]}, account="acct_events")
    assert ok.status_code == 207 and ok.json()["data"]["accepted_count"] == 1000


def test_body_over_16_mib_is_413(service: Service) -> None:
    big = json.dumps({"events": [event(payload={"blob": "x" * 1_000_000}) for _ in range(17)]}).encode()
    r = service.post("/mgt/v1/events/batch", raw=big, account="acct_events")
    assert r.status_code == 413
    assert r.json()["ok"] is False and r.json()["code"] == "VALIDATION.BODY_TOO_LARGE"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\"text\"", b""])
def test_malformed_json_or_non_object_is_400(service: Service, raw: bytes) -> None:
    r = service.post("/mgt/v1/events", raw=raw, account="acct_events")
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == "VALIDATION.MALFORMED_JSON"
    assert body["trace_id"] == r.headers["x-request-id"]
    assert body["meta"] == {"status": 400}


def test_invalid_event_is_422_with_every_error(service: Service) -> None:
    r = service.post("/mgt/v1/events", {"semantic_kind": "x", "event_type": "", "occurred_at": "soon"},
                     account="acct_events")
    assert r.status_code == 422
    body = r.json()
    assert body["code"] == "VALIDATION.INVALID_INPUT"
    assert {e["field"] for e in body["errors"]} == {"semantic_kind", "event_type", "occurred_at"}


def test_missing_account_context_is_400_and_unknown_account_422(service: Service) -> None:
    r = service.post("/mgt/v1/events", event())
    assert r.status_code == 400 and r.json()["code"] == "VALIDATION.MISSING_CONTEXT"
    r = service.post("/mgt/v1/events", event(), account="nobody")
    assert r.status_code == 422 and r.json()["code"] == "RESOURCE.NOT_FOUND"


def test_fifty_concurrent_posts_of_the_same_facts_give_exactly_one_201(service: Service) -> None:
    body = event()

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one() -> int:
                data = json.dumps(body).encode()
                from api.auth import sign_headers
                headers = sign_headers(key_id=service.key.key_id, secret=service.key.secret, method="POST",
                                       path="/mgt/v1/events", body=data, realm="acme",
                                       billing_account_id="acct_events")
                r = await client.post(service.base_url + "/mgt/v1/events", content=data, headers=headers)
                return r.status_code
            return await asyncio.gather(*(one() for _ in range(50)))

    codes = asyncio.run(run())
    assert sorted(codes) == [200] * 49 + [201]


def test_idempotency_key_header_is_accepted_and_ignored_on_events(service: Service) -> None:
    body = event()
    assert service.post("/mgt/v1/events", body, account="acct_events", idempotency_key="k1").status_code == 201
    assert service.post("/mgt/v1/events", body, account="acct_events", idempotency_key="k2").status_code == 200
    assert service.post("/mgt/v1/events", event(), account="acct_events", idempotency_key="k1").status_code == 201


def test_unknown_route_gets_the_error_envelope(service: Service) -> None:
    r = service.client.get(service.base_url + "/mgt/v1/nowhere")
    assert r.status_code == 404 and r.json()["ok"] is False and "x-request-id" in r.headers


def test_healthz_and_openapi_need_no_auth(service: Service) -> None:
    health = service.client.get(service.base_url + "/healthz")
    assert health.json()["data"]["status"] == "ready" and health.json()["data"]["reasons"] == []
    # unsigned, so it names no realm, account or key of the catalog
    assert "realms" not in health.json()["data"]
    assert not any(name in health.text for name in ("acme", "globex", "acct_", service.key.key_id))
    probe = service.client.head(service.base_url + "/healthz")
    assert (probe.status_code, probe.content) == (200, b"")
    schema = service.client.get(service.base_url + "/schema/openapi.json").json()
    assert "/mgt/v1/events" in schema["paths"]


def test_hostile_inputs_get_clear_errors_and_never_cost_the_batch_its_valid_items(service: Service) -> None:
    def single(body: Any) -> httpx.Response:
        return service.post("/mgt/v1/events", body, account="acct_events")

    deep = "[" * 1000 + "]" * 1000
    cases = [
        (event(semantic_kind=["activity"]), 422, "VALIDATION.INVALID_INPUT"),     # unhashable kind
        (event(occurred_at="0001-01-01T00:00:00+01:00"), 422, "VALIDATION.INVALID_INPUT"),  # no UTC instant
    ]
    for body, status, code in cases:
        r = single(body)
        assert (r.status_code, r.json()["code"]) == (status, code), r.text
    raw_cases = [
        json.dumps(event()).replace('{"input_tokens": 1200', '{"input_tokens": 1e400'),   # beyond a double
        json.dumps(event(payload={})).replace('"payload": {}', f'"payload": {deep}'),      # nested too deeply
    ]
    for raw in raw_cases:
        r = service.request("POST", "/mgt/v1/events", raw=raw.encode(), account="acct_events")
        assert (r.status_code, r.json()["code"]) == (400, "VALIDATION.MALFORMED_JSON"), r.text

    def batch(items: list[str]) -> httpx.Response:
        return service.request("POST", "/mgt/v1/events/batch", raw=('{"events": [' + ", ".join(items) + "]}").encode(),
                               account="acct_events")

    good = event()
    r = batch([json.dumps(good), json.dumps(event(semantic_kind={"a": 1})),
               json.dumps(event()).replace('{"input_tokens": 1200', '{"input_tokens": 1e400')])
    assert r.status_code == 207, r.text
    results = r.json()["data"]["results"]
    assert [x["status"] for x in results] == ["accepted", "invalid", "invalid"]
    assert results[1]["error"]["field"] == "events[1].semantic_kind"
    assert single(good).status_code == 200   # item 0 was stored
    # A body nested beyond what the decoder follows is refused whole, with nothing written.
    r = batch([json.dumps(event()), json.dumps(event(payload={})).replace('"payload": {}', f'"payload": {deep}')])
    assert (r.status_code, r.json()["code"]) == (400, "VALIDATION.MALFORMED_JSON")


def test_an_integral_number_is_one_fact_whatever_its_spelling(service: Service) -> None:
    body = event(payload={"bytes": 10000000000000000})
    first = service.post("/mgt/v1/events", body, account="acct_events")
    raw = json.dumps(body).replace("10000000000000000", "1e16")
    again = service.request("POST", "/mgt/v1/events", raw=raw.encode(), account="acct_events")
    assert first.status_code == 201 and again.status_code == 200, again.text
    assert again.json()["data"]["event_id"] == first.json()["data"]["event_id"]


def test_a_body_that_is_not_utf8_is_malformed_json_not_a_500(service: Service) -> None:
    good = json.dumps(event()).encode()
    bad = good.replace(b'"input_tokens"', b'"input_\xfftokens"')
    r = service.request("POST", "/mgt/v1/events", raw=bad, account="acct_events")
    assert (r.status_code, r.json()["code"]) == (400, "VALIDATION.MALFORMED_JSON"), r.text
    assert "UTF-8" in r.json()["message"]
    r = service.request("POST", "/mgt/v1/events/batch", raw=b'{"events": [' + good + b", " + bad + b"]}",
                        account="acct_events")
    assert r.status_code == 207, r.text
    assert [x["status"] for x in r.json()["data"]["results"]] == ["accepted", "invalid"]
