"""The `compact-lake` flow: merge small files, expire old snapshots, delete unused files."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from prefect import flow, get_run_logger

from core.settings import Settings
from flows.workspace import close_lake, open_lake, resolve_data_dir
from warehouse.compaction import compact_lake as compact
from warehouse.lake import compaction_turn

__all__ = ["compact_lake"]


@flow(name="compact-lake")
def compact_lake(data_dir: str | None = None, retention_hours: float | None = None) -> dict[str, Any]:
    """Compact the lake, keeping `retention_hours` of snapshots for time travel (by default
    TOLLGATE_LAKE_SNAPSHOT_HOURS, the window the writer's exporter keeps them for)."""
    folder = resolve_data_dir(data_dir)
    if retention_hours is None:
        retention_hours = Settings.from_env(folder).lake_snapshot_seconds / 3600
    conn = open_lake(folder)
    try:
        # The lake's exporter pauses meanwhile: its commits would make the merge's fail.
        with compaction_turn(folder):
            report = compact(conn, retention=timedelta(hours=retention_hours))
    finally:
        close_lake(conn)
    get_run_logger().info("merged %d files, expired %d snapshots, deleted %d files",
                          report.merged_files, report.expired_snapshots, report.deleted_files)
    return {"merged_files": report.merged_files, "expired_snapshots": report.expired_snapshots,
            "deleted_files": report.deleted_files}
