"""Lake upkeep: fewer, larger files and no history beyond the retention.

Every micro-batch of the exporter and every rating run adds files and a snapshot, so the
lake needs regular compaction (DuckLake's maintenance functions, in the order its CHECKPOINT
runs them):

1. `ducklake_flush_inlined_data`: rows small inserts kept in the catalog go to Parquet;
2. `ducklake_merge_adjacent_files`: small files of a table are merged into larger ones;
3. `ducklake_expire_snapshots`: snapshots older than the retention are dropped, so time
   travel reaches back that far and no further;
4. `ducklake_cleanup_old_files`: files only expired snapshots referenced are deleted, once
   older than the retention too (a long query may still be reading them);
5. `ducklake_delete_orphaned_files`: files no snapshot ever referenced (a writer that died
   before its commit) are deleted, when older than a day, so a commit in flight is safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import duckdb

from warehouse.lake import with_lake_retry

__all__ = ["CompactionReport", "compact_lake"]

_ORPHAN_AGE = timedelta(days=1)


@dataclass(frozen=True, slots=True)
class CompactionReport:
    merged_files: int  # files merged away
    expired_snapshots: int
    deleted_files: int  # old and orphaned files removed from storage


def _interval(age: timedelta) -> str:
    return f"INTERVAL {int(age.total_seconds())} SECOND"


def compact_lake(conn: duckdb.DuckDBPyConnection, *, retention: timedelta,
                 alias: str = "lake") -> CompactionReport:
    """Compact the lake attached to `conn` as `alias`, keeping `retention` of history."""

    def call(sql: str) -> list[tuple[object, ...]]:
        return with_lake_retry(lambda: conn.execute(sql).fetchall())

    call(f"CALL ducklake_flush_inlined_data('{alias}')")
    merged = call(f"CALL ducklake_merge_adjacent_files('{alias}')")
    expired = call(f"CALL ducklake_expire_snapshots('{alias}',"
                   f" older_than => now() - {_interval(retention)})")
    old = call(f"CALL ducklake_cleanup_old_files('{alias}',"
               f" older_than => now() - {_interval(retention)})")
    orphans = call(f"CALL ducklake_delete_orphaned_files('{alias}',"
                   f" older_than => now() - {_interval(max(retention, _ORPHAN_AGE))})")
    merged_files = sum(int(row[2]) for row in merged if len(row) > 2 and row[2] is not None)
    return CompactionReport(merged_files, len(expired), len(old) + len(orphans))
