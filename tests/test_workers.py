"""`tollgate serve --workers N` (api/supervisor.py, api/shared.py): what must hold across HTTP
workers holds whichever worker a request reaches, a worker that dies is replaced, and SIGTERM
under load stops the service gracefully with nothing acknowledged lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.auth import sign_headers
from tests.conftest import Key, Service, make_service, processes_of, tollgate

pytestmark = [pytest.mark.server, pytest.mark.lake]

AUTHORIZE = "/mgt/v1/gate/authorize"
UNIT = {"feature_code": "gate.unit", "estimated_quantity_minor": "1"}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = make_service(tmp_path_factory.mktemp("workers"))
    svc.env = {"TOLLGATE_WORKERS": "2", "TOLLGATE_SCHEDULES": "off", "TOLLGATE_WRITER_DEADLINE_SECONDS": "5"}
    svc.start()
    yield svc
    svc.stop()


def pinned(svc: Service, count: int = 2) -> dict[str, httpx.Client]:
    """A keep-alive client per worker: new connections until each worker holds one (a
    connection stays with the worker that accepted it)."""
    clients: dict[str, httpx.Client] = {}
    spare: list[httpx.Client] = []
    deadline = time.monotonic() + 30
    while len(clients) < count:
        assert time.monotonic() < deadline, f"connections reached only workers {sorted(clients)}"
        client = httpx.Client(timeout=30)
        worker = client.get(svc.base_url + "/healthz").headers["x-tollgate-worker"]
        if worker in clients:
            spare.append(client)  # kept open, so the next connection may go elsewhere
        else:
            clients[worker] = client
    for client in spare:
        client.close()
    return clients


def signed(svc: Service, path: str, body: Any, key: Key | None = None, **kw: Any) -> tuple[bytes, dict[str, str]]:
    key = key or svc.key
    data = json.dumps(body).encode()
    return data, sign_headers(key_id=key.key_id, secret=key.secret, method="POST", path=path, body=data,
                              realm=key.realm, **kw)


def send(svc: Service, client: httpx.Client, path: str, data: bytes, headers: dict[str, str]) -> httpx.Response:
    return client.post(svc.base_url + path, content=data, headers=headers)


def test_a_nonce_used_on_one_worker_is_refused_on_the_other(two: Service) -> None:
    clients = pinned(two)
    for first, second in (("1", "2"), ("2", "1")):
        data, headers = signed(two, AUTHORIZE, UNIT, principal_id="gate-p")
        ok = send(two, clients[first], AUTHORIZE, data, headers)
        assert ok.status_code == 200 and ok.headers["x-tollgate-worker"] == first, ok.text
        again = send(two, clients[second], AUTHORIZE, data, headers)
        assert again.headers["x-tollgate-worker"] == second
        assert (again.status_code, again.json()["code"]) == (401, "AUTH.REPLAYED_NONCE"), again.text


def test_rate_windows_are_one_window_across_workers(two: Service) -> None:
    clients = pinned(two)
    body = {"feature_code": "gate.rated", "estimated_quantity_minor": "1"}  # 3 per 2 s a principal
    principal = "gate-p2"
    while time.time() % 2 > 0.3:  # the start of a window, so all five calls fall in it
        time.sleep(0.02)
    order = ["1", "2", "1", "2", "1"]
    statuses = []
    for worker in order:
        data, headers = signed(two, AUTHORIZE, body, principal_id=principal)
        r = send(two, clients[worker], AUTHORIZE, data, headers)
        assert r.headers["x-tollgate-worker"] == worker
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["code"] == "LIMIT.RATE_EXCEEDED" and r.headers["retry-after"].isdigit()
    assert statuses == [200, 200, 200, 429, 429], statuses
    # GET /gate/limits on either worker counts the same window.
    for worker in ("1", "2"):
        path = "/mgt/v1/gate/limits?feature_code=gate.rated"
        headers = sign_headers(key_id=two.key.key_id, secret=two.key.secret, method="GET", path=path,
                               body=b"", realm="acme", principal_id=principal)
        view = clients[worker].get(two.base_url + path, headers=headers)
        assert view.status_code == 200, view.text
        [feature] = view.json()["data"]
        if time.time() % 2 < 1.9:  # still the same window
            assert feature["rates"][0]["used_minor"] == "3", feature


def test_an_idempotency_key_in_flight_on_one_worker_is_409_on_the_other(two: Service) -> None:
    """The writer is stopped (SIGSTOP) so the first request stays in flight on its worker."""
    clients = pinned(two)
    [writer] = processes_of(two.data_dir, "writer.host")
    key = f"idem-{uuid.uuid4()}"
    data, first_headers = signed(two, AUTHORIZE, UNIT, principal_id="gate-p", idempotency_key=key)
    result: list[httpx.Response] = []
    os.kill(writer, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=lambda: result.append(
            send(two, clients["1"], AUTHORIZE, data, first_headers)))
        thread.start()
        time.sleep(0.5)  # the first request holds the key, waiting for the writer
        _, headers = signed(two, AUTHORIZE, UNIT, principal_id="gate-p", idempotency_key=key)
        busy = send(two, clients["2"], AUTHORIZE, data, headers)
    finally:
        os.kill(writer, signal.SIGCONT)
    thread.join(30)
    assert busy.headers["x-tollgate-worker"] == "2"
    assert (busy.status_code, busy.json()["code"]) == (409, "IDEMPOTENCY.IN_PROGRESS"), busy.text
    # Once the first is answered, the key is free again: a retry on the other worker replays it.
    assert result and result[0].status_code in (200, 503), result
    _, headers = signed(two, AUTHORIZE, UNIT, principal_id="gate-p", idempotency_key=key)
    deadline = time.monotonic() + 10
    while True:
        retry = send(two, clients["2"], AUTHORIZE, data, headers)
        if retry.status_code != 503 or time.monotonic() > deadline:
            break
        _, headers = signed(two, AUTHORIZE, UNIT, principal_id="gate-p", idempotency_key=key)
        time.sleep(0.2)
    assert retry.status_code == 200, retry.text
    if result[0].status_code == 200:
        assert retry.headers.get("idempotent-replayed") == "true"
        assert retry.json()["data"]["lease_token"] == result[0].json()["data"]["lease_token"]


def test_a_disabled_key_is_refused_by_every_worker_within_the_bound(two: Service) -> None:
    clients = pinned(two)
    made = json.loads(tollgate("keys", "create", "--realm", "acme", data_dir=two.data_dir).stdout)
    key = Key(made["key_id"], made["secret"])
    deadline = time.monotonic() + 5  # a new key reaches every worker within the reload interval
    for worker, client in clients.items():
        while True:
            data, headers = signed(two, AUTHORIZE, UNIT, key=key, principal_id="gate-p")
            r = send(two, client, AUTHORIZE, data, headers)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, (worker, r.text)
    tollgate("keys", "disable", made["key_id"], data_dir=two.data_dir)
    disabled = time.monotonic()
    took = {}
    for worker, client in clients.items():
        while True:
            data, headers = signed(two, AUTHORIZE, UNIT, key=key, principal_id="gate-p")
            r = send(two, client, AUTHORIZE, data, headers)
            assert r.headers["x-tollgate-worker"] == worker
            if r.status_code == 403:
                assert r.json()["code"] == "AUTH.SERVICE_KEY_DISABLED"
                took[worker] = time.monotonic() - disabled
                break
            assert r.status_code == 200 and time.monotonic() - disabled < 5, r.text
            time.sleep(0.05)
    assert max(took.values()) < 2.5, took  # the documented bound: a second, plus a poll


def test_a_worker_that_dies_is_replaced_and_the_service_keeps_answering(two: Service) -> None:
    pinned(two)  # both ready
    workers = processes_of(two.data_dir, "api.worker")
    assert len(workers) == 2
    assert two.proc is not None
    victim = workers[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = processes_of(two.data_dir, "api.worker")
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.2)
    assert victim not in now and len(now) == 2, now
    assert two.proc.poll() is None
    clients = pinned(two)  # both answer again
    for client in clients.values():
        data, headers = signed(two, AUTHORIZE, UNIT, principal_id="gate-p")
        assert send(two, client, AUTHORIZE, data, headers).status_code == 200


def _lake_refs(data_dir: Path) -> set[str]:
    from warehouse.lake import connect_lake

    conn = connect_lake(data_dir, read_only=True)
    try:
        rows = conn.execute("SELECT subject_ref FROM lake.events WHERE event_type = 'sigterm.load'").fetchall()
    finally:
        conn.close()
    return {r[0] for r in rows}


def test_sigterm_under_load_answers_what_it_holds_exits_0_within_10_s_and_loses_nothing(
        tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    svc.env = {"TOLLGATE_WORKERS": "2", "TOLLGATE_SCHEDULES": "off"}
    svc.start()
    assert svc.proc is not None
    proc = svc.proc
    acked: set[str] = set()
    commits_acked = 0
    statuses: list[int] = []
    signalled = 0.0
    exited: list[float] = []

    async def load() -> None:
        nonlocal commits_acked, signalled
        stop = False
        async with httpx.AsyncClient(timeout=30) as client:
            async def post(path: str, body: Any, **ctx: str) -> httpx.Response | None:
                data = json.dumps(body).encode()
                headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST",
                                       path=path, body=data, realm="acme", **ctx)
                try:
                    r = await client.post(svc.base_url + path, content=data, headers=headers)
                except httpx.TransportError:
                    return None  # refused or cut once the service stopped accepting
                statuses.append(r.status_code)
                return r

            async def batches() -> None:
                while not stop:
                    refs = [str(uuid.uuid4()) for _ in range(200)]
                    r = await post("/mgt/v1/events/batch", {"events": [
                        {"semantic_kind": "activity", "event_type": "sigterm.load",
                         "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": ref} for ref in refs]},
                        billing_account_id="acct_events")
                    if r is None:
                        return
                    if r.status_code == 207:
                        assert r.json()["data"]["accepted_count"] == len(refs), r.text
                        acked.update(refs)

            async def singles() -> None:
                while not stop:
                    ref = str(uuid.uuid4())
                    r = await post("/mgt/v1/events", {"semantic_kind": "activity", "event_type": "sigterm.load",
                                                      "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": ref},
                                   billing_account_id="acct_events")
                    if r is None:
                        return
                    if r.status_code == 201:
                        acked.add(ref)

            async def gate() -> None:
                nonlocal commits_acked
                while not stop:
                    r = await post(AUTHORIZE, UNIT, principal_id="gate-p")
                    if r is None:
                        return
                    if r.status_code != 200:
                        continue
                    c = await post("/mgt/v1/gate/commits", {"lease_token": r.json()["data"]["lease_token"],
                                                            "feature_code": "gate.unit", "quantity_minor": "1"},
                                   principal_id="gate-p")
                    if c is None:
                        return
                    commits_acked += c.status_code == 200

            async def signal_then_wait() -> None:
                nonlocal stop, signalled
                await asyncio.sleep(3.0)
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                code = await asyncio.to_thread(proc.wait, 30)
                exited.append(time.monotonic() - signalled)
                assert code == 0, svc.log_path.read_text()[-3000:] if svc.log_path else code
                stop = True

            await asyncio.gather(signal_then_wait(), *(batches() for _ in range(3)),
                                 *(singles() for _ in range(3)), *(gate() for _ in range(2)))

    asyncio.run(load())
    svc.proc = None
    assert exited and exited[0] < 10, exited
    print(f"stopped in {exited[0]:.2f} s after SIGTERM; {len(acked)} events and {commits_acked} commits"
          " acknowledged")
    assert set(statuses) <= {200, 201, 207, 503}, sorted(set(statuses))
    assert len(acked) > 500 and commits_acked > 10, (len(acked), commits_acked)
    text = svc.log_path.read_text() if svc.log_path else ""
    assert "Traceback" not in text, text[-3000:]
    assert "killing it" not in text, text[-3000:]
    # Nothing left in the journal: the writer applied it before it exited.
    assert [p for p in (svc.data_dir / "journal").glob("*.journal") if p.stat().st_size] == []
    svc.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            missing = acked - _lake_refs(svc.data_dir)
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not missing, f"{len(missing)} acknowledged events are not in the lake"
    finally:
        svc.stop()
    import duckdb

    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    try:
        commits = conn.execute("SELECT count(*) FROM commits WHERE principal_id = 'gate-p'").fetchone()
    finally:
        conn.close()
    assert commits is not None and commits[0] >= commits_acked
