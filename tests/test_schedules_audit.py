"""The schedules `tollgate serve` runs and `tollgate flows run`, over the real pieces: a real
`tollgate serve` subprocess with its scheduler child and a temporary Prefect API, the real
lake, real signals."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.priority import DEFERRED_NICENESS
from tests.conftest import Service, make_service, processes_of, stop_local_prefect_apis
from tests.lake_events import LakeFeed, catalog_toml, event
from tests.test_rating_flows import POLICIES, PRICES, lake_query
from warehouse.lake import connect_lake

pytestmark = [pytest.mark.server, pytest.mark.prefect, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]


@pytest.fixture(autouse=True)
def own_prefect_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test's Prefect runs (the scheduler's, a hand run's) on a Prefect home of its own;
    the local Prefect API a hand run leaves behind is stopped after the test."""
    for name in [k for k in os.environ if k.startswith("PREFECT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    yield
    stop_local_prefect_apis(tmp_path)


# A backlog a sweep takes a few seconds over, so a signal sent a second after it began lands
# inside it: once the carry moved to numpy, a sweep of 800,000 events could end before the
# signal came, which then met a later, empty run instead.
BACKLOG_COPIES = 2400


def backlog_service(tmp: Path, copies: int) -> Service:
    """A service folder whose lake holds 1,000 events times `copies`, none rated yet."""
    catalog = tmp / "catalog.toml"
    catalog.write_text(catalog_toml(policies=POLICIES, prices=PRICES))
    svc = make_service(tmp / "data", catalog)
    feed = LakeFeed(svc.data_dir)
    try:
        feed.add(*[event(f"acct_{'ab'[i % 2]}", "llm.completion",
                         f"2026-11-{1 + i % 28:02d}T10:00:00Z",
                         {"usage": {"input_tokens": i, "output_tokens": 1}}) for i in range(1000)])
    finally:
        feed.close()
    if copies > 1:
        conn = connect_lake(svc.data_dir)
        try:
            conn.execute("INSERT INTO lake.events SELECT e.* REPLACE (uuid() AS event_id,"
                         " e.seq + 1000 * g AS seq) FROM lake.events AS e,"
                         " (SELECT range AS g FROM range(1, ?))", [copies])
        finally:
            conn.close()
    return svc


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def log_of(svc: Service) -> str:
    assert svc.log_path is not None
    return svc.log_path.read_text(errors="replace")


def sweep_rows(data_dir: Path) -> tuple[int, int]:
    """(events rated by completed sweeps, rows of those ratings that repeat an event line)."""
    [(events, repeated)] = lake_query(data_dir, (
        "SELECT count(DISTINCT r.event_id), count(*) - count(DISTINCT (r.event_id, r.line_index))"
        " FROM lake.ratings AS r JOIN lake.rating_runs AS b ON b.run_id = r.run_id"
        " WHERE b.kind = 'sweep' AND b.status = 'completed'"))
    return int(events), int(repeated)


def test_a_killed_service_takes_its_scheduler_along_even_mid_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefect turns SIGTERM into an exception inside the flow; DuckDB reports it as an
    interrupted query. The scheduler took that for a failed run and went on, an orphan that
    rated every minute with no service, next to the one the next start launched."""
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "on")
    monkeypatch.setenv("TOLLGATE_SCHEDULE_SECONDS", "rate-events=1")
    svc = backlog_service(tmp_path, copies=BACKLOG_COPIES)
    svc.start()
    try:
        wait_for(lambda: "Beginning flow run" in log_of(svc), 90, "the first sweep")
        time.sleep(1.0)  # well inside the sweep's DuckDB query
        svc.stop(signal.SIGKILL)
        wait_for(lambda: not processes_of(svc.data_dir, "flows.scheduler"), 20,
                 "the scheduler to end with its service")
    finally:
        for pid in processes_of(svc.data_dir, "flows.scheduler"):
            os.killpg(pid, signal.SIGKILL)
    assert "stopped by a signal" in log_of(svc)
    # Nothing of the interrupted run is in the lake; the next start rates every event once.
    assert sweep_rows(svc.data_dir) == (0, 0)
    svc.start()
    try:
        wait_for(lambda: sweep_rows(svc.data_dir)[0] == BACKLOG_COPIES * 1000, 120,
                 "the sweep after restart")
        assert sweep_rows(svc.data_dir) == (BACKLOG_COPIES * 1000, 0)
    finally:
        svc.stop()
    assert not processes_of(svc.data_dir, "flows.scheduler")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stopping_serve_mid_sweep_is_prompt_and_leaves_no_half_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int) -> None:
    """Stopping sent SIGTERM to the scheduler's whole session, the temporary Prefect API too;
    the flow engine then retried its calls to that API until the scheduler was killed 10 s
    later."""
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "on")
    monkeypatch.setenv("TOLLGATE_SCHEDULE_SECONDS", "rate-events=1")
    svc = backlog_service(tmp_path, copies=BACKLOG_COPIES)
    svc.start()
    try:
        wait_for(lambda: "Beginning flow run" in log_of(svc), 90, "the first sweep")
        time.sleep(1.0)
        assert svc.proc is not None
        began = time.monotonic()
        svc.proc.send_signal(sig)
        svc.proc.wait(30)
        took = time.monotonic() - began
    finally:
        svc.stop(signal.SIGKILL)
    assert "did not stop" not in log_of(svc)
    assert took < 8, f"serve took {took:.1f} s to stop"
    assert not processes_of(svc.data_dir, "flows.scheduler")
    assert sweep_rows(svc.data_dir) == (0, 0)
    # The run the stop ended is not logged as a failure (Prefect's own lines included).
    assert not [line for line in log_of(svc).splitlines() if '"level":"ERROR"' in line], log_of(svc)


def test_a_run_ended_by_the_stop_is_logged_as_info_and_a_real_failure_as_error() -> None:
    """Prefect logs the exception that ended a flow run at ERROR, even when it is the
    TerminationSignal of the service's stop wrapped in DuckDB's "Query interrupted"."""
    import io
    import logging

    from prefect.exceptions import TerminationSignal

    from core.logs import JsonFormatter
    from flows.scheduler import StopsAreNotErrors

    def logged(message: str, exc: BaseException | None) -> str:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter("scheduler"))
        handler.addFilter(StopsAreNotErrors())
        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, message, None,
                                   (type(exc), exc, exc.__traceback__) if exc else None)
        handler.handle(record)
        return stream.getvalue()

    def raised(make: Callable[[], BaseException]) -> BaseException:
        try:
            raise make()
        except BaseException as exc:  # noqa: BLE001 - the test keeps what was raised
            return exc

    def interrupted() -> BaseException:
        """DuckDB's error for the query the signal ended, caused by Prefect's signal."""
        try:
            try:
                raise TerminationSignal(signal=signal.SIGTERM)
            except TerminationSignal as signalled:
                raise RuntimeError("Query interrupted") from signalled
        except RuntimeError as exc:
            return exc

    stopped = logged("Encountered exception during execution: RuntimeError('Query interrupted')",
                     interrupted())
    assert '"level":"INFO"' in stopped and "Query interrupted" in stopped, stopped
    crashed = logged("Crash detected! Execution was aborted by a termination signal.", None)
    assert '"level":"INFO"' in crashed, crashed
    failed = logged("Encountered exception during execution: RuntimeError('disk full')",
                    raised(lambda: RuntimeError("disk full")))
    assert '"level":"ERROR"' in failed and "disk full" in failed, failed
    other = logging.LogRecord("tollgate.scheduler", logging.ERROR, __file__, 1,
                              "aborted by a termination signal", None, None)
    assert StopsAreNotErrors().filter(other) and other.levelno == logging.ERROR


def test_a_scheduler_that_dies_is_started_again(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "on")
    svc = backlog_service(tmp_path, copies=1)
    svc.start()
    try:
        [first] = processes_of(svc.data_dir, "flows.scheduler")
        os.kill(first, signal.SIGKILL)  # e.g. the kernel's OOM killer
        wait_for(lambda: bool(set(processes_of(svc.data_dir, "flows.scheduler")) - {first}), 20,
                 "a new scheduler")
        assert "the flow scheduler ended" in log_of(svc)
    finally:
        svc.stop()
    assert not processes_of(svc.data_dir, "flows.scheduler")


def test_the_schedules_run_below_the_requests_path(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler (and so every flow it runs, and its Prefect API) runs at the flows'
    niceness; the HTTP workers and the writer stay where the service started (core/priority.py)."""
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "on")
    svc = backlog_service(tmp_path, copies=1)
    svc.start()
    try:
        [scheduler] = processes_of(svc.data_dir, "flows.scheduler")
        wait_for(lambda: os.getpriority(os.PRIO_PROCESS, scheduler) >= DEFERRED_NICENESS, 20,
                 "the scheduler to lower itself")
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        serving = processes_of(svc.data_dir, "writer.host") + processes_of(svc.data_dir, "api.worker")
        assert serving, "no writer or HTTP worker found"
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in serving} == {mine}
    finally:
        svc.stop()


