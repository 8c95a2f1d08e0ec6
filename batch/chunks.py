"""Chunk planning for the sweep: pending events split by a hash of their billing account
into buckets, consecutive buckets grouped into chunks (one run each) or, past the memory
budget, into passes. All of an account's events fall in one chunk, so a run's carry (per
account, meter and price row) is the carry one run over everything would give.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import duckdb

__all__ = ["BUCKETS", "CHUNK_EVENTS", "Chunk", "group_buckets", "plan_chunks", "plan_passes"]

# Events per run (chunks are of equal size, an even number of them, about this big).
# Smaller chunks shorten the stretches where one core idles (the first carry, the last
# commit): interleaved at 5 M events, 5.7-6.2 s with chunks of 500,000 against 6.5-6.7 s
# with 1,000,000 before two threads carried them; now within the noise, with less memory.
CHUNK_EVENTS = 500_000
BUCKETS = 1024  # account hash buckets; chunks are runs of consecutive buckets


@dataclass(frozen=True, slots=True)
class Chunk:
    first_bucket: int
    last_bucket: int
    events: int  # candidates in these buckets

    def where(self, alias: str) -> str:
        return (f"hash({alias}.billing_account_id) % {BUCKETS}"
                f" BETWEEN {self.first_bucket} AND {self.last_bucket}")


def plan_chunks(conn: duckdb.DuckDBPyConnection, candidates: str, chunk_events: int) -> list[Chunk]:
    """Consecutive account buckets grouped into chunks of about `chunk_events` candidates
    (a single bucket bigger than that is a chunk of its own)."""
    counts = conn.execute(
        f"SELECT hash(e.billing_account_id) % {BUCKETS} AS bucket, count(*) FROM lake.events AS e"
        f" WHERE {candidates} GROUP BY bucket ORDER BY bucket").fetchall()
    return group_buckets(counts, chunk_events)


def group_buckets(counts: Iterable[tuple[int, int]], chunk_events: int, multiple: int = 1) -> list[Chunk]:
    """`plan_chunks` from (bucket, events) pairs in bucket order: as few chunks as keep
    them near `chunk_events` (their number rounded up to a `multiple`), of about equal size
    (a small last chunk would cost a run of its own; a bucket bigger than a chunk is a
    chunk of its own)."""
    found = [(bucket, count) for bucket, count in counts if count]
    total = sum(count for _, count in found)
    if not total:
        return []
    parts = -(-total // max(chunk_events, 1))
    if parts > 1:
        parts = -(-parts // multiple) * multiple
    chunks: list[Chunk] = []
    before = 0
    last_part = -1
    for bucket, count in found:
        # A bucket goes to the part its first event falls in, by equal shares of the total.
        part = before * parts // total
        if chunks and part == last_part:
            last = chunks[-1]
            chunks[-1] = Chunk(last.first_bucket, bucket, last.events + count)
        else:
            chunks.append(Chunk(bucket, bucket, count))
        last_part = part
        before += count
    return chunks


def plan_passes(conn: duckdb.DuckDBPyConnection, where: str, candidates: int, width: float,
                budget: int) -> list[Chunk | None]:
    """The passes a sweep rates its `candidates` (those `where`, alias e) in: one over all of
    them (None) when, staged at `width` bytes each, they fit the memory `budget`; else one per
    range of account buckets that fits (a single bucket bigger than that is a pass of its own)."""
    if candidates * width <= budget:
        return [None]
    return list(plan_chunks(conn, where, max(int(budget // width), 1))) or [None]
