"""The event outbox: accepted events with their labels, deduplicated atomically.

Dedupe is on `event_id`, which is derived from (realm, billing_account_id, request_hash), so
the primary key of `events` is the dedupe identity; a fixed 16-byte key keeps the index fast
where a composite text key slowed inserts threefold as the table grew. Within one group the
first occurrence of an identity wins (queue order), and against the file the insert is
`ON CONFLICT DO NOTHING RETURNING`, so under any concurrency exactly one request sees its
event as new.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import duckdb
import msgspec
import pyarrow as pa

__all__ = ["EventOutbox", "OutboxEvent", "StoredIdentity"]


class OutboxEvent(Protocol):
    """What the outbox needs of an event (pipelines.events.ValidEvent has it)."""

    event_id: str
    request_hash: str
    billing_account_id: str
    semantic_kind: str
    event_type: str
    occurred_at_us: int
    subject_ref: str | None
    payload_json: bytes
    labels: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredIdentity:
    """The outcome for one event: new or not, and what was stored at first acceptance."""

    accepted: bool
    created_at: datetime
    labels: dict[str, Any]
    seq: int


_EVENT_SCHEMA = pa.schema([
    ("seq", pa.int64()),
    ("event_id", pa.string()),
    ("realm", pa.string()),
    ("billing_account_id", pa.string()),
    ("request_hash", pa.string()),
    ("semantic_kind", pa.string()),
    ("event_type", pa.string()),
    ("occurred_at", pa.timestamp("us", tz="UTC")),
    ("subject_ref", pa.string()),
    ("payload", pa.binary()),
    ("labels", pa.binary()),
    ("created_at", pa.timestamp("us", tz="UTC")),
    ("ingest_path", pa.string()),
])

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class EventOutbox:
    """Owned by the writer thread: stages events during a group, writes them at its flush."""

    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self.reload(conn)

    def reload(self, conn: duckdb.DuckDBPyConnection) -> None:
        row = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
        self.last_seq = int(row[0]) if row else 0

    def stage(self, tx: Any, realm: str, event: OutboxEvent, ingest_path: str) -> None:
        pending: list[tuple[str, OutboxEvent, str]] = tx.scratch.setdefault("outbox", [])
        pending.append((realm, event, ingest_path))
        tx.on_flush("outbox", self._flush)

    @staticmethod
    def identity(tx: Any, event_id: str) -> StoredIdentity:
        return tx.scratch["outbox_result"][event_id]

    def _flush(self, tx: Any) -> None:
        pending: list[tuple[str, OutboxEvent, str]] = tx.scratch.get("outbox", [])
        results: dict[str, StoredIdentity] = {}
        tx.scratch["outbox_result"] = results
        first: dict[str, tuple[str, OutboxEvent, str]] = {}
        for item in pending:
            first.setdefault(item[1].event_id, item)
        if not first:
            return
        now = tx.now
        created_us = int(now.timestamp() * 1_000_000)
        seq0 = self.last_seq
        items = list(first.values())
        events = [ev for _, ev, _ in items]
        n = len(items)
        batch = pa.Table.from_arrays([  # noqa: F841 (read by DuckDB below)
            pa.array(range(seq0 + 1, seq0 + n + 1), pa.int64()),
            pa.array([ev.event_id for ev in events], pa.string()),
            pa.array([realm for realm, _, _ in items], pa.string()),
            pa.array([ev.billing_account_id for ev in events], pa.string()),
            pa.array([ev.request_hash for ev in events], pa.string()),
            pa.array([ev.semantic_kind for ev in events], pa.string()),
            pa.array([ev.event_type for ev in events], pa.string()),
            pa.array([ev.occurred_at_us for ev in events], pa.timestamp("us", tz="UTC")),
            pa.array([ev.subject_ref for ev in events], pa.string()),
            pa.array([ev.payload_json for ev in events], pa.binary()),
            pa.array([_encode(ev.labels) for ev in events], pa.binary()),
            pa.array([created_us] * n, pa.timestamp("us", tz="UTC")),
            pa.array([path for _, _, path in items], pa.string()),
        ], schema=_EVENT_SCHEMA)
        inserted = {
            r[0] for r in tx.conn.execute(
                "INSERT INTO events SELECT seq, event_id::UUID, realm, billing_account_id, request_hash, "
                "semantic_kind, event_type, occurred_at, subject_ref, decode(payload), decode(labels), "
                "created_at, ingest_path FROM batch ON CONFLICT DO NOTHING RETURNING event_id::VARCHAR"
            ).fetchall()
        }
        self.last_seq = seq0 + n
        existing = [eid for eid in first if eid not in inserted]
        if existing:
            ids = pa.table({"id": existing})  # noqa: F841 (read by DuckDB)
            for eid, labels, created_at, seq in tx.conn.execute(
                "SELECT e.event_id, e.labels, e.created_at, e.seq FROM events e "
                "JOIN ids ON e.event_id = ids.id::UUID"
            ).fetchall():
                results[str(eid)] = StoredIdentity(False, created_at, _decode(labels), seq)
        for i, ev in enumerate(events):
            if ev.event_id in inserted:
                results[ev.event_id] = StoredIdentity(True, now, ev.labels, seq0 + 1 + i)
        # A repeat inside the group is a duplicate of its first occurrence.
        tx.scratch["outbox_first"] = {eid: item for eid, item in first.items()}
