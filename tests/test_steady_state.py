"""Steady state (issue 16): the writer's cost follows its traffic and configuration, not its
history. A preloaded history restarts fast in bounded memory and still dedupes; events leave
the operational file after the window and stay duplicates; the event index's cache is
bounded; idempotency records live on disk for 24 h and are then removed."""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pytest

from bench.preload import preload
from core.clock import ManualClock
from pipelines.catalog import load_catalog
from tests.conftest import FIXTURES, Service, processes_of
from warehouse.event_index import EventIndex
from warehouse.lake import connect_lake
from warehouse.operational import MIGRATIONS, open_operational, schema_version
from warehouse.writer import Transaction
from writer.gate.book import GateBook
from writer.ops import AuthorizeOp, IdemKey

# Scaled down for CI; TOLLGATE_TEST_PRELOAD raises it (the figures are for 50 M).
PRELOAD = int(os.environ.get("TOLLGATE_TEST_PRELOAD", "1000000"))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _self_rss_mib() -> float:
    return _rss_mib(os.getpid())


def _event(**over: object) -> dict[str, object]:
    body: dict[str, object] = {
        "semantic_kind": "activity", "event_type": "llm.completion",
        "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": f"job-{uuid.uuid4()}",
        "payload": {"usage": {"input_tokens": 12}}, "labels": {"team": "blue"}}
    body.update(over)
    return body


def _lake_count(data_dir: Path, event_id: str) -> int:
    lake = connect_lake(data_dir, read_only=True)
    try:
        row = lake.execute("SELECT count(*) FROM lake.events WHERE event_id = ?::UUID", [event_id]).fetchone()
        return int(row[0]) if row else 0
    finally:
        lake.close()


