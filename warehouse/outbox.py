"""The event outbox: accepted events with their labels, deduplicated atomically.

The dedupe identity is `event_id`, derived from (realm, billing_account_id, request_hash).
The writer thread keeps the set of every stored `event_id` (as a 128-bit int, about 70 bytes
an event) and decides new-or-duplicate against it in queue order, so under any concurrency
exactly one request sees an event as new. New events then go in with a plain Arrow insert;
the primary key on `event_id` stays as the file's own guard. Measured here, `INSERT ... ON
CONFLICT DO NOTHING RETURNING` cost 1.5 ms more per group and a third of batch throughput.
"""

from __future__ import annotations

from typing import Any

import duckdb
import msgspec
import pyarrow as pa

from warehouse.journal import register_table

__all__ = ["EventOutbox", "EventRecord", "Stored", "event_key", "write_events"]


class EventRecord(msgspec.Struct, array_like=True, frozen=True):
    """One event as the outbox stores it (sent from the service to the writer process)."""

    event_id: str
    request_hash: str
    billing_account_id: str
    semantic_kind: str
    event_type: str
    occurred_at_us: int
    subject_ref: str | None
    payload_json: bytes
    labels_json: bytes


class Stored(msgspec.Struct, array_like=True, frozen=True):
    """The outcome for one event: new or not, and what was stored at first acceptance
    (`created_at_us` and `labels_json` are None for a duplicate nobody asked to read back)."""

    accepted: bool
    created_at_us: int | None = None
    labels_json: bytes | None = None


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



def event_key(event_id: str) -> int:
    """The 128-bit integer of a UUID string: a compact set member."""
    return int(event_id.replace("-", ""), 16)


class EventOutbox:
    """Owned by the writer thread: stages events during a group, writes them at its flush."""

    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self.reload(conn)

    def reload(self, conn: duckdb.DuckDBPyConnection) -> None:
        """Rebuild from the file: at start, and after a group that failed to commit."""
        row = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
        self.last_seq = int(row[0]) if row else 0
        ids = conn.execute("SELECT replace(event_id::VARCHAR, '-', '') FROM events").fetchall()
        self._known: set[int] = {int(r[0], 16) for r in ids}

    def __len__(self) -> int:
        return len(self._known)

    def stage(self, tx: Any, realm: str, event: EventRecord, ingest_path: str) -> None:
        tx.scratch.setdefault("outbox", []).append((realm, event, ingest_path))
        tx.on_flush("outbox", self._flush)

    def _flush(self, tx: Any) -> None:
        pending: list[tuple[str, EventRecord, str]] = tx.scratch.get("outbox", [])
        results: dict[str, Stored] = {}
        tx.scratch["outbox_result"] = results
        tx.scratch["outbox_first"] = first = {}
        known = self._known
        fresh: list[tuple[str, EventRecord, str]] = []
        look_up: list[str] = []
        # A single-event reply shows what was stored at first acceptance, so a duplicate that
        # any single request of the group carries is read back; batch replies need no read.
        wants_stored = {ev.event_id for _, ev, path in pending if path == "single"}
        for item in pending:
            event = item[1]
            eid = event.event_id
            if eid in first:
                continue  # a repeat inside the group: the op reports it as a duplicate
            first[eid] = event
            key = event_key(eid)
            if key in known:
                if eid in wants_stored:
                    look_up.append(eid)
                else:
                    results[eid] = Stored(False)
            else:
                known.add(key)
                fresh.append(item)
        now_us = int(tx.now.timestamp() * 1_000_000)
        if fresh:
            seq = self.last_seq
            for realm, event, path in fresh:
                seq += 1
                tx.stage("events", (seq, event.event_id, realm, event.billing_account_id,
                                    event.request_hash, event.semantic_kind, event.event_type,
                                    event.occurred_at_us, event.subject_ref, event.payload_json,
                                    event.labels_json, now_us, path))
                results[event.event_id] = Stored(True, now_us, event.labels_json)
            self.last_seq = seq
        if look_up:
            marks = ", ".join("?::UUID" for _ in look_up)
            for eid, labels, created_us in tx.read().execute(
                "SELECT event_id::VARCHAR, labels, epoch_us(created_at) FROM events "
                f"WHERE event_id IN ({marks})", look_up,
            ).fetchall():
                results[eid] = Stored(False, created_us, labels.encode())


def write_events(conn: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]]) -> None:
    """Insert staged event rows (the journal's form) into the events table: one Arrow insert."""
    columns = list(zip(*rows, strict=True))
    batch = pa.Table.from_arrays(  # noqa: F841 (read by DuckDB below)
        [pa.array(column, field.type) for column, field in zip(columns, _EVENT_SCHEMA, strict=True)],
        schema=_EVENT_SCHEMA)
    conn.execute(
        "INSERT INTO events SELECT seq, event_id::UUID, realm, billing_account_id, request_hash, "
        "semantic_kind, event_type, occurred_at, subject_ref, decode(payload), decode(labels), "
        "created_at, ingest_path FROM batch"
    )


register_table("events", write_events)
