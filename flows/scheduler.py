"""The schedules of `tollgate serve`: `python -m flows.scheduler --data-dir D`.

A child process of the service that runs each flow as a Prefect flow run on its interval:
rate-events every minute, close-aggregate-days every 15 minutes, publish-usage-reports every
hour, compact-lake every day. The first run of each comes one interval after start, so the
service starts as fast as without it. Runs go to the Prefect API of PREFECT_API_URL when set,
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

from flows import flow_named

__all__ = ["SCHEDULE", "main", "run_schedule", "schedule_from_env"]

log = logging.getLogger("tollgate.scheduler")

SCHEDULE: tuple[tuple[str, float], ...] = (
    ("rate-events", 60.0),
    ("close-aggregate-days", 15 * 60.0),
    ("publish-usage-reports", 60 * 60.0),
    ("compact-lake", 24 * 60 * 60.0),
)


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


def schedule_from_env(text: str | None = None) -> tuple[tuple[str, float], ...]:
    """SCHEDULE with the intervals of TOLLGATE_SCHEDULE_SECONDS (`NAME=SECONDS,...`); a
    mistake is logged and that entry ignored."""
    text = os.environ.get("TOLLGATE_SCHEDULE_SECONDS", "") if text is None else text
    intervals = dict(SCHEDULE)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if name.strip() not in intervals or not 0 < seconds < float("inf"):
            log.error("TOLLGATE_SCHEDULE_SECONDS: %r ignored (expected NAME=SECONDS with NAME"
                      " one of %s)", item, ", ".join(intervals))
            continue
        intervals[name.strip()] = seconds
    return tuple(intervals.items())


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


def run_schedule(data_dir: Path, schedule: Sequence[tuple[str, float]] = SCHEDULE) -> None:
    """Run the flows on their intervals until the process is told to stop."""
    start = time.monotonic()
    due = {name: start + interval for name, interval in schedule}
    intervals = dict(schedule)
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
            log.exception("flow %s failed; next try in %.0f s", name, intervals[name])
        due[name] = max(due[name] + intervals[name], time.monotonic())


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
    run_schedule(Path(args.data_dir).resolve(), schedule_from_env())
    return 0


if __name__ == "__main__":
    sys.exit(main())
