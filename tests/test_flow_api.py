"""The Prefect API `tollgate flows run` and the scheduler of `tollgate serve` run their flows on
(`flows/prefect_api.py`): a run with nothing to do is quick once the data folder's local API
is up, the service's API serves a hand run beside it, PREFECT_API_URL wins, and no run
prints an ERROR line offline (Prefect's server analytics are off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    FIXTURES,
    make_service,
    processes_of,
    running,
    stop_local_prefect_apis,
    tollgate,
)

pytestmark = [pytest.mark.prefect, pytest.mark.lake,
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

# A run with nothing to do takes 3-4 s on an idle machine. That the kept API served it is
# checked by its record (the same pid and address); the time bound only catches a run gone
# badly wrong, so it leaves room for a machine whose two cores run other work too (11.9 and
# 18.6 s were seen at a load average of 12).
QUICK = 30.0


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Prefect home for the module: its database is made once."""
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture(autouse=True)
def own_prefect(prefect_home: Path, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [k for k in os.environ if k.startswith(("PREFECT_", "TOLLGATE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PREFECT_HOME", str(prefect_home))
    yield
    stop_local_prefect_apis(tmp_path)


def lake(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=data)
    return data


def flows_run(data: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli", "flows", "run", "rate-events", *args,
                           "--data-dir", str(data)], capture_output=True, text=True, timeout=180)
    return done, time.monotonic() - started


def no_error_line(*texts: str) -> None:
    for text in texts:
        assert not [line for line in text.splitlines() if "ERROR" in line], text


def record(data: Path) -> dict[str, object]:
    return dict(json.loads((data / "prefect-api.json").read_text()))


def analytics_off(pid: int) -> bool:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return b"PREFECT_SERVER_ANALYTICS_ENABLED=false" in environ


def test_flows_run_keeps_a_local_api_so_a_run_with_nothing_to_do_is_quick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_PREFECT_API_IDLE_SECONDS", "15")
    data = lake(tmp_path)
    first, _ = flows_run(data)  # starts the API
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["events"] == 0
    api = record(data)
    second, took = flows_run(data)
    assert second.returncode == 0, second.stderr
    assert took < QUICK, (took, second.stderr)
    assert record(data) == api  # the same API served both
    for done in (first, second):
        no_error_line(done.stdout, done.stderr)
        assert "temporary server" not in done.stderr, done.stderr
        assert "View at" not in done.stderr, done.stderr  # the local API serves no UI
    pid = int(str(api["pid"]))
    assert analytics_off(pid)
    # Detached: it outlived the runs, and ends by itself once idle.
    deadline = time.monotonic() + 60
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(pid)
    assert not (data / "prefect-api.json").exists()
    no_error_line((data / "prefect-api.log").read_text())


def test_prefect_api_url_set_by_the_user_wins(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nobody answers there
    data = lake(tmp_path)
    done, _ = flows_run(data)
    assert done.returncode != 0
    assert "127.0.0.1:9/api" in done.stderr
    assert not (data / "prefect-api.json").exists()
    assert processes_of(data, "flows.prefect_api") == []


def test_with_none_kept_a_run_boots_prefects_temporary_api_without_an_error_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_PREFECT_API_IDLE_SECONDS", "0")
    data = lake(tmp_path)
    done, _ = flows_run(data)
    assert done.returncode == 0, done.stderr
    assert "Starting temporary server" in done.stderr
    no_error_line(done.stdout, done.stderr)
    assert not (data / "prefect-api.json").exists()


@pytest.mark.server
def test_a_hand_run_beside_the_service_uses_the_services_api_which_ends_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "on")
    monkeypatch.setenv("TOLLGATE_SCHEDULE_SECONDS", "rate-events=5")
    svc = make_service(tmp_path / "data")
    svc.start()
    try:
        [scheduler] = processes_of(svc.data_dir, "flows.scheduler")
        deadline = time.monotonic() + 90
        while not (svc.data_dir / "prefect-api.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        api = record(svc.data_dir)
        pid = int(str(api["pid"]))
        parent = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1]
        assert int(parent) == scheduler  # the scheduler's own API
        assert analytics_off(pid)
        done, took = flows_run(svc.data_dir)
        assert done.returncode == 0, done.stderr
        assert took < QUICK, (took, done.stderr)
        assert record(svc.data_dir) == api
        no_error_line(done.stdout, done.stderr)
    finally:
        svc.stop()
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(pid)
    assert svc.log_path is not None
    no_error_line(svc.log_path.read_text(errors="replace"))
