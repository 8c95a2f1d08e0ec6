"""POST /mgt/v1/gate/authorize, /commits, /cancel, /commits/batch and /ingest.

The service checks the signature, the context (principal, its account), the body and the
rate limits; the writer process decides everything that needs the gate's state (quotas,
budgets, funding, leases, idempotency) and replies with an outcome rendered here.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgspec
from litestar import Controller, Request, post

from api.auth import AuthContext
from api.envelope import Reply, error_reply, ok, trace_id_of
from api.errors import AppError, BadRequest, Conflict, Forbidden, Unprocessable
from api.gate.limits import RateLimiter
from api.gate.limits import refusal as rate_refusal
from api.requests import read_signed
from api.runtime import Runtime
from core.constants import INT64_MAX
from pipelines.catalog import CODE_PATTERN, Realm
from pipelines.events import format_instant, parse_instant
from writer.ops import (
    AuthorizeOp,
    CancelOp,
    CommitBatchOp,
    CommitOp,
    GateOutcome,
    IdemKey,
    MeterLine,
    RecordOutcomeOp,
    UsageOp,
    commit_body_kept,
)

__all__ = ["GateController", "authorize", "cancel", "commit", "commit_batch", "gate_context", "ingest"]

_INT = re.compile(r"[0-9]+")
_INT64_DIGITS = len(str(INT64_MAX))
_FROM_BODY: Any = object()  # a field read from the body itself, not from a nested entry
_sorted = msgspec.json.Encoder(order="sorted").encode


class _Fields:
    """Collects field faults of one body, so every fault is reported at once."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.errors: list[dict[str, Any]] = []

    def fault(self, field: str, code: str, message: str) -> None:
        self.errors.append({"field": field, "code": code, "message": message})

    def code(self, name: str, value: Any = _FROM_BODY, *, field: str | None = None) -> str | None:
        value = self.body.get(name) if value is _FROM_BODY else value
        field = field or name
        if value is None:
            self.fault(field, "VALIDATION.REQUIRED", f"{name} is required")
            return None
        if not isinstance(value, str) or not CODE_PATTERN.fullmatch(value):
            self.fault(field, "VALIDATION.INVALID_VALUE",
                       f"{name} must be 1-128 lower-case chars of [a-z0-9._/@:-], alphanumeric at both ends")
            return None
        return value

    def quantity(self, name: str, value: Any = _FROM_BODY, *, field: str | None = None) -> int | None:
        value = self.body.get(name) if value is _FROM_BODY else value
        field = field or name
        if value is None:
            self.fault(field, "VALIDATION.REQUIRED", f"{name} is required")
            return None
        # Leading zeros do not count; more digits than 2^63-1 has is out of range before int()
        # (which refuses strings of over 4,300 digits with a ValueError).
        digits = value.lstrip("0") if isinstance(value, str) else ""
        if (not isinstance(value, str) or not _INT.fullmatch(value) or len(digits) > _INT64_DIGITS
                or int(digits or "0") > INT64_MAX):
            self.fault(field, "VALIDATION.INVALID_QUANTITY",
                       f"{name} must be a string holding a non-negative integer within signed 64-bit, e.g. \"1500\"")
            return None
        return int(digits or "0")

    def token(self) -> str | None:
        value = self.body.get("lease_token")
        if value is None:  # absent or null: the alias of later clients
            value = self.body.get("lease")
        if value is None:
            self.fault("lease_token", "VALIDATION.REQUIRED", "lease_token is required")
            return None
        if not isinstance(value, str) or not value or len(value) > 512:
            # A malformed token names no lease: the writer answers 422 LEASE.NOT_FOUND for it,
            # as for an unknown one (the gate's rules; docs/architecture.md).
            return ""
        return value

    def meters(self) -> list[MeterLine] | None:
        raw_meters = self.body.get("meters")
        if raw_meters is None:
            return None
        if not isinstance(raw_meters, list) or not 1 <= len(raw_meters) <= 64:
            self.fault("meters", "VALIDATION.INVALID_TYPE", "meters must be an array of 1 to 64 meter entries")
            return None
        meters = []
        for i, entry in enumerate(raw_meters):
            if not isinstance(entry, dict):
                self.fault(f"meters[{i}]", "VALIDATION.INVALID_TYPE", "a meter entry must be an object")
                continue
            code = self.code("meter_code", entry.get("meter_code"), field=f"meters[{i}].meter_code")
            qty = self.quantity("quantity_minor", entry.get("quantity_minor"), field=f"meters[{i}].quantity_minor")
            if code is not None and qty is not None:
                meters.append(MeterLine(code, qty))
        return meters

    def labels(self) -> dict[str, str]:
        value = self.body.get("labels")
        if value is None:
            return {}
        if not isinstance(value, dict) or len(value) > 32 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 256
                for k, v in value.items()):
            self.fault("labels", "VALIDATION.INVALID_VALUE",
                       "labels must be an object of at most 32 string values (keys <= 64, values <= 256 chars)")
            return {}
        return value


