"""`prefect.yaml` on a Prefect server of one's own, exactly as README.md ("Flows") tells a person
to use it: a real `prefect server start`, a process work pool, `prefect deploy --all` from the
project folder, the deployments' schedules producing runs, and a process worker running a
deployment over a data folder whose events came in over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.test_rating_flows import lake_query, send_events, start_service

pytestmark = [pytest.mark.server, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parents[1]
PREFECT = Path(sys.executable).with_name("prefect")
DEPLOYMENTS = {"rate-events", "close-aggregate-days", "publish-usage-reports", "compact-lake", "rerate"}


class PrefectServer:
    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        # Only what this server needs: no setting of the test process (or of another test's
        # harness) may point these commands elsewhere.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env.update(PREFECT_HOME=str(home), PREFECT_API_URL=self.api,
                        PREFECT_SERVER_ANALYTICS_ENABLED="false", TOLLGATE_PROJECT_DIR=str(ROOT))
        self.log = home.parent / "prefect-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.api, timeout=30)

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError("the Prefect server did not start: " + self.log.read_text()[-3000:])

    def stop(self) -> None:
        self.http.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def prefect(self, *args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(PREFECT), *args], cwd=ROOT, env={**self.env, **env},
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def runs(self, state: str | None = None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"limit": 200}
        if state is not None:
            body["flow_runs"] = {"state": {"type": {"any_": [state]}}}
        reply = self.http.post("/flow_runs/filter", json=body)
        reply.raise_for_status()
        return reply.json()  # type: ignore[no-any-return]

    def deployment_names(self) -> dict[str, str]:
        reply = self.http.post("/deployments/filter", json={"limit": 50})
        reply.raise_for_status()
        return {d["id"]: d["name"] for d in reply.json()}


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[PrefectServer]:
    server = PrefectServer(tmp_path / "prefect-home")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_prefect_yaml_deploys_schedules_and_runs_on_a_process_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_server: PrefectServer) -> None:
    svc = start_service(tmp_path, monkeypatch)
    try:
        send_events(svc)  # six events in the lake
    finally:
        svc.stop()

    prefect_server.prefect("work-pool", "create", "tollgate", "--type", "process")
    prefect_server.prefect("--no-prompt", "deploy", "--all")
    names = prefect_server.deployment_names()
    assert set(names.values()) == DEPLOYMENTS

    # The server's scheduler turns the deployments' schedules into runs (with SQLAlchemy 2.1
    # it failed on every pass and no scheduled run ever appeared).
    deadline = time.monotonic() + 90
    scheduled: set[str] = set()
    while time.monotonic() < deadline and "rate-events" not in scheduled:
        scheduled = {names.get(r["deployment_id"], "") for r in prefect_server.runs("SCHEDULED")}
        time.sleep(1)
    assert "rate-events" in scheduled, prefect_server.log.read_text()[-3000:]
    assert "rerate" not in scheduled  # manual only

    # An operator's run of the sweep, picked up by a process worker over this data folder.
    deployment = next(i for i, n in names.items() if n == "rate-events")
    reply = prefect_server.http.post(f"/deployments/{deployment}/create_flow_run", json={})
    reply.raise_for_status()
    run_id = reply.json()["id"]
    prefect_server.prefect("worker", "start", "--pool", "tollgate", "--run-once", "--prefetch-seconds", "0",
                           timeout=300, TOLLGATE_DATA_DIR=str(svc.data_dir))
    run = prefect_server.http.get(f"/flow_runs/{run_id}").json()
    assert run["state"]["type"] == "COMPLETED", run["state"]
    rated = lake_query(svc.data_dir,
                       "SELECT count(DISTINCT r.event_id) FROM lake.ratings AS r JOIN lake.rating_runs AS b"
                       " ON b.run_id = r.run_id WHERE b.kind = 'sweep' AND b.status = 'completed'")
    assert rated == [(6,)]
