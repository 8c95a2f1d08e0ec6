"""The OpenAPI document against the running service: it validates, names every route the app
serves, and every real answer (success and error, body and headers) fits the schema the
document gives for its route and status. Also the docs page (offline assets, in-browser
signing) and docs/api.md (its error codes, routes, and its shell example run for real)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import typing
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate as validate_spec

from api.auth import sign_headers
from api.openapi import ERROR_CODES, FIELD_CODES, ROUTES, Route
from tests.catalog_builder import CatalogBuilder
from tests.conftest import Key, Service, make_service

ROOT = Path(__file__).parent.parent
API_DOC = ROOT / "docs" / "api.md"
BASE = "/mgt/v1"


@pytest.fixture(scope="module")
def doc(service: Service) -> dict[str, Any]:
    response = httpx.get(service.base_url + "/schema/openapi.json")
    assert response.status_code == 200
    return response.json()  # type: ignore[no-any-return]


def _schema(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """A schema of the document, its `#/components/...` references resolvable."""
    return {**schema, "components": doc["components"]}


def _request_schema(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    body = doc["paths"][path][method.lower()]["requestBody"]
    return _schema(doc, body["content"]["application/json"]["schema"])


def documented_body(doc: dict[str, Any], method: str, path: str, body: Any) -> Any:
    """`body`, after checking that it is a request the document allows."""
    jsonschema.validate(body, _request_schema(doc, method, path))
    return body


def check(doc: dict[str, Any], method: str, path: str, response: httpx.Response,
          status: int, code: str | None = None) -> dict[str, Any]:
    """The response has `status` (and error `code`), and fits what the document says of it."""
    assert response.status_code == status, response.text
    op = doc["paths"][path][method.lower()]
    spec = op["responses"].get(str(status))
    assert spec is not None, f"{method} {path} answered {status}, which the document does not list"
    headers = {name: doc["components"]["headers"][name] for name in spec.get("headers", {})}
    for name, header in headers.items():
        if header.get("required"):
            assert name in response.headers, f"{name} missing from {method} {path} {status}"
    if "idempotent-replayed" in response.headers:
        assert "Idempotent-Replayed" in headers
    if "content" not in spec:
        assert response.content == b""
        return {}
    body = response.json()
    jsonschema.validate(body, _schema(doc, spec["content"]["application/json"]["schema"]))
    if code is not None:
        assert body["code"] == code, body
    if not body["ok"]:
        assert body["trace_id"] == response.headers["x-request-id"]
    return body  # type: ignore[no-any-return]


# ---- the document ----------------------------------------------------------------------------

def test_the_document_is_valid_openapi_3_1(doc: dict[str, Any]) -> None:
    assert doc["openapi"] == "3.1.0"
    validate_spec(doc)
    scheme = doc["components"]["securitySchemes"]["SVC-AUTH"]
    assert (scheme["type"], scheme["in"], scheme["name"]) == ("apiKey", "header", "Authorization")
    for path, item in doc["paths"].items():
        for method, op in item.items():
            example = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("example")
            if example is not None:  # the documented example is a request the schema allows
                documented_body(doc, method, path, example)
            assert op["security"] == ([] if path == "/healthz" else [{"SVC-AUTH": []}]), path


def test_every_route_the_app_serves_is_documented_and_no_other(tmp_path: Path) -> None:
    from api.app import create_app
    from core.settings import Settings

    app = create_app(Settings(data_dir=tmp_path))
    served = {(method, route.path) for route in app.routes for method in route.methods
              if method != "OPTIONS" and not route.path.startswith("/schema")
              and route.path != "/metrics"}  # Prometheus text, not the JSON API (docs/api.md)
    served |= {("POST", path) for path in app.asgi_handler.routes}  # type: ignore[attr-defined]
    documented = {(r.method, r.path) for r in ROUTES}
    assert served == documented


def test_operation_ids_are_the_official_clients() -> None:
    import vlunaai.service_client as client

    source = Path(client.__file__).read_text()
    official = {(m.group(3), BASE + m.group(2)): m.group(1) for m in re.finditer(
        r"operation='(\w+)',\s*path=f?'([^']+)',\s*method='(\w+)'", source)}
    assert ("POST", BASE + "/gate/authorize") in official
    for route in ROUTES:
        if (route.method, route.path) in official:
            assert route.operation_id == official[(route.method, route.path)], route.path
    assert len({r.operation_id for r in ROUTES}) == len(ROUTES)


# ---- real answers --------------------------------------------------------------------------

def test_health_answers_fit(service: Service, doc: dict[str, Any]) -> None:
    check(doc, "GET", "/healthz", httpx.get(service.base_url + "/healthz"), 200)
    check(doc, "HEAD", "/healthz", httpx.head(service.base_url + "/healthz"), 200)
    # Off the document's routes, the error envelope all the same.
    missing = httpx.get(service.base_url + "/mgt/v1/nowhere")
    assert missing.status_code == 404
    jsonschema.validate(missing.json(), _schema(doc, {"$ref": "#/components/schemas/ErrorEnvelope"}))


def _event(**extra: Any) -> dict[str, Any]:
    return {"semantic_kind": "activity", "event_type": "docs.check",
            "occurred_at": "2026-01-02T03:04:05Z", "payload": {"run": uuid.uuid4().hex}, **extra}


def test_event_answers_fit(service: Service, doc: dict[str, Any]) -> None:
    path = BASE + "/events"
    body = documented_body(doc, "POST", path, _event(subject_ref="user-1", labels={"model": "small", "n": 2}))
    check(doc, "POST", path, service.post(path, body, account="acct_events"), 201)
    check(doc, "POST", path, service.post(path, body, account="acct_events"), 200)
    check(doc, "POST", path, service.post(path, _event(), account="acct_events",
                                          headers={"x-request-id": "docs-trace-1"}), 201)
    check(doc, "POST", path, service.post(path, _event()), 400, "VALIDATION.MISSING_CONTEXT")
    check(doc, "POST", path, service.post(path, raw=b"{nope", account="acct_events"), 400,
          "VALIDATION.MALFORMED_JSON")
    check(doc, "POST", path, service.post(path, {"semantic_kind": "neither"}, account="acct_events"),
          422, "VALIDATION.INVALID_INPUT")
    check(doc, "POST", path, service.post(path, _event(), account="acct_nobody"), 422, "RESOURCE.NOT_FOUND")


def test_batch_answers_fit(service: Service, doc: dict[str, Any]) -> None:
    path = BASE + "/events/batch"
    first = _event()
    body = documented_body(doc, "POST", path, {"events": [first, first, _event(labels={"k": True})]})
    sent = [*body["events"], {"semantic_kind": "activity"}, 7]
    answer = check(doc, "POST", path, service.post(path, {"events": sent}, account="acct_events"), 207)
    assert [r["status"] for r in answer["data"]["results"]] == [
        "accepted", "duplicate", "accepted", "invalid", "invalid"]
    check(doc, "POST", path, service.post(path, {"events": []}, account="acct_events"), 422,
          "VALIDATION.INVALID_INPUT")
    check(doc, "POST", path, service.post(path, {"events": [first] * 1001}, account="acct_events"), 422,
          "VALIDATION.BATCH_TOO_LARGE")


_CONTEXT = {"X-Principal-Id": ("principal", "team-c"), "X-Billing-Account-Id": ("account", "acct_events")}


@pytest.mark.parametrize("route", [r for r in ROUTES if r.signed], ids=lambda r: f"{r.method} {r.path}")
def test_authentication_answers_fit(service: Service, doc: dict[str, Any], route: Route) -> None:
    """Every signed route of the table answers the authentication errors as documented."""
    path, method = route.path, route.method
    ctx = dict(_CONTEXT[h.name] for h in route.headers if h.required and h.name in _CONTEXT)
    body = {} if route.request is not None else None

    def send(**kw: Any) -> httpx.Response:
        return service.request(method, path, body, **ctx, **kw)

    check(doc, method, path, send(headers={"x-realm-id": ""}), 400, "AUTH.MISSING_REALM")
    check(doc, method, path, send(headers={"authorization": "Bearer x"}), 401, "AUTH.UNAUTHORIZED")
    check(doc, method, path, send(key=Key("tgk_none", service.key.secret)), 401, "AUTH.SERVICE_KEY_NOT_FOUND")
    check(doc, method, path, send(headers={"content-digest": "sha-256=:AAAA:"}), 401,
          "AUTH.INVALID_SERVICE_SIGNATURE")
    check(doc, method, path, send(ts="2001-01-01T00:00:00+00:00"), 401, "AUTH.STALE_SIGNATURE")
    nonce = uuid.uuid4().hex
    send(nonce=nonce)
    check(doc, method, path, send(nonce=nonce), 401, "AUTH.REPLAYED_NONCE")
    check(doc, method, path, send(realm="globex"), 403, "AUTH.SERVICE_KEY_REALM_FORBIDDEN")
    too_large = service.request(method, path, raw=b" " * (16 * 1024 * 1024 + 1), **ctx)
    check(doc, method, path, too_large, 413, "VALIDATION.BODY_TOO_LARGE")


def test_gate_answers_fit(service: Service, doc: dict[str, Any]) -> None:
    authorize, commit, cancel = (BASE + "/gate/authorize", BASE + "/gate/commits", BASE + "/gate/cancel")
    who = {"principal": "team-c"}  # a principal no other test of the shared service uses
    ask = documented_body(doc, "POST", authorize, {
        "feature_code": "gate.unit", "feature_family_code": "gate", "estimated_quantity_minor": "3",
        "labels": {"job": "docs"}})
    key = uuid.uuid4().hex
    lease = check(doc, "POST", authorize, service.post(authorize, ask, idempotency_key=key, **who), 200)["data"]
    replay = service.post(authorize, ask, idempotency_key=key, **who)
    assert replay.headers["idempotent-replayed"] == "true"
    check(doc, "POST", authorize, replay, 200)
    check(doc, "POST", authorize, service.post(authorize, {**ask, "estimated_quantity_minor": "4"},
                                               idempotency_key=key, **who), 409, "IDEMPOTENCY.CONFLICT")

    done = documented_body(doc, "POST", commit, {
        "lease_token": lease["lease_token"], "feature_code": "gate.unit", "quantity_minor": "3",
        "meters": [{"meter_code": "gate.units", "quantity_minor": "2"},
                   {"meter_code": "gate.unpriced", "quantity_minor": "1"}],
        "labels": {"job": "docs"}})
    committed = check(doc, "POST", commit, service.post(commit, done, **who), 200)
    assert [h["type"] for h in committed["hints"]] == ["pricing.not_configured"]
    check(doc, "POST", commit, service.post(commit, {**done, "quantity_minor": "4"}, **who), 409,
          "LEASE.ALREADY_COMMITTED")
    ended = documented_body(doc, "POST", cancel, {"lease_token": lease["lease_token"], "reason": "done"})
    assert check(doc, "POST", cancel, service.post(cancel, ended, **who), 200)["data"]["cancelled"] is False

    other = check(doc, "POST", authorize, service.post(authorize, ask, **who), 200)["data"]
    check(doc, "POST", commit, service.post(commit, {**done, "lease_token": other["lease_token"],
                                                     "feature_code": "gate.quota"}, **who),
          422, "LEASE.FEATURE_MISMATCH")
    check(doc, "POST", commit, service.post(commit, {**done, "lease_token": other["lease_token"], "meters": [
        {"meter_code": "api.calls", "quantity_minor": "1"}]}, **who), 422, "FEATURE.METER_NOT_ALLOWED")
    assert check(doc, "POST", cancel, service.post(cancel, {"lease_token": other["lease_token"]}, **who),
                 200)["data"]["cancelled"] is True
    check(doc, "POST", commit, service.post(commit, {**done, "lease_token": other["lease_token"]}, **who),
          409, "LEASE.CANCELLED")
    for path in (commit, cancel):
        check(doc, "POST", path, service.post(path, {**done, "lease_token": "tgl_nothing"}, **who), 422,
              "LEASE.NOT_FOUND")
        check(doc, "POST", path, service.post(path, {"lease_token": 5}, **who), 422,
              "VALIDATION.INVALID_INPUT" if path == commit else "LEASE.NOT_FOUND")

    check(doc, "POST", authorize, service.post(authorize, {**ask, "estimated_quantity_minor": "1.5"}, **who),
          422, "VALIDATION.INVALID_INPUT")
    check(doc, "POST", authorize, service.post(authorize, {**ask, "feature_code": "gate.none"}, **who), 422,
          "RESOURCE.NOT_FOUND")
    check(doc, "POST", authorize, service.post(authorize, ask), 400, "VALIDATION.MISSING_CONTEXT")
    check(doc, "POST", authorize, service.post(authorize, ask, principal="nobody-p"), 422, "RESOURCE.NOT_FOUND")
    check(doc, "POST", authorize, service.post(authorize, ask, account="acct_events", **who), 403,
          "AUTH.BILLING_ACCOUNT_MISMATCH")
    check(doc, "POST", authorize, service.post(authorize, raw=b"[1]", **who), 400, "VALIDATION.MALFORMED_JSON")

    # Refusals: funding, quota, budget, rate limit (none of them changes anything).
    unit = {"feature_code": "gate.unit", "estimated_quantity_minor": "1"}
    body = check(doc, "POST", authorize, service.post(authorize, unit, principal="poor-p"), 402,
                 "FUNDING.INSUFFICIENT")
    assert body["hints"][0]["type"] == "funding.xusd_shortfall"
    check(doc, "POST", authorize, service.post(authorize, {"feature_code": "gate.quota",
                                                           "estimated_quantity_minor": "101"}, **who),
          402, "QUOTA.EXHAUSTED")
    check(doc, "POST", authorize, service.post(authorize, {**unit, "estimated_quantity_minor": "101"},
                                               principal="budget-p"), 402, "BUDGET.EXHAUSTED")
    leases = []
    for _ in range(12):
        answer = service.post(authorize, {"feature_code": "gate.rated", "estimated_quantity_minor": "1"}, **who)
        if answer.status_code != 200:
            break
        leases.append(answer.json()["data"]["lease_token"])
    check(doc, "POST", authorize, answer, 429, "LIMIT.RATE_EXCEEDED")
    for token in leases:
        check(doc, "POST", cancel, service.post(cancel, {"lease_token": token}, **who), 200)


def test_balance_answers_fit(service: Service, doc: dict[str, Any]) -> None:
    path = BASE + "/wallet/balance"
    data = check(doc, "GET", path, service.request("GET", path, account="acct_prepaid"), 200)["data"]
    assert data["funding"] == "prepaid" and [g["grant_id"] for g in data["grants"]] == ["welcome-2026-11"]
    by_principal = check(doc, "GET", path, service.request("GET", path, principal="team-c", user_id="u-1"),
                         200)["data"]
    assert (by_principal["billing_account_id"], by_principal["billing_user_id"]) == ("acct_postpaid", "u-1")
    check(doc, "GET", path, service.request("GET", path), 400, "VALIDATION.MISSING_CONTEXT")
    check(doc, "GET", path, service.request("GET", path, account="acct_nobody"), 422, "RESOURCE.NOT_FOUND")
    check(doc, "GET", path, service.request("GET", path, principal="nobody-p"), 422, "RESOURCE.NOT_FOUND")
    check(doc, "GET", path, service.request("GET", path, account="acct_events", principal="team-c"), 403,
          "AUTH.BILLING_ACCOUNT_MISMATCH")


def test_limit_reads_fit(service: Service, doc: dict[str, Any]) -> None:
    limits, meters = BASE + "/gate/limits", BASE + "/gate/meters"
    features = check(doc, "GET", limits, service.request("GET", limits, principal="team-c"), 200)["data"]
    by_code = {f["feature_code"]: f for f in features}
    assert by_code["gate.quota"]["quotas"] and by_code["gate.rated"]["rates"]
    only = service.request("GET", limits + "?feature_code=gate.quota", principal="team-c")
    assert [f["feature_code"] for f in check(doc, "GET", limits, only, 200)["data"]] == ["gate.quota"]
    # A prepaid account: priced meters carry a coverage; an unpriced one has no pricing.
    views = {m["meter_code"]: m for m in check(doc, "GET", meters, service.request(
        "GET", meters, principal="gate-p"), 200)["data"]}
    assert "coverage" in views["gate.units"] and "pricing" not in views["gate.unpriced"]
    only = service.request("GET", meters + "?meter_code=gate.units", principal="team-c")
    [units] = check(doc, "GET", meters, only, 200)["data"]
    assert "pricing" in units and "coverage" not in units  # a postpaid account
    for path in (limits, meters):
        check(doc, "GET", path, service.request("GET", path), 400, "VALIDATION.MISSING_CONTEXT")
        check(doc, "GET", path, service.request("GET", path, principal="nobody-p"), 422, "RESOURCE.NOT_FOUND")
        check(doc, "GET", path, service.request("GET", path, principal="team-c", account="acct_events"), 403,
              "AUTH.BILLING_ACCOUNT_MISMATCH")


def test_commit_batch_answers_fit(service: Service, doc: dict[str, Any]) -> None:
    authorize, cancel, path = BASE + "/gate/authorize", BASE + "/gate/cancel", BASE + "/gate/commits/batch"
    who = {"principal": "team-c"}
    tokens = [service.post(authorize, {"feature_code": "gate.unit", "estimated_quantity_minor": "2"},
                           **who).json()["data"]["lease_token"] for _ in range(4)]
    check(doc, "POST", cancel, service.post(cancel, {"lease_token": tokens[2]}, **who), 200)
    run = uuid.uuid4().hex
    items = documented_body(doc, "POST", path, {"merge_advice": "none", "items": [
        {"lease_token": tokens[0], "feature_code": "gate.unit", "quantity_minor": "2", "idempotency_key": run},
        {"lease_token": tokens[1], "feature_code": "gate.unit", "quantity_minor": "1", "idempotency_key": run,
         "meters": [{"meter_code": "gate.units", "quantity_minor": "1"},
                    {"meter_code": "gate.unpriced", "quantity_minor": "1"}], "labels": {"job": "docs"}},
        {"lease_token": tokens[2], "feature_code": "gate.unit", "quantity_minor": "1", "idempotency_key": run},
        {"lease_token": "tgl_nothing", "feature_code": "gate.unit", "quantity_minor": "1", "idempotency_key": run},
        {"lease_token": tokens[3], "feature_code": "gate.quota", "quantity_minor": "1", "idempotency_key": "x"},
        {"lease_token": tokens[1], "feature_code": "gate.unit", "quantity_minor": "9", "idempotency_key": "y"},
    ]})["items"]
    sent = [*items, {"lease_token": tokens[0], "feature_code": "gate.unit", "quantity_minor": "-1"}, 7]
    key = uuid.uuid4().hex
    answer = check(doc, "POST", path, service.post(path, {"items": sent}, idempotency_key=key, **who), 200)["data"]
    assert [(r["status"], r.get("error", {}).get("code")) for r in answer["items"]] == [
        ("committed", None), ("committed", None), ("failed", "LEASE.CANCELLED"), ("invalid", "LEASE.NOT_FOUND"),
        ("invalid", "LEASE.FEATURE_MISMATCH"), ("failed", "LEASE.ALREADY_COMMITTED"),
        ("invalid", "VALIDATION.INVALID_INPUT"), ("invalid", "VALIDATION.INVALID_TYPE")]
    assert (answer["committed_count"], answer["failed_count"]) == (2, 6)
    assert {e["field"] for e in answer["items"][6]["error"]["errors"]} == {
        "items[6].quantity_minor", "items[6].idempotency_key"}
    replay = service.post(path, {"items": sent}, idempotency_key=key, **who)
    assert replay.headers["idempotent-replayed"] == "true"
    check(doc, "POST", path, replay, 200)
    again = check(doc, "POST", path, service.post(path, {"items": items[:1]}, **who), 200)["data"]
    assert again["items"][0]["status"] == "duplicate"
    assert again["items"][0]["commit"]["commit_id"] == answer["items"][0]["commit"]["commit_id"]
    check(doc, "POST", path, service.post(path, {"items": items[:2]}, idempotency_key=key, **who), 409,
          "IDEMPOTENCY.CONFLICT")
    check(doc, "POST", path, service.post(path, {"items": []}, **who), 422, "VALIDATION.INVALID_INPUT")
    check(doc, "POST", path, service.post(path, {"items": items[:1] * 101}, **who), 422, "VALIDATION.INVALID_INPUT")
    check(doc, "POST", path, service.post(path, {"items": items[:1], "merge_advice": "all"}, **who), 422,
          "VALIDATION.INVALID_INPUT")
    check(doc, "POST", path, service.post(path, {"items": items[:1]}), 400, "VALIDATION.MISSING_CONTEXT")
    check(doc, "POST", path, service.post(path, raw=b"[]", **who), 400, "VALIDATION.MALFORMED_JSON")
    check(doc, "POST", cancel, service.post(cancel, {"lease_token": tokens[3]}, **who), 200)


def test_ingest_answers_fit(service: Service, doc: dict[str, Any]) -> None:
    path = BASE + "/gate/ingest"
    who = {"principal": "team-c"}
    body = documented_body(doc, "POST", path, {
        "feature_code": "gate.unit", "meters": [{"meter_code": "gate.units", "quantity_minor": "3"},
                                                {"meter_code": "gate.unpriced", "quantity_minor": "1"}],
        "occurred_at": "2026-11-02T10:00:00Z", "labels": {"job": "docs"}, "budget_id": "b-1",
        "metadata": {"run": uuid.uuid4().hex}})
    key = uuid.uuid4().hex
    booked = check(doc, "POST", path, service.post(path, body, idempotency_key=key, **who), 200)
    assert "lease_id" not in booked["data"]
    assert [h["type"] for h in booked["hints"]] == ["pricing.not_configured"]
    replay = service.post(path, body, idempotency_key=key, **who)
    assert replay.headers["idempotent-replayed"] == "true"
    assert check(doc, "POST", path, replay, 200)["data"]["commit_id"] == booked["data"]["commit_id"]
    check(doc, "POST", path, service.post(path, documented_body(doc, "POST", path, {
        "feature_code": "gate.unit", "quantity_minor": "2"}), **who), 200)
    check(doc, "POST", path, service.post(path, {**body, "metadata": {}}, idempotency_key=key, **who), 409,
          "IDEMPOTENCY.CONFLICT")
    future = service.post(path, {"feature_code": "gate.unit", "quantity_minor": "1",
                                 "occurred_at": "2099-01-01T00:00:00Z"}, **who)
    assert check(doc, "POST", path, future, 422, "VALIDATION.INVALID_INPUT")["errors"][0]["code"] == (
        "VALIDATION.IN_FUTURE")
    check(doc, "POST", path, service.post(path, {"feature_code": "gate.unit", "meters": [
        {"meter_code": "api.calls", "quantity_minor": "1"}]}, **who), 422, "FEATURE.METER_NOT_ALLOWED")
    check(doc, "POST", path, service.post(path, {"feature_code": "gate.none", "quantity_minor": "1"}, **who),
          422, "RESOURCE.NOT_FOUND")
    check(doc, "POST", path, service.post(path, {"feature_code": "gate.unit"}, **who), 422,
          "VALIDATION.INVALID_INPUT")
    check(doc, "POST", path, service.post(path, {"feature_code": "gate.unit", "quantity_minor": "1"}), 400,
          "VALIDATION.MISSING_CONTEXT")


def test_the_report_schema_names_what_the_query_supports() -> None:
    from api import schemas as s
    from warehouse.usage_query import DIMENSIONS, METRICS

    assert set(typing.get_args(s.Dimension)) == set(DIMENSIONS)
    assert set(typing.get_args(s.FilterDimension)) == set(DIMENSIONS) - {"bucket_start"}
    assert set(typing.get_args(s.Metric)) == set(METRICS)


REPORT_CATALOG = (CatalogBuilder("acme")
                  .account("acct_r", "postpaid", principals=["r-p"])
                  .account("acct_o", "postpaid", principals=["o-p"])
                  .family("llm")
                  .meter("tok", "token").meter("free", "token")
                  .feature("chat", "tok", meters=["tok", "free"], family="llm")
                  .price("tok", 150, "2026-01-01T00:00:00Z", unit_quantity_minor=1000, rounding="floor"))


@pytest.fixture(scope="module")
def report_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    folder = tmp_path_factory.mktemp("reports")
    catalog = folder / "catalog.toml"
    catalog.write_text(REPORT_CATALOG.toml())
    service = make_service(folder / "data", catalog)
    service.start()
    yield service
    service.stop()


def test_usage_report_answers_fit(report_service: Service, doc: dict[str, Any]) -> None:
    """Against a service of its own: its lake holds only the lines booked here."""
    service = report_service
    path = BASE + "/reports/usage"
    ingest = BASE + "/gate/ingest"
    for meter in ("tok", "free"):  # lines of two meters, one without a price
        check(doc, "POST", ingest, service.post(ingest, {"feature_code": "chat", "meters": [
            {"meter_code": meter, "quantity_minor": "4000"}]}, principal="r-p"), 200)
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    window = {"from": _z(today - timedelta(days=3)), "to": _z(today + timedelta(days=1)), "granularity": "day"}
    query = documented_body(doc, "POST", path, {
        "time": window, "group_by": ["meter_code", "feature_family_code", "pricing_fingerprint"],
        "metrics": ["quantity_minor", "amount_xusd", "line_count", "commit_count",
                    "distinct_billing_account_count"]})
    deadline = time.monotonic() + 30
    while True:  # the exporter ships the lines to the lake within seconds
        report = check(doc, "POST", path, service.post(path, query, principal="r-p"), 200)
        if len(report["data"]["rows"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    rows = {r["meter_code"]: r for r in report["data"]["rows"]}
    assert set(rows) == {"tok", "free"}
    assert rows["free"]["pricing_fingerprint"] is None and rows["tok"]["line_count"] == 1
    assert rows["tok"]["amount_xusd"] == "600" and rows["tok"]["feature_family_code"] == "llm"
    assert report["meta"] == {"next_cursor": None, "has_more": False, "limit": 1000}
    paged = check(doc, "POST", path, service.post(path, {**query, "limit": 1}, principal="r-p"), 200)
    assert paged["meta"]["has_more"] is True and len(paged["data"]["rows"]) == 1
    rest = check(doc, "POST", path, service.post(path, {**query, "limit": 1, "cursor": paged["meta"]["next_cursor"]},
                                                 principal="r-p"), 200)
    assert rest["meta"] == {"next_cursor": None, "has_more": False, "limit": 1}
    compared = check(doc, "POST", path, service.post(path, documented_body(doc, "POST", path, {
        "time": window, "group_by": ["bucket_start"], "aggregate": "total", "compare": "previous",
        "metrics": ["amount_xusd", "line_count"]}), account="acct_r"), 200)["data"]
    assert compared["delta"]["line_count"] == compared["totals"]["line_count"] == "2"
    assert compared["delta_pct"]["line_count"] is None  # nothing in the window before
    ranked = documented_body(doc, "POST", path, {
        "time": window, "group_by": ["feature_code"], "aggregate": "group_total", "top_k": 1,
        "order_by_metric": "amount_xusd", "order": "asc", "metrics": ["amount_xusd"],
        "dim_filters": [{"field": "meter_code", "op": "in", "value": ["tok", "free"]}],
        "metric_filters": [{"field": "amount_xusd", "op": "gte", "value": "0"}]})
    assert check(doc, "POST", path, service.post(path, ranked, principal="r-p"), 200)["data"]["rows"]

    refused = check(doc, "POST", path, service.post(path, {**query, "group_by": ["billing_user_id"],
                                                           "metrics": ["cost_xusd"]}), 422, "VALIDATION.INVALID_INPUT")
    assert {e["code"] for e in refused["errors"]} == {"VALIDATION.UNSUPPORTED_DIMENSION", "VALIDATION.UNSUPPORTED_METRIC"}
    bad_time = check(doc, "POST", path, service.post(path, {**query, "time": {"from": "2026-11-01", "to": "x"}}),
                     422, "VALIDATION.INVALID_INPUT")
    assert {e["code"] for e in bad_time["errors"]} == {"VALIDATION.INVALID_TIMESTAMP", "VALIDATION.INVALID_VALUE"}
    missing = check(doc, "POST", path, service.post(path, {"group_by": ["bucket_start"]}), 422, "VALIDATION.INVALID_INPUT")
    assert missing["errors"][0]["code"] == "VALIDATION.REQUIRED"
    other = {**query, "dim_filters": [{"field": "billing_account_id", "op": "eq", "value": "acct_o"}]}
    check(doc, "POST", path, service.post(path, other, principal="r-p"), 403, "AUTH.BILLING_ACCOUNT_MISMATCH")
    check(doc, "POST", path, service.post(path, query, principal="r-p", account="acct_o"), 403,
          "AUTH.BILLING_ACCOUNT_MISMATCH")
    check(doc, "POST", path, service.post(path, query, principal="nobody-p"), 422, "RESOURCE.NOT_FOUND")
    check(doc, "POST", path, service.post(path, raw=b"{nope"), 400, "VALIDATION.MALFORMED_JSON")


def _z(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the docs page ---------------------------------------------------------------------------

def test_the_docs_page_loads_offline(service: Service) -> None:
    page = httpx.get(service.base_url + "/schema")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(service.base_url + "/schema/swagger").text == page.text
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith("/") and not r.startswith("//") for r in refs), refs
    assert "http://" not in page.text and "https://" not in page.text
    for ref in refs:
        asset = httpx.get(service.base_url + ref)
        assert asset.status_code == 200, ref
        if ref.endswith("tollgate-docs.js"):
            assert not re.search(r"https?://", asset.text)
            assert "validatorUrl: null" in asset.text and '"/schema/openapi.json"' in asset.text
    assert httpx.get(service.base_url + "/schema/assets/..%2Fdocs.py").status_code == 404
    assert httpx.get(service.base_url + "/schema/assets/index.html").status_code == 404


NODE_SIGN = """
const docs = require(process.argv[1]);
const args = JSON.parse(process.argv[2]);
docs.signRequest(args.request).then((r) => process.stdout.write(JSON.stringify(r)));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_pages_signer_signs_as_the_service_checks(service: Service) -> None:
    """The docs page's requestInterceptor, run in node's WebCrypto: its signature equals
    api.auth.sign_headers' for the same ts and nonce, and the service accepts its request."""
    script = str(ROOT / "api" / "static" / "tollgate-docs.js")
    path = BASE + "/events?via=docs"
    body = json.dumps(_event())
    request = {"url": service.base_url + path, "method": "POST", "body": body,
               "headers": {"Content-Type": "application/json", "X-Realm-Id": "acme",
                           "X-Billing-Account-Id": "acct_events",
                           "Authorization": f"{service.key.key_id}:{service.key.secret}"}}
    run = subprocess.run(["node", "-e", NODE_SIGN, script, json.dumps({"request": request})],
                         capture_output=True, text=True, check=True, timeout=30)
    signed = json.loads(run.stdout)
    headers = signed["headers"]
    ts, nonce = re.search(r",ts=([^,]+),nonce=([^,]+),", headers["authorization"]).groups()  # type: ignore[union-attr]
    expected = sign_headers(key_id=service.key.key_id, secret=service.key.secret, method="POST", path=path,
                            body=body.encode(), realm="acme", billing_account_id="acct_events", ts=ts, nonce=nonce)
    assert headers == expected
    answer = httpx.post(service.base_url + path, content=signed["body"], headers=headers)
    assert answer.status_code == 201, answer.text


