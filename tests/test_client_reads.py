"""The official client's read side and batch calls, over HTTP against the real service:
each response validated by the client's own model, values checked by hand."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from vlunaai import (
    RequestContext,
    ServiceClientOptions,
    ServiceKeyCredentials,
    VlunaAIConfig,
    create_service_client,
)

from tests.catalog_builder import CatalogBuilder
from tests.conftest import Service, make_service

pytestmark = pytest.mark.server

# Prices: tok 150 xusd per 1000 (floor), out 600 per 1000, req 2000 per request.
CATALOG = (CatalogBuilder("acme")
           .account("acct_pre", "prepaid", credit_limit_xusd=1_000_000, principals=["p1", "p2"])
           .grant("acct_pre", "g-first", 3_000_000, "2026-01-01T00:00:00Z")
           .grant("acct_pre", "g-second", 2_000_000, "2026-06-01T00:00:00Z")
           .grant("acct_pre", "g-future", 9_000_000, "2099-01-01T00:00:00Z")
           .account("acct_post", "postpaid", principals=["p3"])
           .account("acct_batch", "postpaid", principals=["p4"])
           .account("acct_ingest", "prepaid", principals=["p5"])
           .grant("acct_ingest", "g-ingest", 1_000_000, "2026-01-01T00:00:00Z")
           .family("llm").family("api")
           .meter("tok", "token").meter("out", "token").meter("req", "request")
           .feature("chat", "tok", meters=["tok", "out"], family="llm")
           .feature("search", "req", meters=["req"], family="api")
           .price("tok", 150, "2026-01-01T00:00:00Z", unit_quantity_minor=1000, rounding="floor")
           .price("out", 600, "2026-01-01T00:00:00Z", unit_quantity_minor=1000, rounding="floor")
           .price("req", 2000, "2026-01-01T00:00:00Z", unit_quantity_minor=1, rounding="floor")
           .price("tok", 300, "2026-11-20T00:00:00Z", unit_quantity_minor=1000, rounding="floor")
           .price("tok", 150, "2026-11-21T00:00:00Z", unit_quantity_minor=1000, rounding="floor")
           .quota("chat", id="chat-daily-per-principal", scope="principal", window="day", limit_minor=1_000_000)
           .quota("chat", id="chat-monthly-per-account", scope="account", window="month",
                  limit_minor=5_000_000, accounts=["acct_pre"])
           .rate_limit("search", id="search-per-minute", scope="principal", per_seconds=3600, limit=5))


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    folder = tmp_path_factory.mktemp("reads")
    catalog = folder / "catalog.toml"
    catalog.write_text(CATALOG.toml())
    service = make_service(folder / "data", catalog)
    service.start()
    yield service
    service.stop()


def client_of(service: Service) -> Any:
    return create_service_client(ServiceClientOptions(
        config=VlunaAIConfig(base_url=service.base_url + "/mgt/v1", realm_id="acme"),
        service_key=ServiceKeyCredentials(key_id=service.key.key_id, secret=service.key.secret),
    ))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _authorize(client: Any, principal: str, feature: str, estimate: str | None) -> Any:
    body = {"feature_code": feature}
    if estimate is not None:
        body["estimated_quantity_minor"] = estimate
    reply = await client.gate_authorize(body=body, context=RequestContext(principal_id=principal))
    assert reply.ok, reply
    return reply.data


def test_balance_after_grants_holds_and_commits(svc: Service) -> None:
    async def go() -> None:
        client = client_of(svc)
        first = await _authorize(client, "p1", "chat", "100000")  # holds 15,000
        committed = await client.gate_commit(
            body={"lease_token": first.lease_token, "feature_code": "chat", "quantity_minor": "40000"},
            context=RequestContext(principal_id="p1"))
        assert committed.ok and committed.data.amount_xusd == "6000"
        await _authorize(client, "p2", "chat", "20000")  # holds 3,000
        balance = await client.get_credit_balance(context=RequestContext(billing_account_id="acct_pre"))
        by_principal = await client.get_credit_balance(context=RequestContext(principal_id="p2"))
        await client.close()
        assert balance.ok and balance.data is not None
        data = balance.data
        assert data.billing_account_id == "acct_pre"
        # granted in force 5,000,000 (not the 2099 grant); committed 6,000; held 3,000;
        # credit limit 1,000,000: available = 5,000,000 - 6,000 + 1,000,000 - 3,000.
        assert data.balances.xusd == "5991000" and data.balances.usd == "599"
        assert data.outstanding_balances.xusd == "4994000"
        assert data.conversion.usd_per_xusd == "0.000001"
        grants = {g.grant_id: g for g in data.grants}
        assert set(grants) == {"g-first", "g-second"}
        assert grants["g-first"].remaining.xusd == "2994000" and grants["g-first"].consumed_xusd == "6000"
        assert grants["g-second"].remaining.xusd == "2000000"
        assert by_principal.data.balances.xusd == "5991000"
    run(go())
    raw = svc.request("GET", "/mgt/v1/wallet/balance", account="acct_pre").json()["data"]
    assert (raw["granted_xusd"], raw["committed_xusd"], raw["held_xusd"], raw["available_xusd"]) == (
        "5000000", "6000", "3000", "5991000")


def test_feature_and_meter_limits_show_use_holds_and_rates(svc: Service) -> None:
    async def go() -> tuple[Any, Any]:
        client = client_of(svc)
        lease = await _authorize(client, "p3", "chat", "70000")
        await client.gate_commit(body={"lease_token": lease.lease_token, "feature_code": "chat",
                                       "quantity_minor": "30000"}, context=RequestContext(principal_id="p3"))
        await _authorize(client, "p3", "chat", "25000")
        for _ in range(2):
            await _authorize(client, "p3", "search", "1")
        limits = await client.gate_list_feature_limits(context=RequestContext(principal_id="p3"))
        meters = await client.gate_list_meter_limits(context=RequestContext(principal_id="p1"))
        await client.close()
        return limits, meters
    limits, meters = run(go())
    assert limits.ok
    features = {f.feature_code: f for f in limits.data}
    assert set(features) == {"chat", "search"}
    chat = features["chat"]
    assert chat.feature_family_code == "llm" and chat.unit == "token" and chat.meters == ["tok", "out"]
    # p3's account is not under the monthly account quota (accounts = [acct_pre]).
    assert [(q.limit_minor, q.used_minor) for q in chat.quotas] == [("1000000", "30000")]
    assert chat.quotas[0].subject_scope.value == "user"
    raw = svc.request("GET", "/mgt/v1/gate/limits?feature_code=chat", principal="p3").json()["data"]
    assert len(raw) == 1
    assert (raw[0]["quotas"][0]["held_minor"], raw[0]["quotas"][0]["remaining_minor"]) == ("25000", "945000")
    search = features["search"]
    assert [(r.limit_minor, r.used_minor) for r in search.rates] == [("5", "2")]
    assert search.rates[0].window_end > search.rates[0].window_start

    by_meter = {m.meter_code: m for m in meters.data}
    assert set(by_meter) == {"tok", "out", "req"}
    tok = by_meter["tok"]
    assert tok.features == ["chat"] and tok.feature_family_codes == ["llm"]
    assert tok.pricing is not None and tok.pricing.unit_price_xusd == "150"
    assert tok.coverage is not None and tok.coverage.advisory is True
    available = int(tok.coverage.balance_xusd)
    assert tok.coverage.max_quantity_minor_estimated == str(available // 150 * 1000)
    assert {q.limit_minor for q in tok.quotas} == {"1000000", "5000000"}
    assert by_meter["out"].quotas == []


def test_commit_batch_commits_each_item_once_and_reports_each(svc: Service) -> None:
    async def go() -> tuple[Any, Any, list[str]]:
        client = client_of(svc)
        ctx = RequestContext(principal_id="p4")
        tokens = [(await _authorize(client, "p4", "chat", "10000")).lease_token for _ in range(3)]
        cancelled = tokens[2]
        await client.gate_cancel(body={"lease_token": cancelled}, context=ctx)
        items = [
            {"lease_token": tokens[0], "feature_code": "chat", "quantity_minor": "2000", "idempotency_key": "a"},
            {"lease_token": tokens[1], "feature_code": "chat", "quantity_minor": "1000",
             "meters": [{"meter_code": "tok", "quantity_minor": "1000"}, {"meter_code": "out", "quantity_minor": "3000"}],
             "idempotency_key": "b"},
            {"lease_token": cancelled, "feature_code": "chat", "quantity_minor": "5", "idempotency_key": "c"},
            {"lease_token": tokens[0], "feature_code": "chat", "quantity_minor": "7"},
            {"lease_token": "tgl_unknown", "feature_code": "chat", "quantity_minor": "7", "idempotency_key": "d"},
        ]
        first = await client.gate_commit_batch(body={"items": items}, context=ctx)
        again = await client.gate_commit_batch(body={"items": items[:1]}, context=ctx)
        await client.close()
        return first, again, tokens
    first, again, _ = run(go())
    assert first.ok
    result = first.data
    statuses = [(i.index, i.status.value) for i in result.items]
    assert statuses == [(0, "committed"), (1, "committed"), (2, "failed"), (3, "invalid"), (4, "invalid")]
    assert result.items[0].commit.amount_xusd == "300"  # 2000 tok: 2 blocks of 150
    assert result.items[1].commit.amount_xusd == str(150 + 3 * 600)
    assert result.items[2].error.type == "conflict"
    assert result.items[3].error.type == "invalid_request"
    assert result.items[4].error.type == "invalid_lease"
    assert (result.committed_count, result.failed_count) == (2, 3)
    assert [(i.index, i.status.value) for i in again.data.items] == [(0, "duplicate")]
    assert again.data.items[0].commit.commit_id == result.items[0].commit.commit_id


def test_commit_batch_refuses_more_than_a_hundred_items(svc: Service) -> None:
    item = {"lease_token": "tgl_x", "feature_code": "chat", "quantity_minor": "1", "idempotency_key": "k"}
    reply = svc.post("/mgt/v1/gate/commits/batch", {"items": [item] * 101}, principal="p4")
    assert reply.status_code == 422
    assert reply.json()["errors"][0]["field"] == "items"


def test_ingest_prices_at_occurred_at_and_books_like_a_commit(svc: Service) -> None:
    async def go() -> tuple[Any, Any, Any, Any]:
        client = client_of(svc)
        ctx = RequestContext(principal_id="p5", idempotency_key=f"ingest-{uuid.uuid4()}")
        body = {"feature_code": "chat", "quantity_minor": "10000", "occurred_at": "2026-11-20T12:00:00Z"}
        first = await client.gate_ingest(body=body, context=ctx)
        replay = await client.gate_ingest(body=body, context=ctx)
        metered = await client.gate_ingest(body={"feature_code": "chat", "meters": [
            {"meter_code": "out", "quantity_minor": "2000"}]}, context=RequestContext(principal_id="p5"))
        balance = await client.get_credit_balance(context=RequestContext(principal_id="p5"))
        await client.close()
        return first, replay, metered, balance
    first, replay, metered, balance = run(go())
    # 2026-11-20 is the day the tok price was 300 per 1000.
    assert first.ok and first.data.amount_xusd == "3000"
    assert replay.data.commit_id == first.data.commit_id
    assert metered.data.amount_xusd == "1200"
    assert balance.data.outstanding_balances.xusd == str(1_000_000 - 3000 - 1200)


def test_ingest_refuses_usage_from_the_future_and_unknown_meters(svc: Service) -> None:
    future = svc.post("/mgt/v1/gate/ingest", {"feature_code": "chat", "quantity_minor": "1",
                                              "occurred_at": "2099-01-01T00:00:00Z"}, principal="p5")
    assert future.status_code == 422
    assert future.json()["errors"][0]["field"] == "occurred_at"
    meter = svc.post("/mgt/v1/gate/ingest", {"feature_code": "chat", "meters": [
        {"meter_code": "req", "quantity_minor": "1"}]}, principal="p5")
    assert meter.status_code == 422 and meter.json()["code"] == "FEATURE.METER_NOT_ALLOWED"


def test_authorize_without_an_estimate_holds_one_block(svc: Service) -> None:
    async def go() -> Any:
        client = client_of(svc)
        lease = await _authorize(client, "p3", "search", None)
        await client.close()
        return lease
    lease = run(go())
    assert lease.lease_token
    raw = svc.post("/mgt/v1/gate/authorize", {"feature_code": "chat"}, principal="p3").json()["data"]
    assert (raw["held_quantity_minor"], raw["held_amount_xusd"]) == ("0", "150")


def test_a_quota_refusal_names_the_quota_as_the_catalog_does(svc: Service) -> None:
    reply = svc.post("/mgt/v1/gate/authorize", {"feature_code": "chat", "estimated_quantity_minor": "2000000"},
                     principal="p3")
    assert reply.status_code == 402 and reply.json()["code"] == "QUOTA.EXHAUSTED"
    message = reply.json()["message"]
    assert "chat-daily-per-principal" in message and "daily quota on chat per principal" in message


def test_reads_need_their_context(svc: Service) -> None:
    assert svc.request("GET", "/mgt/v1/wallet/balance").json()["code"] == "VALIDATION.MISSING_CONTEXT"
    assert svc.request("GET", "/mgt/v1/gate/limits").json()["code"] == "VALIDATION.MISSING_CONTEXT"
    unknown = svc.request("GET", "/mgt/v1/wallet/balance", account="acct_nobody")
    assert unknown.status_code == 422 and unknown.json()["code"] == "RESOURCE.NOT_FOUND"
    mismatch = svc.request("GET", "/mgt/v1/wallet/balance", account="acct_post", principal="p1")
    assert mismatch.status_code == 403



def test_usage_report_sums_the_commits_in_the_lake(svc: Service) -> None:
    """Runs after the batch test above: acct_batch (principal p4) committed 2000 + 1000 tok
    (300 + 150 xusd, with carry) and 3000 out (1800 xusd) today."""
    query = {"time": {"from": "2026-11-01T00:00:00Z", "to": "2027-01-01T00:00:00Z", "granularity": "month"},
             "group_by": ["meter_code"], "metrics": ["quantity_minor", "amount_xusd", "line_count", "commit_count"]}

    async def go() -> Any:
        client = client_of(svc)
        deadline = time.monotonic() + 30
        while True:  # the exporter ships commits to the lake within seconds
            reply = await client.gate_query_usage_reports(body=query, context=RequestContext(principal_id="p4"))
            if len(reply.data.rows) == 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        total = await client.gate_query_usage_reports(body={**query, "group_by": ["bucket_start"],
                                                            "aggregate": "total"},
                                                      context=RequestContext(principal_id="p4"))
        await client.close()
        return reply, total
    reply, total = run(go())
    assert reply.ok
    rows = {r.meter_code: r for r in reply.data.rows}
    assert set(rows) == {"tok", "out"}
    assert (rows["tok"].quantity_minor, rows["tok"].amount_xusd, rows["tok"].line_count) == ("3000", "450", 2)
    assert (rows["out"].quantity_minor, rows["out"].amount_xusd, rows["out"].commit_count) == ("3000", "1800", 0)
    assert rows["tok"].bucket_start.isoformat() == "2026-11-01T00:00:00+00:00"
    assert reply.data.totals["amount_xusd"] == "2250"
    [only] = total.data.rows
    assert only.amount_xusd == "2250" and only.bucket_start.isoformat().startswith("2026-11-01T00:00:00")


def test_usage_report_refuses_what_tollgate_does_not_record(svc: Service) -> None:
    query = {"time": {"from": "2026-11-01T00:00:00Z", "to": "2026-12-01T00:00:00Z", "granularity": "day"},
             "group_by": ["billing_user_id"], "metrics": ["cost_xusd"]}
    reply = svc.post("/mgt/v1/reports/usage", query)
    assert reply.status_code == 422
    codes = {e["field"]: e["code"] for e in reply.json()["errors"]}
    assert codes == {"group_by": "VALIDATION.UNSUPPORTED_DIMENSION", "metrics": "VALIDATION.UNSUPPORTED_METRIC"}
    bad_time = svc.post("/mgt/v1/reports/usage", {**query, "group_by": ["bucket_start"], "metrics": None,
                                                  "time": {"from": "2026-11-01", "to": "x", "granularity": "week"}})
    assert bad_time.status_code == 422
    assert {e["field"] for e in bad_time.json()["errors"]} == {"time.from", "time.to", "time.granularity"}


def test_usage_report_refuses_malformed_filters_and_foreign_cursors(svc: Service) -> None:
    base = {"time": {"from": "2026-11-01T00:00:00Z", "to": "2027-01-01T00:00:00Z", "granularity": "day"},
            "group_by": ["meter_code"]}
    for field in ("dim_filters", "metric_filters"):
        reply = svc.post("/mgt/v1/reports/usage", {**base, field: 7})
        assert reply.status_code == 422, reply.text
        assert reply.json()["errors"][0] == {"field": field, "code": "VALIDATION.INVALID_TYPE",
                                             "message": f"{field} must be an array"}
    assert svc.post("/mgt/v1/reports/usage", {**base, "limit": None}).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # two rows (tok, out) once the batch test's commits are in the lake
        first = svc.post("/mgt/v1/reports/usage", {**base, "limit": 1}, principal="p4").json()
        if first["meta"]["has_more"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    cursor = first["meta"]["next_cursor"]
    assert cursor
    following = svc.post("/mgt/v1/reports/usage", {**base, "limit": 1, "cursor": cursor}, principal="p4").json()
    assert following["data"]["rows"] and following["data"]["rows"] != first["data"]["rows"]
    other = svc.post("/mgt/v1/reports/usage", {**base, "group_by": ["feature_code"], "cursor": cursor},
                     principal="p4")
    assert other.status_code == 422 and other.json()["errors"][0]["field"] == "cursor"
