"""The writer's disk-backed index: every stored event id, forever, and the idempotency records
of the last 24 hours, in a RocksDB store under `<data>/index/` with a bounded block cache.

Content dedupe has no expiry (docs/api.md, POST /mgt/v1/events), so the set of stored event ids grows
with history. Held in a Python set it cost ~70 bytes an event in RAM and a full scan of the
events table at every start; here an id costs about 24-28 bytes on disk (its value included,
LZ4-compressed) and a Bloom filter of 10 bits an id, also on disk, cut into partitions that
are read through the same cache of bounded size as the data (`FILTERS`; measured in
docs/measurements.md, "The dedupe index"). What stays in memory beyond the cache is the top
level of each file's partitions, a few bytes per thousand ids.

Keys (one store, a byte prefix per kind):

    b"E" + occurred_at + 16-byte event id
                                 -> created_at (8 bytes, big-endian microseconds) + labels JSON:
                                    what a duplicate single-event reply shows, for every event
                                    ever stored, also after it left the operational file.
                                    occurred_at is 8 bytes, big-endian microseconds plus 2**63
                                    (so that instants before 1970 sort first)
    b"e" + 16-byte event id      -> the same, in indexes written before the key carried
                                    occurred_at: read, never written (`EventIndex.legacy`)
    b"w"                         -> the highest event seq whose group is in the index
    b"i" + sha256(scope)         -> an idempotency record (msgpack: body digest, stored_at us,
                                    the outcome as msgpack)
    b"t" + stored_at us + digest -> nothing: the records in order of time, to expire them
    b"l" + sha256 of a lease token -> an ended lease (msgpack; `writer.gate.book`), for 7 days
    b"u" + ended_at us + sha256  -> nothing: the ended leases in order of time
    b"m"                         -> the latest ended_at of a lease put (the book reads the
                                    leases that ended after it, less a margin, from the file)

Why occurred_at leads the key: an event id is a hash, so ids alone land all over the key
range, and every flush of a memtable was merged into most of the level below it; the deeper the
tree (the longer the history), the more often each id was rewritten, and the writer's CPU an
event grew with history (docs/measurements.md, "Compaction as the index grows"). occurred_at is
part of the facts the id is derived from (docs/api.md, POST /mgt/v1/events), so a repeat of an
event carries the same occurred_at and finds the same key, and events arrive close to their
business time: new keys land at the end of the range, where the flushes meet only the newest
files. A late event lands among older keys and costs what every event cost before.

The journal stays the truth. Events are put into the index by the writer right after their
group is durable in the journal, in one write batch with the watermark (`w`), so the index
never holds an event the journal lacks and the watermark always covers what the batch put.
The index may lag (a kill between the journal's sync and the index's write, or a power loss
of RocksDB's unsynced write-ahead log): at start `catch_up` puts every event of the
operational file past the watermark. The file deletes events (`warehouse.retention`) only up
to the watermark that `durable_watermark` returns after syncing RocksDB's log, so every
event is always in the file, in the index, or in both.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import duckdb
import msgspec
from rocksdict import (
    BlockBasedIndexType,
    BlockBasedOptions,
    Cache,
    DBCompressionType,
    Options,
    Rdict,
    WriteBatch,
)

__all__ = ["EventIndex", "idempotency_digest", "open_rocks"]

log = logging.getLogger("tollgate.writer")

_EVENT = b"E"
_EVENT_BY_ID = b"e"
_SHIFT = 1 << 63
_WATERMARK = b"w"
_IDEM = b"i"
_IDEM_TIME = b"t"
_LEASE = b"l"
_LEASE_TIME = b"u"
_LEASE_MARK = b"m"
_U64 = struct.Struct(">Q")
CATCH_UP_ROWS = 100_000
# Where the Bloom filters (10 bits an id, ~1.25 bytes) and the index blocks live:
# - "partitioned" (the default): cut into ~4 KiB partitions held in the block cache, with
#   only their top-level index pinned in memory, so that memory is the cache's bound whatever
#   the history. A whole-file filter of a compacted file (~2.5 MB) is larger than a shard of
#   the cache; held there it was read again at each lookup, and the soak's ingestion fell by
#   a third (docs/measurements.md, The dedupe index).
# - "table": with each table, outside the cache. Fast, but ~1.6 bytes an id of RAM that grows
#   with history (~80 MB at 50 M events, ~1.6 GB at 1 B).
FILTERS = "partitioned"
# Each of the two memtables: the size of a flush into level 0 (smaller memtables, more
# flushes and more compaction CPU: docs/measurements.md, "Compaction as the index grows").
WRITE_BUFFER = 8 << 20
# The size at which compaction cuts its output files. Keys lead with occurred_at, so every
# compaction of level 0 meets only the newest file of the level below and rewrites it whole:
# with RocksDB's 64 MiB (files grow to twice it) that file was rewritten with each 8 MiB of
# new ids, a write amplification that grew from 1 to 15 as it filled (docs/measurements.md,
# "Where the writer's cost an event grows").
TARGET_FILE = 16 << 20


def open_rocks(path: Path, cache_bytes: int) -> Rdict:
    """A RocksDB store of raw bytes whose memory is bounded: the block cache of `cache_bytes`
    (the Bloom filter and index partitions included, see `FILTERS`), two memtables of
    `WRITE_BUFFER` bytes, a bounded number of open files."""
    path.mkdir(parents=True, exist_ok=True)
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    table = BlockBasedOptions()
    table.set_block_cache(Cache(max(cache_bytes, 8 << 20)))
    table.set_bloom_filter(10, False)
    if FILTERS == "partitioned":
        table.set_index_type(BlockBasedIndexType.two_level_index_search())
        table.set_partition_filters(True)
        table.set_metadata_block_size(4096)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_top_level_index_and_filter(True)
    else:
        table.set_cache_index_and_filter_blocks(False)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opts.set_block_based_table_factory(table)
    opts.set_compression_type(DBCompressionType.lz4())
    opts.set_write_buffer_size(WRITE_BUFFER)
    opts.set_target_file_size_base(TARGET_FILE)
    opts.set_max_write_buffer_number(2)
    # With 16 MiB files (`TARGET_FILE`), ~310 M ids before the table cache evicts a reader.
    opts.set_max_open_files(512)
    opts.set_max_background_jobs(1)
    opts.set_keep_log_file_num(2)
    opts.set_max_total_wal_size(64 << 20)
    return Rdict(str(path), opts)


def idempotency_digest(realm: str, principal: str, endpoint: str, key: str) -> bytes:
    """The 32-byte key of an idempotency scope."""
    return hashlib.sha256("\x00".join((realm, principal, endpoint, key)).encode()).digest()


def event_key(occurred_us: int, raw_id: bytes) -> bytes:
    """The index's key of an event: its occurred_at (UTC microseconds), then its 16-byte id.

    >>> event_key(0, bytes.fromhex("00000000000000000000000000000001")).hex()
    '45800000000000000000000000000000000000000000000001'
    >>> event_key(-1, bytes(16)) < event_key(0, bytes(16)) < event_key(1, bytes(16))
    True
    """
    return _EVENT + _U64.pack(occurred_us + _SHIFT) + raw_id


class EventIndex:
    """Owned by the writer process. Reads and writes come from the writer thread; RocksDB is
    safe to share with the thread that prunes the file (it only reads the watermark)."""

    def __init__(self, path: Path, cache_bytes: int) -> None:
        self.path = path
        self.db = open_rocks(path, cache_bytes)
        raw = self.db.get(_WATERMARK)
        self.watermark = _U64.unpack(raw)[0] if raw is not None else 0
        # An index written before the key carried occurred_at keeps its ids under b"e": a
        # lookup that misses the new keys reads them too (one more Bloom filter probe).
        self.legacy = self._has_prefix(_EVENT_BY_ID)

    # ---- events ---------------------------------------------------------------------
    def add_events(self, rows: Iterable[tuple[int, int, bytes, int, bytes]]) -> int:
        """Put events (seq, occurred_at us, 16-byte id, created_at us, labels JSON) and move
        the watermark to their highest seq, in one write batch; the number put."""
        batch = WriteBatch(raw_mode=True)
        top = self.watermark
        n = 0
        for seq, occurred_us, raw_id, created_us, labels in rows:
            batch.put(event_key(occurred_us, raw_id), _U64.pack(created_us) + labels)
            if seq > top:
                top = seq
            n += 1
        if n == 0:
            return 0
        batch.put(_WATERMARK, _U64.pack(top))
        self.db.write(batch)
        self.watermark = top
        return n

    def _values(self, keys: Sequence[tuple[int, bytes]]) -> list[Any]:
        """The stored value of each (occurred_at us, 16-byte id), None where it has none."""
        if not keys:
            return []
        values: list[Any] = self.db.get([event_key(occurred_us, raw) for occurred_us, raw in keys]) or []
        if self.legacy:
            missed = [i for i, v in enumerate(values) if v is None]
            if missed:
                older: list[Any] = self.db.get([_EVENT_BY_ID + keys[i][1] for i in missed]) or []
                for i, value in zip(missed, older, strict=True):
                    values[i] = value
        return values

    def known(self, keys: Sequence[tuple[int, bytes]]) -> list[bool]:
        """For each (occurred_at us, 16-byte id): is it stored?"""
        return [v is not None for v in self._values(keys)]

    def first_stored(self, keys: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes] | None]:
        """For each (occurred_at us, 16-byte id): (created_at us, labels JSON) as stored at
        first acceptance."""
        out: list[tuple[int, bytes] | None] = []
        for value in self._values(keys):
            out.append(None if value is None else (_U64.unpack_from(value)[0], bytes(value[8:])))
        return out

    def catch_up(self, conn: duckdb.DuckDBPyConnection) -> int:
        """Put every event the operational file holds past the watermark (after a kill between
        the journal's sync and the index's write, or at the first start of a file written
        before the index existed); the number put."""
        total = 0
        while True:
            # A range of seqs (zone maps skip the rest), not a top-n that reads every row
            # past the mark (warehouse.export says what that cost).
            found = conn.execute("SELECT min(seq) FROM events WHERE seq > ?",
                                 [self.watermark]).fetchall()
            if not found or found[0][0] is None:
                break
            start = int(found[0][0]) - 1
            table = conn.execute(
                "SELECT seq, epoch_us(occurred_at), event_id, epoch_us(created_at) AS created_us, "
                "labels::VARCHAR AS labels FROM events WHERE seq > ? AND seq <= ? ORDER BY seq",
                [start, start + CATCH_UP_ROWS]).fetchall()
            total += self.add_events(
                (int(seq), int(occurred), eid.bytes, int(created), labels.encode())
                for seq, occurred, eid, created, labels in table)
        if total:
            log.info("event index: caught up %d events from the operational file", total)
        return total

    def durable_watermark(self) -> int:
        """The watermark, after syncing RocksDB's write-ahead log: every event up to it
        survives a power loss in the index, so the file may let it go."""
        mark = self.watermark
        self.db.flush_wal(True)
        return mark

    # ---- idempotency records ----------------------------------------------------------
    def put_idempotency(self, records: Iterable[tuple[bytes, str, int, bytes]]) -> None:
        """Put records (scope digest, body digest, stored_at us, outcome msgpack)."""
        batch = WriteBatch(raw_mode=True)
        for digest, body_sha, stored_us, outcome in records:
            batch.put(_IDEM + digest, msgspec.msgpack.encode((body_sha, stored_us, outcome)))
            batch.put(_IDEM_TIME + _U64.pack(stored_us) + digest, b"")
        if not batch.is_empty():
            self.db.write(batch)

    def get_idempotency(self, digest: bytes) -> tuple[str, int, bytes] | None:
        """(body digest, stored_at us, outcome msgpack) of a scope, or None."""
        raw = self.db.get(_IDEM + digest)
        if raw is None:
            return None
        body_sha, stored_us, outcome = msgspec.msgpack.decode(raw)
        return str(body_sha), int(stored_us), bytes(outcome)

    def expire_idempotency(self, before_us: int, limit: int = 10_000) -> int:
        """Delete up to `limit` records stored before `before_us`; the number deleted."""
        return self._expire(_IDEM_TIME, _IDEM, before_us, limit)

    def _expire(self, time_prefix: bytes, value_prefix: bytes, before_us: int, limit: int) -> int:
        """Delete up to `limit` entries whose time key is before `before_us` (each value is
        a msgpack array whose second item is that time)."""
        it = self.db.iter()
        it.seek(time_prefix)
        batch = WriteBatch(raw_mode=True)
        n = 0
        while it.valid() and n < limit:
            key: Any = it.key()
            if not key.startswith(time_prefix) or _U64.unpack_from(key, 1)[0] >= before_us:
                break
            digest = bytes(key[9:])
            raw = self.db.get(value_prefix + digest)
            # A key stored again later has a newer time key: only the entry of this time goes.
            if raw is not None and int(msgspec.msgpack.decode(raw)[1]) == _U64.unpack_from(key, 1)[0]:
                batch.delete(value_prefix + digest)
            batch.delete(bytes(key))
            n += 1
            it.next()
        del it
        if n:
            self.db.write(batch)
        return n

    # ---- ended leases -----------------------------------------------------------------
    def put_leases(self, records: Iterable[tuple[bytes, int, bytes]]) -> None:
        """Put ended leases (sha256 of the token, ended_at us, the lease as msgpack whose
        second item is ended_at us) and move the mark to the latest ended_at."""
        batch = WriteBatch(raw_mode=True)
        mark = self.lease_mark()
        top = mark
        for sha, ended_us, value in records:
            batch.put(_LEASE + sha, value)
            batch.put(_LEASE_TIME + _U64.pack(ended_us) + sha, b"")
            top = max(top, ended_us)
        if batch.is_empty():
            return
        if top > mark:
            batch.put(_LEASE_MARK, _U64.pack(top))
        self.db.write(batch)

    def lease_mark(self) -> int:
        """The latest ended_at (us) of a lease put; 0 before any."""
        raw = self.db.get(_LEASE_MARK)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def get_lease(self, sha: bytes) -> bytes | None:
        raw = self.db.get(_LEASE + sha)
        return None if raw is None else bytes(raw)

    def expire_leases(self, before_us: int, limit: int = 10_000) -> int:
        """Delete up to `limit` leases that ended before `before_us`; the number deleted."""
        return self._expire(_LEASE_TIME, _LEASE, before_us, limit)

    def _has_prefix(self, prefix: bytes) -> bool:
        it = self.db.iter()
        it.seek(prefix)
        found = it.valid() and bytes(it.key()[:1]) == prefix
        del it
        return found

    def count_prefix(self, prefix: bytes) -> int:
        it = self.db.iter()
        it.seek(prefix)
        n = 0
        while it.valid() and bytes(it.key()[:1]) == prefix:
            n += 1
            it.next()
        return n

    def count_idempotency(self) -> int:
        """Records on disk (tests and tools; a full scan of the idempotency keys)."""
        return self.count_prefix(_IDEM)

    def count_leases(self) -> int:
        """Ended leases on disk (tests and tools; a full scan of their keys)."""
        return self.count_prefix(_LEASE)

    # ---- upkeep -----------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """What RocksDB holds in memory now: block cache, memtables, table readers."""
        total = 0
        for prop in ("rocksdb.block-cache-usage", "rocksdb.cur-size-all-mem-tables",
                     "rocksdb.estimate-table-readers-mem"):
            try:
                total += int(self.db.property_int_value(prop) or 0)
            except Exception:
                pass
        return total

    def memory(self) -> dict[str, int]:
        """Bytes RocksDB holds in memory, by part: the block cache, the memtables, and the
        table readers (the top-level index of each file's filter and index partitions, `FILTERS`)."""
        parts = {"index_block_cache": "rocksdb.block-cache-usage",
                 "index_memtables": "rocksdb.cur-size-all-mem-tables",
                 "index_table_readers": "rocksdb.estimate-table-readers-mem"}
        out = {}
        for part, name in parts.items():
            value = self.db.property_int_value(name)
            if value is not None:
                out[part] = int(value)
        return out

    def close(self) -> None:
        try:
            self.db.flush_wal(True)
        finally:
            self.db.close()


class MemoryIndex:
    """The event part of `EventIndex` in a dict: for tools and tests that write an
    operational file without a writer process (it is rebuilt from the file it is given)."""

    def __init__(self) -> None:
        self.watermark = 0
        self._events: dict[bytes, tuple[int, bytes]] = {}

    def add_events(self, rows: Iterable[tuple[int, int, bytes, int, bytes]]) -> int:
        n = 0
        for seq, _occurred_us, raw_id, created_us, labels in rows:
            self._events[raw_id] = (created_us, labels)
            self.watermark = max(self.watermark, seq)
            n += 1
        return n

    def known(self, keys: Sequence[tuple[int, bytes]]) -> list[bool]:
        return [raw in self._events for _, raw in keys]

    def first_stored(self, keys: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes] | None]:
        return [self._events.get(raw) for _, raw in keys]

    def catch_up(self, conn: duckdb.DuckDBPyConnection) -> int:
        rows = conn.execute(
            "SELECT seq, epoch_us(occurred_at), event_id, epoch_us(created_at), labels::VARCHAR "
            "FROM events WHERE seq > ?", [self.watermark]).fetchall()
        return self.add_events((int(s), int(o), e.bytes, int(c), lab.encode())
                               for s, o, e, c, lab in rows)
