"""The event outbox: accepted events with their labels, deduplicated atomically.

The dedupe identity is `event_id`, derived from (realm, billing_account_id, request_hash).
The writer thread decides new-or-duplicate against the event index (`warehouse.event_index`,
every stored id on disk behind a bounded cache) in queue order, so under any concurrency
exactly one request sees an event as new; a group's new events enter the index as soon as
the group is durable, before the next group is decided. New events go in with a plain Arrow insert;
the primary key on `event_id` stays as the file's own guard. Measured here, `INSERT ... ON
CONFLICT DO NOTHING RETURNING` cost 1.5 ms more per group and a third of batch throughput.
"""

from __future__ import annotations

from typing import Any

import duckdb
import msgspec
import pyarrow as pa

from warehouse.event_index import EventIndex, MemoryIndex
from warehouse.journal import register_table

__all__ = ["EventOutbox", "EventRecord", "Stored", "write_events"]


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



class EventOutbox:
    """Owned by the writer thread: stages events during a group, writes them at its flush.
    Without an index (tools, tests) it keeps one in memory, rebuilt from the file."""

    def __init__(self, conn: duckdb.DuckDBPyConnection,
                 index: EventIndex | MemoryIndex | None = None) -> None:
        self.index = index if index is not None else MemoryIndex()
        self.reload(conn)

    def reload(self, conn: duckdb.DuckDBPyConnection) -> None:
        """Catch the index up with the file and find the next seq: at start, and after a
        group that failed to commit. Events leave the file once the index holds them
        (`warehouse.retention`), so the last seq is the greater of the two."""
        self.index.catch_up(conn)
        row = conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
        self.last_seq = max(int(row[0]) if row else 0, self.index.watermark)

    def __len__(self) -> int:
        """The events stored so far (their last seq: seqs have no gaps)."""
        return self.last_seq

    def stage(self, tx: Any, realm: str, event: EventRecord, ingest_path: str) -> None:
        tx.scratch.setdefault("outbox", []).append((realm, event, ingest_path))
        tx.on_flush("outbox", self._flush)

    def _flush(self, tx: Any) -> None:
        pending: list[tuple[str, EventRecord, str]] = tx.scratch.get("outbox", [])
        results: dict[str, Stored] = {}
        tx.scratch["outbox_result"] = results
        tx.scratch["outbox_first"] = first = {}
        # A single-event reply shows what was stored at first acceptance, so a duplicate that
        # any single request of the group carries is read back; batch replies need no read.
        wants_stored = {ev.event_id for _, ev, path in pending if path == "single"}
        candidates: list[tuple[str, EventRecord, str]] = []
        for item in pending:
            eid = item[1].event_id
            if eid in first:
                continue  # a repeat inside the group: the op reports it as a duplicate
            first[eid] = item[1]
            candidates.append(item)
        # The ids are the service's own canonical UUID strings: `bytes.fromhex` reads one in
        # 0.2 us, `uuid.UUID` in 2 us (1 ms of the writer's loop for a 500-event group).
        # The index's key leads with occurred_at (`warehouse.event_index` says why).
        keys = [(item[1].occurred_at_us, bytes.fromhex(item[1].event_id.replace("-", "")))
                for item in candidates]
        fresh: list[tuple[str, EventRecord, str, bytes]] = []
        look_up: list[tuple[str, tuple[int, bytes]]] = []
        for item, key, stored in zip(candidates, keys, self.index.known(keys), strict=True):
            eid = item[1].event_id
            if not stored:
                fresh.append((*item, key[1]))
            elif eid in wants_stored:
                look_up.append((eid, key))
            else:
                results[eid] = Stored(False)
        now_us = int(tx.now.timestamp() * 1_000_000)
        if fresh:
            seq = self.last_seq
            added: list[tuple[int, int, bytes, int, bytes]] = []
            for realm, event, path, raw in fresh:
                seq += 1
                tx.stage("events", (seq, event.event_id, realm, event.billing_account_id,
                                    event.request_hash, event.semantic_kind, event.event_type,
                                    event.occurred_at_us, event.subject_ref, event.payload_json,
                                    event.labels_json, now_us, path))
                added.append((seq, event.occurred_at_us, raw, now_us, event.labels_json))
                results[event.event_id] = Stored(True, now_us, event.labels_json)
            self.last_seq = seq
            index = self.index

            def into_index() -> None:
                # Durable in the journal now: the next group must see these as stored. If
                # this fails the group is answered 503 and the rollback catches the index up
                # from the file, so a retry is a duplicate, never a second row.
                index.add_events(added)

            tx.after_commit(into_index)
        if look_up:
            for (eid, _), found in zip(look_up, self.index.first_stored([r for _, r in look_up]),
                                       strict=True):
                results[eid] = Stored(False, found[0], found[1]) if found else Stored(False)


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
