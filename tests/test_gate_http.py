"""The gate loop over real HTTP (the gate's rules; docs/architecture.md): authorize, commit, cancel, holds,
limits, leases and idempotency."""

from __future__ import annotations

import asyncio
import json
import time
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

from api.auth import sign_headers
from tests.conftest import Service


def authorize(service: Service, principal: str, feature: str = "gate.unit", estimate: str = "10", **kw: Any) -> httpx.Response:
    return service.post("/mgt/v1/gate/authorize", {"feature_code": feature, "estimated_quantity_minor": estimate},
                        principal=principal, **kw)


def commit(service: Service, principal: str, token: str, quantity: str = "10", feature: str = "gate.unit",
           **extra: Any) -> httpx.Response:
    body = {"lease_token": token, "feature_code": feature, "quantity_minor": quantity, **extra}
    return service.post("/mgt/v1/gate/commits", body, principal=principal)


def token_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["data"]["lease_token"]


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["code"]


def test_official_client_runs_the_gate_loop_unmodified(service: Service) -> None:
    async def run() -> None:
        client = create_service_client(ServiceClientOptions(
            config=VlunaAIConfig(base_url=service.base_url + "/mgt/v1", realm_id="acme"),
            service_key=ServiceKeyCredentials(key_id=service.key.key_id, secret=service.key.secret)))
        ctx = RequestContext(principal_id="gate-p")
        auth = await client.gate_authorize(body={"feature_code": "llm.chat", "estimated_quantity_minor": "2000"}, context=ctx)
        assert auth.ok and auth.data is not None
        assert auth.data.feature_family_code == "llm"
        done = await client.gate_commit(body={
            "lease_token": auth.data.lease_token, "feature_code": "llm.chat", "quantity_minor": "1500",
            "meters": [{"meter_code": "llm.input_tokens", "quantity_minor": "1000"},
                       {"meter_code": "llm.output_tokens", "quantity_minor": "500"}]}, context=ctx)
        assert done.ok and done.data is not None
        assert done.data.amount_xusd == "150"  # 1 block of input (150) + 0 blocks of output (floor)
        assert [line.meter_code for line in done.data.lines or []] == ["llm.input_tokens", "llm.output_tokens"]
        second = await client.gate_authorize(body={"feature_code": "llm.chat", "estimated_quantity_minor": "10"}, context=ctx)
        assert second.data is not None
        cancelled = await client.gate_cancel(body={"lease_token": second.data.lease_token}, context=ctx)
        assert cancelled.ok and cancelled.data is not None
        assert cancelled.data.cancelled is True and cancelled.data.released_cap == "10"
        await client.close()
    asyncio.run(run())


def test_authorize_reply_has_every_contract_field(service: Service) -> None:
    r = authorize(service, "gate-p", estimate="7")
    data = r.json()["data"]
    assert set(data) >= {"lease_token", "lease_id", "feature_code", "feature_family_code", "window_start",
                         "window_end", "expires_at", "held_quantity_minor", "held_amount_xusd", "lease"}
    assert data["lease"] == data["lease_token"]
    assert data["held_quantity_minor"] == "7" and data["held_amount_xusd"] == "700"
    assert len(data["lease_token"]) >= 40  # 32 random bytes


def test_unknown_feature_or_family_mismatch_is_422(service: Service) -> None:
    assert error(authorize(service, "gate-p", feature="no.such")) == (422, "RESOURCE.NOT_FOUND")
    r = service.post("/mgt/v1/gate/authorize", {"feature_code": "gate.unit", "feature_family_code": "llm",
                                                "estimated_quantity_minor": "1"}, principal="gate-p")
    assert error(r) == (422, "RESOURCE.NOT_FOUND")


def test_context_errors(service: Service) -> None:
    r = service.post("/mgt/v1/gate/authorize", {"feature_code": "gate.unit", "estimated_quantity_minor": "1"})
    assert error(r) == (400, "VALIDATION.MISSING_CONTEXT")
    assert error(authorize(service, "nobody")) == (422, "RESOURCE.NOT_FOUND")
    assert error(authorize(service, "gate-p", account="acct_prepaid")) == (403, "AUTH.BILLING_ACCOUNT_MISMATCH")
    assert authorize(service, "gate-p", account="acct_gate").status_code == 200


