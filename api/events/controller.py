"""POST /mgt/v1/events and /mgt/v1/events/batch: validate, hash, store once, answer.

A single event answers 201 when new and 200 when its facts were seen before, with the
identity stored at first acceptance. A batch always answers 207 with one result per item in
input order. An answer is sent only once the event is committed to the operational file.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
from litestar import Controller, Request, post

from api.envelope import Reply, ok
from api.errors import AppError, BadRequest, Unprocessable
from api.events.prepare import UNDECODABLE, Prepared, reason
from api.events.views import event_view, item_view, to_record
from api.requests import read_signed
from api.runtime import Runtime
from pipelines.catalog import Realm
from pipelines.events import FieldError, ValidEvent, decode_event, validate_event
from writer.ops import IngestOp

__all__ = ["EventsController", "record_event", "record_event_batch"]


def _errors(found: list[FieldError]) -> list[dict[str, Any]]:
    return [msgspec.structs.asdict(e) for e in found]


def _malformed(exc: Exception) -> BadRequest:
    return BadRequest("VALIDATION.MALFORMED_JSON", f"body is not a JSON object: {reason(exc)}")


async def _event_call(runtime: Runtime, request: Any) -> tuple[bytes, Realm, str]:
    """Every event call: the raw body, its signature, and the account of the context."""
    ctx, body = await read_signed(runtime, request)
    realm, account = runtime.account_of_event_call(ctx)
    return body, realm, account


def _declared_length(request: Any) -> int:
    for name, value in request.scope["headers"]:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


class EventsController(Controller):
    path = "/mgt/v1/events"
    tags = ["events"]

    @post("/", operation_id="record_billing_event", status_code=201)
    async def record(self, request: Request[Any, Any, Any]) -> Reply:
        return await record_event(request)

    @post("/batch", operation_id="record_billing_event_batch", status_code=207)
    async def record_batch(self, request: Request[Any, Any, Any]) -> Reply:
        return await record_event_batch(request)


# The handlers, callable with a Litestar request or an `api.direct.DirectRequest`. Each is
# admitted to the ingest queue first (`Runtime.ingest_admission`): past its bound it is
# answered 503 STORAGE.BUSY before its body is read. While the lake export is behind, it then
# waits the writer's pace (`Runtime.pace_ingest`).
async def record_event(request: Any) -> Reply:
    runtime: Runtime = request.app.state.runtime
    with runtime.ingest_admission(_declared_length(request)) as admitted:
        await runtime.pace_ingest()
        body, realm, account = await _event_call(runtime, request)
        admitted.read(len(body))
        try:
            item = decode_event(body)
        except UNDECODABLE as exc:
            raise _malformed(exc) from None
        result = validate_event(item, realm=realm.id, billing_account_id=account, now=runtime.clock.now(),
                                max_future_skew_seconds=realm.settings.max_future_skew_seconds,
                                floats_normalized=True)
        if not isinstance(result, ValidEvent):
            raise Unprocessable("VALIDATION.INVALID_INPUT", "the event is invalid", errors=_errors(result))
        stored = (await runtime.write(IngestOp(realm.id, "single", [to_record(result)])))[0]
        return ok(event_view(result, stored), status=201 if stored.accepted else 200)


async def record_event_batch(request: Any) -> Reply:
    runtime: Runtime = request.app.state.runtime
    with runtime.ingest_admission(_declared_length(request)) as admitted:
        await runtime.pace_ingest()
        body, realm, account = await _event_call(runtime, request)
        admitted.read(len(body))
        prepared = await runtime.decoders.prepare(body, realm.id, account, runtime.clock.now(),
                                                  realm.settings.max_future_skew_seconds,
                                                  runtime.settings.max_batch_items)
        if prepared.error is not None:
            raise AppError.from_wire(prepared.error)
        return await _store_batch(runtime, realm.id, prepared)


async def _store_batch(runtime: Runtime, realm: str, prepared: Prepared) -> Reply:
    results: list[dict[str, Any] | None] = prepared.results
    valid = prepared.valid
    if valid:
        # The records are sent as the decoding process encoded them (see api.events.prepare).
        records = cast(Any, msgspec.Raw(prepared.records))
        try:
            stored = await runtime.write(IngestOp(realm, "batch", records))
        except AppError as exc:
            if exc.status != 503:
                raise
            for index, event_id, request_hash in valid:
                results[index] = item_view(index, event_id, request_hash, None, failure=str(exc))
        else:
            for (index, event_id, request_hash), identity in zip(valid, stored, strict=False):
                results[index] = item_view(index, event_id, request_hash, identity)
    counts = {"accepted": 0, "duplicate": 0, "invalid": 0, "failed": 0}
    for r in results:
        assert r is not None
        counts[r["status"]] += 1
    return ok({
        "results": results,
        "accepted_count": counts["accepted"],
        "duplicate_count": counts["duplicate"],
        "invalid_count": counts["invalid"],
        "failed_count": counts["invalid"] + counts["failed"],
    }, status=207)
