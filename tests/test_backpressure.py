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
from tests.conftest import Service, make_service, processes_of
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
                # The HTTP workers' memory together (`tollgate serve --workers N`).
                rss.append(sum(_rss_kib(p) for p in processes_of(svc.data_dir, "api.worker")))
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


def _metric(svc: Service, name: str) -> float:
    for line in httpx.get(svc.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def _lake_flood_events(data_dir: Path) -> tuple[int, int]:
    conn = connect_lake(data_dir, read_only=True)
    try:
        found: Any = conn.execute("SELECT count(*), count(DISTINCT event_id) FROM lake.events "
                                  "WHERE event_type = 'flood.check'").fetchone()
        return int(found[0]), int(found[1])
    finally:
        conn.close()


def test_past_the_export_backlog_bound_ingestion_is_refused_until_the_lake_catches_up(tmp_path: Path) -> None:
    """The lake export held (a compaction's turn, taken here as the compaction takes it):
    events pile up in the operational file until the bound, then every event route of every
    worker answers 503 STORAGE.BUSY with Retry-After 2 while the gate goes on; once the
    export runs again and ships the backlog, ingestion is taken again. The lake holds every
    acknowledged event once, and none of the refused."""
    from warehouse.lake import compaction_turn

    svc = make_service(tmp_path)
    svc.env = {"TOLLGATE_EXPORT_BACKLOG_ROWS": "1000", "TOLLGATE_SCHEDULES": "off"}
    svc.start()
    try:
        run = uuid.uuid4().hex[:8]
        accepted = 0
        with httpx.Client(timeout=30) as client:
            first = _post(client, svc, "/mgt/v1/events/batch", _batch(run, 0), billing_account_id=ACCOUNT)
            assert first.status_code == 207, first.text
            accepted += first.json()["data"]["accepted_count"]
            deadline = time.monotonic() + 30
            while _lake_flood_events(tmp_path)[0] < accepted:  # the export runs
                assert time.monotonic() < deadline, "the first batch never reached the lake"
                time.sleep(0.2)
            assert _metric(svc, "tollgate_export_backlog_limit_events") == 1000
            with compaction_turn(tmp_path):
                refused: httpx.Response | None = None
                took: dict[int, float] = {}
                for n in range(1, 6):  # 400 events a batch: the bound is reached by the third
                    began = time.monotonic()
                    r = _post(client, svc, "/mgt/v1/events/batch", _batch(run, n), billing_account_id=ACCOUNT)
                    took[n] = time.monotonic() - began
                    if r.status_code == 503:
                        refused = r
                        break
                    assert r.status_code == 207, r.text
                    accepted += r.json()["data"]["accepted_count"]
                    time.sleep(0.6)  # past the writer's tick, which tells the workers
                assert refused is not None, "never refused"
                assert 1000 <= accepted - BATCH < 2000  # refused from the bound on, not before
                assert refused.json()["code"] == "STORAGE.BUSY", refused.text
                assert refused.headers["retry-after"] == "2"
                # Before the bound, ingestion was paced: from 100 rows behind (a tenth of the
                # bound) each post waits, 330 ms at 400 behind and 770 ms at 800.
                assert took[2] >= 0.33 and took[3] >= 0.77, took
                # Every worker refuses (requests land on either), single events too.
                for i in range(6):
                    single = json.dumps({"semantic_kind": "activity", "event_type": "flood.check",
                                         "occurred_at": "2026-11-20T10:00:00Z",
                                         "subject_ref": f"{run}-single-{i}"}).encode()
                    s = _post(client, svc, "/mgt/v1/events", single, billing_account_id=ACCOUNT)
                    assert s.status_code == 503 and s.json()["code"] == "STORAGE.BUSY", s.text
                # The gate goes on.
                body = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "1"}).encode()
                auth = _post(client, svc, "/mgt/v1/gate/authorize", body, principal_id="team-c")
                assert auth.status_code == 200, auth.text
                cancel = json.dumps({"lease_token": auth.json()["data"]["lease_token"]}).encode()
                assert _post(client, svc, "/mgt/v1/gate/cancel", cancel, principal_id="team-c").status_code == 200
                time.sleep(0.6)  # the writer's metrics file is written by its tick
                assert _metric(svc, "tollgate_ingest_backlog_refusing") == 1
                assert _metric(svc, "tollgate_export_backlog_events") >= 1000
                assert _metric(svc, "tollgate_ingest_pace_seconds") == 1.0
                # A service started again while the lake is still away refuses at once: the
                # backlog is read from the file's watermark, not from an export round.
                svc.stop()
                svc.start()
                time.sleep(0.6)
                again = _post(client, svc, "/mgt/v1/events/batch", _batch(run, 50), billing_account_id=ACCOUNT)
                assert again.status_code == 503 and again.json()["code"] == "STORAGE.BUSY", again.text
            # The compaction's turn is over: the export ships the backlog, ingestion resumes.
            deadline = time.monotonic() + 30
            while True:
                r = _post(client, svc, "/mgt/v1/events/batch", _batch(run, 99), billing_account_id=ACCOUNT)
                if r.status_code == 207:
                    accepted += r.json()["data"]["accepted_count"]
                    break
                assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
                assert time.monotonic() < deadline, "ingestion was never taken again"
                time.sleep(0.5)
            assert _metric(svc, "tollgate_ingest_backlog_spells_total") == 1  # this process's
        deadline = time.monotonic() + 30
        while _lake_flood_events(tmp_path)[0] < accepted and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _lake_flood_events(tmp_path) == (accepted, accepted)
        time.sleep(0.6)  # the writer's tick
        assert _metric(svc, "tollgate_ingest_pace_seconds") == 0  # caught up: no pace
        with httpx.Client(timeout=30) as client:
            began = time.monotonic()
            r = _post(client, svc, "/mgt/v1/events/batch", _batch(run, 100), billing_account_id=ACCOUNT)
            assert r.status_code == 207 and time.monotonic() - began < 0.3, r.text
    finally:
        svc.stop()


def test_ingestion_is_paced_in_proportion_to_the_export_backlog() -> None:
    """No pace up to a tenth of the bound, then a wait that grows with the backlog to 1 s at
    the bound, in 10 ms steps; none without a bound or before the backlog is known."""
    from warehouse.writer import LoopStatus

    status = LoopStatus(backlog_bound=4_000_000)
    assert [status.pace_ms(b) for b in (None, 0, 400_000, 400_001, 436_000, 2_200_000,
                                        4_000_000, 9_000_000)] == [0, 0, 0, 0, 10, 500, 1000, 1000]
    assert LoopStatus(backlog_bound=0).pace_ms(10**9) == 0