@pytest.mark.parametrize("body", [
    {"estimated_quantity_minor": "1"},
    {"feature_code": "gate.unit", "estimated_quantity_minor": 10},
    {"feature_code": "gate.unit", "estimated_quantity_minor": "-1"},
    {"feature_code": "gate.unit", "estimated_quantity_minor": "9223372036854775808"},
    {"feature_code": "Gate.Unit", "estimated_quantity_minor": "1"},
])
def test_invalid_authorize_bodies_are_422_with_errors(service: Service, body: dict[str, Any]) -> None:
    r = service.post("/mgt/v1/gate/authorize", body, principal="gate-p")
    assert error(r) == (422, "VALIDATION.INVALID_INPUT")
    assert r.json()["errors"]


def test_funding_refusal_is_402_with_shortfall_hint(service: Service) -> None:
    r = authorize(service, "poor-p", estimate="3")
    assert error(r) == (402, "FUNDING.INSUFFICIENT")
    assert r.json()["hints"] == [{"type": "funding.xusd_shortfall", "shortfall_xusd": 300}]


def test_rate_limit_is_429_with_retry_after_and_hint(service: Service) -> None:
    codes = [authorize(service, "gate-p2", feature="gate.rated", estimate="1") for _ in range(4)]
    assert [r.status_code for r in codes[:3]] == [200, 200, 200]
    refused = codes[3]
    assert error(refused) == (429, "LIMIT.RATE_EXCEEDED")
    assert 1 <= int(refused.headers["retry-after"]) <= 2
    hint = refused.json()["hints"][0]
    assert hint["type"] == "rate.limit" and hint["limit"] == 3 and hint["remaining"] == 0 and hint["reset_at"]


def test_a_rate_limited_retry_with_an_idempotency_key_gets_the_stored_answer(service: Service) -> None:
    key = f"rated-{uuid.uuid4()}"
    first = authorize(service, "gate-p", feature="gate.rated", estimate="1", idempotency_key=key)
    token = token_of(first)
    for _ in range(3):  # the limit's window may roll over between two calls: try again then
        while authorize(service, "gate-p", feature="gate.rated", estimate="1").status_code != 429:
            pass
        fresh = authorize(service, "gate-p", feature="gate.rated", estimate="1",
                          idempotency_key=f"rated-{uuid.uuid4()}")
        if fresh.status_code == 429:
            break
    assert error(fresh) == (429, "LIMIT.RATE_EXCEEDED")       # a new key is limited like any call
    replay = authorize(service, "gate-p", feature="gate.rated", estimate="1", idempotency_key=key)
    assert replay.status_code == 200 and replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["data"]["lease_token"] == token
    other = authorize(service, "gate-p", feature="gate.rated", estimate="2", idempotency_key=key)
    assert error(other) == (409, "IDEMPOTENCY.CONFLICT")


def test_commit_errors(service: Service) -> None:
    token = token_of(authorize(service, "gate-p"))
    assert error(commit(service, "gate-p", "tgl_unknown")) == (422, "LEASE.NOT_FOUND")
    assert error(commit(service, "gate-p2", token)) == (422, "LEASE.NOT_FOUND")  # other principal
    assert error(commit(service, "gate-p", token, feature="gate.quota")) == (422, "LEASE.FEATURE_MISMATCH")
    r = commit(service, "gate-p", token, meters=[{"meter_code": "llm.input_tokens", "quantity_minor": "1"}])
    assert error(r) == (422, "FEATURE.METER_NOT_ALLOWED")
    assert r.json()["errors"][0]["field"] == "meters[0].meter_code"
    first = commit(service, "gate-p", token)
    assert first.status_code == 200
    again = commit(service, "gate-p", token)
    assert again.status_code == 200 and again.json()["data"]["commit_id"] == first.json()["data"]["commit_id"]
    assert error(commit(service, "gate-p", token, quantity="11")) == (409, "LEASE.ALREADY_COMMITTED")
    cancel = service.post("/mgt/v1/gate/cancel", {"lease_token": token}, principal="gate-p").json()["data"]
    assert cancel["cancelled"] is False and cancel["state"] == "committed" and cancel["released_cap"] == "0"


