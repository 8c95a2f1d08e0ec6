"""The write op that stores events through the group-commit writer, and the views of a
stored event that the endpoints return."""

from __future__ import annotations

from typing import Any

from pipelines.events import ValidEvent, format_instant
from warehouse.outbox import EventOutbox, StoredIdentity
from warehouse.writer import Transaction

__all__ = ["IngestOp", "event_view", "item_view"]


class IngestOp:
    """Stage events in the outbox; the outcome is one `StoredIdentity` per event, in order.

    An event that repeats an earlier one of the same group (this request's or another's) is
    a duplicate of that first occurrence."""

    __slots__ = ("outbox", "realm", "events", "path")

    def __init__(self, outbox: EventOutbox, realm: str, events: list[ValidEvent], path: str) -> None:
        self.outbox = outbox
        self.realm = realm
        self.events = events
        self.path = path

    def apply(self, tx: Transaction) -> None:
        stage = self.outbox.stage
        for event in self.events:
            stage(tx, self.realm, event, self.path)

    def outcome(self, tx: Transaction) -> list[StoredIdentity]:
        stored = tx.scratch["outbox_result"]
        first = tx.scratch["outbox_first"]
        out = []
        for event in self.events:
            identity: StoredIdentity = stored[event.event_id]
            if identity.accepted and first[event.event_id] is not event:
                identity = StoredIdentity(False, identity.created_at, identity.labels)
            out.append(identity)
        return out


def event_view(event: ValidEvent, stored: StoredIdentity) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "request_hash": event.request_hash,
        "billing_account_id": event.billing_account_id,
        "semantic_kind": event.semantic_kind,
        "event_type": event.event_type,
        "occurred_at": event.occurred_at,
        "subject_ref": event.subject_ref,
        "payload": event.payload,
        "labels": stored.labels if stored.labels is not None else event.labels,
        "created_at": format_instant(stored.created_at) if stored.created_at else None,
    }


def item_view(index: int, event: ValidEvent, stored: StoredIdentity | None,
              failure: str | None = None) -> dict[str, Any]:
    if stored is None:
        return {"index": index, "status": "failed", "event_id": event.event_id,
                "request_hash": event.request_hash,
                "error": {"code": "STORAGE.UNAVAILABLE", "message": failure or "not stored; retry"}}
    return {"index": index, "status": "accepted" if stored.accepted else "duplicate",
            "event_id": event.event_id, "request_hash": event.request_hash}