class GateController(Controller):
    path = "/mgt/v1/gate"
    tags = ["gate"]

    @post("/authorize", operation_id="gate_authorize", status_code=200)
    async def authorize(self, request: Request[Any, Any, Any]) -> Reply:
        return await authorize(request)

    @post("/commits", operation_id="gate_commit", status_code=200)
    async def commit(self, request: Request[Any, Any, Any]) -> Reply:
        return await commit(request)

    @post("/cancel", operation_id="gate_cancel", status_code=200)
    async def cancel(self, request: Request[Any, Any, Any]) -> Reply:
        return await cancel(request)

    @post("/commits/batch", operation_id="gate_commit_batch", status_code=200)
    async def commit_batch(self, request: Request[Any, Any, Any]) -> Reply:
        return await commit_batch(request)

    @post("/ingest", operation_id="gate_ingest", status_code=200)
    async def ingest(self, request: Request[Any, Any, Any]) -> Reply:
        return await ingest(request)


# The handlers, callable with a Litestar request or an `api.direct.DirectRequest`.
async def authorize(request: Any) -> Reply:
    return await _handle(request, "authorize", _authorize)


async def commit(request: Any) -> Reply:
    return await _handle(request, "commits", _commit)


async def cancel(request: Any) -> Reply:
    return await _handle(request, "cancel", _cancel)


async def commit_batch(request: Any) -> Reply:
    return await _handle(request, "commits/batch", _commit_batch)


async def ingest(request: Any) -> Reply:
    return await _handle(request, "ingest", _ingest)


class _Call:
    """The context of one gate call, after authentication."""

    __slots__ = ("runtime", "ctx", "realm", "principal", "account", "body", "idem", "replayed")

    def __init__(self, runtime: Runtime, ctx: AuthContext, realm: Realm, principal: str, account: str,
                 body: dict[str, Any], idem: IdemKey | None) -> None:
        self.runtime = runtime
        self.ctx = ctx
        self.realm = realm
        self.principal = principal
        self.account = account
        self.body = body
        self.idem = idem
        self.replayed = False


def gate_context(runtime: Runtime, ctx: AuthContext) -> tuple[Realm, str, str]:
    """The realm, principal and billing account of a gate call: the principal is required
    and names its account; an X-Billing-Account-Id, when sent, must be that account."""
    if not ctx.principal_id:
        raise BadRequest("VALIDATION.MISSING_CONTEXT", "the X-Principal-Id header is required for gate calls")
    realm = runtime.realm(ctx)
    account = realm.principal_account.get(ctx.principal_id)
    if account is None:
        raise Unprocessable("RESOURCE.NOT_FOUND", f"unknown principal {ctx.principal_id!r}")
    if ctx.billing_account_id and ctx.billing_account_id != account:
        raise Forbidden("AUTH.BILLING_ACCOUNT_MISMATCH",
                        "X-Billing-Account-Id is not the principal's billing account")
    return realm, ctx.principal_id, account