def test_cancel_releases_and_a_cancelled_lease_cannot_commit(service: Service) -> None:
    token = token_of(authorize(service, "gate-p", estimate="25"))
    first = service.post("/mgt/v1/gate/cancel", {"lease_token": token, "reason": "job failed"}, principal="gate-p")
    assert first.json()["data"] == {"cancelled": True, "state": "cancelled", "released_cap": "25",
                                    "lease_id": first.json()["data"]["lease_id"]}
    second = service.post("/mgt/v1/gate/cancel", {"lease": token}, principal="gate-p").json()["data"]
    assert second["cancelled"] is False and second["released_cap"] == "0"
    assert error(commit(service, "gate-p", token)) == (409, "LEASE.CANCELLED")
    assert error(service.post("/mgt/v1/gate/cancel", {"lease_token": "tgl_nope"}, principal="gate-p")) == (422, "LEASE.NOT_FOUND")
    for malformed in ("", 42, "x" * 600, ["tgl"]):            # malformed is unknown too
        assert error(service.post("/mgt/v1/gate/cancel", {"lease_token": malformed},
                                  principal="gate-p")) == (422, "LEASE.NOT_FOUND")
        assert error(commit(service, "gate-p", malformed)) == (422, "LEASE.NOT_FOUND")


def test_unpriced_meter_is_charged_zero_with_hint(service: Service) -> None:
    token = token_of(authorize(service, "gate-p"))
    r = commit(service, "gate-p", token, meters=[{"meter_code": "gate.unpriced", "quantity_minor": "5"},
                                                  {"meter_code": "gate.units", "quantity_minor": "2"}])
    data = r.json()
    assert data["data"]["amount_xusd"] == "200"
    assert {"type": "pricing.not_configured", "feature_code": "gate.unit", "meters": ["gate.unpriced"]} in data["hints"]


def test_small_commits_carry_their_remainder_like_one_large_commit(service: Service) -> None:
    amounts = {"gate.floor": 0, "gate.nearest": 0, "gate.ceil": 0}
    for qty in ("400", "400", "400", "1300"):  # 2500 tokens in all
        token = token_of(authorize(service, "gate-p", feature="gate.rounding", estimate=qty))
        r = commit(service, "gate-p", token, quantity=qty, feature="gate.rounding",
                   meters=[{"meter_code": m, "quantity_minor": qty} for m in amounts])
        for line in r.json()["data"]["lines"]:
            amounts[line["meter_code"]] += int(line["amount_xusd"])
    # one commit of 2500 tokens at 150 per 1000: floor 2 blocks, nearest 3 (2.5 rounds up), ceil 3
    assert amounts == {"gate.floor": 300, "gate.nearest": 450, "gate.ceil": 450}


def test_idempotency_key_replays_conflicts_and_scopes(service: Service) -> None:
    key = f"idem-{uuid.uuid4()}"
    body = {"feature_code": "gate.unit", "estimated_quantity_minor": "4"}
    first = service.post("/mgt/v1/gate/authorize", body, principal="gate-p", idempotency_key=key)
    replay = service.post("/mgt/v1/gate/authorize", body, principal="gate-p", idempotency_key=key)
    assert first.status_code == replay.status_code == 200
    assert replay.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first.headers
    assert replay.json()["data"] == first.json()["data"]
    other = service.post("/mgt/v1/gate/authorize", {**body, "estimated_quantity_minor": "5"},
                         principal="gate-p", idempotency_key=key)
    assert error(other) == (409, "IDEMPOTENCY.CONFLICT")
    # another principal has its own scope
    assert service.post("/mgt/v1/gate/authorize", body, principal="gate-p2", idempotency_key=key).status_code == 200
    # a stored 422 replays too
    bad = {"feature_code": "gate.unit", "estimated_quantity_minor": "x"}
    k2 = f"idem-{uuid.uuid4()}"
    a = service.post("/mgt/v1/gate/authorize", bad, principal="gate-p", idempotency_key=k2)
    b = service.post("/mgt/v1/gate/authorize", bad, principal="gate-p", idempotency_key=k2)
    assert a.status_code == b.status_code == 422 and b.headers.get("idempotent-replayed") == "true"


