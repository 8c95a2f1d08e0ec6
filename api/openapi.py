"""The OpenAPI 3.1 document, built from one table: `ROUTES`, one `Route` per operation.

A route names its method, path, operation id, the Struct of its request body (`api.schemas`),
the Struct of each success status's `data`, the error codes it can answer (grouped by status
from `ERROR_CODES`), and the headers it reads. `document()` turns the table into the document
served at /schema/openapi.json: success bodies wrapped in the envelope, each error status's
envelope restricted to its codes, the response headers every answer carries (X-Request-Id;
Retry-After on 429; Idempotent-Replayed where an Idempotency-Key can replay), and the SVC-AUTH
security scheme. docs/api.md describes the same routes and codes for people.

To add a route: define the Struct of its `data` (and of its request body, if it has one) in
`api.schemas`, response Structs with `forbid_unknown_fields=True` and money as decimal strings;
then append one `Route` to `ROUTES`, for example

    Route("GET", "/mgt/v1/gate/meters", "gate_list_meter_limits", "Each meter's quotas, price and coverage",
          "gate", {200: list[s.MeterLimits]}, errors=READ_ERRORS, headers=READ_HEADERS,
          query=(Query("meter_code", "Only this meter."),))

(`data` is a Struct, or `list[Struct]` for an array; `meta=` names the Struct of an envelope's
top-level `meta`, as the usage report's) with the operation id of the official client where it
has the route, every code the handler can answer (a new code goes into `ERROR_CODES` and the
error table of docs/api.md), and the route's section in docs/api.md. `tests/test_openapi.py` then fails until the app serves the
route, and checks its authentication errors against the document; add its real success and
refusals to that file as for the routes there.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api import schemas as s

__all__ = ["ERROR_CODES", "FIELD_CODES", "ROUTES", "TAGS", "Header", "Query", "Route", "document",
           "document_json"]

# ---- error codes: the one list (docs/api.md repeats it for people; a test keeps them equal) --
ERROR_CODES: dict[str, tuple[int, str]] = {
    "VALIDATION.MALFORMED_JSON": (400, "The body is not JSON, not UTF-8, nested too deeply, or not an object."),
    "VALIDATION.MISSING_CONTEXT": (400, "A context header the route needs is missing: `X-Billing-Account-Id` for events, `X-Principal-Id` for gate calls, either for the balance."),
    "AUTH.MISSING_REALM": (400, "The `X-Realm-Id` header is missing."),
    "REQUEST.INCOMPLETE": (400, "The client went away before its whole body arrived."),
    "REQUEST.INVALID": (400, "The request is not valid HTTP/1.1 (answered by the HTTP parser, before any route)."),
    "AUTH.NONCE_TOO_LONG": (400, "The SVC-AUTH nonce is longer than 128 characters (`TOLLGATE_MAX_NONCE_CHARS`)."),
    "IDEMPOTENCY.KEY_TOO_LONG": (400, "The `Idempotency-Key` header is longer than 255 characters (`TOLLGATE_MAX_IDEMPOTENCY_KEY_CHARS`)."),
    "AUTH.UNAUTHORIZED": (401, "`Authorization` is missing or not in the SVC-AUTH format."),
    "AUTH.SERVICE_KEY_NOT_FOUND": (401, "No service key has this `keyId`."),
    "AUTH.INVALID_SERVICE_SIGNATURE": (401, "`Content-Digest` does not match the body, or the signature does not match the request."),
    "AUTH.STALE_SIGNATURE": (401, "`ts` has no offset or is more than 300 s from the server's clock."),
    "AUTH.REPLAYED_NONCE": (401, "The nonce was already used with this key within the window."),
    "QUOTA.EXHAUSTED": (402, "A quota's window has less left than the estimate (hint `quota.remaining`)."),
    "BUDGET.EXHAUSTED": (402, "A budget's window has no room for the priced estimate (hint `budget.shortfall`)."),
    "FUNDING.INSUFFICIENT": (402, "A prepaid account's balance and credit, less what it holds, do not cover the priced estimate (hint `funding.xusd_shortfall`)."),
    "AUTH.SERVICE_KEY_DISABLED": (403, "The key is disabled (`tollgate keys disable`)."),
    "AUTH.SERVICE_KEY_REALM_FORBIDDEN": (403, "The key belongs to another realm than `X-Realm-Id`."),
    "AUTH.BILLING_ACCOUNT_MISMATCH": (403, "`X-Billing-Account-Id` is not the principal's account."),
    "RESOURCE.ROUTE_NOT_FOUND": (404, "No route has this path."),
    "REQUEST.METHOD_NOT_ALLOWED": (405, "The route does not take this method."),
    "REQUEST.TIMEOUT": (408, "The request's head did not arrive within 10 s of the connection or its first byte, or the whole request within 60 s; the connection is closed."),
    "IDEMPOTENCY.IN_PROGRESS": (409, "A request with this `Idempotency-Key` is still being answered."),
    "IDEMPOTENCY.CONFLICT": (409, "The `Idempotency-Key` was used within 24 h with another body."),
    "LEASE.ALREADY_COMMITTED": (409, "The lease was committed with another body."),
    "LEASE.CANCELLED": (409, "The lease was cancelled."),
    "VALIDATION.BODY_TOO_LARGE": (413, "The body is larger than 16 MiB."),
    "REQUEST.HEADERS_TOO_LARGE": (431, "The request's head is larger than 32 KiB or has more than 100 headers; the connection is closed."),
    "VALIDATION.INVALID_INPUT": (422, "The body is invalid; `errors` lists every fault with its field."),
    "VALIDATION.BATCH_TOO_LARGE": (422, "A batch holds more than 1,000 events; nothing was written."),
    "RESOURCE.NOT_FOUND": (422, "The realm has no catalog, or the account, principal or feature is unknown (or inactive, or not of the family given)."),
    "LEASE.NOT_FOUND": (422, "No lease of this principal has this token (or it ended more than 7 days ago)."),
    "LEASE.FEATURE_MISMATCH": (422, "The commit's `feature_code` is not the lease's."),
    "FEATURE.METER_NOT_ALLOWED": (422, "A meter of the commit is not a meter of the feature; `errors` names each."),
    "LIMIT.RATE_EXCEEDED": (429, "A rate limit of the feature is full; retry after `Retry-After` seconds (hint `rate.limit`)."),
    "INTERNAL.ERROR": (500, "An unexpected failure, logged with the trace id; no detail is sent."),
    "STORAGE.UNAVAILABLE": (503, "The writer could not make the request durable, is restarting, did not answer within its deadline, or refuses writes while the operational file does (a full disk): retry after `Retry-After` seconds (a retried event already stored is answered as a duplicate; a gate call replays under its `Idempotency-Key`)."),
    "STORAGE.BUSY": (503, "Event ingestion is at its bound (the requests waiting for storage in this HTTP process, or the events waiting for the lake export); nothing of the request was read or stored: retry after `Retry-After` seconds. Gate calls are not refused by it."),
    "SERVICE.BUSY": (503, "The service holds as many connections as it takes, or is stopping; retry after `Retry-After` seconds. The connection is closed."),
}

# Codes of `errors[].code` (and of an event batch item's `error.code`): the fault of one field.
FIELD_CODES: dict[str, str] = {
    "VALIDATION.REQUIRED": "The field is required.",
    "VALIDATION.INVALID_TYPE": "The field has the wrong JSON type (also: a batch item that is not an object).",
    "VALIDATION.INVALID_VALUE": "The value is not allowed (a code's pattern, a label key, an amount beyond 2^63-1 micro-USD once priced).",
    "VALIDATION.INVALID_QUANTITY": "A quantity is not a string holding a non-negative integer within signed 64-bit.",
    "VALIDATION.INVALID_TIMESTAMP": "`occurred_at` is not RFC 3339 with an offset; a report's `time.from` or `time.to` is not RFC 3339 ending in `Z`.",
    "VALIDATION.IN_FUTURE": "`occurred_at` (of an event or of ingested usage) is further ahead than the realm allows.",
    "VALIDATION.TOO_LONG": "A text is longer than allowed.",
    "VALIDATION.TOO_MANY": "More labels than allowed.",
    "VALIDATION.DUPLICATE_KEY": "Two label keys are equal once lower-cased.",
    "VALIDATION.UNSUPPORTED_DIMENSION": "(reports) A `group_by` dimension that tollgate does not record; the message names each.",
    "VALIDATION.UNSUPPORTED_METRIC": "(reports) A metric that tollgate does not record; the message names each.",
    "FEATURE.METER_NOT_ALLOWED": "The meter is not a meter of the feature.",
    "STORAGE.UNAVAILABLE": "(batch items) Not stored; retry this item.",
}

# ---- the table's parts --------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    name: str
    description: str
    required: bool = False
    example: str | None = None


@dataclass(frozen=True)
class Query:
    name: str
    description: str
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = False


REALM = Header("X-Realm-Id", "The realm of the call; the service key must belong to it.", True, "acme")
PRINCIPAL = Header("X-Principal-Id", "The principal the gate call is for; the catalog maps it to its billing account.", True, "team-a")
ACCOUNT_OPTIONAL = Header("X-Billing-Account-Id", "When given, must be the principal's billing account (else 403 AUTH.BILLING_ACCOUNT_MISMATCH).")
ACCOUNT = Header("X-Billing-Account-Id", "The billing account the events belong to, an account of the realm.", True, "acct_prepaid")
USER = Header("X-User-Id", "The end user behind the call, recorded with the lease.")
IDEMPOTENCY_KEY = Header(
    "Idempotency-Key",
    "Scope (realm, principal, endpoint, key): for 24 h the same body replays the stored answer "
    "(Idempotent-Replayed: true), another body answers 409 IDEMPOTENCY.CONFLICT, and while the "
    "first is in flight 409 IDEMPOTENCY.IN_PROGRESS.")
DIGEST = Header(
    "Content-Digest", "sha-256 of the body (RFC 9530): `sha-256=:<base64>:`; `sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:` for an empty body.",
    True, "sha-256=:RBNvo1WzZ4oRRq0W9+hknpT7T8If536DEMBg9hyq/4o=:")
REQUEST_ID = Header("X-Request-Id", "Your trace id (1-128 of [A-Za-z0-9._:-]); echoed in X-Request-Id and the error's trace_id, else a new one is made.")

SIGNED_ERRORS = (
    "AUTH.MISSING_REALM", "AUTH.UNAUTHORIZED", "AUTH.SERVICE_KEY_NOT_FOUND",
    "AUTH.INVALID_SERVICE_SIGNATURE", "AUTH.STALE_SIGNATURE", "AUTH.REPLAYED_NONCE",
    "AUTH.SERVICE_KEY_DISABLED", "AUTH.SERVICE_KEY_REALM_FORBIDDEN",
    "VALIDATION.BODY_TOO_LARGE", "REQUEST.INCOMPLETE", "VALIDATION.MALFORMED_JSON",
    "VALIDATION.MISSING_CONTEXT", "RESOURCE.NOT_FOUND", "VALIDATION.INVALID_INPUT",
    "INTERNAL.ERROR", "AUTH.NONCE_TOO_LONG", "IDEMPOTENCY.KEY_TOO_LONG",
    # answered by the HTTP protocol before any route (api/http_protocol.py)
    "REQUEST.HEADERS_TOO_LARGE", "REQUEST.TIMEOUT", "SERVICE.BUSY",
)
GATE_ERRORS = (*SIGNED_ERRORS, "AUTH.BILLING_ACCOUNT_MISMATCH", "IDEMPOTENCY.IN_PROGRESS",
               "IDEMPOTENCY.CONFLICT", "STORAGE.UNAVAILABLE")
GATE_HEADERS = (REALM, PRINCIPAL, ACCOUNT_OPTIONAL, USER, IDEMPOTENCY_KEY, DIGEST, REQUEST_ID)
EVENT_HEADERS = (REALM, ACCOUNT, DIGEST, REQUEST_ID)
# A gate call that records no end user (commit batches and ingests).
BOOKING_HEADERS = (REALM, PRINCIPAL, ACCOUNT_OPTIONAL, IDEMPOTENCY_KEY, DIGEST, REQUEST_ID)
# A read of the gate book: no body, so the body's codes are not answered.
READ_ERRORS = (*(c for c in SIGNED_ERRORS if c not in ("VALIDATION.MALFORMED_JSON", "VALIDATION.INVALID_INPUT")),
               "AUTH.BILLING_ACCOUNT_MISMATCH", "STORAGE.UNAVAILABLE")
READ_HEADERS = (REALM, PRINCIPAL, ACCOUNT_OPTIONAL, DIGEST, REQUEST_ID)
BALANCE_HEADERS = (
    REALM,
    Header("X-Billing-Account-Id", "The account whose balance is read; required unless X-Principal-Id is sent.",
           example="acct_prepaid"),
    Header("X-Principal-Id", "Names its account instead; with X-Billing-Account-Id, they must agree "
                             "(else 403 AUTH.BILLING_ACCOUNT_MISMATCH)."),
    Header("X-User-Id", "Answered as billing_user_id (else the principal)."),
    DIGEST, REQUEST_ID)
REPORT_HEADERS = (
    REALM,
    Header("X-Billing-Account-Id", "When given, the report covers only this account (a dim filter naming "
                                   "another is 403 AUTH.BILLING_ACCOUNT_MISMATCH)."),
    Header("X-Principal-Id", "When given, the report covers only its account; with X-Billing-Account-Id, "
                             "they must agree."),
    DIGEST, REQUEST_ID)
REPORT_ERRORS = (*(c for c in SIGNED_ERRORS if c != "VALIDATION.MISSING_CONTEXT"), "AUTH.BILLING_ACCOUNT_MISMATCH")


@dataclass(frozen=True)
class Route:
    """One operation of the document.

    `responses` maps each success status to the type of the envelope's `data`: a Struct, or
    `list[Struct]` for an array (None for a response without a body); `meta`, the Struct of
    the success envelope's top-level `meta` when it has one. `errors` lists the error codes the
    route can answer, which `ERROR_CODES` groups by status. `idempotent`: answers may be
    replays (Idempotent-Replayed).
    """

    method: str
    path: str
    operation_id: str
    summary: str
    tag: str
    responses: Mapping[int, type | None]
    request: type | None = None
    request_example: Mapping[str, Any] | None = None
    errors: tuple[str, ...] = ()
    headers: tuple[Header, ...] = ()
    query: tuple[Query, ...] = ()
    signed: bool = True
    idempotent: bool = False
    description: str = ""
    meta: type | None = None


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", "healthz", "Readiness", "ops",
          {200: s.HealthData, 503: s.HealthData}, signed=False,
          errors=("INTERNAL.ERROR", "REQUEST.HEADERS_TOO_LARGE", "REQUEST.TIMEOUT"),
          headers=(REQUEST_ID,),
          description="Unsigned. 200 when the service and its writer are ready; 503 with the same "
                      "body (`ok: true`) while starting, when the writer is down, or while it refuses writes "
                      "because the operational file does, `reasons` saying which. Names no realm, account or key."),
    Route("HEAD", "/healthz", "healthz_head", "Readiness, as a status alone", "ops",
          {200: None, 503: None}, signed=False, headers=(REQUEST_ID,),
          description="Unsigned; for load balancers that probe with HEAD."),
    Route("POST", "/mgt/v1/events", "record_billing_event", "Record one event", "events",
          {201: s.EventData, 200: s.EventData}, request=s.EventRequest,
          request_example=s.example(s.EventRequest, semantic_kind="activity", event_type="llm.completion",
                                    occurred_at="2026-11-01T12:00:00Z",
                                    payload={"usage": {"input_tokens": 1200}}, labels={"model": "small"}),
          errors=(*SIGNED_ERRORS, "STORAGE.UNAVAILABLE", "STORAGE.BUSY"), headers=EVENT_HEADERS,
          description="201 when new, 200 when its facts were stored before (answered with what was "
                      "stored then). An answer means the event is durable."),
    Route("POST", "/mgt/v1/events/batch", "record_billing_event_batch", "Record 1 to 1,000 events",
          "events", {207: s.BatchData}, request=s.EventBatchRequest,
          request_example=s.example(s.EventBatchRequest, events=[{
              "semantic_kind": "activity", "event_type": "llm.completion",
              "occurred_at": "2026-11-01T12:00:00Z", "payload": {"usage": {"input_tokens": 1200}}}]),
          errors=(*SIGNED_ERRORS, "VALIDATION.BATCH_TOO_LARGE", "STORAGE.BUSY"), headers=EVENT_HEADERS,
          description="Always 207 once the batch is read: one result per event, in input order. "
                      "Invalid items are answered without a write; if storage fails, the valid "
                      "items are `failed` and can be retried."),
    Route("POST", "/mgt/v1/gate/authorize", "gate_authorize", "Authorize: hold funds and quota in a lease",
          "gate", {200: s.AuthorizeData}, request=s.AuthorizeRequest,
          request_example=s.example(s.AuthorizeRequest, feature_code="llm.chat",
                                    estimated_quantity_minor="5000"),
          errors=(*GATE_ERRORS, "QUOTA.EXHAUSTED", "BUDGET.EXHAUSTED", "FUNDING.INSUFFICIENT",
                  "LIMIT.RATE_EXCEEDED"),
          headers=GATE_HEADERS, idempotent=True,
          description="Checks, in order, quotas, budgets and (prepaid accounts) funding, then holds "
                      "the priced estimate in a lease until it is committed, cancelled or expires. "
                      "Without `estimated_quantity_minor` the hold is one block's price."),
    Route("POST", "/mgt/v1/gate/commits", "gate_commit", "Commit: book what a lease's work used",
          "gate", {200: s.CommitData}, request=s.CommitRequest,
          request_example=s.example(s.CommitRequest, lease_token="tgl_...", feature_code="llm.chat",
                                    quantity_minor="4200"),
          errors=(*GATE_ERRORS, "LEASE.NOT_FOUND", "LEASE.FEATURE_MISMATCH", "FEATURE.METER_NOT_ALLOWED",
                  "LEASE.ALREADY_COMMITTED", "LEASE.CANCELLED"),
          headers=GATE_HEADERS, idempotent=True,
          description="Prices the quantity (or each of `meters`) at the price in force, carrying "
                      "remainders, releases the hold and books the usage. After expiry it is still "
                      "booked, with a lease.expired hint."),
    Route("POST", "/mgt/v1/gate/cancel", "gate_cancel", "Cancel: release a lease's hold", "gate",
          {200: s.CancelData}, request=s.CancelRequest,
          request_example=s.example(s.CancelRequest, lease_token="tgl_...", reason="the work failed"),
          errors=(*GATE_ERRORS, "LEASE.NOT_FOUND"), headers=GATE_HEADERS, idempotent=True,
          description="`cancelled: false` with the lease's state when it had already ended."),
    Route("POST", "/mgt/v1/gate/commits/batch", "gate_commit_batch", "Commit up to 100 leases in one call",
          "gate", {200: s.CommitBatchData}, request=s.CommitBatchRequest,
          request_example=s.example(s.CommitBatchRequest, items=[{
              "lease_token": "tgl_...", "feature_code": "llm.chat", "quantity_minor": "4200",
              "idempotency_key": "job-17"}]),
          errors=GATE_ERRORS, headers=BOOKING_HEADERS, idempotent=True,
          description="Each item is checked, then decided as a commit of its own, in order, under its "
                      "own idempotency scope (principal, lease, `idempotency_key`); a refused item does "
                      "not stop the others. 200 with one result per item once the batch is read."),
    Route("POST", "/mgt/v1/gate/ingest", "gate_ingest", "Ingest: book usage that ran without a lease",
          "gate", {200: s.IngestData}, request=s.IngestRequest,
          request_example=s.example(s.IngestRequest, feature_code="llm.chat", quantity_minor="4200",
                                    occurred_at="2026-11-01T12:00:00Z"),
          errors=(*GATE_ERRORS, "FEATURE.METER_NOT_ALLOWED"), headers=BOOKING_HEADERS, idempotent=True,
          description="Priced at the prices in force at `occurred_at` (now when absent) and booked like "
                      "a commit (a commit's answer, without `lease_id`). No limit is checked: the work "
                      "has already run, and a prepaid balance may go negative."),
    Route("GET", "/mgt/v1/gate/limits", "gate_list_feature_limits", "Each feature's quotas and rate limits, with use",
          "gate", {200: list[s.FeatureLimits]}, errors=READ_ERRORS, headers=READ_HEADERS,
          query=(Query("feature_code", "Only this feature."),
                 Query("feature_family_code", "Only the features of this family.")),
          description="For the principal in context: every active feature, its quotas (used, held, "
                      "remaining in the window open now) and rate limits (requests counted in the "
                      "window open now)."),
    Route("GET", "/mgt/v1/gate/meters", "gate_list_meter_limits", "Each meter's quotas, price and coverage",
          "gate", {200: list[s.MeterLimits]}, errors=READ_ERRORS, headers=READ_HEADERS,
          query=(Query("meter_code", "Only this meter."),),
          description="For the principal in context: every meter of the realm, the features that use "
                      "it, the quotas counted in it, the price in force and, for a prepaid account, "
                      "what its available funds buy (advisory)."),
    Route("GET", "/mgt/v1/wallet/balance", "get_credit_balance", "The account's balance, holds and grants",
          "wallet", {200: s.BalanceData}, errors=READ_ERRORS, headers=BALANCE_HEADERS,
          description="The account of X-Billing-Account-Id or of X-Principal-Id, read from the gate "
                      "book in queue order: a read sees every gate call answered before it was sent."),
    Route("POST", "/mgt/v1/reports/usage", "gate_query_usage_reports", "Usage over a time range",
          "reports", {200: s.UsageReportData}, meta=s.ReportMeta, request=s.UsageReportRequest,
          request_example=s.example(s.UsageReportRequest, time={
              "from": "2026-11-01T00:00:00Z", "to": "2026-12-01T00:00:00Z", "granularity": "day"},
              group_by=["feature_code"], metrics=["quantity_minor", "amount_xusd", "line_count"]),
          errors=REPORT_ERRORS, headers=REPORT_HEADERS,
          description="Sums of the current ratings of events and of the gate's commit lines, from the "
                      "lake (a few seconds behind the service), per bucket and dimension. The "
                      "envelope's `meta` pages the rows."),
)

# ---- building the document ------------------------------------------------------------------
TAGS = {"gate": "Admission and booking of metered work.",
        "events": "Business events, stored once and rated later.",
        "wallet": "Balances of billing accounts.",
        "reports": "Usage reports.",
        "ops": "Health."}
_REF = "#/components/schemas/{name}"
_SECURITY_SCHEME = "SVC-AUTH"
_SVC_AUTH_TEXT = (
    "`Authorization: SVC-AUTH keyId=<id>,sig=<base64>,ts=<ISO 8601>,nonce=<text>,alg=HMAC-SHA256`.\n\n"
    "`sig` is base64 HMAC-SHA256, keyed by the base64-decoded secret of the service key, over "
    "twelve lines joined by `\\n` (no final newline): the method in capitals; the path with its "
    "query as sent; `ts:<ts>`; `nonce:<nonce>`; then `name:value` for content-digest, "
    "content-type, x-realm-id, x-principal-id, x-user-id, x-billing-account-id, "
    "x-billing-user-id and idempotency-key, in that order, each with an empty value when the "
    "header is absent. `ts` must be within 300 s of the server's clock; a nonce is accepted "
    "once. Content-Digest must match the body. docs/api.md has a worked example.\n\n"
    "In the docs page at /schema, enter `KEY_ID:SECRET` here: the page signs each request in "
    "the browser (WebCrypto) and never sends the secret."
)
_RESPONSE_HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-Id": {"description": "The trace id of this request (the caller's X-Request-Id when sane); equals the error body's trace_id.",
                     "required": True, "schema": {"type": "string"}},
    "Retry-After": {"description": "429: seconds until the rate limit's window resets; 503: seconds after which to retry.",
                    "required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"}},
    "Idempotent-Replayed": {"description": "Present, `true`, when this answer replays the one stored under the Idempotency-Key.",
                            "schema": {"type": "string", "enum": ["true"]}},
}
_STATUS_TEXT = {200: "OK", 201: "Created", 207: "Multi-Status", 400: "Bad Request", 401: "Unauthorized",
                402: "Payment Required", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
                408: "Request Timeout", 409: "Conflict", 413: "Content Too Large",
                422: "Unprocessable Content", 429: "Too Many Requests",
                431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


def _structs() -> list[Any]:
    found: list[Any] = [s.ErrorEnvelope]
    for route in ROUTES:
        if route.request is not None:
            found.append(route.request)
        if route.meta is not None:
            found.append(route.meta)
        found.extend(t for t in route.responses.values() if t is not None)
    return list(dict.fromkeys(found))


def _name(data: Any) -> str:
    """The name of a `data` type: the Struct's, or `<Struct>List` for `list[Struct]`."""
    if typing.get_origin(data) is list:
        return f"{typing.get_args(data)[0].__name__}List"
    return str(data.__name__)


