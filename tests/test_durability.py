"""A 2xx means durable: acknowledged events survive SIGKILL of the server (CONTRACT.md section 4)."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import httpx

from api.auth import sign_headers
from tests.conftest import Service


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