async def _handle(request: Any, endpoint: str, decide: Any) -> Reply:
    runtime: Runtime = request.app.state.runtime
    ctx, raw = await read_signed(runtime, request)
    realm, _, account = gate_context(runtime, ctx)
    assert ctx.principal_id is not None
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest("VALIDATION.MALFORMED_JSON", f"body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:  # msgspec's answer to a string that is not UTF-8
        raise BadRequest("VALIDATION.MALFORMED_JSON", "body is not valid JSON: not valid UTF-8") from None
    except RecursionError:
        raise BadRequest("VALIDATION.MALFORMED_JSON", "body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("VALIDATION.MALFORMED_JSON", "body must be a JSON object")
    idem = None
    if ctx.idempotency_key:
        idem = IdemKey(realm.id, ctx.principal_id, endpoint, ctx.idempotency_key,
                       hashlib.sha256(raw).hexdigest())
    call = _Call(runtime, ctx, realm, ctx.principal_id, account, body, idem)
    # In flight once across every worker of the service (`api.shared`).
    shared = runtime.shared
    scope = ((realm.id, ctx.principal_id, endpoint, ctx.idempotency_key)
             if idem and ctx.idempotency_key is not None else None)
    if scope is not None and not await shared.acquire(scope):
        raise Conflict("IDEMPOTENCY.IN_PROGRESS", "a request with this Idempotency-Key is in flight")
    try:
        outcome: GateOutcome = await decide(call)
    finally:
        if scope is not None:
            await shared.release(scope)
    return _render(trace_id_of(request.scope), outcome)


async def _settle(call: _Call, outcome: GateOutcome) -> GateOutcome:
    """An outcome decided here: remembered under the Idempotency-Key when it is storable."""
    if call.idem is not None and outcome.storable:
        return await call.runtime.write(RecordOutcomeOp(call.idem, outcome))  # type: ignore[no-any-return]
    return outcome


def _invalid(errors: list[dict[str, Any]]) -> GateOutcome:
    return GateOutcome(status=422, code="VALIDATION.INVALID_INPUT", message="the request is invalid",
                       errors=errors)


async def _authorize(call: _Call) -> GateOutcome:
    f = _Fields(call.body)
    feature_code = f.code("feature_code")
    family = f.body.get("feature_family_code")
    if family is not None:
        family = f.code("feature_family_code")
    # Absent, the estimate is 0 and the hold is the price of one block of the feature's
    # primary meter (docs/api.md): the official client declares the field optional.
    at_least_a_block = f.body.get("estimated_quantity_minor") is None
    estimate = 0 if at_least_a_block else f.quantity("estimated_quantity_minor")
    labels = f.labels()
    if f.errors:
        return await _settle(call, _invalid(f.errors))
    feature = call.realm.features.get(feature_code)  # type: ignore[arg-type]
    if feature is None or not feature.active or (family is not None and family != feature.family):
        return await _settle(call, GateOutcome(
            status=422, code="RESOURCE.NOT_FOUND",
            message=f"unknown or inactive feature {feature_code!r}"
                    + (f" in family {family!r}" if family is not None else "")))
    plan = RateLimiter.plan(call.realm, feature.code, call.principal, call.account)
    refused = None
    if plan:
        # Counted for every worker of the service in one place (`api.shared`).
        stamp = call.runtime.clock.now().timestamp()
        counted = await call.runtime.shared.admit(plan, stamp)
        refused = None if counted is None else rate_refusal(*counted, stamp)
    if refused is not None:
        refusal = refused
        limited = GateOutcome(
            status=429, code="LIMIT.RATE_EXCEEDED", message="rate limit exceeded; retry later",
            headers={"Retry-After": str(refusal.retry_after_seconds)},
            hints=[{"type": "rate.limit", "limit": refusal.limit, "remaining": 0,
                    "reset_at": refusal.reset_at.isoformat().replace("+00:00", "Z")}])
        if call.idem is not None:
            # A retry of a request that was already answered gets that answer (or the 409 of
            # another body), not a 429; a 429 itself is never stored.
            return await call.runtime.write(RecordOutcomeOp(call.idem, limited))  # type: ignore[no-any-return]
        return limited
    op = AuthorizeOp(call.realm.id, call.principal, call.account, call.ctx.user_id, feature.code,
                     estimate, labels, call.idem, at_least_a_block)  # type: ignore[arg-type]
    return await call.runtime.write(op)  # type: ignore[no-any-return]


async def _commit(call: _Call) -> GateOutcome:
    f = _Fields(call.body)
    token = f.token()
    feature_code = f.code("feature_code")
    quantity = f.quantity("quantity_minor")
    meters = f.meters()
    labels = f.labels()
    if f.errors:
        return await _settle(call, _invalid(f.errors))
    op = CommitOp(call.realm.id, call.principal, call.account, token, feature_code, quantity,  # type: ignore[arg-type]
                  meters or None, labels, commit_body_kept(call.body), call.idem)
    return await call.runtime.write(op)  # type: ignore[no-any-return]


async def _cancel(call: _Call) -> GateOutcome:
    f = _Fields(call.body)
    token = f.token()
    reason = call.body.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > 512):
        f.fault("reason", "VALIDATION.INVALID_VALUE", "reason must be a string of at most 512 characters")
    if f.errors:
        return await _settle(call, _invalid(f.errors))
    return await call.runtime.write(CancelOp(call.realm.id, call.principal, token, reason, call.idem))  # type: ignore[arg-type,no-any-return]


MAX_BATCH_ITEMS = 100
# An item's error as the official client's ErrorObject names it (`type`), with the code.
_ERROR_TYPES = {
    "LEASE.NOT_FOUND": "invalid_lease",
    "LEASE.FEATURE_MISMATCH": "feature_mismatch",
    "FEATURE.METER_NOT_ALLOWED": "meter_not_allowed_for_feature",
    "LEASE.ALREADY_COMMITTED": "conflict",
    "LEASE.CANCELLED": "conflict",
    "IDEMPOTENCY.CONFLICT": "conflict",
}


def _item_error(code: str, message: str, errors: list[dict[str, Any]]) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(code, "invalid_request")
    error: dict[str, Any] = {"type": kind, "code": code, "details": message}
    if errors:
        error["errors"] = errors
    return error


async def _commit_batch(call: _Call) -> GateOutcome:
    """Up to 100 commits, each checked here and decided by the writer as a commit of its own
    under its own idempotency scope: (principal, lease, the item's idempotency_key)."""
    items = call.body.get("items")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH_ITEMS:
        return await _settle(call, _invalid([{"field": "items", "code": "VALIDATION.INVALID_VALUE",
                                              "message": f"items must be an array of 1 to {MAX_BATCH_ITEMS} commits"}]))
    advice = call.body.get("merge_advice")
    if advice is not None and advice not in ("none", "by_pricing_fingerprint"):
        return await _settle(call, _invalid([{"field": "merge_advice", "code": "VALIDATION.INVALID_VALUE",
                                              "message": "merge_advice must be none or by_pricing_fingerprint"}]))
    results: list[dict[str, Any] | None] = [None] * len(items)
    ops: list[CommitOp] = []
    placed: list[int] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            results[index] = {"index": index, "status": "invalid", "error": _item_error(
                "VALIDATION.INVALID_TYPE", "an item must be an object", [])}
            continue
        f = _Fields(item)
        token = f.token()
        feature_code = f.code("feature_code")
        quantity = f.quantity("quantity_minor")
        meters = f.meters()
        labels = f.labels()
        key = item.get("idempotency_key")
        if key is None:
            f.fault("idempotency_key", "VALIDATION.REQUIRED", "idempotency_key is required")
        elif not isinstance(key, str) or not 1 <= len(key) <= 255:
            f.fault("idempotency_key", "VALIDATION.INVALID_VALUE", "idempotency_key must be 1-255 characters")
        if f.errors:
            results[index] = {"index": index, "status": "invalid", "error": _item_error(
                "VALIDATION.INVALID_INPUT", "the item is invalid",
                [{**e, "field": f"items[{index}].{e['field']}"} for e in f.errors])}
            continue
        canonical = commit_body_kept(item)
        scope_key = f"{hashlib.sha256((token or '').encode()).hexdigest()}:{key}"
        idem = IdemKey(call.realm.id, call.principal, "commits/batch.item", scope_key,
                       hashlib.sha256(canonical).hexdigest())
        ops.append(CommitOp(call.realm.id, call.principal, call.account, token, feature_code,  # type: ignore[arg-type]
                            quantity, meters or None, labels, canonical, idem))  # type: ignore[arg-type]
        placed.append(index)
    if ops:
        outcome: GateOutcome = await call.runtime.write(CommitBatchOp(ops, call.idem))
        if outcome.status != 200 or outcome.data is None:  # the batch's own key: a replay conflict
            return outcome
        if outcome.replayed:
            call.replayed = True
        for index, item_outcome in zip(placed, outcome.data["items"], strict=True):
            results[index] = _item_result(index, item_outcome)
    elif call.idem is not None:
        outcome = await call.runtime.write(RecordOutcomeOp(call.idem, GateOutcome(status=200, data={"items": []})))
        if outcome.status != 200:
            return outcome
        call.replayed = outcome.replayed
    done = [r for r in results if r is not None]
    committed = sum(1 for r in done if r["status"] in ("committed", "duplicate"))
    return GateOutcome(status=200, data={"items": done, "committed_count": committed,
                                         "failed_count": len(done) - committed},
                       replayed=call.replayed)


def _item_result(index: int, outcome: dict[str, Any]) -> dict[str, Any]:
    status = outcome["status"]
    if 200 <= status < 300:
        result = {"index": index, "status": "duplicate" if outcome["replayed"] else "committed",
                  "commit": outcome["data"]}
        if outcome["hints"]:
            result["hints"] = outcome["hints"]
        return result
    return {"index": index, "status": "invalid" if status == 422 else "failed",
            "error": _item_error(outcome["code"], outcome["message"], outcome["errors"])}


async def _ingest(call: _Call) -> GateOutcome:
    """Usage that ran without a lease: priced at its occurred_at (now when absent) and booked
    like a commit, with no limit checked (docs/api.md)."""
    f = _Fields(call.body)
    feature_code = f.code("feature_code")
    meters = f.meters()
    quantity: int | None = 0
    if call.body.get("quantity_minor") is not None or meters is None:
        quantity = f.quantity("quantity_minor")
    labels = f.labels()
    now = call.runtime.clock.now()
    at = now
    raw_at = call.body.get("occurred_at")
    if raw_at is not None:
        parsed = parse_instant(raw_at) if isinstance(raw_at, str) else None
        if parsed is None:
            f.fault("occurred_at", "VALIDATION.INVALID_TIMESTAMP", "occurred_at must be an RFC 3339 instant")
        elif (parsed - now).total_seconds() > call.realm.settings.max_future_skew_seconds:
            f.fault("occurred_at", "VALIDATION.IN_FUTURE",
                    f"occurred_at is more than {call.realm.settings.max_future_skew_seconds} s in the future")
        else:
            at = parsed
    for name in ("budget_id",):
        value = call.body.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > 128):
            f.fault(name, "VALIDATION.INVALID_VALUE", f"{name} must be a string of at most 128 characters")
    metadata = call.body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        f.fault("metadata", "VALIDATION.INVALID_TYPE", "metadata must be an object")
    if f.errors:
        return await _settle(call, _invalid(f.errors))
    feature = call.realm.features.get(feature_code)  # type: ignore[arg-type]
    if meters and call.body.get("quantity_minor") is None and feature is not None:
        # The feature's quantity is counted in its primary meter (as authorize estimates are).
        quantity = sum(m.quantity_minor for m in meters if m.meter_code == feature.primary_meter)
    op = UsageOp(call.realm.id, call.principal, call.account, feature_code, quantity,  # type: ignore[arg-type]
                 meters or None, labels, format_instant(at), _sorted(call.body), call.idem)
    return await call.runtime.write(op)  # type: ignore[no-any-return]


def _render(trace_id: str, outcome: GateOutcome) -> Reply:
    headers = dict(outcome.headers)
    if outcome.replayed:
        headers["Idempotent-Replayed"] = "true"
    if 200 <= outcome.status < 300:
        return ok(outcome.data, status=outcome.status, hints=outcome.hints, headers=headers)
    return error_reply(trace_id, AppError.of_status(
        outcome.status, outcome.code, outcome.message, errors=outcome.errors,
        hints=outcome.hints, headers=headers))
