"""Export to the lake (docs/architecture.md, the life of an event): every committed event, label, gate commit
line and inline rating reaches the lake in commit order, exactly once, across crashes."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import signal
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import duckdb
import httpx
import msgspec
import pytest

from api.auth import sign_headers
from api.events.views import to_record
from core.clock import ManualClock
from pipelines.events import EventIn, ValidEvent, validate_event
from tests.conftest import Service
from warehouse.export import ExportMismatch, LakeExporter, run_exporter_thread
from warehouse.lake import connect_lake
from warehouse.operational import open_operational
from warehouse.outbox import EventOutbox
from warehouse.writer import Transaction

pytestmark = pytest.mark.lake

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)
EMPTY = {"events": 0, "commit_lines": 0, "inline_ratings": 0}


def valid(n: int, **extra: Any) -> ValidEvent:
    body = {"semantic_kind": "activity", "event_type": "llm.completion",
            "occurred_at": (NOW - timedelta(minutes=n)).isoformat(), "subject_ref": f"s-{n}",
            "payload": {"usage": {"input_tokens": 100 + n}}, **extra}
    item = msgspec.json.decode(json.dumps(body).encode(), type=EventIn)
    event = validate_event(item, realm="acme", billing_account_id=f"acct_{n % 2}", now=NOW,
                           max_future_skew_seconds=300)
    assert isinstance(event, ValidEvent), event
    return event


class OperationalFile:
    """An operational file written the way the writer writes it, plus gate and rating rows."""

    def __init__(self, path: Path) -> None:
        self.conn = open_operational(path)
        self.outbox = EventOutbox(self.conn)
        self.events = 0
        self.lines = 0
        self.ratings = 0

    def add_events(self, count: int, **extra: Any) -> None:
        self.conn.execute("BEGIN")
        tx = Transaction(self.conn, NOW)
        for _ in range(count):
            self.events += 1
            self.outbox.stage(tx, "acme", to_record(valid(self.events, **extra)), "single")
        tx.flush()
        tx.commit()
        self.conn.execute("COMMIT")

    def add_commit(self, lines: int) -> str:
        commit_id = f"cmt_{uuid.uuid4().hex[:12]}"
        for i in range(lines):
            self.lines += 1
            self.conn.execute(
                "INSERT INTO commit_lines VALUES (?, ?, ?, 'lease_1', 'acme', 'acct_0', 'team-a', "
                "'llm.chat', ?, ?, 'p1', 150, 1000, 'floor', 0, 0, ?, 'fp', ?)",
                [self.lines, f"{commit_id}:{i}", commit_id, f"llm.meter_{i}", 1000 * (i + 1),
                 150 * (i + 1), NOW + timedelta(seconds=self.lines)])
        return commit_id

    def add_inline_rating(self, status: str = "rated") -> None:
        self.ratings += 1
        event_id = self.conn.execute("SELECT event_id FROM events ORDER BY seq LIMIT 1").fetchone()[0]
        self.conn.execute(
            "INSERT INTO inline_ratings VALUES (?, ?, ?, 'acme', 'acct_1', ?, 'llm-completions', "
            "'2026-01', 'llm.chat', 'llm.input_tokens', 1200, 'p1', 150, 1000, 180, ?, ?, 0)",
            [self.ratings, f"rt_{self.ratings}", event_id, status, NOW, NOW + timedelta(seconds=1)])


def lake_rows(data_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = connect_lake(data_dir, read_only=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@pytest.fixture()
def op(tmp_path: Path) -> OperationalFile:
    return OperationalFile(tmp_path / "operational.duckdb")


def test_every_stream_reaches_the_lake_equal_to_its_source(tmp_path: Path, op: OperationalFile) -> None:
    op.add_events(5, labels={"env": "prod", "run": str(uuid.uuid4()), "ok": True, "n": 3})
    op.add_events(2)
    first = op.add_commit(2)
    op.add_commit(1)
    op.add_inline_rating()
    op.add_inline_rating("skipped_no_policy")

    assert LakeExporter(tmp_path).export_once(op.conn) == {"events": 7, "commit_lines": 3,
                                                           "inline_ratings": 2}

    columns = ("event_id, realm, billing_account_id, request_hash, semantic_kind, event_type, "
               "occurred_at, subject_ref, payload::VARCHAR, labels::VARCHAR, created_at, ingest_path, seq")
    source = op.conn.execute(f"SELECT {columns} FROM events ORDER BY seq").fetchall()
    assert lake_rows(tmp_path, f"SELECT {columns} FROM lake.events ORDER BY seq") == source

    label_cols = "event_id, realm, billing_account_id, key, slot, value_text, value_uuid, value_bool, value_number"
    typed = op.conn.execute(f"SELECT {label_cols} FROM event_labels ORDER BY ALL").fetchall()
    assert len(typed) == 20
    assert lake_rows(tmp_path, f"SELECT {label_cols} FROM lake.event_labels ORDER BY ALL") == typed
    assert {r[4] for r in typed} == {"text", "uuid", "bool", "number"}

    gate = lake_rows(tmp_path, "SELECT rating_id, run_id, source_id, event_id, status, meter_code, "
                     "quantity_minor, amount_xusd, line_index, occurred_at = rated_at FROM lake.ratings "
                     "WHERE source = 'gate_commit' ORDER BY rating_id")
    assert [g for g in gate if g[2] == first] == [
        (f"{first}:0", "gate", first, None, "rated", "llm.meter_0", 1000, 150, 0, True),
        (f"{first}:1", "gate", first, None, "rated", "llm.meter_1", 2000, 300, 1, True)]
    assert len(gate) == 3

    inline = lake_rows(tmp_path, "SELECT rating_id, run_id, source_id = event_id::VARCHAR, status, "
                       "amount_xusd FROM lake.ratings WHERE source = 'event' ORDER BY rating_id")
    assert inline == [("rt_1", "inline", True, "rated", 180), ("rt_2", "inline", True, "skipped_no_policy", 180)]
    assert lake_rows(tmp_path, "SELECT run_id, kind FROM lake.rating_runs ORDER BY run_id") == [
        ("gate", "gate"), ("inline", "inline")]
    assert lake_rows(tmp_path, "SELECT stream, export_id, from_seq, to_seq, rows FROM lake.export_log "
                     "ORDER BY stream") == [("commit_lines", 1, 1, 3, 3), ("events", 1, 1, 7, 7),
                                            ("inline_ratings", 1, 1, 2, 2)]
    assert op.conn.execute("SELECT stream, last_seq, export_id FROM export_watermarks ORDER BY stream").fetchall() == [
        ("commit_lines", 3, 1), ("events", 7, 1), ("inline_ratings", 2, 1)]


def test_a_second_round_with_nothing_new_exports_nothing(tmp_path: Path, op: OperationalFile) -> None:
    op.add_events(3)
    exporter = LakeExporter(tmp_path)
    assert exporter.export_once(op.conn)["events"] == 3
    assert exporter.export_once(op.conn) == EMPTY
    assert LakeExporter(tmp_path).export_once(op.conn) == EMPTY  # a restarted exporter too
    op.add_events(2)
    assert exporter.export_once(op.conn)["events"] == 2
    assert lake_rows(tmp_path, "SELECT count(*), count(DISTINCT event_id), max(export_id) FROM lake.events") == [(5, 5, 2)]
    assert lake_rows(tmp_path, "SELECT count(*) FROM lake.rating_runs") == [(0,)]


def test_the_exporter_expires_lake_snapshots_older_than_its_window(tmp_path: Path,
                                                                  op: OperationalFile) -> None:
    """Every round commits a snapshot, and every lake transaction reads the whole snapshot
    table first: the exporter keeps only its window's (warehouse.compaction.expire_snapshots)."""
    clock = ManualClock(datetime.now(timezone.utc))
    exporter = LakeExporter(tmp_path, clock=clock, snapshot_window=timedelta(hours=6),
                            expire_every=0.0)
    for _ in range(6):
        op.add_events(3)
        assert exporter.export_once(op.conn)["events"] == 3
    made = exporter.snapshots_kept
    assert made >= 6 and exporter.snapshots_expired == 0  # none is 6 hours old yet

    clock.advance(7 * 3600)  # every snapshot so far is now 7 hours old
    op.add_events(2)
    assert exporter.export_once(op.conn)["events"] == 2
    assert exporter.snapshots_expired >= made - 1
    assert exporter.snapshots_kept <= 2 and exporter.expire_failures == 0
    lake = connect_lake(tmp_path, read_only=True)
    try:
        assert lake.execute("SELECT count(*) FROM ducklake_snapshots('lake')").fetchone() == (
            exporter.snapshots_kept,)
        # The rows stay: only the history of how they came is gone.
        assert lake.execute("SELECT count(*), count(DISTINCT seq) FROM lake.events").fetchone() == (20, 20)
    finally:
        lake.close()

    quiet = LakeExporter(tmp_path, clock=clock, snapshot_window=None)  # no window: none expired
    op.add_events(1)
    quiet.export_once(op.conn)
    assert quiet.snapshots_expired == 0 and quiet.expire_failures == 0


