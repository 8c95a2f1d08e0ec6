"""The schedules of `tollgate serve`: `python -m flows.scheduler --data-dir D`.

A child process of the service that runs each flow as a Prefect flow run on its schedule
(`core.schedules`): rate-events every minute, close-aggregate-days every 15 minutes,
publish-usage-reports every hour, compact-lake daily at 03:30 UTC. The first run of an
interval comes one interval after start, so the service starts as fast as without it. Runs go to the Prefect API of PREFECT_API_URL when set,
else to a local one this process starts as its child at the first run and records in the data
folder, where `tollgate flows run` finds it (`flows.prefect_api`).

It dies with the service: on Linux the kernel sends it SIGTERM when its parent dies (and it
ends at once if the parent died before it could ask for that), and
SIGTERM ends it through `sys.exit`, and the local API, which the kernel signals when its
parent ends, stops with it.
During a flow run Prefect turns SIGTERM into an exception inside the flow (DuckDB reports it as
an interrupted query): such a failure ends the schedules too, instead of being taken for a
failed run, and Prefect's own lines about that run are logged at INFO (`StopsAreNotErrors`).
A flow that fails is logged at ERROR and tried again at its next time.

TOLLGATE_SCHEDULE_SECONDS changes intervals, e.g. `rate-events=30,compact-lake=43200`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from core.clock import SYSTEM_CLOCK, Clock
from core.layout import keep_private
from core.lifetime import end_with_parent
from core.logs import setup_logging
from core.priority import run_deferred
from core.schedules import SCHEDULED, Deployment, scheduled_with_overrides
from core.settings import Settings
from flows import flow_named
from flows.prefect_api import flow_api

__all__ = ["StopsAreNotErrors", "main", "run_schedule"]

log = logging.getLogger("tollgate.scheduler")


def _exit(signum: int, frame: FrameType | None) -> None:
    if _parent_gone():
        log.info(ORPHANED)
    _leave()


ORPHANED = "the service is gone: the scheduler stopped by a signal; its work is left to the next run"
STOPPING = "the service is stopping: the scheduler stopped by a signal; its work is left to the next run"


# Set when the service asks this process to stop through its standard input (`--stop-on-eof`).
_STOP = threading.Event()
_PARENT: list[int] = []  # the service's pid, when it gave one


def _parent_gone() -> bool:
    return bool(_PARENT) and os.getppid() != _PARENT[0]


def _leave() -> None:
    """End the process. When the service asked and is still there, at once: the service ends
    this process's session right after, the local Prefect API with it (a graceful stop
    of that server took up to 8 s, which held `tollgate serve`'s stop). When the service is
    gone (killed), at once too: nobody is left to end the session, and an interpreter's
    orderly exit waits for Prefect's exit hooks, which retry a dying API for seconds (a
    killed service's scheduler was seen alive 10 s later). What a flow had under way is
    safe to drop: every lake write is one transaction and a run is retried at its next
    time. Otherwise (a scheduler run by hand) through `sys.exit`."""
    if _parent_gone() or (_STOP.wait(0.5) and _PARENT and not _parent_gone()):
        logging.shutdown()
        os._exit(0)
    sys.exit(0)


# How long the flow under way has, once the service closed standard input, to stop by its own
# path (its log line, then `_leave`) before the thread that saw the input end ends the process
# itself: the signal handler runs only between bytecodes, so a query in native code holds it,
# and Prefect's handling of a stopped run (state reports to its API) took over 8 s on a busy
# machine, past the service's stop budget.
STOP_GRACE_SECONDS = 4.0


def _stop_on_eof() -> None:
    """Wait for the end of standard input, which the service closes when it stops (or dies):
    then stop, interrupting the DuckDB query under way, which would otherwise hold the
    SIGTERM that comes with it until the query ends (seconds, mid-sweep). If the process
    still runs after a short grace, end it from here: every lake write is one transaction
    and the run's work is left to the next run."""
    while sys.stdin.buffer.read(4096):
        pass
    _STOP.set()
    workspace = sys.modules.get("flows.workspace")  # not imported: no flow has run, no lake
    if workspace is not None:
        workspace.interrupt_open_lakes()
    time.sleep(STOP_GRACE_SECONDS)
    log.info(ORPHANED if _parent_gone() else STOPPING)
    logging.shutdown()
    os._exit(0)


def _stopped(exc: BaseException) -> bool:
    """Whether a flow's failure is really this process being told to stop (Prefect raises
    TerminationSignal from its SIGTERM handler; code under way may wrap it in its own error)."""
    from prefect.exceptions import TerminationSignal

    if _STOP.is_set():
        return True  # the query under way was interrupted because the service is stopping
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (TerminationSignal, KeyboardInterrupt, SystemExit)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


# Prefect's messages for a run that a signal ended ("Crash detected! Execution was aborted by a
# termination signal.", "... by an interrupt signal."), which carry no exception of their own.
_SIGNAL_MESSAGES = ("aborted by a termination signal", "aborted by an interrupt signal")


class StopsAreNotErrors(logging.Filter):
    """Lower to INFO what Prefect logs at WARNING or above about a flow run that this process's
    stop ended (its "Encountered exception during execution" with the TerminationSignal or the
    interrupted query, its "Crash detected!"): the run did not fail, the service stopped, and
    the line that says so is `run_schedule`'s. A real failure keeps its level."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith("prefect"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if (_STOP.is_set() or (exc is not None and _stopped(exc))
                or any(text in record.getMessage() for text in _SIGNAL_MESSAGES)):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def keep_stops_out_of_errors() -> None:
    """Put `StopsAreNotErrors` on the root logger's handlers (after `setup_logging`)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(StopsAreNotErrors())


