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

With the SQLite catalog, DuckLake compares an `older_than` instant with the catalog's stored
times as text, so any instant of a UTC day stands for the end of that day: `older_than => now()
- INTERVAL 1 HOUR` expires every snapshot of the day, an hour old or a second. So steps 3 and
4 are given the end of the day before the cutoff (exact, whatever the catalog), and the
snapshots of the cutoff's own day that are older than the cutoff are expired by id.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import duckdb

from core.clock import SYSTEM_CLOCK, Clock
from warehouse.lake import with_lake_retry

__all__ = ["CompactionReport", "compact_lake", "expire_snapshots"]

_ORPHAN_AGE = timedelta(days=1)
# Snapshots expired by one call: the ids are spelled out in its SQL.
EXPIRE_CHUNK = 10_000


@dataclass(frozen=True, slots=True)
class CompactionReport:
    merged_files: int  # files merged away
    expired_snapshots: int
    deleted_files: int  # old and orphaned files removed from storage


def _interval(age: timedelta) -> str:
    return f"INTERVAL {int(age.total_seconds())} SECOND"


def _instant(moment: datetime) -> str:
    return f"TIMESTAMPTZ '{moment.astimezone(timezone.utc).isoformat()}'"


def _before_day(moment: datetime) -> str:
    """The last microsecond of the UTC day before `moment`'s: an `older_than` DuckLake applies
    exactly even when it compares times as text (see above)."""
    day = moment.astimezone(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    return _instant(day - timedelta(microseconds=1))


# DuckLake's own commit of a step failed: "Failed to commit DuckLake transaction." A step's
# commit that met another process's commit is retried by DuckLake, and that retry of
# `ducklake_flush_inlined_data` has been seen to build its SQL with an empty table name
# ('syntax error at or near "<="'). The commit failed whole (its SQLite transaction rolled
# back, the inlined rows where they were), so the step runs again in a fresh transaction.
_FAILED_COMMIT = "failed to commit ducklake transaction"


def _call(conn: duckdb.DuckDBPyConnection, sql: str) -> list[tuple[object, ...]]:
    """Run one maintenance step, again while another process's commit stands in its way (a
    catalog locked or busy, a transaction aborted by a conflict, a failed DuckLake commit)."""
    def step() -> list[tuple[object, ...]]:
        try:
            return conn.execute(sql).fetchall()
        except duckdb.Error as exc:
            # A step that meets another process's commit to the catalog can fail as
            # "Current transaction is aborted": nothing of it is kept, so it runs again.
            try:
                conn.execute("ROLLBACK")
            except duckdb.Error:
                pass  # no transaction left open
            text = str(exc).lower()
            if "transaction is aborted" in text or _FAILED_COMMIT in text:
                raise duckdb.TransactionException(f"conflict with another commit: {exc}") from exc
            raise
    return with_lake_retry(step)


def expire_snapshots(conn: duckdb.DuckDBPyConnection, *, keep: timedelta, alias: str = "lake",
                     clock: Clock = SYSTEM_CLOCK, chunk: int = EXPIRE_CHUNK) -> tuple[int, int]:
    """Expire the snapshots of the lake attached as `alias` that are older than `keep` (the
    newest is always kept), then delete the files only expired snapshots referenced, once
    scheduled for deletion before the cutoff's day (steps 3 and 4 above). Returns the
    snapshots expired and the files deleted.

    Every transaction on the lake starts by finding the newest snapshot, a query DuckDB runs
    over the whole of SQLite's snapshot table: 0.13 ms a thousand snapshots, 90 ms at 700,000
    (docs/measurements.md, "The lake's catalog"). So what the lake keeps bounds what every
    lake transaction costs, the exporter's among them (`warehouse.export`)."""
    cutoff = clock.now() - keep
    expired = len(_call(conn, f"CALL ducklake_expire_snapshots('{alias}', older_than => {_before_day(cutoff)})"))
    same_day = [snapshot for (snapshot,) in _call(conn,
        f"SELECT snapshot_id FROM ducklake_snapshots('{alias}') WHERE snapshot_time < {_instant(cutoff)}"
        f" AND snapshot_id < (SELECT max(snapshot_id) FROM ducklake_snapshots('{alias}')) ORDER BY 1")]
    for start in range(0, len(same_day), chunk):
        versions = same_day[start:start + chunk]
        expired += len(_call(conn, f"CALL ducklake_expire_snapshots('{alias}', versions => {versions})"))
    old = _call(conn, f"CALL ducklake_cleanup_old_files('{alias}', older_than => {_before_day(cutoff)})")
    return expired, len(old)


def compact_lake(conn: duckdb.DuckDBPyConnection, *, retention: timedelta,
                 alias: str = "lake", clock: Clock = SYSTEM_CLOCK) -> CompactionReport:
    """Compact the lake attached to `conn` as `alias`, keeping `retention` of history."""

    call = functools.partial(_call, conn)
    call(f"CALL ducklake_flush_inlined_data('{alias}')")
    merged = call(f"CALL ducklake_merge_adjacent_files('{alias}')")
    expired, old = expire_snapshots(conn, keep=retention, alias=alias, clock=clock)
    orphans = call(f"CALL ducklake_delete_orphaned_files('{alias}',"
                   f" older_than => now() - {_interval(max(retention, _ORPHAN_AGE))})")
    merged_files = sum(int(str(row[2])) for row in merged if len(row) > 2 and row[2] is not None)
    return CompactionReport(merged_files, expired, old + len(orphans))
