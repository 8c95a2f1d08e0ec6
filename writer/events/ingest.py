"""The ingest handler of the writer process: it stages each event of an `IngestOp` in the
outbox inside the group's transaction, and answers one `Stored` per event, in order."""

from __future__ import annotations

from collections.abc import Callable

from warehouse.outbox import EventOutbox, EventRecord, Stored
from warehouse.writer import Transaction
from writer.ops import IngestOp

__all__ = ["IngestHandler"]


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
