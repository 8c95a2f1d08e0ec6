"""POST /mgt/v1/events and /mgt/v1/events/batch: validate, hash, store once, answer.

A single event answers 201 when new and 200 when its facts were seen before, with the
identity stored at first acceptance. A batch always answers 207 with one result per item in
input order. An answer is sent only once the event is committed to the operational file.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, post

from api.envelope import Reply, ok
from api.errors import AppError, BadRequest, Unprocessable
from api.events.views import event_view, item_view, to_record
from api.requests import read_signed
from api.runtime import Runtime
from pipelines.catalog import Realm
from pipelines.events import FieldError, ValidEvent, decode_event, validate_event
from writer.ops import IngestOp

__all__ = ["EventsController", "record_event", "record_event_batch"]


class _BatchIn(msgspec.Struct):
    events: list[msgspec.Raw] | None = None



_decode_batch = msgspec.json.Decoder(_BatchIn).decode


def _errors(found: list[FieldError]) -> list[dict[str, Any]]:
    return [msgspec.structs.asdict(e) for e in found]


# What decoding a client's body can raise: msgspec raises UnicodeDecodeError (not a
# DecodeError) for a string that is not valid UTF-8, and RecursionError past its depth limit.
_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError)


def _reason(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "not valid UTF-8"
    return str(exc)


def _malformed(exc: Exception) -> BadRequest:
    return BadRequest("VALIDATION.MALFORMED_JSON", f"body is not a JSON object: {_reason(exc)}")


async def _event_call(request: Any) -> tuple[Runtime, bytes, Realm, str]:
    """Every event call: the raw body, its signature, and the account of the context."""
    runtime: Runtime = request.app.state.runtime
    ctx, body = await read_signed(runtime, request)
    realm, account = runtime.account_of_event_call(ctx)
    return runtime, body, realm, account


class EventsController(Controller):
    path = "/mgt/v1/events"
    tags = ["events"]

    @post("/", operation_id="record_billing_event", status_code=201)
    async def record(self, request: Request[Any, Any, Any]) -> Reply:
        return await record_event(request)

    @post("/batch", operation_id="record_billing_event_batch", status_code=207)
    async def record_batch(self, request: Request[Any, Any, Any]) -> Reply:
        return await record_event_batch(request)


# The handlers, callable with a Litestar request or an `api.direct.DirectRequest`.
async def record_event(request: Any) -> Reply:
    runtime, body, realm, account = await _event_call(request)
    try:
        item = decode_event(body)
    except _UNDECODABLE as exc:
        raise _malformed(exc) from None
    result = validate_event(item, realm=realm.id, billing_account_id=account, now=runtime.clock.now(),
                            max_future_skew_seconds=realm.settings.max_future_skew_seconds,
                            floats_normalized=True)
    if not isinstance(result, ValidEvent):
        raise Unprocessable("VALIDATION.INVALID_INPUT", "the event is invalid", errors=_errors(result))
    stored = (await runtime.write(IngestOp(realm.id, "single", [to_record(result)])))[0]
    return ok(event_view(result, stored), status=201 if stored.accepted else 200)


async def record_event_batch(request: Any) -> Reply:
    runtime, body, realm, account = await _event_call(request)
    try:
        batch = _decode_batch(body)
    except _UNDECODABLE as exc:
        if isinstance(exc, msgspec.ValidationError) and "$.events" in str(exc):
            raise Unprocessable("VALIDATION.INVALID_INPUT", "events must be an array of event objects",
                                errors=[{"field": "events", "code": "VALIDATION.INVALID_TYPE",
                                         "message": str(exc)}]) from None
        raise _malformed(exc) from None
    items = batch.events
    limit = runtime.settings.max_batch_items
    if items is None or not items:
        raise Unprocessable("VALIDATION.INVALID_INPUT", f"a batch holds 1 to {limit} events",
                            errors=[{"field": "events", "code": "VALIDATION.REQUIRED",
                                     "message": "events must hold at least one event"}])
    if len(items) > limit:
        raise Unprocessable("VALIDATION.BATCH_TOO_LARGE",
                            f"a batch holds at most {limit} events, got {len(items)}; nothing was written")
    now = runtime.clock.now()
    skew = realm.settings.max_future_skew_seconds
    results: list[dict[str, Any]] = [{}] * len(items)
    valid: list[tuple[int, ValidEvent]] = []
    for index, raw in enumerate(items):
        try:
            item = decode_event(raw)
        except _UNDECODABLE as exc:
            results[index] = {"index": index, "status": "invalid", "error": {
                "code": "VALIDATION.INVALID_TYPE",
                "message": f"an event must be a JSON object of the event's fields ({_reason(exc)})",
                "field": f"events[{index}]"}}
            continue
        found = validate_event(item, realm=realm.id, billing_account_id=account, now=now,
                               max_future_skew_seconds=skew, floats_normalized=True,
                               prefix=f"events[{index}].")
        if isinstance(found, ValidEvent):
            valid.append((index, found))
        else:
            first = found[0]
            results[index] = {"index": index, "status": "invalid", "error": {
                "code": first.code,
                "message": "; ".join(f"{e.field}: {e.message}" for e in found),
                "field": first.field}}
    if valid:
        try:
            stored = await runtime.write(IngestOp(realm.id, "batch", [to_record(v) for _, v in valid]))
        except AppError as exc:
            if exc.status != 503:
                raise
            for index, event in valid:
                results[index] = item_view(index, event, None, failure=str(exc))
        else:
            for (index, event), identity in zip(valid, stored, strict=False):
                results[index] = item_view(index, event, identity)
    counts = {"accepted": 0, "duplicate": 0, "invalid": 0, "failed": 0}
    for r in results:
        counts[r["status"]] += 1
    return ok({
        "results": results,
        "accepted_count": counts["accepted"],
        "duplicate_count": counts["duplicate"],
        "invalid_count": counts["invalid"],
        "failed_count": counts["invalid"] + counts["failed"],
    }, status=207)
