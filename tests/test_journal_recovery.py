"""Recovery never skips an acknowledged group silently (docs/architecture.md, Recovery): bad
bytes followed by a valid record, or a jump in group numbers, stop the start and change
nothing; a torn tail is cut; `tollgate journal accept-loss` accepts a loss explicitly and keeps
the evidence."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from warehouse.journal import Journal, JournalCorrupt, JournaledStore
from warehouse.journal_scan import ACCEPTED_LOG, QUARANTINE, accept_loss, scan_journal
from warehouse.operational import open_operational

AT = datetime(2026, 11, 1, 10, 0, tzinfo=timezone.utc)


def _row(n: int) -> tuple:
    return (f"lease-{n}", "cancelled", AT, None)


def _transitions(conn) -> list[str]:
    rows = conn.execute("SELECT lease_id FROM lease_transitions ORDER BY lease_id").fetchall()
    return [r[0] for r in rows]


def _segment(directory: Path, number: int, groups: list[int], *, prefill: int = 0) -> Path:
    """A segment as the writer leaves it: the groups' records (each one row), then zeros."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{number:012d}.journal"
    journal = Journal(path, prefill=prefill)
    for seq in groups:
        journal.append(seq, {"lease_transitions": [_row(seq)]})
    journal.close()
    return path


def _offset_of(path: Path, seq: int) -> int:
    [record] = [r for r in scan_journal(path.parent, 0, [path]).segments[0].records if r.seq == seq]
    return record.offset


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _refused(tmp_path: Path) -> JournalCorrupt:
    conn = open_operational(tmp_path / "op.duckdb")
    try:
        with pytest.raises(JournalCorrupt) as caught:
            JournaledStore(conn, tmp_path / "journal")
    finally:
        conn.close()
    return caught.value


def test_a_flip_inside_a_segment_refuses_the_start_and_keeps_the_segment(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    first = _segment(journal, 1, [1, 2, 3], prefill=1 << 16)
    _segment(journal, 2, [4, 5], prefill=1 << 16)
    at = _offset_of(first, 2)
    _flip(first, at + 20)                             # inside group 2's payload
    before = _snapshot(journal)

    message = str(_refused(tmp_path))
    assert "000000000001.journal" in message and f"offset {at}" in message, message
    assert "group 2 is missing" in message, message
    assert "tollgate journal accept-loss --through 2" in message, message
    assert "\n" not in message
    assert _snapshot(journal) == before               # nothing cut, deleted or created
    conn = open_operational(tmp_path / "op.duckdb")
    assert _transitions(conn) == []                   # nothing applied
    conn.close()

    # The operator accepts the loss of group 2: the rest is applied, the evidence kept.
    scan = scan_journal(journal, 0)
    assert [p.missing for p in accept_loss(scan, through=2)] == [(2, 2)]
    [kept] = (tmp_path / QUARANTINE).glob("*-000000000001.journal")
    assert kept.read_bytes() == before["000000000001.journal"]
    [entry] = [json.loads(line) for line in (tmp_path / QUARANTINE / ACCEPTED_LOG).read_text().splitlines()]
    assert entry["segment"] == "000000000001.journal" and entry["lost_groups"] == [[2, 2]]
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, journal)
    assert store.recover() == 5                       # 1, an empty 2, 3, 4, 5
    assert _transitions(conn) == ["lease-1", "lease-3", "lease-4", "lease-5"]
    store.close()
    conn.close()


