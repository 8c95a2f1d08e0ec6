"""A full disk under the operational file (issue 18, "What must hold" 2): the journal's
prefilled segments need no new blocks, so it keeps taking groups while DuckDB refuses every
write. The fault is injected at the applier's DuckDB call by the test hook
`TOLLGATE_TEST_FULL_DISK_FILE` (while that file exists in the data folder, each apply fails as
on a full disk). What must hold: acknowledgements stop within the backlog bound, 503
`STORAGE.UNAVAILABLE` with `Retry-After`, `/healthz` not ready and the metrics saying why,
reads from memory still answered; when the file takes writes again the service resumes by
itself, and every acknowledged event is in the operational file."""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import duckdb
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Service

BOUND = 40  # TOLLGATE_MAX_BACKLOG_ROWS of the service under test


def _event(kind: str) -> dict[str, Any]:
    return {"semantic_kind": "activity", "event_type": kind, "occurred_at": "2026-11-20T10:00:00Z",
            "subject_ref": str(uuid.uuid4())}


def _metrics(svc: Service) -> dict[str, float]:
    text = svc.client.get(svc.base_url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}


def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_full_disk_stops_acknowledgements_within_the_bound_and_the_service_resumes_by_itself(
        fresh_service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = fresh_service
    monkeypatch.setenv("TOLLGATE_TEST_FULL_DISK_FILE", "full-disk")
    monkeypatch.setenv("TOLLGATE_MAX_BACKLOG_ROWS", str(BOUND))
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "off")
    svc.start()
    acknowledged: list[dict[str, Any]] = []

    def post(body: dict[str, Any]) -> Any:
        r = svc.post("/mgt/v1/events", body, account="acct_events")
        if r.status_code == 201:
            acknowledged.append(body)
        return r

    for _ in range(5):
        assert post(_event("disk.before")).status_code == 201
    posted = time.time()

    def applied() -> bool:  # by a tick of the writer after the last reply
        seen = _metrics(svc)
        return (seen.get("tollgate_writer_last_tick_timestamp_seconds", 0) > posted + 0.3
                and seen.get("tollgate_journal_unapplied_rows") == 0)
    _wait_for(applied, 10, "the first events applied")

    fault = svc.data_dir / "full-disk"
    fault.touch()
    assert post(_event("disk.during")).status_code == 201  # the journal still takes it
    _wait_for(lambda: _metrics(svc).get("tollgate_journal_apply_failures_total", 0) >= 1, 10,
              "an apply refused by the file")
    assert svc.client.get(svc.base_url + "/healthz").status_code == 200  # below the bound: ready

    # The file refuses every write: acknowledgements go on until the backlog reaches the bound.
    before = len(acknowledged)
    refused: list[dict[str, Any]] = []
    for _ in range(3 * BOUND):
        body = _event("disk.during")
        r = post(body)
        if r.status_code == 201:
            continue
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "STORAGE.UNAVAILABLE"
        assert int(r.headers["retry-after"]) >= 1
        assert "full-disk" not in r.text and str(svc.data_dir) not in r.text  # the log has the error
        refused.append(body)
    after_fault = len(acknowledged) - before + 1
    assert BOUND - 1 <= after_fault <= BOUND, after_fault  # one row an event, one event a group
    assert len(refused) == 3 * BOUND - (len(acknowledged) - before)

    # A gate call that would write is refused too; a read from the writer's memory is not.
    auth = svc.post("/mgt/v1/gate/authorize", {"feature_code": "llm.chat", "estimated_quantity_minor": "10"},
                    principal="team-a")
    assert auth.status_code == 503 and auth.json()["code"] == "STORAGE.UNAVAILABLE", auth.text
    assert auth.headers["retry-after"]
    balance = svc.request("GET", "/mgt/v1/wallet/balance", account="acct_prepaid")
    assert balance.status_code == 200, balance.text

    health = svc.client.get(svc.base_url + "/healthz")
    assert health.status_code == 503
    assert health.json()["data"]["reasons"] == ["storage refuses writes"]
    assert health.json()["data"]["writer"] == "running"
    assert svc.client.head(svc.base_url + "/healthz").status_code == 503
    # The writer's figures reach /metrics with its next tick.
    _wait_for(lambda: _metrics(svc).get("tollgate_writer_refused_ops_total", 0) >= len(refused) + 1,
              5, "the refused ops counted")
    seen = _metrics(svc)
    assert seen["tollgate_storage_refusing"] == 1
    assert seen["tollgate_journal_unapplied_rows"] == BOUND  # memory bounded: nothing more taken
    assert seen["tollgate_journal_backlog_limit_rows"] == BOUND
    assert seen["tollgate_storage_failing_seconds"] > 0

    # Space comes back: the applier's next try lands, and writes are taken again.
    fault.unlink()
    _wait_for(lambda: svc.client.get(svc.base_url + "/healthz").status_code == 200, 15,
              "ready again once the file takes writes")
    assert _metrics(svc)["tollgate_storage_refusing"] == 0
    _wait_for(lambda: _metrics(svc)["tollgate_storage_failing_seconds"] == 0, 5, "failing no more")
    for body in refused:  # refused before they were decided: new now
        assert post(body).status_code == 201
    for body in acknowledged[:3]:  # acknowledged ones are stored once
        assert svc.post("/mgt/v1/events", body, account="acct_events").status_code == 200
    svc.stop()

    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    stored = {r[0] for r in conn.execute(
        "SELECT subject_ref FROM events WHERE event_type LIKE 'disk.%'").fetchall()}
    conn.close()
    assert stored == {b["subject_ref"] for b in acknowledged}
    assert len(acknowledged) == 5 + after_fault + len(refused)