def test_micro_batches_keep_commit_order_and_never_split_a_commit(tmp_path: Path, op: OperationalFile) -> None:
    op.add_events(7)
    commits = [op.add_commit(n) for n in (2, 3, 1, 2)]
    exporter = LakeExporter(tmp_path, batch_rows=3)
    rounds = []
    while (counts := exporter.export_once(op.conn)) != EMPTY:
        rounds.append(counts)
    assert [r["events"] for r in rounds] == [3, 3, 1, 0]
    assert [r["commit_lines"] for r in rounds] == [2, 3, 1, 2]  # a full batch leaves its last commit
    log = lake_rows(tmp_path, "SELECT from_seq, to_seq FROM lake.export_log WHERE stream = 'events' ORDER BY export_id")
    assert log == [(1, 3), (4, 6), (7, 7)]
    indexes = lake_rows(tmp_path, "SELECT source_id, list(line_index ORDER BY rating_id) FROM lake.ratings "
                        "GROUP BY source_id")
    assert dict(indexes) == {c: list(range(n)) for c, n in zip(commits, (2, 3, 1, 2), strict=False)}


def test_the_export_lag_is_the_age_of_the_oldest_row_the_lake_lacks(tmp_path: Path,
                                                                    op: OperationalFile) -> None:
    # Under a sustained load every round is full and the exporter never finds nothing to do:
    # the lag is then how old the rows it left behind are, not how long ago it caught up.
    op.add_events(6)
    accepted = datetime.now(timezone.utc) - timedelta(seconds=100)
    op.conn.execute("UPDATE events SET created_at = ?::TIMESTAMPTZ + to_seconds(seq)", [accepted])
    exporter = LakeExporter(tmp_path, batch_rows=3)
    began = time.time()
    exporter.export_once(op.conn)
    assert exporter.caught_up_at == pytest.approx(accepted.timestamp() + 3)  # rows 1-3 shipped
    exporter.export_once(op.conn)
    assert exporter.caught_up_at == pytest.approx(accepted.timestamp() + 6)
    assert exporter.export_once(op.conn) == EMPTY
    assert exporter.caught_up_at >= began  # nothing left: caught up as the round began


