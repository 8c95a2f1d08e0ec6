"""Gate state survives restarts and SIGKILL: leases, holds, idempotency records, commits."""

from __future__ import annotations

import signal
import tempfile
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb
from hypothesis import given, settings
from hypothesis import strategies as st

from core.clock import ManualClock
from pipelines.catalog import load_catalog
from tests.conftest import FIXTURES, Service, examples
from warehouse.operational import open_operational
from warehouse.writer import Transaction
from writer.gate.book import GateBook
from writer.ops import AuthorizeOp, CommitOp, MeterLine


def _stopping(r: object) -> bool:
    """A worker still answering while the service is killed: a 503 the client retries (its
    parent gone, or its writer), never a 500."""
    return (getattr(r, "status_code", 0) == 503
            and r.json()["code"] in ("SERVICE.BUSY", "STORAGE.UNAVAILABLE"))  # type: ignore[attr-defined]


def _authorize(svc: Service, principal: str, estimate: str = "10", key: str | None = None):
    return svc.post("/mgt/v1/gate/authorize", {"feature_code": "gate.unit", "estimated_quantity_minor": estimate},
                    principal=principal, idempotency_key=key)


def test_restart_keeps_leases_holds_and_idempotency_records(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    key = f"idem-{uuid.uuid4()}"
    held = [_authorize(svc, "funds-p", key=key if i == 0 else None) for i in range(10)]
    assert all(r.status_code == 200 for r in held)
    assert _authorize(svc, "funds-p").json()["code"] == "FUNDING.INSUFFICIENT"
    svc.stop()
    svc.start()
    assert _authorize(svc, "funds-p").json()["code"] == "FUNDING.INSUFFICIENT"  # holds came back
    replay = _authorize(svc, "funds-p", key=key)
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["data"]["lease_token"] == held[0].json()["data"]["lease_token"]
    token = held[1].json()["data"]["lease_token"]
    cancel = svc.post("/mgt/v1/gate/cancel", {"lease_token": token}, principal="funds-p")
    assert cancel.json()["data"]["released_cap"] == "10"
    assert _authorize(svc, "funds-p").status_code == 200


def test_a_commit_acknowledged_before_kill_9_is_there_once_after_restart(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    token = _authorize(svc, "funds-p", estimate="3").json()["data"]["lease_token"]
    body = {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": "3"}
    first = svc.post("/mgt/v1/gate/commits", body, principal="funds-p")
    assert first.status_code == 200 and first.json()["data"]["balance_xusd"] == "9700"
    svc.proc.send_signal(signal.SIGKILL)
    svc.proc.wait()
    svc.proc = None
    svc.start()
    again = svc.post("/mgt/v1/gate/commits", body, principal="funds-p")
    assert again.status_code == 200
    assert again.json()["data"]["commit_id"] == first.json()["data"]["commit_id"]
    token2 = _authorize(svc, "funds-p", estimate="1").json()["data"]["lease_token"]
    after = svc.post("/mgt/v1/gate/commits", {"lease_token": token2, "feature_code": "gate.unit",
                                              "quantity_minor": "1"}, principal="funds-p")
    assert after.json()["data"]["balance_xusd"] == "9600"  # charged once: 10000 - 300 - 100
    svc.stop()
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    assert conn.execute("SELECT count(*), sum(amount_xusd) FROM commits").fetchone() == (2, 400)


NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(["gate.floor", "gate.nearest", "gate.ceil"]),
       st.lists(st.integers(0, 5000), min_size=1, max_size=12))
def test_split_commits_are_charged_exactly_one_commit_of_the_total(meter: str, parts: list[int]) -> None:
    catalog = load_catalog((FIXTURES / "catalog.toml").read_text())
    for total_run in (parts, [sum(parts)]):
        conn = open_operational_memory()
        book = GateBook(lambda: catalog, ManualClock(NOW))
        book.rebuild(conn)
        charged = 0
        for qty in total_run:
            tx = Transaction(conn, NOW)
            conn.execute("BEGIN")
            auth = book.authorize(tx, AuthorizeOp("acme", "gate-p", "acct_gate", None, "gate.rounding", qty, {}, None))()
            token = auth.data["lease_token"]
            done = book.commit(tx, CommitOp("acme", "gate-p", "acct_gate", token, "gate.rounding", qty,
                                            [MeterLine(meter, qty)], {}, b"{}", None))()
            tx.flush()
            tx.commit()
            conn.execute("COMMIT")
            charged += int(done.data["amount_xusd"])
        if total_run is parts:
            split_total = charged
        else:
            assert split_total == charged


# One folder for the whole run, removed at exit: a folder per hypothesis example was left
# behind in the system's temporary folder (about 84 per run).
_SCRATCH = tempfile.TemporaryDirectory(prefix="tollgate-gate-test-")


def open_operational_memory() -> duckdb.DuckDBPyConnection:
    return open_operational(Path(tempfile.mkdtemp(dir=_SCRATCH.name)) / "op.duckdb")


def test_expired_leases_release_their_holds_in_the_book() -> None:
    catalog = load_catalog((FIXTURES / "catalog.toml").read_text())
    clock = ManualClock(NOW)
    conn = open_operational_memory()
    book = GateBook(lambda: catalog, clock)
    book.rebuild(conn)
    tx = Transaction(conn, NOW)
    conn.execute("BEGIN")
    ok = book.authorize(tx, AuthorizeOp("acme", "expiry-p", "acct_gate_expiry", None, "gate.short", 10, {}, None))()
    tx.flush()
    tx.commit()
    conn.execute("COMMIT")
    assert ok.status == 200
    assert book.holds.funding[("acme", "acct_gate_expiry")] == 1000
    clock.advance(2)
    assert book.expire_due(conn) == 1
    assert book.holds.funding[("acme", "acct_gate_expiry")] == 0
    book.rebuild(conn)  # the expiry is in the file too
    assert book.holds.funding.get(("acme", "acct_gate_expiry"), 0) == 0


def test_reapplying_a_catalog_never_grants_twice(fresh_service: Service) -> None:
    import time

    from tests.conftest import tollgate

    svc = fresh_service
    svc.start()
    tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=svc.data_dir)
    time.sleep(2.5)  # past the writer's catalog refresh
    svc.stop()
    svc.start()
    token = _authorize(svc, "funds-p", estimate="1").json()["data"]["lease_token"]
    done = svc.post("/mgt/v1/gate/commits", {"lease_token": token, "feature_code": "gate.unit",
                                             "quantity_minor": "1"}, principal="funds-p")
    assert done.json()["data"]["balance_xusd"] == "9900"  # one grant of 10,000 less 100
    svc.stop()
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    assert conn.execute("SELECT count(*) FROM grants WHERE grant_id = 'gate-funds'").fetchone() == (1,)


def test_amounts_beyond_bigint_are_refused_before_anything_is_written() -> None:
    # 10^17 units at 100 xusd each is 10^19 xusd: more than a BIGINT holds. Acknowledging it
    # would leave a row the file refuses; it is a 422 and nothing changes.
    catalog = load_catalog((FIXTURES / "catalog.toml").read_text())
    conn = open_operational_memory()
    book = GateBook(lambda: catalog, ManualClock(NOW))
    book.rebuild(conn)
    huge = 10 ** 17
    tx = Transaction(conn, NOW)
    refused = book.authorize(tx, AuthorizeOp("acme", "team-c", "acct_postpaid", None, "gate.unit", huge, {}, None))()
    assert (refused.status, refused.code) == (422, "VALIDATION.INVALID_INPUT")
    assert refused.errors[0]["field"] == "estimated_quantity_minor"
    assert tx.rows == {}
    ok = book.authorize(tx, AuthorizeOp("acme", "team-c", "acct_postpaid", None, "gate.unit", 1, {}, None))()
    token = ok.data["lease_token"]
    seq_before = (book.commit_seq, book.line_seq)
    over = book.commit(tx, CommitOp("acme", "team-c", "acct_postpaid", token, "gate.unit", huge,
                                    None, {}, b"{}", None))()
    assert (over.status, over.code) == (422, "VALIDATION.INVALID_INPUT")
    assert (book.commit_seq, book.line_seq) == seq_before and "commits" not in tx.rows
    done = book.commit(tx, CommitOp("acme", "team-c", "acct_postpaid", token, "gate.unit", 3,
                                    None, {}, b"{}", None))()
    assert done.status == 200 and done.data["amount_xusd"] == "300"


def test_kill_9_under_concurrent_gate_load_keeps_every_acknowledged_commit_exactly_once(
        fresh_service: Service) -> None:
    # 16 clients run authorize+commit pairs; the service is killed while they run. After a
    # restart every acknowledged commit replays to its own commit id, the file holds each
    # exactly once, and the ledger's committed total is their sum (nothing unacknowledged
    # beyond what was in flight at the kill).
    import asyncio
    import json

    import httpx

    from api.auth import sign_headers

    svc = fresh_service
    svc.start()
    acknowledged: list[tuple[dict, str, int]] = []   # (commit body, commit id, amount)

    async def client(n: int, http: httpx.AsyncClient) -> None:
        def signed(path: str, data: bytes) -> dict[str, str]:
            return sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST", path=path,
                                body=data, realm="acme", principal_id="gate-p")
        for i in range(200):
            try:
                data = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "2"}).encode()
                r = await http.post(svc.base_url + "/mgt/v1/gate/authorize", content=data,
                                    headers=signed("/mgt/v1/gate/authorize", data))
                if _stopping(r):
                    return
                token = r.json()["data"]["lease_token"]
                body = {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": str(1 + (n + i) % 3)}
                data = json.dumps(body).encode()
                r = await http.post(svc.base_url + "/mgt/v1/gate/commits", content=data,
                                    headers=signed("/mgt/v1/gate/commits", data))
                if _stopping(r):
                    return  # not acknowledged
                assert r.status_code == 200, r.text
                acknowledged.append((body, r.json()["data"]["commit_id"], int(r.json()["data"]["amount_xusd"])))
            except (httpx.TransportError, KeyError, ValueError):
                return  # the service is gone

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            tasks = [asyncio.create_task(client(n, http)) for n in range(16)]
            deadline = asyncio.get_running_loop().time() + 120
            while len(acknowledged) < 300 and not all(t.done() for t in tasks):
                assert asyncio.get_running_loop().time() < deadline, "the clients stalled"
                await asyncio.sleep(0.01)
            svc.proc.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks)

    asyncio.run(run())
    svc.proc.wait()
    svc.proc = None
    assert len(acknowledged) >= 300
    svc.start()
    for body, commit_id, _ in acknowledged[::7] + acknowledged[-5:]:
        again = svc.post("/mgt/v1/gate/commits", body, principal="gate-p")
        assert again.status_code == 200 and again.json()["data"]["commit_id"] == commit_id
    svc.stop()
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    ids = [commit_id for _, commit_id, _ in acknowledged]
    stored = dict(conn.execute(
        "SELECT commit_id, count(*) FROM commits GROUP BY commit_id").fetchall())
    assert all(stored.get(commit_id) == 1 for commit_id in ids)
    total, count = conn.execute("SELECT sum(amount_xusd), count(*) FROM commits").fetchone()
    # Commits in flight at the kill may have become durable without their reply arriving.
    assert len(ids) <= count <= len(ids) + 16
    assert total >= sum(amount for _, _, amount in acknowledged)
    lines = conn.execute("SELECT count(*) FROM commit_lines").fetchone()[0]
    assert lines == count
    conn.close()


