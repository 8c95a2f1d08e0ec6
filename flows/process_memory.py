"""How a process that runs flows uses memory: it reuses what it frees.

A sweep allocates and frees a few hundred MB for every chunk of 500,000 events (Arrow takes
and concatenations, numpy sorts and sums). Measured with `perf` on a 5 M event sweep, a sixth
of all its CPU was the kernel zeroing fresh pages, nearly all of them 2 MiB transparent huge
pages (the kernel's `madvise` mode, which Arrow's allocator and numpy ask for), and the
chunk phase spent as much time in the kernel as in user space. So a flow's process runs with:

- transparent huge pages off (`PR_SET_THP_DISABLE`; small pages are zeroed only where
  touched). The setting is inherited by the processes it starts;
- Arrow on the system allocator, so that Arrow and numpy share glibc's heap;
- glibc keeping large blocks in its heap (up to its 32 MiB ceiling) and up to 1 GiB of
  freed memory until the flow is done (`release_process_memory` gives it back), in one
  arena: glibc gives each thread an arena of its own, made of 64 MiB heaps that it unmaps
  as soon as one is empty, whatever the trim threshold, so the threads that carry chunks
  faulted their memory in again for every chunk.

`settle_process_memory` applies these in a running process (`flows.workspace.open_lake`
calls it). glibc makes no new arena once told so, but threads that already have one keep
it, and a new thread may still be handed an existing one; a process started with
`environment(...)` (the service's scheduler) has glibc's tunables from its first
allocation. Measured in interleaved runs on copies of one lake, chunk phase of a 5 M event
sweep: 1.45-1.67 s (CPU 2.7-3.1 s) without any of it, 1.04-1.22 s with huge pages off,
the system allocator and the two thresholds, 0.99-1.03 s and 140,000-150,000 page faults
with one arena too (230,000-250,000 without). With 256 MiB rather than 1 GiB kept, a sweep
in passes freed each pass's stage and faulted it in again (20 M events: 13.5-14.5 s against
11.9-12.4 s). Each step is skipped where the platform lacks it (not Linux, not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Mapping

__all__ = ["environment", "heap_bytes", "release_process_memory", "settle_process_memory",
           "settle_writer_memory"]

# glibc's mallopt parameters, and prctl's switch for transparent huge pages.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_PR_SET_THP_DISABLE = 41
_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it
_TRIM_THRESHOLD = 1 << 30
# The same three as glibc tunables, read when a process starts.
_TUNABLES = {"glibc.malloc.arena_max": 1, "glibc.malloc.mmap_threshold": _MMAP_THRESHOLD,
             "glibc.malloc.trim_threshold": _TRIM_THRESHOLD}

@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is not None and hasattr(libc, "prctl"):
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                               ctypes.c_ulong]
    return libc


def environment(base: Mapping[str, str]) -> dict[str, str]:
    """`base` with glibc's tunables for a flow's process added (those `base` sets win)."""
    env = dict(base)
    given = [part for part in env.get("GLIBC_TUNABLES", "").split(":") if part]
    names = {part.split("=", 1)[0] for part in given}
    env["GLIBC_TUNABLES"] = ":".join(
        given + [f"{name}={value}" for name, value in _TUNABLES.items() if name not in names])
    return env


@functools.cache
def settle_process_memory() -> None:
    """Apply the settings above to this process, once (each is idempotent)."""
    import pyarrow as pa  # (here: a scheduler that only spawns needs no Arrow)

    pa.set_memory_pool(pa.system_memory_pool())
    libc = _libc()
    if libc is None:
        return
    if hasattr(libc, "prctl"):
        libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
    if hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        libc.mallopt(_M_ARENA_MAX, 1)


def settle_writer_memory(arenas: int = 2) -> None:
    """The writer process's side of the same: unlike a flow it runs for months and must stay
    under its ceiling (TOLLGATE_WRITER_MEMORY), so it keeps nothing it freed. Arrow's
    buffers (the journal applier's inserts, the exporter) go to glibc's heap rather than to
    Arrow's own mimalloc pool, which kept what it freed; glibc makes at most `arenas` arenas,
    so the applier's and the exporter's threads share heaps that `release_process_memory`
    (called on the writer's tick) gives back. Called first thing, before the threads start."""
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_ARENA_MAX, arenas)


def release_process_memory() -> None:
    """Give the freed memory glibc kept back to the system (at the end of a flow)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_bytes() -> dict[str, int]:
    """glibc's heap (every arena): bytes in use (with the large blocks it maps one by one)
    and bytes freed but kept. Empty where glibc has no `mallinfo2` (not glibc, or before 2.33)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap_in_use": int(info.uordblks + info.hblkhd), "heap_kept_free": int(info.fordblks)}