def test_a_round_reads_a_range_of_seqs_and_steps_over_a_gap_wider_than_a_batch(
        tmp_path: Path, op: OperationalFile) -> None:
    # A round reads the seqs past its mark, a batch's worth (not a top-n over the backlog);
    # a gap wider than a batch (none is made today) must not stop the stream.
    op.add_events(5)
    op.conn.execute("UPDATE events SET seq = seq + 10 WHERE seq > 2")
    exporter = LakeExporter(tmp_path, batch_rows=2)
    rounds = []
    while (counts := exporter.export_once(op.conn)) != EMPTY:
        rounds.append(counts["events"])
    assert rounds == [2, 2, 1]
    assert lake_rows(tmp_path, "SELECT list(seq ORDER BY seq) FROM lake.events") == [([1, 2, 13, 14, 15],)]


def test_a_stop_with_more_than_a_round_waiting_leaves_nothing_behind(tmp_path: Path,
                                                                   op: OperationalFile) -> None:
    # A round ships at most `batch_rows` rows a stream. A clean stop met with a backlog (after
    # a lake stall or a restart) used to run one last round and leave the rest unexported.
    op.add_events(8)
    op.add_commit(2)
    op.add_inline_rating()
    stop = threading.Event()
    stop.set()  # the backlog is met at shutdown
    thread = run_exporter_thread(op.conn, tmp_path, stop, interval=0.05, batch_rows=3)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert lake_rows(tmp_path, "SELECT count(*), count(DISTINCT event_id) FROM lake.events") == [(8, 8)]
    assert lake_rows(tmp_path, "SELECT from_seq, to_seq FROM lake.export_log WHERE stream = 'events' "
                     "ORDER BY export_id") == [(1, 3), (4, 6), (7, 8)]
    assert op.conn.execute("SELECT stream, last_seq FROM export_watermarks ORDER BY stream").fetchall() == [
        ("commit_lines", 2), ("events", 8), ("inline_ratings", 1)]


