"""The data folder a flow works on: its lake, its applied catalog and its rating lock.

Every flow takes `data_dir`; None means the data folder of the settings (`core.settings`),
as for the service.
Flows read and write the lake only, never the service's operational file.
"""

from __future__ import annotations

import os
import threading
from datetime import datetime
from pathlib import Path

import duckdb

from batch.rating_runs import RatingLock
from core.layout import DataFolder, keep_private
from core.priority import run_deferred
from core.settings import Settings
from flows.process_memory import release_process_memory, settle_process_memory
from pipelines.catalog import Catalog, load_catalog
from warehouse.catalog_history import latest_catalog_source
from warehouse.catalog_store import CatalogStore
from warehouse.lake import connect_lake

__all__ = ["applied_catalog", "close_lake", "interrupt_open_lakes", "open_lake", "parse_instant", "rating_lock",
           "resolve_data_dir", "scratch_dir"]

# The flow connections open in this process, for `interrupt_open_lakes`.
_OPEN: list[duckdb.DuckDBPyConnection] = []
_OPEN_LOCK = threading.Lock()


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """The data folder of a flow's `data_dir` parameter, or of the settings."""
    return Settings.from_env(data_dir).data_dir


def scratch_dir(data_dir: Path) -> Path:
    """Where flows spill and keep work in progress: next to the lake, on the same disk."""
    return DataFolder(data_dir).lake_spill


def open_lake(data_dir: Path) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the lake attached as `lake`, memory capped, in a process
    whose allocators are set for flows (`flows.process_memory`), on a thread lowered to the
    flows' priority (`core.priority`, `DEFERRED_NICENESS`) before DuckDB starts its threads
    from it."""
    settle_process_memory()
    run_deferred()
    keep_private()  # a flow run by a Prefect worker writes lake files too: 0600
    conn = connect_lake(data_dir)
    spill = scratch_dir(data_dir)
    spill.mkdir(parents=True, exist_ok=True)
    # DuckDB spills to disk beyond this, so a flow's memory stays flat however big the lake.
    conn.execute(f"SET memory_limit = '{Settings.from_env(data_dir).flow_memory_limit}'")
    conn.execute(f"SET temp_directory = '{spill}'")
    # Rows of a rating run need no order in their files; unordered writes run in parallel.
    conn.execute("SET preserve_insertion_order = false")
    with _OPEN_LOCK:
        _OPEN.append(conn)
    return conn


def interrupt_open_lakes() -> None:
    """Interrupt the queries under way on every flow connection of this process (from
    another thread): a signal reaches Python only between two bytecodes, so a flow in the
    middle of a long DuckDB query would otherwise hear it only when the query ends."""
    with _OPEN_LOCK:
        for conn in _OPEN:
            conn.interrupt()


def close_lake(conn: duckdb.DuckDBPyConnection) -> None:
    """Close a flow's connection and give the memory the process kept for reuse
    (`flows.process_memory`) back to the system: a process that runs flows on a schedule
    holds no more than it needs between them."""
    with _OPEN_LOCK:
        _OPEN[:] = [c for c in _OPEN if c is not conn]
    conn.close()
    release_process_memory()


def applied_catalog(data_dir: Path, conn: duckdb.DuckDBPyConnection) -> Catalog:
    """The catalog applied last with `tollgate catalog apply`, as the lake records it (`conn`
    has the lake attached): a flow needs nothing of the service's folder but the lake. A
    lake with no catalog recorded falls back to the service's applied file (an empty
    catalog before the first apply)."""
    text = latest_catalog_source(conn)
    if text is None:
        text = CatalogStore(DataFolder(data_dir).catalog).read()
    return Catalog.empty() if text is None else load_catalog(text)


def rating_lock(data_dir: Path, timeout: float | None = None) -> RatingLock:
    return RatingLock(DataFolder(data_dir).rating_lock, timeout)


def parse_instant(text: str | datetime) -> datetime:
    """An RFC 3339 instant with an offset (a flow parameter)."""
    moment = text if isinstance(text, datetime) else datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} needs an offset, e.g. 2026-11-01T00:00:00Z")
    return moment
