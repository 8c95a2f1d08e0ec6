"""Background work runs at a lower CPU priority than the requests' path, in two levels.

On a machine whose cores are short, the HTTP processes and the writer's loop answer the gate
and acknowledge events; everything that can wait uses the time they leave:

- `BACKGROUND_NICENESS` (10): work the service's own throughput waits on. The HTTP
  processes' batch decoders (`api.events.decoders`: a batch's reply waits for them), the
  writer's applier, exporter and journal upkeep threads (`warehouse.journal`,
  `warehouse.export`: the journal's backlog and the operational file's window wait for them).
- `DEFERRED_NICENESS` (19): work that may fall behind for as long as the cores are short
  without holding up a reply or the file. Every flow (`flows.workspace.open_lake`: the
  scheduled sweeps, reports and compactions, and flows run by hand beside a live service),
  the schedules' process with its Prefect API (`flows.scheduler`), and the process of a
  hand run with the Prefect API it starts (`cli.flows`). A sweep that runs
  late rates more events at its next run; nothing acknowledged waits for it.

Alone on a machine, niceness costs them nothing. Under full batch load the flows at 10 took
their share beside the decoders at the same level (the minute's sweep, ~0.1-0.2 of 2 cores);
at 19 they take mostly what the others leave (docs/measurements.md, "The 10-minute soak").

Linux keeps niceness per thread; a thread (and a process) inherits it from the thread that
starts it, so a flow's DuckDB and carrying threads, started after `run_in_background`, run
at the flow's priority. The writer's applier and exporter at equal priority delayed the
replies; at niceness 10, over 10,000 gate pairs in three alternating runs each, authorize p99
was 12.3-14.4 ms against 14.6-18.0 ms. More in docs/measurements.md ("The gate next to event
ingestion").
"""

from __future__ import annotations

import os
import threading

__all__ = ["BACKGROUND_NICENESS", "DEFERRED_NICENESS", "name_os_thread", "run_deferred", "run_in_background"]

BACKGROUND_NICENESS = 10
DEFERRED_NICENESS = 19


def run_in_background(niceness: int = BACKGROUND_NICENESS) -> None:
    """Lower the calling thread's priority to `niceness` (never raise it: a thread already
    lower stays so), and give the thread its Python name in the system's tables too
    (`name_os_thread`). Threads and processes it starts afterwards inherit both. Not Linux,
    or not allowed: it stays as it is."""
    try:
        me = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, me) < niceness:
            os.setpriority(os.PRIO_PROCESS, me, niceness)
    except (AttributeError, OSError):
        pass
    name_os_thread()


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread for the system (`top -H`, `ps -L`, /proc/<pid>/task/<tid>/comm:
    at most 15 bytes) as `name`, by default its Python name. Python does not do it, so every
    thread of a process was shown as the process; named, the writer's exporter, applier and
    journal threads can be told apart, and `bench/soak.py` reports the cores of each. The main
    thread is left alone: it names the process. Not Linux: nothing."""
    current = threading.current_thread()
    if current is threading.main_thread():
        return
    label = (name or current.name).encode(errors="replace")[:15]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
            comm.write(label)
    except OSError:
        pass


def run_deferred() -> None:
    """Lower the calling thread to `DEFERRED_NICENESS`: the flows' level."""
    run_in_background(DEFERRED_NICENESS)