def _commit_once(book: GateBook, conn: duckdb.DuckDBPyConnection, meter: str, qty: int) -> dict:
    tx = Transaction(conn, NOW)
    conn.execute("BEGIN")
    auth = book.authorize(tx, AuthorizeOp("acme", "gate-p", "acct_gate", None, "gate.rounding", qty, {}, None))()
    done = book.commit(tx, CommitOp("acme", "gate-p", "acct_gate", auth.data["lease_token"], "gate.rounding", qty,
                                    [MeterLine(meter, qty)], {}, b"{}", None))()
    tx.flush()
    tx.commit()
    conn.execute("COMMIT")
    assert done.status == 200, done
    return done.data


def test_a_price_row_whose_terms_change_starts_its_carry_afresh() -> None:
    text = (FIXTURES / "catalog.toml").read_text()
    block_1000 = load_catalog(text)
    # The same row (meter and effective_at) re-applied with blocks of 100 and price 20.
    old_row = ('meter = "gate.ceil"\nunit_price_xusd = "150"\nunit_quantity_minor = "1000"')
    assert old_row in text
    block_100 = load_catalog(text.replace(old_row, 'meter = "gate.ceil"\nunit_price_xusd = "20"\n'
                                                   'unit_quantity_minor = "100"'))
    catalog = [block_1000]
    conn = open_operational_memory()
    book = GateBook(lambda: catalog[0], ManualClock(NOW))
    book.rebuild(conn)
    first = _commit_once(book, conn, "gate.ceil", 400)      # ceil: one block of 1000 charged, 400 carried
    assert first["amount_xusd"] == "150"
    catalog[0] = block_100
    second = _commit_once(book, conn, "gate.ceil", 250)     # fresh carry: 3 blocks of 100 at 20
    assert second["amount_xusd"] == "60"
    assert second["lines"][0]["pricing_fingerprint"] != first["lines"][0]["pricing_fingerprint"]
    third = _commit_once(book, conn, "gate.ceil", 40)       # 250 + 40 = 290: still within 3 blocks
    assert third["amount_xusd"] == "0"
    book.rebuild(conn)                                       # the carry of the new terms comes back
    assert _commit_once(book, conn, "gate.ceil", 20)["amount_xusd"] == "20"  # 310: a fourth block


