"""Priority and backpressure (docs/operations.md, "Priority and backpressure"): under a flood
of event batches, bounded in time, gate calls keep answering, event requests past the ingest
queue's bound are answered 503 STORAGE.BUSY with Retry-After (never a timeout), the HTTP
process's memory stays bounded, and every event acknowledged reaches the lake, once."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.auth import sign_headers
from tests.conftest import Service, make_service
from warehouse.lake import connect_lake

pytestmark = [pytest.mark.server, pytest.mark.lake]

FLOOD_SECONDS = 6.0
FLOODERS = 10
BATCH = 400  # events per batch: about 110 KB
BODIES = 25  # batches made per flooding thread (the last is sent again if they run out)
ACCOUNT = "acct_events"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _batch(run: str, n: int) -> bytes:
    return json.dumps({"events": [
        {"semantic_kind": "activity", "event_type": "flood.check", "occurred_at": "2026-11-20T10:00:00Z",
         "subject_ref": f"{run}-{n}-{i}", "payload": {"usage": {"input_tokens": i}}}
        for i in range(BATCH)]}).encode()


def _post(client: httpx.Client, svc: Service, path: str, body: bytes, **context: str) -> httpx.Response:
    headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST", path=path,
                           body=body, realm="acme", **context)
    return client.post(svc.base_url + path, content=body, headers=headers)


def test_a_flood_of_batches_is_refused_past_its_bound_while_the_gate_answers(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    # A queue of about two batches per HTTP process, and groups of 200 events in the writer.
    svc.env = {"TOLLGATE_INGEST_QUEUE_BYTES": "250000", "TOLLGATE_WRITER_GROUP_EVENTS": "200",
               "TOLLGATE_SCHEDULES": "off"}
    svc.start()
    try:
        assert svc.proc is not None
        pid = svc.proc.pid
        run = uuid.uuid4().hex[:8]
        stop = time.monotonic() + FLOOD_SECONDS
        lock = threading.Lock()
        accepted = [0]
        failed = [0]
        statuses: dict[tuple[int, str], int] = {}
        retry_after: set[str | None] = set()
        gate_latency: list[float] = []
        gate_statuses: list[int] = []
        rss: list[int] = []

        # Made before the flood, so that the test's own threads spend their time sending.
        bodies = [[_batch(f"{run}-{k}", n) for n in range(BODIES)] for k in range(FLOODERS)]

        def flood(k: int) -> None:
            n = 0
            with httpx.Client(timeout=30) as client:
                while time.monotonic() < stop:
                    try:
                        r = _post(client, svc, "/mgt/v1/events/batch", bodies[k][min(n, BODIES - 1)],
                                  billing_account_id=ACCOUNT)
                    except httpx.TransportError:
                        continue  # a refusal sent before the body was read closes the connection
                    if r.status_code == 207:
                        n += 1  # a refused body was not stored: it is sent again
                    else:
                        time.sleep(0.05)
                    code = r.json().get("code", "") if r.status_code != 207 else ""
                    with lock:
                        statuses[(r.status_code, code)] = statuses.get((r.status_code, code), 0) + 1
                        if r.status_code == 207:
                            data = r.json()["data"]
                            accepted[0] += data["accepted_count"]
                            failed[0] += data["failed_count"]
                        else:
                            retry_after.add(r.headers.get("retry-after"))

        def gate() -> None:
            with httpx.Client(timeout=30) as client:
                while time.monotonic() < stop:
                    body = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "1"}).encode()
                    t0 = time.perf_counter()
                    r = _post(client, svc, "/mgt/v1/gate/authorize", body, principal_id="team-c")
                    gate_latency.append(time.perf_counter() - t0)
                    gate_statuses.append(r.status_code)
                    if r.status_code == 200:
                        token = r.json()["data"]["lease_token"]
                        body = json.dumps({"lease_token": token}).encode()
                        gate_statuses.append(_post(client, svc, "/mgt/v1/gate/cancel", body,
                                                   principal_id="team-c").status_code)
                    time.sleep(0.01)

        def watch() -> None:
            while time.monotonic() < stop:
                rss.append(_rss_kib(pid))
                time.sleep(0.2)

        threads = [threading.Thread(target=flood, args=(k,)) for k in range(FLOODERS)]
        threads += [threading.Thread(target=gate), threading.Thread(target=watch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)

        # Only two answers to a batch: stored (207) or refused at the bound with Retry-After.
        assert set(statuses) <= {(207, ""), (503, "STORAGE.BUSY")}, statuses
        assert statuses.get((503, "STORAGE.BUSY"), 0) > 0, statuses
        assert statuses.get((207, ""), 0) > 0, statuses
        assert retry_after == {"1"}
        assert failed == [0]
        # The gate kept answering, every call, well within the writer's deadline (10 s).
        assert gate_statuses and set(gate_statuses) == {200}, set(gate_statuses)
        assert len(gate_latency) >= 20
        assert max(gate_latency) < 2.0, max(gate_latency)
        # Memory stays bounded: the HTTP process holds at most its queue's bound of bodies.
        assert max(rss) - rss[0] < 100 * 1024, (rss[0], max(rss))

        metrics = httpx.get(svc.base_url + "/metrics", timeout=10).text
        refused = statuses[(503, "STORAGE.BUSY")]
        assert f"tollgate_ingest_refused_total {float(refused)}" in metrics
        assert "tollgate_ingest_queue_bytes 0.0" in metrics  # every request was answered

        # Nothing acknowledged is lost: every accepted event reaches the lake, once.
        deadline = time.monotonic() + 90
        while True:
            conn = connect_lake(tmp_path, read_only=True)
            try:
                found: Any = conn.execute(
                    "SELECT count(*), count(DISTINCT event_id) FROM lake.events WHERE event_type = 'flood.check'"
                ).fetchone()
            finally:
                conn.close()
            if found[0] >= accepted[0] or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert found == (accepted[0], accepted[0])
    finally:
        svc.stop()