@pytest.mark.lake
def test_a_preloaded_history_restarts_fast_in_bounded_memory_and_still_dedupes(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    svc.stop()
    began = time.monotonic()
    loaded = preload(svc.data_dir, PRELOAD, seed=7)
    preload_s = time.monotonic() - began
    began = time.monotonic()
    svc.start()
    ready_s = time.monotonic() - began
    [writer] = processes_of(svc.data_dir, "writer.host")
    first = loaded["first_event"]
    again = svc.post("/mgt/v1/events", first, account=loaded["account"])
    assert again.status_code == 200, again.text  # a duplicate of the history's first event
    assert again.json()["data"]["labels"] == {}
    fresh = svc.post("/mgt/v1/events", _event(), account=loaded["account"])
    assert fresh.status_code == 201, fresh.text
    rss = _rss_mib(writer)
    print(f"preload {PRELOAD:,} events {preload_s:.1f} s; ready {ready_s:.1f} s; writer RSS {rss:.0f} MiB")
    assert ready_s < 20, ready_s  # generous: nothing at start reads the history
    assert rss < 1024, rss  # the default TOLLGATE_WRITER_MEMORY
    svc.stop()
    # The new event follows the history in seq and reached the lake once.
    lake = connect_lake(svc.data_dir, read_only=True)
    try:
        row = lake.execute("SELECT count(*), max(seq) FROM lake.events").fetchone()
        assert row == (PRELOAD + 1, PRELOAD + 1)
    finally:
        lake.close()


def _store_51_events(svc: Service) -> tuple[dict[str, object], Any, list[dict[str, object]]]:
    """One single event (seq 1) and a batch of 50 (seqs 2-51): (the single's body, its
    reply, the batch's bodies)."""
    single = _event()
    first = svc.post("/mgt/v1/events", single, account="acct_events")
    assert first.status_code == 201, first.text
    batch = [_event() for _ in range(50)]
    assert svc.post("/mgt/v1/events/batch", {"events": batch}, account="acct_events").status_code == 207
    return single, first, batch


@pytest.mark.lake
def test_events_leave_the_operational_file_after_the_window_and_stay_duplicates(fresh_service: Service) -> None:
    svc = fresh_service
    svc.env["TOLLGATE_OPERATIONAL_WINDOW_SECONDS"] = "1"
    svc.start()
    single, first, batch = _store_51_events(svc)
    time.sleep(1.5)  # past the window
    svc.stop()  # the last export ships them, then they leave the file
    op = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    try:
        assert op.execute("SELECT count(*) FROM events").fetchone() == (0,)
        marks = dict(op.execute("SELECT stream, last_seq FROM export_watermarks").fetchall())
        assert marks["events"] == 51
    finally:
        op.close()
    svc.start()
    again = svc.post("/mgt/v1/events", single, account="acct_events")
    assert again.status_code == 200, again.text
    # What was stored at first acceptance, read from the index now that the file let it go.
    assert again.json()["data"]["created_at"] == first.json()["data"]["created_at"]
    assert again.json()["data"]["labels"] == {"team": "blue"}
    redo = svc.post("/mgt/v1/events/batch", {"events": batch[:3]}, account="acct_events")
    assert [item["status"] for item in redo.json()["data"]["results"]] == ["duplicate"] * 3, redo.text
    svc.stop()
    assert _lake_count(svc.data_dir, first.json()["data"]["event_id"]) == 1


@pytest.mark.lake
def test_past_the_rows_bound_the_oldest_exported_events_leave_however_young(fresh_service: Service) -> None:
    svc = fresh_service
    svc.env["TOLLGATE_OPERATIONAL_WINDOW_ROWS"] = "20"  # the hour's window stays
    svc.start()
    single, first, batch = _store_51_events(svc)
    svc.stop()  # the last export ships them, then all but the newest 20 leave the file
    op = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    try:
        assert op.execute("SELECT count(*), min(seq), max(seq) FROM events").fetchone() == (20, 32, 51)
    finally:
        op.close()
    svc.start()
    again = svc.post("/mgt/v1/events", single, account="acct_events")
    assert again.status_code == 200, again.text  # from the index, the file let it go
    assert again.json()["data"]["created_at"] == first.json()["data"]["created_at"]
    redo = svc.post("/mgt/v1/events/batch", {"events": batch[:3] + batch[-3:]}, account="acct_events")
    assert [item["status"] for item in redo.json()["data"]["results"]] == ["duplicate"] * 6, redo.text
    svc.stop()
    lake = connect_lake(svc.data_dir, read_only=True)
    try:
        assert lake.execute("SELECT count(*), count(DISTINCT seq) FROM lake.events").fetchone() == (51, 51)
    finally:
        lake.close()


def test_the_index_cache_stays_bounded_while_it_holds_many_more_ids(tmp_path: Path) -> None:
    cache = 8 << 20
    index = EventIndex(tmp_path / "index", cache)
    before = _self_rss_mib()
    count = 1_500_000  # ~60 MiB of keys and values: far more than the cache holds
    sample: list[tuple[int, bytes]] = []
    rnd = uuid.uuid4
    seq = 0
    occurred = 1_795_000_000_000_000
    for _ in range(count // 1000):
        occurred += 25_000  # 40,000 events a second, a thousand at each instant
        ids = [rnd().bytes for _ in range(1000)]
        sample.append((occurred, ids[0]))
        index.add_events((seq := seq + 1, occurred, i, 1, b'{"k":"v"}') for i in ids)
    grew = _self_rss_mib() - before
    assert index.known(sample) == [True] * len(sample)
    assert index.known([(o, rnd().bytes) for o, _ in sample[:1000]]) == [False] * 1000
    # The same id at another instant is another event's key (ids derive from the facts,
    # occurred_at among them, so a repeat always carries its instant).
    assert index.known([(o + 1, raw) for o, raw in sample[:10]]) == [False] * 10
    assert index.first_stored(sample[:1]) == [(1, b'{"k":"v"}')]
    # A Python set of the same ids would hold ~100 MiB; the index keeps its cache and memtables.
    assert grew < 80, grew
    assert index.memory_bytes() < 4 * cache
    # The Bloom filters (~1.25 bytes an id, ~1.8 MiB here) live in the bounded cache as
    # partitions; what stays with the tables is their top level, which must not follow the ids.
    parts = index.memory()
    assert parts["index_table_readers"] < 256 << 10, parts
    assert parts["index_block_cache"] <= cache + (1 << 20), parts
    index.close()
    reopened = EventIndex(tmp_path / "index", cache)
    assert reopened.watermark == seq and reopened.known(sample[-3:]) == [True] * 3
    reopened.close()


def test_an_index_written_with_id_only_keys_still_finds_its_events(tmp_path: Path) -> None:
    """Indexes written before the key carried occurred_at hold b"e" + id: they are read as
    they are, beside the new keys, with no migration."""
    path = tmp_path / "index"
    index = EventIndex(path, 8 << 20)
    assert index.legacy is False
    old = [uuid.uuid4().bytes for _ in range(50)]
    for n, raw in enumerate(old):  # the former layout, written by hand
        index.db[b"e" + raw] = (1000 + n).to_bytes(8, "big") + b'{"old":true}'
    index.close()
    index = EventIndex(path, 8 << 20)
    assert index.legacy is True
    new = [uuid.uuid4().bytes for _ in range(50)]
    index.add_events((n + 1, 7_000_000 + n, raw, 2000 + n, b"{}") for n, raw in enumerate(new))
    keys = [(123, raw) for raw in old] + [(7_000_000 + n, raw) for n, raw in enumerate(new)]
    assert index.known(keys) == [True] * 100
    assert index.known([(7_000_000, uuid.uuid4().bytes) for _ in range(20)]) == [False] * 20
    assert index.first_stored([(5, old[3]), (7_000_002, new[2]), (0, bytes(16))]) == [
        (1003, b'{"old":true}'), (2002, b"{}"), None]
    index.close()


NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)


def _authorize(book: GateBook, conn: duckdb.DuckDBPyConnection, at: datetime, key: str) -> object:
    tx = Transaction(conn, at)
    conn.execute("BEGIN")
    done = book.authorize(tx, AuthorizeOp("acme", "idem-p", "acct_gate", None, "gate.unit", 1, {},
                                          IdemKey("acme", "idem-p", "authorize", key, "body-1")))()
    tx.flush()
    tx.commit()
    conn.execute("COMMIT")
    return done


def test_idempotency_records_live_on_disk_for_a_day_and_are_then_removed(tmp_path: Path) -> None:
    catalog = load_catalog((FIXTURES / "catalog.toml").read_text())
    clock = ManualClock(NOW)
    conn = open_operational(tmp_path / "op.duckdb")
    index = EventIndex(tmp_path / "index", 8 << 20)
    book = GateBook(lambda: catalog, clock, index)
    book.rebuild(conn)
    first = _authorize(book, conn, NOW, "k-1")
    assert first.status == 200  # type: ignore[attr-defined]
    assert index.count_idempotency() == 1
    index.close()
    # A restart 23 h later: a new book, the index reopened, nothing of the record in memory.
    index = EventIndex(tmp_path / "index", 8 << 20)
    clock.advance(23 * 3600)
    book = GateBook(lambda: catalog, clock, index)
    book.rebuild(conn)
    assert book.idempotency == {}
    replay = _authorize(book, conn, clock.now(), "k-1")
    assert replay.replayed and replay.data == first.data  # type: ignore[attr-defined]
    assert book.expire_idempotency() == 0  # within the day: kept
    clock.advance(2 * 3600)  # 25 h after it was stored
    assert book.expire_idempotency() == 1
    assert index.count_idempotency() == 0
    book = GateBook(lambda: catalog, clock, index)
    book.rebuild(conn)
    anew = _authorize(book, conn, clock.now(), "k-1")
    assert not anew.replayed and anew.data["lease_id"] != first.data["lease_id"]  # type: ignore[attr-defined]
    index.close()
    conn.close()


def test_an_idempotent_replay_after_a_restart_returns_the_stored_outcome(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    key = f"idem-{uuid.uuid4()}"
    body = {"feature_code": "gate.unit", "estimated_quantity_minor": "1"}
    first = svc.post("/mgt/v1/gate/authorize", body, principal="funds-p", idempotency_key=key)
    assert first.status_code == 200, first.text
    svc.stop()
    svc.start()
    replay = svc.post("/mgt/v1/gate/authorize", body, principal="funds-p", idempotency_key=key)
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["data"]["lease_id"] == first.json()["data"]["lease_id"]
    other = svc.post("/mgt/v1/gate/authorize", {**body, "estimated_quantity_minor": "2"},
                     principal="funds-p", idempotency_key=key)
    assert other.status_code == 409, other.text
    svc.stop()
    op = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    try:
        assert op.execute("SELECT count(*) FROM idempotency").fetchone() == (0,)  # in the index
    finally:
        op.close()
    assert (svc.data_dir / "index").is_dir()



def test_pruned_commits_change_no_balance_usage_carry_or_seq(tmp_path: Path) -> None:
    from datetime import timedelta

    from warehouse.retention import Retention
    from writer.ops import CommitOp, MeterLine

    catalog = load_catalog((FIXTURES / "catalog.toml").read_text())
    conn = open_operational(tmp_path / "op.duckdb")
    book = GateBook(lambda: catalog, ManualClock(NOW))
    book.rebuild(conn)
    for qty in (7, 11, 13):  # a meter that carries a remainder from commit to commit
        tx = Transaction(conn, NOW)
        conn.execute("BEGIN")
        auth = book.authorize(tx, AuthorizeOp("acme", "gate-p", "acct_gate", None, "gate.rounding", qty, {}, None))()
        book.commit(tx, CommitOp("acme", "gate-p", "acct_gate", auth.data["lease_token"], "gate.rounding", qty,
                                 [MeterLine("gate.floor", qty)], {}, b"{}", None))()
        tx.flush()
        tx.commit()
        conn.execute("COMMIT")
    before = (dict(book.committed), dict(book.carry), book.line_seq, book.commit_seq,
              book.tally.window("acme", "account", "acct_gate", "month", NOW.date(), None))
    assert before[0] and before[1] and before[2] == 3
    conn.execute("INSERT INTO export_watermarks VALUES ('commit_lines', 3, 1, now())")  # in the lake
    later = NOW + timedelta(days=8, hours=6)  # past what the book remembers, the same month
    clock = ManualClock(later)
    Retention(tmp_path / "op.duckdb", 3600, lambda: 0, clock=clock).step(conn, force=True)
    for table in ("commits", "commit_lines", "leases"):
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table
    again = GateBook(lambda: catalog, clock)
    again.rebuild(conn)
    after = (dict(again.committed), dict(again.carry), again.line_seq, again.commit_seq,
             again.tally.window("acme", "account", "acct_gate", "month", later.date(), None))
    assert after == before
    conn.close()


def test_ended_leases_live_on_disk_behind_a_bounded_cache_for_a_week(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import writer.gate.book as book_module
    from writer.ops import CommitOp

    monkeypatch.setattr(book_module, "ENDED_LEASE_CACHE", 5)
    catalog = load_catalog((FIXTURES / "catalog.toml").read_text())
    clock = ManualClock(NOW)
    conn = open_operational(tmp_path / "op.duckdb")
    index = EventIndex(tmp_path / "index", 8 << 20)
    book = GateBook(lambda: catalog, clock, index)
    book.rebuild(conn)

    def commit(token: str) -> object:
        tx = Transaction(conn, clock.now())
        conn.execute("BEGIN")
        done = book.commit(tx, CommitOp("acme", "gate-p", "acct_gate", token, "gate.unit", 1, None, {},
                                        b'{"quantity_minor":"1"}', None))()
        tx.flush()
        tx.commit()
        conn.execute("COMMIT")
        return done

    firsts = []
    for _ in range(20):
        tx = Transaction(conn, clock.now())
        conn.execute("BEGIN")
        auth = book.authorize(tx, AuthorizeOp("acme", "gate-p", "acct_gate", None, "gate.unit", 1, {}, None))()
        tx.flush()
        tx.commit()
        conn.execute("COMMIT")
        token = auth.data["lease_token"]  # type: ignore[attr-defined]
        firsts.append((token, commit(token)))
        clock.advance(1)
    assert sum(1 for lease in book.leases.values() if lease.state != "active") <= 5
    assert index.count_leases() == 20
    token, first = firsts[0]  # long gone from memory: its replay comes from the index
    again = commit(token)
    assert again.data == first.data  # type: ignore[attr-defined]
    index.close()
    # A restart: the index holds them, the file is read only past the index's mark.
    index = EventIndex(tmp_path / "index", 8 << 20)
    book = GateBook(lambda: catalog, clock, index)
    book.rebuild(conn)
    token, first = firsts[3]
    assert commit(token).data == first.data  # type: ignore[attr-defined]
    clock.advance(8 * 86400)  # a week past their end
    assert book.expire_leases() == 20
    assert index.count_leases() == 0
    assert commit(firsts[5][0]).code == "LEASE.NOT_FOUND"  # type: ignore[attr-defined]

    index.close()
    conn.close()


def test_a_file_from_before_migration_5_keeps_its_events_and_loses_the_events_key(tmp_path: Path) -> None:
    """Migration 5 drops `events.event_id`'s primary key (the event index dedupes): a file
    made by migrations 1-4 keeps every row and its labels view, and takes a repeated id."""
    path = tmp_path / "op.duckdb"
    conn = duckdb.connect(str(path))
    conn.execute("CREATE TABLE schema_migrations "
                 "(version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
    for version, sql in MIGRATIONS[:4]:
        conn.execute(sql)
        conn.execute("INSERT INTO schema_migrations (version) VALUES (?)", [version])
    row = ("r", "acct", "h", "usage", "api.call", "2026-01-01 00:00:00+00", None, "{}",
           '{"team": "a"}', "2026-01-01 00:00:00+00", "single")
    for seq in (1, 2):
        conn.execute("INSERT INTO events VALUES (?, gen_random_uuid(), ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     [seq, *row])
    with pytest.raises(duckdb.ConstraintException):
        conn.execute("INSERT INTO events SELECT 3, event_id, * EXCLUDE (seq, event_id) "
                     "FROM events WHERE seq = 1")
    conn.close()

    conn = open_operational(path)
    assert schema_version(conn) == len(MIGRATIONS)
    assert conn.execute("SELECT list(seq ORDER BY seq) FROM events").fetchone() == ([1, 2],)
    assert conn.execute("SELECT count(*) FROM duckdb_constraints() WHERE table_name = 'events' "
                        "AND constraint_type = 'PRIMARY KEY'").fetchone() == (0,)
    conn.execute("INSERT INTO events SELECT 3, event_id, * EXCLUDE (seq, event_id) "
                 "FROM events WHERE seq = 1")
    assert conn.execute("SELECT count(*), list(DISTINCT value_text) FROM event_labels").fetchone() \
        == (3, ["a"])
    conn.close()
