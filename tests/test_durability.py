"""A 2xx means durable: acknowledged events survive SIGKILL of the server (the events' rules; docs/architecture.md)."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import httpx

from api.auth import sign_headers
from tests.conftest import Service, processes_of


def test_acknowledged_events_survive_kill_9_and_replays_return_200(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    bodies = [{"semantic_kind": "activity", "event_type": "durable.check",
               "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": str(uuid.uuid4())} for _ in range(300)]
    batch = [{"semantic_kind": "outcome", "event_type": "durable.batch",
              "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": str(uuid.uuid4())} for _ in range(500)]

    async def post_all() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            async def post(path: str, body: object) -> httpx.Response:
                data = json.dumps(body).encode()
                headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST", path=path,
                                       body=data, realm="acme", billing_account_id="acct_events")
                return await client.post(svc.base_url + path, content=data, headers=headers)
            singles = asyncio.gather(*(post("/mgt/v1/events", b) for b in bodies))
            batched = post("/mgt/v1/events/batch", {"events": batch})
            results = await asyncio.gather(singles, batched)
            svc.proc.send_signal(signal.SIGKILL)  # the instant after the last reply
            return results[0], results[1]

    singles, batched = asyncio.run(post_all())
    svc.proc.wait()
    assert [r.status_code for r in singles] == [201] * len(bodies)
    assert batched.status_code == 207 and batched.json()["data"]["accepted_count"] == len(batch)

    svc.start()
    for body in bodies[:50] + bodies[-50:]:
        r = svc.post("/mgt/v1/events", body, account="acct_events")
        assert r.status_code == 200, r.text
    replay = svc.post("/mgt/v1/events/batch", {"events": batch}, account="acct_events").json()["data"]
    assert replay["duplicate_count"] == len(batch) and replay["accepted_count"] == 0
    svc.stop()

    import duckdb
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    stored = conn.execute("SELECT count(*) FROM events WHERE event_type IN ('durable.check', 'durable.batch')").fetchone()
    assert stored == (len(bodies) + len(batch),)


def test_a_dead_writer_gives_503_in_the_envelope_and_a_restart_keeps_what_was_acknowledged(
        fresh_service: Service) -> None:
    import os
    import time
    from pathlib import Path

    if not Path("/proc").is_dir():
        return
    svc = fresh_service
    svc.start()
    first = {"semantic_kind": "activity", "event_type": "writer.death", "occurred_at": "2026-11-20T10:00:00Z",
             "subject_ref": str(uuid.uuid4())}
    assert svc.post("/mgt/v1/events", first, account="acct_events").status_code == 201
    [writer] = processes_of(svc.data_dir, "writer.host")
    os.kill(writer, signal.SIGKILL)   # its journal holds the event, maybe not the file
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and svc.client.get(svc.base_url + "/healthz").status_code == 200:
        time.sleep(0.05)
    health = svc.client.get(svc.base_url + "/healthz")
    assert health.status_code == 503 and health.json()["data"]["writer"] == "down"
    assert health.json()["data"]["reasons"] == ["writer down"]
    second = dict(first, subject_ref=str(uuid.uuid4()))
    refused = svc.post("/mgt/v1/events", second, account="acct_events")
    assert refused.status_code == 503, refused.text
    assert refused.json()["ok"] is False and refused.json()["code"] == "STORAGE.UNAVAILABLE"
    gate = svc.post("/mgt/v1/gate/authorize", {"feature_code": "gate.unit", "estimated_quantity_minor": "1"},
                    principal="gate-p")
    assert gate.status_code == 503 and gate.json()["code"] == "STORAGE.UNAVAILABLE"
    svc.stop()
    svc.start()
    assert svc.post("/mgt/v1/events", first, account="acct_events").status_code == 200  # kept
    assert svc.post("/mgt/v1/events", second, account="acct_events").status_code == 201  # never stored


def test_ctrl_c_to_the_process_group_stops_cleanly_with_everything_in_the_file(fresh_service: Service) -> None:
    # A terminal's Ctrl-C reaches the service and its writer alike. The writer waits for the
    # service to close its socket, so the last rows reach the file and nothing is left over.
    import os
    import subprocess
    import sys
    import time

    import duckdb
    import httpx

    svc = fresh_service
    log = open(svc.data_dir / "serve.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(svc.port),
                             "--data-dir", str(svc.data_dir)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "TOLLGATE_SCHEDULES": "off"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(svc.base_url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        body = {"semantic_kind": "activity", "event_type": "ctrl.c", "occurred_at": "2026-11-20T10:00:00Z"}
        assert svc.post("/mgt/v1/events", body, account="acct_events").status_code == 201
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130  # after a graceful shutdown
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (svc.data_dir / "serve.log").read_text()
    assert "Traceback" not in text and "went away" not in text, text
    assert [p for p in (svc.data_dir / "journal").glob("*.journal") if p.stat().st_size] == []
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    assert conn.execute("SELECT count(*) FROM events WHERE event_type = 'ctrl.c'").fetchone() == (1,)
    conn.close()
