"""What the HTTP process makes of a validated event: the record it sends to the writer, and
the views of a stored event that the endpoints return."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec

from pipelines.events import ValidEvent, format_instant
from warehouse.outbox import EventRecord, Stored

__all__ = ["event_view", "item_view", "to_record"]

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def to_record(event: ValidEvent) -> EventRecord:
    return EventRecord(event.event_id, event.request_hash, event.billing_account_id,
                       event.semantic_kind, event.event_type, event.occurred_at_us,
                       event.subject_ref, event.payload_json, _encode(event.labels))


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _instant(us: int) -> str:
    return format_instant(_EPOCH + timedelta(microseconds=us))


def event_view(event: ValidEvent, stored: Stored) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "request_hash": event.request_hash,
        "billing_account_id": event.billing_account_id,
        "semantic_kind": event.semantic_kind,
        "event_type": event.event_type,
        "occurred_at": event.occurred_at,
        "subject_ref": event.subject_ref,
        "payload": event.payload,
        "labels": _decode(stored.labels_json) if stored.labels_json is not None else event.labels,
        "created_at": _instant(stored.created_at_us) if stored.created_at_us is not None else None,
    }


def item_view(index: int, event_id: str, request_hash: str, stored: Stored | None,
              failure: str | None = None) -> dict[str, Any]:
    if stored is None:
        return {"index": index, "status": "failed", "event_id": event_id,
                "request_hash": request_hash,
                "error": {"code": "STORAGE.UNAVAILABLE", "message": failure or "not stored; retry"}}
    return {"index": index, "status": "accepted" if stored.accepted else "duplicate",
            "event_id": event_id, "request_hash": request_hash}