def test_a_stop_ends_the_exporter_when_the_lake_fails(tmp_path: Path, op: OperationalFile,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    op.add_events(8)

    def fail(self: LakeExporter, conn: duckdb.DuckDBPyConnection) -> dict[str, int]:
        self.behind = True  # as a round that failed after reading a full batch
        raise duckdb.IOException("the lake is gone")

    monkeypatch.setattr(LakeExporter, "export_once", fail)
    stop = threading.Event()
    stop.set()
    thread = run_exporter_thread(op.conn, tmp_path, stop, interval=0.05, batch_rows=3)
    thread.join(timeout=10)
    assert not thread.is_alive()  # the next start exports what is left


def test_a_crash_after_the_lake_commit_writes_nothing_twice(tmp_path: Path, op: OperationalFile,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    op.add_events(4)
    op.add_commit(2)
    exporter = LakeExporter(tmp_path)
    real_step = exporter._advance_watermarks

    def crash_once(*args: Any) -> None:
        monkeypatch.setattr(exporter, "_advance_watermarks", real_step)
        raise RuntimeError("killed between the lake commit and the watermark")

    monkeypatch.setattr(exporter, "_advance_watermarks", crash_once)
    with pytest.raises(RuntimeError, match="killed"):
        exporter.export_once(op.conn)
    assert op.conn.execute("SELECT count(*) FROM export_watermarks").fetchone() == (0,)
    assert lake_rows(tmp_path, "SELECT count(*) FROM lake.events") == [(4,)]

    op.add_events(1)
    # The next round finds export #1 in the lake, advances the watermark over it, and
    # exports only what came after.
    assert exporter.export_once(op.conn) == {**EMPTY, "events": 1}
    assert LakeExporter(tmp_path).export_once(op.conn) == EMPTY
    assert lake_rows(tmp_path, "SELECT count(*), count(DISTINCT event_id) FROM lake.events") == [(5, 5)]
    assert lake_rows(tmp_path, "SELECT count(*), count(DISTINCT rating_id) FROM lake.ratings") == [(2, 2)]
    assert op.conn.execute("SELECT stream, last_seq, export_id FROM export_watermarks ORDER BY stream").fetchall() == [
        ("commit_lines", 2, 1), ("events", 5, 2)]


def test_a_restarted_exporter_reconciles_before_writing(tmp_path: Path, op: OperationalFile,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    op.add_events(3)
    crashed = LakeExporter(tmp_path)
    monkeypatch.setattr(crashed, "_advance_watermarks", lambda *a: (_ for _ in ()).throw(RuntimeError("kill -9")))
    with pytest.raises(RuntimeError):
        crashed.export_once(op.conn)
    assert LakeExporter(tmp_path).export_once(op.conn) == EMPTY
    assert lake_rows(tmp_path, "SELECT count(*) FROM lake.events") == [(3,)]


def test_a_lake_filled_from_another_file_stops_the_export(tmp_path: Path, op: OperationalFile) -> None:
    op.add_events(3)
    LakeExporter(tmp_path).export_once(op.conn)
    other = OperationalFile(tmp_path / "started-afresh.duckdb")
    other.add_events(5, subject_ref="other")
    with pytest.raises(ExportMismatch, match="another file"):
        LakeExporter(tmp_path).export_once(other.conn)
    assert lake_rows(tmp_path, "SELECT count(*) FROM lake.events") == [(3,)]


def test_a_lake_removed_or_restored_from_an_older_copy_gets_the_missing_rows_again(
        tmp_path: Path, op: OperationalFile) -> None:
    op.add_events(3)
    LakeExporter(tmp_path).export_once(op.conn)
    shutil.rmtree(tmp_path / "lake")
    op.add_events(1)
    assert LakeExporter(tmp_path).export_once(op.conn)["events"] == 4
    assert lake_rows(tmp_path, "SELECT count(*), count(DISTINCT event_id), min(seq), max(seq) "
                     "FROM lake.events") == [(4, 4, 1, 4)]


def _post(svc: Service, client: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    path = "/mgt/v1/events"
    data = json.dumps(body).encode()
    headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST", path=path,
                           body=data, realm="acme", billing_account_id="acct_events")
    return client.post(svc.base_url + path, content=data, headers=headers)


def _lake_event_ids(data_dir: Path, event_type: str) -> list[str]:
    conn = connect_lake(data_dir, read_only=True)
    try:
        rows = conn.execute("SELECT event_id::VARCHAR FROM lake.events WHERE event_type = ?", [event_type]).fetchall()
    finally:
        conn.close()
    return [r[0] for r in rows]


def _wait_for(data_dir: Path, event_type: str, ids: set[str], seconds: float) -> float:
    start = time.monotonic()
    while True:
        try:
            if ids <= set(_lake_event_ids(data_dir, event_type)):
                return time.monotonic() - start
        except (duckdb.Error, FileNotFoundError):
            pass  # the lake is being created, or its catalog is locked for a moment
        if time.monotonic() - start > seconds:
            raise AssertionError(f"{event_type}: not all {len(ids)} events reached the lake in {seconds} s")
        time.sleep(0.2)


def test_acknowledged_events_reach_the_lake_once_across_kill_9(fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    body = {"semantic_kind": "activity", "event_type": "lake.fresh", "occurred_at": "2026-11-20T10:00:00Z"}
    fresh = {svc.post("/mgt/v1/events", {**body, "subject_ref": str(i)}, account="acct_events").json()["data"]["event_id"]
             for i in range(10)}
    assert _wait_for(svc.data_dir, "lake.fresh", fresh, 5.0) <= 5.0

    acknowledged: set[str] = set()

    async def stream_then_kill() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            async def worker(w: int) -> None:
                for i in range(100_000):
                    try:
                        r = await _post(svc, client, {**body, "event_type": "lake.stream",
                                                      "subject_ref": f"{w}-{i}"})
                    except httpx.HTTPError:
                        return  # the server is gone: this post was never acknowledged
                    if r.status_code == 201:
                        acknowledged.add(r.json()["data"]["event_id"])
            workers = [asyncio.create_task(worker(w)) for w in range(8)]
            # Kill while posts are in flight and the exporter has had a few rounds.
            await asyncio.sleep(2.5)
            assert svc.proc is not None
            svc.proc.send_signal(signal.SIGKILL)
            await asyncio.gather(*workers)

    asyncio.run(stream_then_kill())
    assert svc.proc is not None
    svc.proc.wait()
    assert len(acknowledged) > 50

    time.sleep(0.5)  # the writer process dies with its parent
    svc.start()
    _wait_for(svc.data_dir, "lake.stream", acknowledged, 30.0)
    svc.stop()  # a clean stop: the exporter runs a last round

    lake = _lake_event_ids(svc.data_dir, "lake.stream")
    assert len(lake) == len(set(lake)), "an event reached the lake twice"
    assert acknowledged <= set(lake)
    conn = duckdb.connect(str(svc.data_dir / "operational.duckdb"), read_only=True)
    try:
        stored = {r[0] for r in conn.execute(
            "SELECT event_id::VARCHAR FROM events WHERE event_type = 'lake.stream'").fetchall()}
        marks = dict(conn.execute("SELECT stream, last_seq FROM export_watermarks").fetchall())
        total = conn.execute("SELECT count(*), max(seq) FROM events").fetchone()
    finally:
        conn.close()
    assert set(lake) == stored
    assert marks["events"] == total[1]
    log = lake_rows(svc.data_dir, "SELECT export_id, from_seq, to_seq FROM lake.export_log "
                    "WHERE stream = 'events' ORDER BY export_id")
    assert [r[0] for r in log] == list(range(1, len(log) + 1))
    assert all(prev[2] < nxt[1] for prev, nxt in itertools.pairwise(log))
    assert lake_rows(svc.data_dir, "SELECT count(*), count(DISTINCT event_id) FROM lake.events") == [total[:1] * 2]
