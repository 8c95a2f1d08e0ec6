"""The journaled store and the writer loop when storage fails (warehouse/journal.py,
warehouse/writer.py): the operational file refusing writes (the test hook `fault_file` fails
each apply as a full disk does), a journal that cannot take a group, and a large journal
applied at a start. The service-level test is tests/test_full_disk.py."""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest

from warehouse.journal import JournaledStore, StorageUnavailable, register_table
from warehouse.operational import open_operational
from warehouse.writer import LoopStatus, run_writer

AT = datetime(2026, 11, 1, 10, 0, tzinfo=timezone.utc)
_LEN = struct.Struct(">I")


def _row(n: int) -> tuple[Any, ...]:
    return (f"lease-{n}", "cancelled", AT, None)


def _transitions(conn: duckdb.DuckDBPyConnection) -> int:
    row = conn.execute("SELECT count(*) FROM lease_transitions").fetchone()
    assert row is not None
    return int(row[0])


def test_a_large_journal_is_applied_at_a_start_in_bounded_steps(tmp_path: Path) -> None:
    """Transactions of at most a step's rows, each recorded; the rows read a segment at a time."""
    steps: list[int] = []

    def write_probe(conn: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]]) -> None:
        steps.append(len(rows))  # one call per transaction of the store
        conn.executemany("INSERT INTO step_probe VALUES (?)", rows)

    register_table("step_probe", write_probe)
    conn = open_operational(tmp_path / "op.duckdb")
    conn.execute("CREATE TABLE step_probe (n BIGINT)")
    store = JournaledStore(conn, tmp_path / "journal")
    for n in range(100):
        store.commit({"step_probe": [(3 * n,), (3 * n + 1,), (3 * n + 2,)]})
    conn.close()  # a crash: 300 rows in the journal only

    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.RECOVERY_STEP_ROWS = 30
    assert store._scan is not None  # read and checked, its rows let go until they are applied
    assert all(r.tables is None for segment in store._scan.segments for r in segment.records)
    assert store.recover() == 100
    assert steps == [30] * 10  # ten transactions, none larger than the step
    assert conn.execute("SELECT count(DISTINCT n), max(applied_seq) FROM step_probe, journal_state"
                        ).fetchone() == (300, 100)
    store.close()
    assert list((tmp_path / "journal").glob("*.journal")) == []
    conn.close()


def test_a_file_that_refuses_writes_keeps_the_rows_retries_after_a_pause_and_refuses_past_the_bound(
        tmp_path: Path) -> None:
    fault = tmp_path / "full-disk"
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal", max_backlog_rows=5, fault_file=fault)
    store.commit({"lease_transitions": [_row(1)]})
    store.materialize()
    fault.touch()
    store.commit({"lease_transitions": [_row(2), _row(3)]})
    with pytest.raises(StorageUnavailable) as caught:
        store.materialize()
    wire = caught.value.to_wire()
    assert (wire["status"], wire["code"]) == (503, "STORAGE.UNAVAILABLE")
    assert int(wire["headers"]["Retry-After"]) >= 1
    assert store.failing_since is not None and store.apply_failures == 1
    assert not store.refusing and store.unapplied_rows == 2  # below the bound: still taken
    with pytest.raises(StorageUnavailable):
        store.materialize()  # within the pause: refused at once, not tried
    assert store.apply_failures == 1
    store.commit({"lease_transitions": [_row(4), _row(5), _row(6)]})
    assert store.refusing and store.unapplied_rows == 5
    assert "5 acknowledged rows wait" in str(store.refusal())
    assert _transitions(conn) == 1

    fault.unlink()
    deadline = time.monotonic() + 5
    while not store.retry_due():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    store.materialize()
    assert not store.refusing and store.failing_since is None and store.unapplied_rows == 0
    assert _transitions(conn) == 6
    store.close()
    conn.close()


class Put(msgspec.Struct, tag=True):
    n: int


class Peek(msgspec.Struct, tag=True):
    n: int


class _Put:
    def apply(self, tx: Any, op: Put) -> Any:
        tx.stage("lease_transitions", _row(op.n))
        return lambda: op.n


class _Peek:
    def apply(self, tx: Any, op: Peek) -> Any:
        return lambda: -op.n


def _read_frames(sock: socket.socket, count: int) -> list[Any]:
    sock.settimeout(10)
    found = []
    for _ in range(count):
        (size,) = _LEN.unpack(sock.recv(4, socket.MSG_WAITALL))
        found.append(msgspec.msgpack.decode(sock.recv(size, socket.MSG_WAITALL)))
    return found