def _envelope(data: Any, schemas: Mapping[Any, dict[str, Any]], meta: type | None) -> dict[str, Any]:
    properties: dict[str, Any] = {"ok": {"const": True}, "code": {"const": "OK"}, "data": schemas[data]}
    required = ["ok", "code", "data"]
    if meta is not None:
        properties["meta"] = schemas[meta]
        required.append("meta")
    properties["hints"] = {**schemas[list[s.Hint]], "description": "Present only when there are hints."}
    return {"title": f"{_name(data)} envelope", "type": "object", "properties": properties,
            "required": required, "additionalProperties": False}


def _headers(route: Route, status: int) -> dict[str, Any]:
    names = ["X-Request-Id"]
    if status in (429, 503) and route.signed:
        names.append("Retry-After")
    if route.idempotent and (200 <= status < 300 or status in (402, 409, 422)):
        names.append("Idempotent-Replayed")
    return {n: {"$ref": f"#/components/headers/{n}"} for n in names}


def _error_response(route: Route, status: int, codes: list[str]) -> dict[str, Any]:
    lines = "\n".join(f"- `{c}`: {ERROR_CODES[c][1]}" for c in codes)
    schema = {"allOf": [
        {"$ref": _REF.format(name="ErrorEnvelope")},
        {"type": "object", "properties": {
            "code": {"enum": codes},
            "meta": {"type": "object", "properties": {"status": {"const": status}}}}},
    ]}
    return {"description": f"{_STATUS_TEXT[status]}: the error envelope, `code` one of:\n{lines}",
            "headers": _headers(route, status),
            "content": {"application/json": {"schema": schema}}}


