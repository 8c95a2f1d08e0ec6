"""The schedules of `tollgate serve`: `python -m flows.scheduler --data-dir D`.

A child process of the service that runs each flow as a Prefect flow run on its schedule
(`core.schedules`): rate-events every minute, close-aggregate-days every 15 minutes,
publish-usage-reports every hour, compact-lake daily at 03:30 UTC. The first run of an
interval comes one interval after start, so the service starts as fast as without it. Runs go to the Prefect API of PREFECT_API_URL when set,
else to a temporary local one that Prefect starts on the first run.

It dies with the service: on Linux the kernel sends it SIGTERM when its parent dies (and it
ends at once if the parent died before it could ask for that), and
SIGTERM ends it through `sys.exit`, so Prefect's exit hooks stop the temporary API server.
During a flow run Prefect turns SIGTERM into an exception inside the flow (DuckDB reports it as
an interrupted query): such a failure ends the schedules too, instead of being taken for a
failed run. A flow that fails is logged and tried again at its next time.

TOLLGATE_SCHEDULE_SECONDS changes intervals, e.g. `rate-events=30,compact-lake=43200`.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from core.clock import SYSTEM_CLOCK, Clock
from core.schedules import SCHEDULED, Deployment, scheduled_with_overrides
from core.settings import Settings
from flows import flow_named

__all__ = ["main", "run_schedule"]

log = logging.getLogger("tollgate.scheduler")


def _end_with_parent(parent_pid: int | None) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the service stops it itself
    # A parent that died before prctl ran sends no signal: this process has been handed to
    # another parent by then, so compare.
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(0)


def _exit(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def _stopped(exc: BaseException) -> bool:
    """Whether a flow's failure is really this process being told to stop (Prefect raises
    TerminationSignal from its SIGTERM handler; code under way may wrap it in its own error)."""
    from prefect.exceptions import TerminationSignal

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (TerminationSignal, KeyboardInterrupt, SystemExit)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def run_schedule(data_dir: Path, schedule: Sequence[Deployment] = SCHEDULED,
                 clock: Clock = SYSTEM_CLOCK) -> None:
    """Run the flows on their schedules until the process is told to stop."""
    start = time.monotonic()
    due = {d.flow: start + d.seconds_to_next(clock.now()) for d in schedule}
    by_name = {d.flow: d for d in schedule}
    while True:
        name = min(due, key=due.__getitem__)
        time.sleep(max(0.0, due[name] - time.monotonic()))
        try:
            flow_named(name)(data_dir=str(data_dir))
        except BaseException as exc:
            # Prefect's TerminationSignal is a BaseException: bare when the signal came
            # while the flow ran Python (the sweep's carry), inside a DuckDB error when it
            # came during a query.
            if _stopped(exc):
                log.info("flow %s stopped by a signal; its work is left to the next run", name)
                sys.exit(0)
            if not isinstance(exc, Exception):
                raise
            log.exception("flow %s failed; next try at its next time", name)
        deployment = by_name[name]
        if deployment.daily_at is None:
            due[name] = max(due[name] + deployment.seconds_to_next(clock.now()), time.monotonic())
        else:
            due[name] = time.monotonic() + deployment.seconds_to_next(clock.now())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.scheduler")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="end at once if this process is no longer the parent")
    args = parser.parse_args(argv)
    _end_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, _exit)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    for chatty in ("httpx", "httpcore"):  # a line per request to Prefect's API, every minute
        logging.getLogger(chatty).setLevel(logging.WARNING)
    settings = Settings.from_env(args.data_dir)
    run_schedule(settings.data_dir, scheduled_with_overrides(settings.schedule_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