def test_cancelling_a_lease_past_its_time_reports_it_expired_before_the_sweep_does() -> None:
    from writer.ops import CancelOp

    catalog = load_catalog((FIXTURES / "catalog.toml").read_text())
    conn = open_operational_memory()
    book = GateBook(lambda: catalog, ManualClock(NOW))
    book.rebuild(conn)
    tx = Transaction(conn, NOW)
    ok = book.authorize(tx, AuthorizeOp("acme", "expiry-p", "acct_gate_expiry", None, "gate.short", 10, {}, None))()
    tx.flush()
    tx.commit()
    assert book.holds.funding[("acme", "acct_gate_expiry")] == 1000
    later = NOW + timedelta(seconds=2)                         # past the 1 s lease; no sweep ran
    tx = Transaction(conn, later)
    done = book.cancel(tx, CancelOp("acme", "expiry-p", ok.data["lease_token"], None, None))()
    tx.flush()
    tx.commit()
    assert done.data["cancelled"] is False and done.data["state"] == "expired"
    assert done.data["released_cap"] == "0"
    assert book.holds.funding.get(("acme", "acct_gate_expiry"), 0) == 0
    book.rebuild(conn)                                          # the file says expired, at its time
    assert book.holds.funding.get(("acme", "acct_gate_expiry"), 0) == 0
    assert conn.execute("SELECT state, happened_at FROM lease_transitions").fetchall() == [
        ("expired", NOW + timedelta(seconds=1))]