def _frame(value: Any) -> bytes:
    body = msgspec.msgpack.encode(value)
    return _LEN.pack(len(body)) + body


def test_a_group_the_journal_refuses_gets_503_and_the_writer_goes_on_when_its_state_cannot_be_rebuilt(
        tmp_path: Path) -> None:
    fault = tmp_path / "full-disk"
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal", max_backlog_rows=1000, fault_file=fault)
    ours, theirs = socket.socketpair()
    decoder = msgspec.msgpack.Decoder(tuple[int, Put | Peek])
    status = LoopStatus()
    ended: list[BaseException | None] = []

    def writer() -> None:
        try:
            run_writer(store, theirs, decoder.decode, {Put: _Put(), Peek: _Peek()},  # type: ignore[dict-item]
                       on_rollback=lambda s: s.reading(), tick_seconds=0.05,
                       read_only=frozenset({Peek}), status=status)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    ours.sendall(_frame((1, Put(1))))
    assert _read_frames(ours, 1) == [[1, True, 1]]

    # The file refuses writes and the journal cannot take the next group (as after a write it
    # could not take back): the group fails, and the state cannot be rebuilt from the file.
    fault.touch()
    store.journal.broken = True
    ours.sendall(_frame((2, Put(2))))
    state, reply = sorted(_read_frames(ours, 2))
    assert state[0] == 0 and state[2]["refusing"] is True
    assert reply[0] == 2 and reply[1] is False
    assert (reply[2]["status"], reply[2]["code"]) == (503, "STORAGE.UNAVAILABLE")
    assert status.stale
    ours.sendall(_frame((3, Peek(3))))  # nothing is decided on a state that may be wrong
    [refused] = _read_frames(ours, 1)
    assert refused[0] == 3 and refused[2]["status"] == 503 and refused[2]["headers"]["Retry-After"]

    fault.unlink()  # space again: a tick applies the journal and rebuilds
    [state] = _read_frames(ours, 1)
    assert state == [0, True, {"refusing": False, "reason": "", "ingest_busy": "",
                              "ingest_pace_ms": 0}]
    ours.sendall(_frame((4, Put(4))) + _frame((5, Peek(5))))
    assert sorted(_read_frames(ours, 2)) == [[4, True, 4], [5, True, -5]]
    assert thread.is_alive() and ended == [] and status.refused_ops == 1
    ours.close()
    thread.join(10)
    assert ended == [None]
    store.close()
    assert _transitions(conn) == 2  # group 2 was never acknowledged
    conn.close()


_NO_ROOM_FOR_THE_JOURNAL = r'''
import json, resource, signal, sys
from datetime import datetime, timezone
from pathlib import Path
from warehouse.journal import JournaledStore
from warehouse.operational import open_operational

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as the writer does: EFBIG, not a kill
folder = Path(sys.argv[1])
conn = open_operational(folder / "op.duckdb")
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # no file grows past 1 MiB
store = JournaledStore(conn, folder / "journal")
store._spare_thread.join()  # its 16 MiB of zeros cannot be written: no spare
at = datetime(2026, 11, 1, tzinfo=timezone.utc)
taken, refused = 0, 0
for n in range(200):
    try:
        store.commit({"lease_transitions": [(f"lease-{n}", "cancelled", at, "x" * 10_000)]})
        taken += 1
    except OSError:
        refused += 1
seq_when_full = store.seq
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
store.commit({"lease_transitions": [("lease-after", "cancelled", at, None)]})
store.close()
stored = conn.execute("SELECT count(*) FROM lease_transitions").fetchone()[0]
print(json.dumps({"spare": store._spare is not None, "taken": taken, "refused": refused,
                  "seq_when_full": seq_when_full, "stored": stored}))
'''


def test_a_journal_that_cannot_grow_refuses_the_group_and_takes_groups_again_once_it_can(
        tmp_path: Path) -> None:
    """A real write failure on the journal: a file size limit makes the kernel refuse to grow
    the segment (EFBIG, as ENOSPC on a full disk), in a process of its own."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NO_ROOM_FOR_THE_JOURNAL, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(done.stdout.strip().splitlines()[-1])
    assert 50 <= result["taken"] < 110 and result["refused"] == 200 - result["taken"]
    assert result["seq_when_full"] == result["taken"]  # a refused group takes no number
    assert result["stored"] == result["taken"] + 1  # nothing acknowledged lost, nothing else
    assert "could not prepare a journal segment" in done.stderr
