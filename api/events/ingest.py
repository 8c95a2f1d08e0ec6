"""The write op that stores events through the writer process, its handler there, and the
views of a stored event that the endpoints return."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import msgspec

from pipelines.events import ValidEvent, format_instant
from warehouse.outbox import EventOutbox, EventRecord, Stored
from warehouse.writer import Transaction

__all__ = ["IngestHandler", "IngestOp", "event_view", "item_view", "to_record"]

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class IngestOp(msgspec.Struct, tag="ingest", array_like=True, frozen=True):
    """Store these events of one realm; the outcome is one `Stored` per event, in order."""

    result_type: ClassVar[Any] = list[Stored]
    realm: str
    path: str  # single | batch
    events: list[EventRecord]


def to_record(event: ValidEvent) -> EventRecord:
    return EventRecord(event.event_id, event.request_hash, event.billing_account_id,
                       event.semantic_kind, event.event_type, event.occurred_at_us,
                       event.subject_ref, event.payload_json, _encode(event.labels))


class IngestHandler:
    """Runs in the writer process. An event that repeats an earlier one of the same group
    (this request's or another's) is a duplicate of that first occurrence."""

    def __init__(self, outbox: EventOutbox) -> None:
        self.outbox = outbox
        # Newly accepted single events of committed groups, waiting to be rated inline
        # (drained by the writer host's after-group step).
        self.accepted_singles: list[tuple[str, EventRecord]] = []

    def apply(self, tx: Transaction, op: IngestOp) -> Callable[[], list[Stored]]:
        stage = self.outbox.stage
        for event in op.events:
            stage(tx, op.realm, event, op.path)

        def outcome() -> list[Stored]:
            stored: dict[str, Stored] = tx.scratch["outbox_result"]
            first: dict[str, EventRecord] = tx.scratch["outbox_first"]
            out = []
            singles: list[tuple[str, EventRecord]] = []
            for event in op.events:
                identity = stored[event.event_id]
                if identity.accepted and first[event.event_id] is not event:
                    identity = Stored(False, identity.created_at_us, identity.labels_json)
                elif identity.accepted and op.path == "single":
                    singles.append((op.realm, event))
                out.append(identity)
            if singles:
                # Rated inline only once durable: a group rolled back leaves nothing to rate.
                tx.after_commit(lambda: self.accepted_singles.extend(singles))
            return out

        return outcome


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


def item_view(index: int, event: ValidEvent, stored: Stored | None,
              failure: str | None = None) -> dict[str, Any]:
    if stored is None:
        return {"index": index, "status": "failed", "event_id": event.event_id,
                "request_hash": event.request_hash,
                "error": {"code": "STORAGE.UNAVAILABLE", "message": failure or "not stored; retry"}}
    return {"index": index, "status": "accepted" if stored.accepted else "duplicate",
            "event_id": event.event_id, "request_hash": event.request_hash}