def test_same_key_in_flight_is_409_in_progress(service: Service) -> None:
    key = f"idem-{uuid.uuid4()}"
    data = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "1"}).encode()

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def one() -> httpx.Response:
                headers = sign_headers(key_id=service.key.key_id, secret=service.key.secret, method="POST",
                                       path="/mgt/v1/gate/authorize", body=data, realm="acme",
                                       principal_id="gate-p", idempotency_key=key)
                return await client.post(service.base_url + "/mgt/v1/gate/authorize", content=data, headers=headers)
            return await asyncio.gather(*(one() for _ in range(20)))

    replies = asyncio.run(run())
    fresh = [r for r in replies if r.status_code == 200 and "idempotent-replayed" not in r.headers]
    replayed = [r for r in replies if r.status_code == 200 and "idempotent-replayed" in r.headers]
    busy = [r for r in replies if r.status_code == 409]
    assert len(fresh) == 1
    assert len(fresh) + len(replayed) + len(busy) == 20
    assert all(r.json()["code"] == "IDEMPOTENCY.IN_PROGRESS" for r in busy)
    assert busy, "20 simultaneous requests with one key should meet the first in flight"
    assert {r.json()["data"]["lease_token"] for r in replayed} <= {fresh[0].json()["data"]["lease_token"]}


def _race(service: Service, principal: str, feature: str, estimate: str, clients: int, attempts: int) -> list[httpx.Response]:
    data = json.dumps({"feature_code": feature, "estimated_quantity_minor": estimate}).encode()

    async def run() -> list[httpx.Response]:
        results: list[httpx.Response] = []
        remaining = [attempts]
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as client:
            async def worker() -> None:
                while remaining[0] > 0:
                    remaining[0] -= 1
                    headers = sign_headers(key_id=service.key.key_id, secret=service.key.secret, method="POST",
                                           path="/mgt/v1/gate/authorize", body=data, realm="acme",
                                           principal_id=principal)
                    results.append(await client.post(service.base_url + "/mgt/v1/gate/authorize",
                                                     content=data, headers=headers))
            await asyncio.gather(*(worker() for _ in range(clients)))
        return results

    return asyncio.run(run())


@pytest.mark.parametrize(("principal", "feature", "code"), [
    ("funds-p", "gate.unit", "FUNDING.INSUFFICIENT"),   # 10,000 xusd, 1,000 per lease
    ("quota-p", "gate.quota", "QUOTA.EXHAUSTED"),        # 100 units a day, 10 per lease
    ("budget-p", "gate.unit", "BUDGET.EXHAUSTED"),       # 10,000 xusd a month, 1,000 per lease
])
def test_no_overspend_under_concurrency(service: Service, principal: str, feature: str, code: str) -> None:
    n = 10
    replies = _race(service, principal, feature, "10", clients=20, attempts=10 * n)
    granted = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 402]
    assert len(granted) == n, [r.text for r in replies if r.status_code not in (200, 402)][:3]
    assert len(refused) == 9 * n and {r.json()["code"] for r in refused} == {code}
    assert sum(int(r.json()["data"]["held_quantity_minor"]) for r in granted) == 100
    if feature == "gate.unit":
        assert sum(int(r.json()["data"]["held_amount_xusd"]) for r in granted) == 10_000


def test_expiry_releases_holds_without_a_call_and_a_late_commit_is_charged(service: Service) -> None:
    token = token_of(authorize(service, "expiry-p", feature="gate.short"))
    assert error(authorize(service, "expiry-p", feature="gate.short")) == (402, "FUNDING.INSUFFICIENT")
    deadline = time.monotonic() + 5
    while True:  # the 1 s lease expires on the writer's timer; nothing is called on it
        time.sleep(0.3)
        second = authorize(service, "expiry-p", feature="gate.short")
        if second.status_code == 200:
            break
        assert time.monotonic() < deadline, "the hold was not released by expiry"
    late = commit(service, "expiry-p", token, feature="gate.short")
    assert late.status_code == 200
    assert late.json()["data"]["amount_xusd"] == "1000"
    assert late.json()["hints"][0]["type"] == "lease.expired"
    assert late.json()["data"]["balance_xusd"] == "0"
    cancel = service.post("/mgt/v1/gate/cancel", {"lease_token": token}, principal="expiry-p").json()["data"]
    assert cancel["state"] == "committed"