# ---- docs/api.md -----------------------------------------------------------------------------

def test_every_error_code_is_listed_and_documented() -> None:
    found = set()
    for folder in ("api", "writer", "warehouse", "pipelines"):
        for source in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r'"([A-Z]+\.[A-Z]+(?:_[A-Z]+)*)"', source.read_text()))
    known = set(ERROR_CODES) | set(FIELD_CODES)
    assert found <= known, f"codes the service answers that api/openapi.py does not list: {found - known}"
    text = API_DOC.read_text()
    # The tables of docs/api.md are the lists of api/openapi.py, row for row.
    table = {code: (int(status), meaning) for code, status, meaning in
             re.findall(r"^\| `([A-Z]+\.[A-Z_]+)` \| (\d+) \| (.*) \|$", text, re.M)}
    assert table == ERROR_CODES
    fields = dict(re.findall(r"^\| `([A-Z]+\.[A-Z_]+)` \| ([^|0-9][^|]*) \|$", text, re.M))
    assert fields == FIELD_CODES
    for route in ROUTES:
        assert f"`{route.method} {route.path}`" in text, route.path


def _doc_block(marker: str) -> str:
    text = API_DOC.read_text()
    found = re.search(rf"<!-- {marker} -->\s*```(?:sh|bash|text)\n(.*?)```", text, re.S)
    assert found, f"docs/api.md has no block marked {marker}"
    return found.group(1)


def test_the_worked_signature_in_the_doc_is_right() -> None:
    block = _doc_block("worked-example")
    values = dict(re.findall(r"^(\w+)=(\S+)$", block, re.M))
    headers = sign_headers(key_id=values["KEY_ID"], secret=values["SECRET"], method="POST",
                           path="/mgt/v1/events", body=values["BODY"].strip("'").encode(),
                           realm="acme", billing_account_id="acct_prepaid", ts=values["TS"],
                           nonce=values["NONCE"])
    assert f"sig={values['SIG']}" in headers["authorization"]
    assert headers["content-digest"] == values["DIGEST"]


@pytest.mark.skipif(any(shutil.which(t) is None for t in ("bash", "openssl", "curl")),
                    reason="needs bash, openssl and curl")
def test_the_docs_shell_example_runs_against_the_service(service: Service) -> None:
    script = _doc_block("sign-and-send")
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "BASE": service.base_url,
           "KEY_ID": service.key.key_id, "SECRET": service.key.secret, "REALM": "acme",
           "ACCOUNT": "acct_events"}
    started = time.monotonic()
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    *_, body, status = run.stdout.strip().splitlines()
    assert status == "201", run.stdout
    assert json.loads(body)["ok"] is True
    assert time.monotonic() - started < 30
