"""Background work runs at a lower CPU priority than the requests' path.

On a machine whose cores are short, the HTTP processes and the writer's loop answer the gate
and acknowledge events; everything that can wait uses the time they leave: the HTTP
processes' batch decoders (`api.events.decoders`), the writer's applier, exporter and
journal upkeep threads (`warehouse.journal`, `warehouse.export`), and every flow
(`flows.workspace.open_lake`: the scheduled sweeps, reports and compactions, and flows run
by hand beside a live service). Alone on a machine, niceness costs them nothing.

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

__all__ = ["BACKGROUND_NICENESS", "run_in_background"]

BACKGROUND_NICENESS = 10


def run_in_background() -> None:
    """Lower the calling thread's priority to `BACKGROUND_NICENESS` (never raise it: a thread
    already lower stays so). Not Linux, or not allowed: it stays as it is."""
    try:
        me = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, me) < BACKGROUND_NICENESS:
            os.setpriority(os.PRIO_PROCESS, me, BACKGROUND_NICENESS)
    except (AttributeError, OSError):
        pass