def test_a_commit_is_never_refused_for_funds(service: Service) -> None:
    token = token_of(authorize(service, "debt-p", estimate="1"))
    r = commit(service, "debt-p", token, quantity="50")  # 5,000 xusd against 100 granted
    assert r.status_code == 200 and r.json()["data"]["balance_xusd"] == "-4900"
    assert error(authorize(service, "debt-p", estimate="1")) == (402, "FUNDING.INSUFFICIENT")


def test_quota_and_budget_answers_carry_their_hints(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    # gate.quota: 100 units a day per principal. Below a fifth left, a success says how much.
    assert authorize(svc, "quota-p", feature="gate.quota", estimate="70").json().get("hints", []) == []
    low = authorize(svc, "quota-p", feature="gate.quota", estimate="15")
    assert low.status_code == 200
    assert low.json()["hints"] == [{"type": "quota.remaining", "max_quantity_minor": 15}]
    refused = authorize(svc, "quota-p", feature="gate.quota", estimate="20")
    assert error(refused) == (402, "QUOTA.EXHAUSTED")
    assert refused.json()["hints"] == [{"type": "quota.remaining", "max_quantity_minor": 15}]
    # gate-budget: 10,000 xusd a month for the account; gate.unit costs 100 a unit.
    near = authorize(svc, "budget-p", estimate="85")
    assert near.status_code == 200
    assert near.json()["hints"] == [{"type": "budget.low_headroom", "budget_id": "gate-budget",
                                     "headroom_xusd": 1500}]
    over = authorize(svc, "budget-p", estimate="20")
    assert error(over) == (402, "BUDGET.EXHAUSTED")
    assert over.json()["hints"] == [{"type": "budget.shortfall", "budget_id": "gate-budget",
                                     "shortfall_xusd": 500}]
    svc.stop()


def test_idempotency_keys_on_commit_and_cancel_replay_what_was_stored(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()

    def post(path: str, body: dict[str, Any], key: str) -> httpx.Response:
        return svc.post(path, body, principal="gate-p", idempotency_key=key)

    token = token_of(authorize(svc, "gate-p"))
    body = {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": "4"}
    first = post("/mgt/v1/gate/commits", body, "commit-1")
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    again = post("/mgt/v1/gate/commits", body, "commit-1")
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json()["data"]["commit_id"] == first.json()["data"]["commit_id"]
    assert error(post("/mgt/v1/gate/commits", {**body, "quantity_minor": "5"}, "commit-1")) == (
        409, "IDEMPOTENCY.CONFLICT")
    unknown = {"lease_token": "tgl_unknown", "feature_code": "gate.unit", "quantity_minor": "1"}
    assert error(post("/mgt/v1/gate/commits", unknown, "commit-2")) == (422, "LEASE.NOT_FOUND")
    stored = post("/mgt/v1/gate/commits", unknown, "commit-2")         # a 422 is stored too
    assert error(stored) == (422, "LEASE.NOT_FOUND") and stored.headers.get("idempotent-replayed") == "true"

    token = token_of(authorize(svc, "gate-p", estimate="6"))
    cancel = {"lease_token": token, "reason": "job failed"}
    done = post("/mgt/v1/gate/cancel", cancel, "cancel-1")
    assert done.json()["data"]["cancelled"] is True and done.json()["data"]["released_cap"] == "6"
    replay = post("/mgt/v1/gate/cancel", cancel, "cancel-1")              # the first answer, again
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["data"] == done.json()["data"]
    plain = svc.post("/mgt/v1/gate/cancel", cancel, principal="gate-p")  # without the key: a no-op
    assert plain.json()["data"]["cancelled"] is False and plain.json()["data"]["released_cap"] == "0"
    svc.stop()


@pytest.mark.parametrize("path", ["/mgt/v1/gate/authorize", "/mgt/v1/gate/commits", "/mgt/v1/gate/cancel"])
def test_a_body_that_is_not_utf8_or_nests_too_deep_is_malformed_json(service: Service, path: str) -> None:
    for raw, reason in ((b'{"feature_code": "api.\xff"}', "UTF-8"), (b"[" * 5000 + b"]" * 5000, "nested")):
        r = service.request("POST", path, raw=raw, principal="gate-p")
        assert (r.status_code, r.json()["code"]) == (400, "VALIDATION.MALFORMED_JSON"), r.text
        assert reason in r.json()["message"]
