"""POST /mgt/v1/gate/authorize, /commits and /cancel.

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
from api.requests import authenticate, read_body
from api.runtime import Runtime
from core.constants import INT64_MAX
from pipelines.catalog import CODE_PATTERN, Realm
from writer.ops import (
    AuthorizeOp,
    CancelOp,
    CommitOp,
    GateOutcome,
    IdemKey,
    MeterLine,
    RecordOutcomeOp,
)

__all__ = ["GateController", "authorize", "cancel", "commit"]

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


# The handlers, callable with a Litestar request or an `api.direct.DirectRequest`.
async def authorize(request: Any) -> Reply:
    return await _handle(request, "authorize", _authorize)


async def commit(request: Any) -> Reply:
    return await _handle(request, "commits", _commit)


async def cancel(request: Any) -> Reply:
    return await _handle(request, "cancel", _cancel)


class _Call:
    """The context of one gate call, after authentication."""

    __slots__ = ("runtime", "ctx", "realm", "principal", "account", "body", "idem")

    def __init__(self, runtime: Runtime, ctx: AuthContext, realm: Realm, principal: str, account: str,
                 body: dict[str, Any], idem: IdemKey | None) -> None:
        self.runtime = runtime
        self.ctx = ctx
        self.realm = realm
        self.principal = principal
        self.account = account
        self.body = body
        self.idem = idem


async def _handle(request: Any, endpoint: str, decide: Any) -> Reply:
    runtime: Runtime = request.app.state.runtime
    raw = await read_body(request)
    ctx = authenticate(runtime, request, raw)
    if not ctx.principal_id:
        raise BadRequest("VALIDATION.MISSING_CONTEXT", "the X-Principal-Id header is required for gate calls")
    realm = runtime.realm(ctx)
    account = realm.principal_account.get(ctx.principal_id)
    if account is None:
        raise Unprocessable("RESOURCE.NOT_FOUND", f"unknown principal {ctx.principal_id!r}")
    if ctx.billing_account_id and ctx.billing_account_id != account:
        raise Forbidden("AUTH.BILLING_ACCOUNT_MISMATCH",
                        "X-Billing-Account-Id is not the principal's billing account")
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
    in_flight = runtime.idempotency_in_flight
    scope = ((realm.id, ctx.principal_id, endpoint, ctx.idempotency_key)
             if idem and ctx.idempotency_key is not None else None)
    if scope is not None:
        if scope in in_flight:
            raise Conflict("IDEMPOTENCY.IN_PROGRESS", "a request with this Idempotency-Key is in flight")
        in_flight.add(scope)
    try:
        outcome: GateOutcome = await decide(call)
    finally:
        if scope is not None:
            in_flight.discard(scope)
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
    estimate = f.quantity("estimated_quantity_minor")
    labels = f.labels()
    if f.errors:
        return await _settle(call, _invalid(f.errors))
    feature = call.realm.features.get(feature_code)  # type: ignore[arg-type]
    if feature is None or not feature.active or (family is not None and family != feature.family):
        return await _settle(call, GateOutcome(
            status=422, code="RESOURCE.NOT_FOUND",
            message=f"unknown or inactive feature {feature_code!r}"
                    + (f" in family {family!r}" if family is not None else "")))
    refusal = call.runtime.rate_limiter.admit(call.realm, feature.code, call.principal, call.account, call.runtime.clock.now())
    if refusal is not None:
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
                     estimate, labels, call.idem)  # type: ignore[arg-type]
    return await call.runtime.write(op)  # type: ignore[no-any-return]


async def _commit(call: _Call) -> GateOutcome:
    f = _Fields(call.body)
    token = f.token()
    feature_code = f.code("feature_code")
    quantity = f.quantity("quantity_minor")
    meters: list[MeterLine] | None = None
    raw_meters = call.body.get("meters")
    if raw_meters is not None:
        if not isinstance(raw_meters, list) or len(raw_meters) > 64:
            f.fault("meters", "VALIDATION.INVALID_TYPE", "meters must be an array of at most 64 meter entries")
        else:
            meters = []
            for i, entry in enumerate(raw_meters):
                if not isinstance(entry, dict):
                    f.fault(f"meters[{i}]", "VALIDATION.INVALID_TYPE", "a meter entry must be an object")
                    continue
                code = f.code("meter_code", entry.get("meter_code"), field=f"meters[{i}].meter_code")
                qty = f.quantity("quantity_minor", entry.get("quantity_minor"), field=f"meters[{i}].quantity_minor")
                if code is not None and qty is not None:
                    meters.append(MeterLine(code, qty))
    labels = f.labels()
    if f.errors:
        return await _settle(call, _invalid(f.errors))
    op = CommitOp(call.realm.id, call.principal, call.account, token, feature_code, quantity,  # type: ignore[arg-type]
                  meters or None, labels, _sorted(call.body), call.idem)
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


def _render(trace_id: str, outcome: GateOutcome) -> Reply:
    headers = dict(outcome.headers)
    if outcome.replayed:
        headers["Idempotent-Replayed"] = "true"
    if 200 <= outcome.status < 300:
        return ok(outcome.data, status=outcome.status, hints=outcome.hints, headers=headers)
    return error_reply(trace_id, AppError.of_status(
        outcome.status, outcome.code, outcome.message, errors=outcome.errors,
        hints=outcome.hints, headers=headers))
