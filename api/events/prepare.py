"""An event batch made ready for the writer: decoded, validated and hashed, as one function
that runs in a decoding process (`api.events.decoders`) or, for a small batch, on the HTTP
loop itself.

A 1000-event batch costs tens of milliseconds of Python (decode, validate, canonical JSON,
two hashes an event). On the HTTP loop that time holds every other request, gate calls
included; in another process it holds none (docs/measurements.md, "The gate next to event
ingestion"). What crosses back is small and cheap for the loop: the replies of the invalid
items, the index and identity of each valid one, and the valid events already encoded in the
writer's wire form (msgpack of `warehouse.outbox.EventRecord`, array-like: a tuple of the
same fields encodes to the same bytes), so the loop neither decodes nor re-encodes them.

This module imports only msgspec, `pipelines.events` and `api.errors`, so a decoding
process starts small.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from api.errors import AppError, BadRequest, Unprocessable
from pipelines.events import ValidEvent, decode_event, validate_event

__all__ = ["Prepared", "prepare_batch", "reason"]


class _BatchIn(msgspec.Struct):
    events: list[msgspec.Raw] | None = None


_decode_batch = msgspec.json.Decoder(_BatchIn).decode
_encode_labels = msgspec.json.encode
_encode = msgspec.msgpack.Encoder().encode

# What decoding a client's body can raise: msgspec raises UnicodeDecodeError (not a
# DecodeError) for a string that is not valid UTF-8, and RecursionError past its depth limit.
UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError)


class Prepared(msgspec.Struct, array_like=True):
    """A batch ready for the writer, or the error that refuses it whole (`AppError.to_wire`).

    `results` holds one entry per item: the reply of an invalid item, None for a valid one;
    `valid` the (index, event_id, request_hash) of each valid item, in order; `records` the
    msgpack array of their `EventRecord`s, in the same order."""

    results: list[dict[str, Any] | None]
    valid: list[tuple[int, str, str]]
    records: bytes
    error: dict[str, Any] | None = None


def reason(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "not valid UTF-8"
    return str(exc)


def prepare_batch(body: bytes, realm: str, account: str, now: datetime, skew: int, limit: int) -> Prepared:
    """Decode, validate and hash every item of a batch body; never raises for the client's
    input (a body refused whole comes back as `error`)."""
    try:
        return _prepare(body, realm, account, now, skew, limit)
    except AppError as exc:
        return Prepared([], [], b"", exc.to_wire())


def prepare_batch_wire(body: bytes, realm: str, account: str, now: datetime, skew: int, limit: int) -> bytes:
    """`prepare_batch` as msgpack: what a decoding process sends back (one bytes object
    pickles at memcpy speed; a tree of dicts would be pickled item by item)."""
    return _encode(prepare_batch(body, realm, account, now, skew, limit))


def _prepare(body: bytes, realm: str, account: str, now: datetime, skew: int, limit: int) -> Prepared:
    try:
        batch = _decode_batch(body)
    except UNDECODABLE as exc:
        if isinstance(exc, msgspec.ValidationError) and "$.events" in str(exc):
            raise Unprocessable("VALIDATION.INVALID_INPUT", "events must be an array of event objects",
                                errors=[{"field": "events", "code": "VALIDATION.INVALID_TYPE",
                                         "message": str(exc)}]) from None
        raise BadRequest("VALIDATION.MALFORMED_JSON", f"body is not a JSON object: {reason(exc)}") from None
    items = batch.events
    if items is None or not items:
        raise Unprocessable("VALIDATION.INVALID_INPUT", f"a batch holds 1 to {limit} events",
                            errors=[{"field": "events", "code": "VALIDATION.REQUIRED",
                                     "message": "events must hold at least one event"}])
    if len(items) > limit:
        raise Unprocessable("VALIDATION.BATCH_TOO_LARGE",
                            f"a batch holds at most {limit} events, got {len(items)}; nothing was written")
    results: list[dict[str, Any] | None] = [None] * len(items)
    valid: list[tuple[int, str, str]] = []
    records: list[tuple[Any, ...]] = []
    for index, raw in enumerate(items):
        try:
            item = decode_event(raw)
        except UNDECODABLE as exc:
            results[index] = {"index": index, "status": "invalid", "error": {
                "code": "VALIDATION.INVALID_TYPE",
                "message": f"an event must be a JSON object of the event's fields ({reason(exc)})",
                "field": f"events[{index}]"}}
            continue
        found = validate_event(item, realm=realm, billing_account_id=account, now=now,
                               max_future_skew_seconds=skew, floats_normalized=True,
                               prefix=f"events[{index}].")
        if isinstance(found, ValidEvent):
            valid.append((index, found.event_id, found.request_hash))
            records.append(record_fields(found))
        else:
            first = found[0]
            results[index] = {"index": index, "status": "invalid", "error": {
                "code": first.code,
                "message": "; ".join(f"{e.field}: {e.message}" for e in found),
                "field": first.field}}
    return Prepared(results, valid, _encode(records))


def record_fields(event: ValidEvent) -> tuple[Any, ...]:
    """The fields of the event's `EventRecord`, in its order (`api.events.views.to_record`)."""
    return (event.event_id, event.request_hash, event.billing_account_id, event.semantic_kind,
            event.event_type, event.occurred_at_us, event.subject_ref, event.payload_json,
            _encode_labels(event.labels))