def test_a_writer_started_while_the_file_refuses_the_journal_waits_for_it_and_then_serves(
        fresh_service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service killed while the file refused writes, started again on the same full disk:
    the writer starts, refuses every op (its state would lack the journal's rows) and is not
    ready, then applies the journal by itself once the file takes writes."""
    svc = fresh_service
    monkeypatch.setenv("TOLLGATE_TEST_FULL_DISK_FILE", "full-disk")
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "off")
    svc.start()
    fault = svc.data_dir / "full-disk"
    fault.touch()
    bodies = [_event("disk.restart") for _ in range(20)]
    for body in bodies:
        assert svc.post("/mgt/v1/events", body, account="acct_events").status_code == 201
    svc.stop(signal.SIGKILL)  # the 20 events are in the journal only

    svc.start(ready=False)
    _wait_for(lambda: svc.client.get(svc.base_url + "/healthz").json()["data"]["reasons"]
              == ["storage refuses writes"], 30, "not ready while the journal waits for the file")
    replay = svc.post("/mgt/v1/events", bodies[0], account="acct_events")
    assert replay.status_code == 503 and replay.json()["code"] == "STORAGE.UNAVAILABLE"
    balance = svc.request("GET", "/mgt/v1/wallet/balance", account="acct_prepaid")
    assert balance.status_code == 503  # not even a read: the state is not rebuilt yet

    fault.unlink()
    _wait_for(lambda: svc.client.get(svc.base_url + "/healthz").status_code == 200, 15,
              "ready once the file takes the journal")
    for body in bodies:  # every acknowledged event is there: a replay, not a new event
        assert svc.post("/mgt/v1/events", body, account="acct_events").status_code == 200
    svc.stop()
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    assert conn.execute("SELECT count(*) FROM events WHERE event_type = 'disk.restart'").fetchone() == (20,)
    conn.close()


def test_a_database_the_full_disk_invalidated_is_reopened_by_a_new_writer_once_there_is_room(
        fresh_service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real full disk DuckDB may invalidate its database (an I/O error in its WAL or a
    checkpoint): no later write on that connection can land, however much room comes back.
    The test hook's `fatal` mode fails the apply that way. While the disk is full the writer
    stays up and refuses; once it has room the writer process ends, the service starts a new
    one, which reopens the file and applies the journal: nothing acknowledged is lost."""
    svc = fresh_service
    monkeypatch.setenv("TOLLGATE_TEST_FULL_DISK_FILE", "full-disk")
    monkeypatch.setenv("TOLLGATE_MAX_BACKLOG_ROWS", str(BOUND))
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "off")
    svc.start()
    fault = svc.data_dir / "full-disk"
    fault.write_text("fatal")
    first = _event("disk.fatal")
    assert svc.post("/mgt/v1/events", first, account="acct_events").status_code == 201
    acknowledged: list[dict[str, Any]] = [first]
    _wait_for(lambda: _metrics(svc).get("tollgate_journal_apply_failures_total", 0) >= 1, 10,
              "an apply refused by the file")
    for _ in range(2 * BOUND):
        body = _event("disk.fatal")
        r = svc.post("/mgt/v1/events", body, account="acct_events")
        if r.status_code == 201:
            acknowledged.append(body)
        else:
            assert r.status_code == 503 and r.json()["code"] == "STORAGE.UNAVAILABLE", r.text
    assert 0 < len(acknowledged) <= BOUND + 1  # refusals began (the bound: the test above)
    _wait_for(lambda: svc.client.get(svc.base_url + "/healthz").status_code == 503, 10,
              "not ready while the file refuses")
    time.sleep(1.5)  # several retries while the disk is still "full": the writer stays
    assert svc.client.get(svc.base_url + "/healthz").json()["data"]["writer"] == "running"

    fault.unlink()
    _wait_for(lambda: svc.client.get(svc.base_url + "/healthz").status_code == 200, 30,
              "ready again with a new writer")
    log = (svc.data_dir / "serve.log").read_text()
    assert log.count("the writer process ended to reopen the operational file") == 1, log[-3000:]
    for body in acknowledged:  # in the file: duplicates now
        assert svc.post("/mgt/v1/events", body, account="acct_events").status_code == 200
    fresh = _event("disk.fatal")
    assert svc.post("/mgt/v1/events", fresh, account="acct_events").status_code == 201
    svc.stop()
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    stored = {r[0] for r in conn.execute(
        "SELECT subject_ref FROM events WHERE event_type = 'disk.fatal'").fetchall()}
    conn.close()
    assert stored == {b["subject_ref"] for b in acknowledged} | {fresh["subject_ref"]}
