"""The data folder a flow works on: its lake, its applied catalog and its rating lock.

Every flow takes `data_dir`; None means TOLLGATE_DATA_DIR, else `./var`, as for the service.
Flows read and write the lake only, never the service's operational file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from pipelines.catalog import Catalog, load_catalog
from pipelines.rating_runs import RatingLock
from warehouse.catalog_history import latest_catalog_source
from warehouse.catalog_store import CatalogStore
from warehouse.lake import connect_lake

__all__ = ["applied_catalog", "close_lake", "open_lake", "parse_instant", "rating_lock", "resolve_data_dir",
           "scratch_dir", "settle_process_memory"]

# DuckDB spills to disk beyond this, so a flow's memory stays flat however big the lake.
_MEMORY_LIMIT = os.environ.get("TOLLGATE_FLOW_MEMORY_LIMIT", "1GB")


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    return Path(data_dir or os.environ.get("TOLLGATE_DATA_DIR") or "var").resolve()


def scratch_dir(data_dir: Path) -> Path:
    """Where flows spill and keep work in progress: next to the lake, on the same disk."""
    return data_dir / "lake" / "spill"


# glibc's mallopt parameters, and prctl's switch for transparent huge pages.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_PR_SET_THP_DISABLE = 41
# Large blocks come from the heap up to this size (glibc's ceiling for the threshold), and
# the heap keeps up to this much freed memory for the next chunk rather than return it
# (`close_lake` returns it when the flow is done).
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30
_settled = threading.Lock()
_SETTLED: list[bool] = []


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def settle_process_memory() -> None:
    """Make this process reuse the memory it frees instead of faulting in fresh pages.

    A sweep allocates and frees a few hundred MB for every chunk of 500,000 events (Arrow
    takes and concatenations, numpy sorts and sums). Measured with `perf` on a 5 M event
    sweep: a sixth of all its CPU was the kernel zeroing fresh pages, nearly all of them
    2 MiB transparent huge pages (the kernel's `madvise` mode, which Arrow's allocator and
    numpy ask for), and the chunk phase spent as much time in the kernel as in user space.
    So, once per process: huge pages off (small pages are zeroed only where touched),
    Arrow on the system allocator, and glibc keeping large blocks in its heap (up to its
    32 MiB ceiling) and up to 1 GiB of freed memory (`close_lake` gives it back at the end
    of a flow; with 256 MiB, a sweep in passes, past the memory budget, freed each pass's
    stage and faulted it in again: 20 M events took 13.5-14.5 s against 11.9), in one
    arena: glibc gives each
    thread an arena of its own, made of 64 MiB heaps that it unmaps as soon as one is
    empty, whatever the trim threshold, so the threads that carry chunks faulted their
    memory in again for every chunk. Interleaved runs on copies of one lake, chunk phase:
    1.04-1.22 s against 1.45-1.67 s without any of it; then 0.99-1.03 s and 140,000-150,000
    page faults with one arena against 1.07-1.19 s and 230,000-250,000 without. Threads
    that already had an arena keep it. Each step is skipped where the platform lacks it
    (not Linux, not glibc)."""
    with _settled:
        if _SETTLED:
            return
        _SETTLED.append(True)
    pa.set_memory_pool(pa.system_memory_pool())
    libc = _libc()
    if libc is None:
        return
    prctl = getattr(libc, "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        mallopt(_M_ARENA_MAX, 1)


def open_lake(data_dir: Path) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the lake attached as `lake`, memory capped, in a process
    whose allocators are set for flows (`settle_process_memory`)."""
    settle_process_memory()
    conn = connect_lake(data_dir)
    spill = scratch_dir(data_dir)
    spill.mkdir(parents=True, exist_ok=True)
    conn.execute(f"SET memory_limit = '{_MEMORY_LIMIT}'")
    conn.execute(f"SET temp_directory = '{spill}'")
    # Rows of a rating run need no order in their files; unordered writes run in parallel.
    conn.execute("SET preserve_insertion_order = false")
    return conn


def close_lake(conn: duckdb.DuckDBPyConnection) -> None:
    """Close a flow's connection and give the memory the process kept for reuse
    (`settle_process_memory`) back to the system: a process that runs flows on a schedule
    holds no more than it needs between them."""
    conn.close()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def applied_catalog(data_dir: Path, conn: duckdb.DuckDBPyConnection) -> Catalog:
    """The catalog applied last with `tollgate catalog apply`, as the lake records it (`conn`
    has the lake attached): a flow needs nothing of the service's folder but the lake. A
    lake with no catalog recorded falls back to the service's applied file (an empty
    catalog before the first apply)."""
    text = latest_catalog_source(conn)
    if text is None:
        text = CatalogStore(data_dir / "catalog").read()
    return Catalog.empty() if text is None else load_catalog(text)


def rating_lock(data_dir: Path, timeout: float | None = None) -> RatingLock:
    return RatingLock(data_dir / "lake" / "rating.lock", timeout)


def parse_instant(text: str | datetime) -> datetime:
    """An RFC 3339 instant with an offset (a flow parameter)."""
    moment = text if isinstance(text, datetime) else datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} needs an offset, e.g. 2026-11-01T00:00:00Z")
    return moment