def test_a_flip_in_a_record_length_is_found_by_the_records_after_it(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    first = _segment(journal, 1, [1, 2, 3])
    _flip(first, _offset_of(first, 2) + 1)            # group 2's length: its end is unknown
    assert "group 2 is missing" in str(_refused(tmp_path))


def test_a_bad_tail_with_valid_groups_in_a_later_segment_is_refused(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    first = _segment(journal, 1, [1, 2, 3], prefill=1 << 16)
    _segment(journal, 2, [4, 5])
    _flip(first, _offset_of(first, 3) + 12)           # the last record of a full segment
    before = _snapshot(journal)
    message = str(_refused(tmp_path))
    assert "group 3 is missing" in message and "in segment 000000000002.journal" in message, message
    assert _snapshot(journal) == before


def test_a_skipped_group_number_refuses_the_start(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    _segment(journal, 1, [1, 2, 4, 5])
    before = _snapshot(journal)
    message = str(_refused(tmp_path))
    assert "group 4 follows group 2; group 3 is missing" in message, message
    assert _snapshot(journal) == before
    # Groups must also follow on from the last one the file holds.
    conn = open_operational(tmp_path / "op.duckdb")
    conn.execute("INSERT INTO journal_state VALUES (0)")
    conn.close()
    (journal / "000000000001.journal").unlink()
    _segment(journal, 2, [3, 4])                      # groups 1-2 never reached the file
    assert "group 1-2 are missing" in str(_refused(tmp_path))


def test_a_torn_tail_is_cut_and_every_group_before_it_applied(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    _segment(journal, 1, [1, 2, 3], prefill=1 << 16)
    second = _segment(journal, 2, [4, 5], prefill=1 << 16)
    at = _offset_of(second, 5)
    data = bytearray(second.read_bytes())
    data[at + 30:] = bytes(len(data) - at - 30)       # group 5's write never finished
    second.write_bytes(bytes(data))

    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, journal)
    assert store.recover() == 4
    assert _transitions(conn) == ["lease-1", "lease-2", "lease-3", "lease-4"]
    store.commit({"lease_transitions": [_row(6)]})    # the next group takes number 5
    assert store.seq == 5
    store.close()
    conn.close()
    assert not (tmp_path / QUARANTINE).exists()


def test_journal_check_reports_without_changing_anything(tmp_path: Path) -> None:
    from cli.main import main

    journal = tmp_path / "journal"
    first = _segment(journal, 1, [1, 2, 3])
    _flip(first, _offset_of(first, 2) + 20)
    before = _snapshot(journal)
    assert main(["journal", "check", "--data-dir", str(tmp_path)]) == 1
    assert _snapshot(journal) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal"]


def test_the_writer_process_exits_with_the_message_and_code_3(tmp_path: Path) -> None:
    import socket

    from core.constants import WRITER_JOURNAL_REFUSED

    first = _segment(tmp_path / "journal", 1, [1, 2, 3])
    _flip(first, _offset_of(first, 2) + 20)
    before = first.read_bytes()
    ours, theirs = socket.socketpair()
    r = subprocess.run([sys.executable, "-m", "writer.host", "--fd", str(theirs.fileno()),
                        "--data-dir", str(tmp_path)], pass_fds=[theirs.fileno()],
                       capture_output=True, text=True, timeout=120)
    theirs.close()
    assert r.returncode == WRITER_JOURNAL_REFUSED, r.stderr
    assert "group 2 is missing" in r.stderr and "accept-loss --through 2" in r.stderr, r.stderr
    assert ours.recv(4) == b""                        # never said it was ready
    ours.close()
    assert first.read_bytes() == before
    assert [p.name for p in (tmp_path / "journal").iterdir()] == [first.name]


# ---- the service ----------------------------------------------------------------------------

@pytest.mark.server
@pytest.mark.lake
def test_serve_refuses_a_flipped_journal_and_starts_after_accept_loss(tmp_path: Path) -> None:
    from tests.conftest import make_service, tollgate

    svc = make_service(tmp_path)
    # Five acknowledged groups, the process gone before any reached the file.
    conn = open_operational(tmp_path / "operational.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    for n in range(1, 6):
        store.commit({"lease_transitions": [_row(n)]})
    segment = store.journal.path
    conn.close()
    for leftover in (tmp_path / "journal").glob("spare.tmp"):
        leftover.unlink()                              # as a restart does
    _flip(segment, _offset_of(segment, 2) + 20)
    before = segment.read_bytes()

    r = subprocess.run([sys.executable, "-m", "cli", "serve", "--port", str(svc.port),
                        "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("tollgate: the journal in ") and "Traceback" not in r.stderr, r.stderr
    assert "group 2 is missing" in r.stderr and "tollgate journal accept-loss --through 2" in r.stderr, r.stderr
    assert segment.read_bytes() == before

    check = tollgate("journal", "check", data_dir=tmp_path, check=False)
    assert check.returncode == 1 and "group 2 is missing" in check.stdout, check.stdout
    accepted = tollgate("journal", "accept-loss", "--through", "2", data_dir=tmp_path)
    assert "recovery applies groups 1-5" in accepted.stdout, accepted.stdout
    assert list((tmp_path / QUARANTINE).glob("*-" + segment.name))[0].read_bytes() == before

    svc.start()
    try:
        assert httpx.get(f"{svc.base_url}/healthz", timeout=5).status_code == 200
        event = {"semantic_kind": "activity", "event_type": "journal.after",
                 "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": "after-accept"}
        assert svc.post("/mgt/v1/events", event, account="acct_events").status_code == 201
    finally:
        svc.stop()
    import duckdb

    time.sleep(0.1)
    conn = duckdb.connect(str(tmp_path / "operational.duckdb"), read_only=True)
    assert _transitions(conn) == ["lease-1", "lease-3", "lease-4", "lease-5"]
    conn.close()
