"""The `compact-lake` flow: merge small files, expire old snapshots, delete unused files."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from prefect import flow, get_run_logger

from flows.workspace import close_lake, open_lake, resolve_data_dir
from warehouse.compaction import compact_lake as compact
from warehouse.lake import compaction_turn

__all__ = ["compact_lake"]


@flow(name="compact-lake")
def compact_lake(data_dir: str | None = None, retention_hours: float = 7 * 24) -> dict[str, Any]:
    """Compact the lake, keeping `retention_hours` of snapshots for time travel."""
    folder = resolve_data_dir(data_dir)
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
