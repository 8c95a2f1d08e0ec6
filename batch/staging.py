"""Staging for a sweep of more than one chunk: the rated pending events held between the
scan that rates them and the runs made of them, with their account's bucket. In memory as
Arrow while they fit (`memory_stage`); a single bucket too big for memory in Parquet files, one
partition per chunk (`parquet_stage`). Each stage hands back its chunks and how to prepare
the run of one (`RunWriter.prepare`), safe on threads of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from batch.chunks import BUCKETS, Chunk, group_buckets, plan_chunks
from batch.run_writer import PreparedRun, RunWriter

__all__ = ["memory_limit", "memory_stage", "parquet_stage", "stage_width"]


# A rated event staged in memory as Arrow takes: event_id 16 bytes, occurred_at 8, its
# bucket 2, the offsets of realm and account 4 each, validity bits ~2; the text of realm
# and account; its slots. Times a margin (measured: the benchmark's mix, estimated 78
# bytes an event, took 77.6).
_STAGED_FIXED_BYTES = 36
_STAGE_OVERHEAD = 1.1


def stage_width(conn: duckdb.DuckDBPyConnection, slot_bytes: int, where: str) -> float:
    """The bytes one event `where` (alias e) takes in the stage, on average."""
    row = conn.execute("SELECT avg(length(e.realm) + length(e.billing_account_id))"
                       f" FROM lake.events AS e WHERE {where}").fetchone()
    text = float(row[0]) if row and row[0] is not None else 0.0
    return (_STAGED_FIXED_BYTES + slot_bytes + text) * _STAGE_OVERHEAD


def memory_limit(conn: duckdb.DuckDBPyConnection) -> int:
    """DuckDB's memory limit in bytes (1 GiB when it cannot be read)."""
    row = conn.execute("SELECT value FROM duckdb_settings() WHERE name = 'memory_limit'").fetchone()
    text = str(row[0]) if row else ""
    number, _, unit = text.partition(" ")
    scale = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40, "KB": 10 ** 3,
             "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "bytes": 1}.get(unit.strip())
    try:
        return int(float(number) * scale) if scale else 1 << 30
    except ValueError:
        return 1 << 30


def memory_stage(conn: duckdb.DuckDBPyConnection, writer: RunWriter, rated: str,
                 chunk_events: int, preparers: int) -> tuple[list[Chunk], Callable[[int], PreparedRun]]:
    """The rated events as Arrow, in this process, with their account's bucket; the chunks
    their counts make (a multiple of the `preparers`, the threads that prepare them), and how
    to prepare one (a take of its rows, batch by batch: a take from the whole chunked table
    would concatenate it first)."""
    stage = conn.sql(f"SELECT {writer.columns()},"
                     f" CAST(hash(billing_account_id) % {BUCKETS} AS USMALLINT) AS _bucket"
                     f" FROM ({rated})").to_arrow_table()
    schema = stage.schema.remove(stage.schema.get_field_index("_bucket"))
    batches = [batch for batch in stage.to_batches() if batch.num_rows]
    del stage
    buckets = [np.asarray(batch.column("_bucket")).astype(np.intp) for batch in batches]
    counts = np.zeros(BUCKETS, dtype=np.int64)
    for bucket in buckets:
        counts += np.bincount(bucket, minlength=BUCKETS)
    chunks = (group_buckets(enumerate(counts.tolist()), chunk_events, preparers)
              or [Chunk(0, BUCKETS - 1, 0)])
    # int16: numpy sorts it by radix (int32 took 0.2 s at 5 M events, on one core).
    chunk_of = np.zeros(BUCKETS, dtype=np.int16)
    for i, chunk in enumerate(chunks):
        chunk_of[chunk.first_bucket:chunk.last_bucket + 1] = i
    # Each batch's rows in chunk order (a stable sort keeps them in order within a chunk),
    # with where each chunk's rows start.
    held: list[tuple[pa.RecordBatch, np.ndarray, np.ndarray]] = []
    for batch, bucket in zip(batches, buckets, strict=True):
        of = chunk_of[bucket]
        order = np.argsort(of, kind="stable")
        starts = np.searchsorted(of[order], np.arange(len(chunks) + 1))
        held.append((batch.drop_columns(["_bucket"]), order, starts))
    del batches, buckets

    def prepare(index: int) -> PreparedRun:
        return writer.prepare(pa.Table.from_batches(
            [batch.take(pa.array(order[starts[index]:starts[index + 1]]))
             for batch, order, starts in held], schema))

    return chunks, prepare


def parquet_stage(conn: duckdb.DuckDBPyConnection, writer: RunWriter, rated: str,
                  chunk_events: int, where: str,
                  folder: Path) -> tuple[list[Chunk], Callable[[int], PreparedRun]]:
    """The rated events in Parquet under `folder`, one partition per chunk of `plan_chunks`
    (candidates `where`); the chunks, and how to prepare one (each on a connection of its
    own: they are read on two threads)."""
    chunks = plan_chunks(conn, where, chunk_events) or [Chunk(0, BUCKETS - 1, 0)]
    chunk_of = " ".join(f"WHEN _bucket <= {c.last_bucket} THEN {i}" for i, c in enumerate(chunks))
    staged = (f"SELECT {writer.columns()}, CASE {chunk_of} END AS chunk FROM"
              f" (SELECT *, hash(billing_account_id) % {BUCKETS} AS _bucket FROM ({rated}))")
    conn.execute(f"COPY ({staged}) TO '{folder}'"
                 " (FORMAT parquet, PARTITION_BY (chunk), COMPRESSION uncompressed)")

    def prepare(index: int) -> PreparedRun:
        part = folder / f"chunk={index}"
        source = (f"read_parquet('{part}/*.parquet')" if part.is_dir()
                  else f"({rated}) WHERE FALSE")
        with conn.cursor() as reader:
            reader.execute("SET TimeZone = 'UTC'")
            reader.execute("SET arrow_lossless_conversion = true")
            return writer.prepare(
                reader.sql(f"SELECT {writer.columns()} FROM {source}").to_arrow_table())

    return chunks, prepare