# The flows that start with a rating sweep: their start is the sweep lag's reference.
SWEEPING = frozenset({"rate-events", "close-aggregate-days"})


class SchedulerMetrics:
    """The scheduler's metrics, written to `metrics/scheduler.prom` (`core.metrics`) after
    each flow run and every 15 s: runs per flow and outcome, their time, the last success,
    when the last successful sweep started, and this process's memory."""

    def __init__(self, path: Path) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.registry import Collector

        from core.metrics import rss_family

        self.path = path
        self.registry = CollectorRegistry(auto_describe=False)
        self.runs = Counter("tollgate_flow_runs", "Scheduled flow runs, per flow and outcome",
                            ["flow", "outcome"], registry=self.registry)
        self.seconds = Histogram("tollgate_flow_run_seconds", "Time of a scheduled flow run",
                                 ["flow"], registry=self.registry,
                                 buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))
        self.last_success = Gauge("tollgate_flow_last_success_timestamp_seconds",
                                  "When each flow last completed (Unix time)", ["flow"],
                                  registry=self.registry)
        self.sweep_started = Gauge("tollgate_sweep_last_start_timestamp_seconds",
                                   "When the last rating sweep that completed started (Unix time;"
                                   " the scheduler's start until one has)", registry=self.registry)
        self.sweep_started.set(time.time())

        class _Memory(Collector):
            def collect(self):  # type: ignore[no-untyped-def]
                yield rss_family("scheduler")

        self.registry.register(_Memory())
        self._lock = threading.Lock()

    def ran(self, flow: str, began: float, seconds: float, outcome: str) -> None:
        self.runs.labels(flow, outcome).inc()
        self.seconds.labels(flow).observe(seconds)
        if outcome == "completed":
            self.last_success.labels(flow).set(time.time())
            if flow in SWEEPING:
                self.sweep_started.set(began)
        self.write()

    def write(self) -> None:
        from core.metrics import write_registry

        with self._lock:
            try:
                write_registry(self.registry, self.path)
            except OSError:
                log.warning("could not write the scheduler's metrics", exc_info=True)

    def keep_writing(self, every: float = 15.0) -> None:
        def loop() -> None:
            while not _STOP.wait(every):
                self.write()

        self.write()
        threading.Thread(target=loop, name="metrics", daemon=True).start()


def run_schedule(data_dir: Path, schedule: Sequence[Deployment] = SCHEDULED,
                 clock: Clock = SYSTEM_CLOCK, metrics: SchedulerMetrics | None = None) -> None:
    """Run the flows on their schedules until the process is told to stop."""
    start = time.monotonic()
    log.info("schedules: %s", ", ".join(f"{d.flow} {d.describe()}" for d in schedule))
    due = {d.flow: start + d.seconds_to_next(clock.now()) for d in schedule}
    by_name = {d.flow: d for d in schedule}
    while True:
        name = min(due, key=due.__getitem__)
        if _STOP.wait(max(0.0, due[name] - time.monotonic())):
            log.info("stopped by the service")
            _leave()
        began, began_mono, outcome = time.time(), time.monotonic(), "failed"
        try:
            with flow_api(data_dir, owned=True):
                flow_named(name)(data_dir=str(data_dir))
            outcome = "completed"
        except BaseException as exc:
            # Prefect's TerminationSignal is a BaseException: bare when the signal came
            # while the flow ran Python (the sweep's carry), inside a DuckDB error when it
            # came during a query.
            if _stopped(exc):
                outcome = "stopped"
                log.info("flow %s stopped by a signal; its work is left to the next run", name)
                _leave()
            if not isinstance(exc, Exception):
                raise
            log.exception("flow %s failed; next try at its next time", name)
        finally:
            if metrics is not None and outcome != "stopped":
                metrics.ran(name, began, time.monotonic() - began_mono, outcome)
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
    parser.add_argument("--stop-on-eof", action="store_true",
                        help="stop when standard input ends (the service holds its other end)")
    args = parser.parse_args(argv)
    keep_private()
    # The schedules, their Prefect API (a child, which inherits it) and every flow they run
    # may fall behind while the cores are short; the requests' path may not (core.priority).
    run_deferred()
    if not end_with_parent(signal.SIGTERM, args.parent_pid):  # the parent died before the request
        return 0
    if args.parent_pid is not None:
        _PARENT.append(args.parent_pid)
    signal.signal(signal.SIGTERM, _exit)
    if args.stop_on_eof:
        threading.Thread(target=_stop_on_eof, name="stop-on-eof", daemon=True).start()
    settings = Settings.from_env(args.data_dir)
    # After Prefect's import, which installs its console handler on the root logger: this
    # replaces it, and the flow runs' records reach the JSON lines too (core.logs).
    setup_logging("scheduler", settings.log_format or None)
    keep_stops_out_of_errors()
    metrics = None
    if settings.metrics_on:
        metrics = SchedulerMetrics(settings.folder.metrics / "scheduler.prom")
        metrics.keep_writing()
    run_schedule(settings.data_dir, scheduled_with_overrides(settings.schedule_seconds),
                 metrics=metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
