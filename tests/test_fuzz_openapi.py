"""Property-based fuzzing of every operation of the OpenAPI document (schemathesis), against
the real service on loopback: requests generated from the document (bodies, query and headers,
valid and not), each signed as a client must sign it (SVC-AUTH over the exact path, query and
body, a fresh nonce and timestamp, Content-Digest). Every answer must be no 5xx, a status the
document lists for the operation, and a body and headers that match the document's schema for
that status.

The context headers are those of a known principal and account of the test catalog, so that
the generated bodies reach validation and the writer rather than stopping at an unknown
principal; the generated values are kept for the rest (X-Request-Id, Idempotency-Key,
X-User-Id). Half of the commits and cancels name a live lease, so that commits are priced and
conflicts decided. Examples per operation: 25, or 10 in CI (CI=true), with no Hypothesis
deadline (a shared 2-core machine): the module takes one to two minutes there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.auth import sign_headers
from api.openapi import document
from tests.conftest import Service, make_service

pytestmark = [pytest.mark.server, pytest.mark.lake]

# FUZZ_EXAMPLES=500 for a longer hunt by hand.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES") or (10 if os.environ.get("CI") == "true" else 25))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]

schema = schemathesis.openapi.from_dict(document())

# The context each route is called with (a principal and account of tests/fixtures/catalog.toml).
EVENT_ACCOUNT = "acct_events"
PRINCIPAL = "team-a"  # of acct_prepaid
# Commits and cancels name leases of a postpaid account's principal: its leases, held until
# they expire, never exhaust a balance, so a live lease can always be had.
LEASE_PRINCIPAL = "team-c"  # of acct_postpaid
LEASED = ("/mgt/v1/gate/commits", "/mgt/v1/gate/cancel", "/mgt/v1/gate/commits/batch")
BALANCE_ACCOUNT = "acct_prepaid"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, httpx.Client]]:
    svc = make_service(tmp_path_factory.mktemp("fuzz"))
    svc.env = {"TOLLGATE_SCHEDULES": "off"}
    svc.start()
    with httpx.Client(timeout=30) as client:
        yield svc, client
    svc.stop()


def _context(path: str) -> dict[str, str | None]:
    """The context headers to sign: the route's known principal or account."""
    if path.startswith("/mgt/v1/events"):
        return {"billing_account_id": EVENT_ACCOUNT}
    if path == "/mgt/v1/wallet/balance":
        return {"billing_account_id": BALANCE_ACCOUNT}
    if path == "/mgt/v1/reports/usage":
        return {}
    return {"principal_id": LEASE_PRINCIPAL if path in LEASED else PRINCIPAL}


def _live_lease(svc: Service, client: httpx.Client) -> str | None:
    """A fresh lease of the principal (feature api.search), for a commit or cancel to name."""
    body = json.dumps({"feature_code": "api.search", "estimated_quantity_minor": "1"}).encode()
    path = "/mgt/v1/gate/authorize"
    headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST", path=path,
                           body=body, realm=svc.key.realm, principal_id=LEASE_PRINCIPAL)
    r = client.post(svc.base_url + path, content=body, headers=headers)
    return str(r.json()["data"]["lease_token"]) if r.status_code == 200 else None


def _with_live_leases(path: str, payload: Any, svc: Service, client: httpx.Client) -> Any:
    """Half of the generated commits and cancels (by the parity of their body's length) name
    a live lease instead of a made-up token, so that the fuzzing reaches what a commit decides
    (pricing, meters, conflicts), not only LEASE.NOT_FOUND."""
    def live(item: Any) -> Any:
        if isinstance(item, dict) and isinstance(item.get("lease_token"), str):
            token = _live_lease(svc, client)
            if token is not None:  # of its feature, when the item names one
                feature = {"feature_code": "api.search"} if "feature_code" in item else {}
                return {**item, "lease_token": token, **feature}
        return item

    if len(json.dumps(payload)) % 2:
        return payload
    if path in ("/mgt/v1/gate/commits", "/mgt/v1/gate/cancel"):
        return live(payload)
    if path == "/mgt/v1/gate/commits/batch" and isinstance(payload, dict) \
            and isinstance(payload.get("items"), list):
        return {**payload, "items": [live(item) for item in payload["items"][:5]]
                + payload["items"][5:]}
    return payload


def _send(case: Any, svc: Service, client: httpx.Client) -> httpx.Response:
    kwargs = case.as_transport_kwargs(base_url=svc.base_url)
    generated = {k.lower(): str(v) for k, v in (kwargs.get("headers") or {}).items()}
    if "json" in kwargs:
        body = json.dumps(_with_live_leases(case.operation.path, kwargs["json"], svc, client)).encode()
    else:
        data = kwargs.get("data")
        body = data.encode() if isinstance(data, str) else (data or b"")
    url = httpx.URL(kwargs["url"], params=kwargs.get("params") or None)
    headers: dict[str, str] = {}
    if case.operation.path == "/healthz":  # unsigned
        if "x-request-id" in generated:
            headers["x-request-id"] = generated["x-request-id"]
        return client.request(case.method, url, headers=headers)
    signed = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method=case.method,
                          path=url.raw_path.decode("ascii"), body=body, realm=svc.key.realm,
                          user_id=generated.get("x-user-id"),
                          idempotency_key=generated.get("idempotency-key"),
                          **_context(case.operation.path))
    if "x-request-id" in generated:
        signed["x-request-id"] = generated["x-request-id"]
    return client.request(case.method, url, content=body, headers=signed)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_every_operation_answers_as_documented(case: Any, fuzzed: tuple[Service, httpx.Client]) -> None:
    svc, client = fuzzed
    response = _send(case, svc, client)
    case.validate_response(response, checks=CHECKS)


def test_a_dimension_filter_whose_field_is_not_a_string_is_invalid_input(
        fuzzed: tuple[Service, httpx.Client]) -> None:
    # Found by the fuzzing above: an object as a filter's field was looked up in a dict of
    # dimensions and answered 500.
    svc, _ = fuzzed
    r = svc.post("/mgt/v1/reports/usage", {
        "time": {"from": "2026-11-01T00:00:00Z", "to": "2026-12-01T00:00:00Z", "granularity": "day"},
        "group_by": ["feature_code"], "dim_filters": [{"field": {}, "op": "eq", "value": ""}]})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == "dim_filters[0]"


def test_the_fuzzing_covers_every_operation_of_the_document() -> None:
    operations = {(op.method.upper(), op.path) for op in
                  (result.ok() for result in schema.get_all_operations())}
    paths = {(method.upper(), path) for path, ops in document()["paths"].items() for method in ops}
    assert operations == paths and len(paths) >= 13