def _operation(route: Route) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": route.operation_id, "summary": route.summary,
                          "tags": [route.tag]}
    if route.description:
        op["description"] = route.description
    params: list[dict[str, Any]] = []
    for h in route.headers:
        param: dict[str, Any] = {"name": h.name, "in": "header", "required": h.required,
                                 "description": h.description, "schema": {"type": "string"}}
        if h.example is not None:
            param["example"] = h.example
        params.append(param)
    for q in route.query:
        params.append({"name": q.name, "in": "query", "required": q.required,
                       "description": q.description, "schema": dict(q.schema)})
    if params:
        op["parameters"] = params
    if route.request is not None:
        media: dict[str, Any] = {"schema": {"$ref": _REF.format(name=route.request.__name__)}}
        if route.request_example is not None:
            media["example"] = dict(route.request_example)
        op["requestBody"] = {"required": True, "content": {"application/json": media}}
    op["security"] = [{_SECURITY_SCHEME: []}] if route.signed else []
    responses: dict[str, Any] = {}
    for status, data in sorted(route.responses.items()):
        response: dict[str, Any] = {"description": _STATUS_TEXT[status], "headers": _headers(route, status)}
        if data is not None:
            response["content"] = {"application/json": {
                "schema": {"$ref": _REF.format(name=f"{_name(data)}Envelope")}}}
        responses[str(status)] = response
    by_status: dict[int, list[str]] = {}
    for code in dict.fromkeys(route.errors):
        by_status.setdefault(ERROR_CODES[code][0], []).append(code)
    for status, codes in sorted(by_status.items()):
        if status in route.responses:
            raise ValueError(f"{route.operation_id}: {status} is both a success and an error")
        responses[str(status)] = _error_response(route, status, codes)
    op["responses"] = dict(sorted(responses.items()))
    return op


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of `ROUTES`."""
    types = [*_structs(), list[s.Hint]]
    found, components = msgspec.json.schema_components(types, ref_template=_REF)
    schemas = dict(zip(types, found, strict=True))
    # A field fault's code (and a batch item's, which names its first fault) is one of the
    # field codes: an enum, so a response with another code does not match the document.
    for name in ("FieldFault", "ItemError"):
        components[name]["properties"]["code"] = {
            "enum": list(FIELD_CODES), "description": "One of the field codes (docs/api.md)."}
    for route in ROUTES:
        for data in route.responses.values():
            if data is not None:
                components[f"{_name(data)}Envelope"] = _envelope(data, schemas, route.meta)
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tollgate",
            "version": "0.1.0",
            "description": "Usage gating (authorize, commit, cancel) and billing events. Every "
                           "body is JSON; money is integer micro-USD in decimal strings. "
                           "docs/api.md in the repository describes routes, signing and error codes.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "tags": [{"name": tag, "description": TAGS.get(tag, "")} for tag in sorted(
            {r.tag for r in ROUTES}, key=lambda tag: (list(TAGS).index(tag) if tag in TAGS else len(TAGS), tag))],
        "paths": paths,
        "components": {
            "schemas": dict(sorted(components.items())),
            "headers": _RESPONSE_HEADERS,
            "securitySchemes": {_SECURITY_SCHEME: {
                "type": "apiKey", "in": "header", "name": "Authorization",
                "description": _SVC_AUTH_TEXT}},
        },
    }


def document_json() -> bytes:
    return msgspec.json.encode(document())
