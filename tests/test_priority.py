"""Background work runs below the requests' path (core/priority.py): a flow's connection
lowers its thread, and the threads DuckDB starts for it, to the flows' level before they run."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from core.priority import (
    BACKGROUND_NICENESS,
    DEFERRED_NICENESS,
    name_os_thread,
    run_deferred,
    run_in_background,
)
from flows.workspace import close_lake, open_lake


def _nice_of_threads() -> dict[int, int]:
    """Niceness of every thread of this process, by thread id (field 19 of its stat)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        stat = (task / "stat").read_text()
        out[int(task.name)] = int(stat[stat.rindex(")") + 2:].split()[16])
    return out


def _in_a_thread(work: object) -> int:
    """Run `work` in a new thread; its thread id."""
    ident: list[int] = []

    def run() -> None:
        ident.append(threading.get_native_id())
        work()  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return ident[0]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux keeps niceness per thread")
def test_a_background_thread_is_lowered_and_the_caller_is_not() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def lowered() -> None:
        run_in_background()
        run_in_background()  # twice: still the same level, never lower
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    _in_a_thread(lowered)
    assert seen == [max(mine, BACKGROUND_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux keeps niceness per thread")
def test_deferred_work_goes_below_background_work_and_never_back_up() -> None:
    seen: list[int] = []

    def lowered() -> None:
        run_deferred()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        run_in_background()  # the higher level asked later: the thread stays lower
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    _in_a_thread(lowered)
    assert DEFERRED_NICENESS > BACKGROUND_NICENESS
    assert seen == [DEFERRED_NICENESS, DEFERRED_NICENESS]


def _comm(tid: int) -> str:
    return (Path("/proc/self/task") / str(tid) / "comm").read_text().rstrip("\n")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux names threads in /proc")
def test_a_background_thread_is_named_for_the_system_and_the_main_thread_is_not() -> None:
    """`top -H` and the soak's cores by thread read these names: without them every thread
    of the writer is shown as the process."""
    main = threading.get_native_id()
    before = _comm(main)
    named: list[str] = []

    def background() -> None:
        run_in_background()
        named.append(_comm(threading.get_native_id()))
        name_os_thread("journal-apply")
        named.append(_comm(threading.get_native_id()))

    thread = threading.Thread(target=background, name="lake-exporter-of-a-long-name")
    thread.start()
    thread.join()
    run_in_background(niceness=0)  # on the main thread: its name is the process's, kept
    name_os_thread("not-the-main")
    assert named == ["lake-exporter-o", "journal-apply"]  # 15 bytes at most
    assert _comm(main) == before


@pytest.mark.lake
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux keeps niceness per thread")
def test_a_flows_connection_runs_its_duckdb_threads_in_the_background(tmp_path: Path) -> None:
    before = set(_nice_of_threads())
    started: dict[int, int] = {}

    def flow() -> None:
        conn = open_lake(tmp_path)
        try:
            conn.execute("SET threads = 2")
            conn.execute("SELECT sum(i) FROM range(20000000) AS t(i)").fetchall()
            started.update({t: n for t, n in _nice_of_threads().items() if t not in before})
        finally:
            close_lake(conn)

    flow_thread = _in_a_thread(flow)
    assert started.pop(flow_thread) == DEFERRED_NICENESS
    assert started, "DuckDB started no thread of its own"
    assert min(started.values()) == DEFERRED_NICENESS