@pytest.mark.parametrize(("value", "runs", "said"), [
    (" OFF ", False, None),  # was taken for on
    ("of", True, "TOLLGATE_SCHEDULES='of' is neither on nor off")])  # was on, silently
def test_tollgate_schedules_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str,
                                   runs: bool, said: str | None) -> None:
    monkeypatch.setenv("TOLLGATE_SCHEDULES", value)
    svc = backlog_service(tmp_path, copies=1)
    svc.start()
    try:
        assert bool(processes_of(svc.data_dir, "flows.scheduler")) == runs
        if said:
            assert said in log_of(svc)
    finally:
        svc.stop()


def flows_run(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", "flows", "run", *args,
                           "--data-dir", str(data_dir)], capture_output=True, text=True,
                          timeout=180)


def test_flows_run_mistakes_are_one_line(tmp_path: Path) -> None:
    svc = backlog_service(tmp_path, copies=1)
    done = flows_run(svc.data_dir, "rate-event")
    assert done.returncode == 2
    assert done.stderr.startswith("tollgate: no flow 'rate-event'") and done.stderr.count("\n") == 1
    done = flows_run(svc.data_dir, "rate-events", "--param", "chunk_events=abc")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "chunk_events" in done.stderr, done.stderr
    # A run that fails: its own line, and no traceback on the terminal.
    done = flows_run(svc.data_dir, "close-aggregate-days", "--param", "now=yesterday")
    assert done.returncode == 1
    assert "tollgate: flow close-aggregate-days ended Failed" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_hand_sweep_waiting_for_another_says_so_and_rates_once(tmp_path: Path) -> None:
    svc = backlog_service(tmp_path, copies=1)
    lock = svc.data_dir / "lake" / "rating.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another sweep at work
    err = tmp_path / "err"
    with open(err, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "flows", "run", "rate-events",
                                 "--data-dir", str(svc.data_dir)], stdout=subprocess.PIPE,
                                stderr=sink, text=True)
    try:
        wait_for(lambda: "another rating run holds" in err.read_text(), 90, "the waiting notice")
        assert proc.poll() is None
        # A hand run goes below the service as the scheduled ones do (core/priority.py).
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == DEFERRED_NICENESS
    finally:
        os.close(fd)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and '"events": 1000' in out
    assert sweep_rows(svc.data_dir) == (1000, 0)
