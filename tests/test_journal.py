"""The write-ahead journal in front of the operational file: durable before DuckDB, applied
once, a torn tail cut off."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import msgspec

from warehouse.journal import Journal, JournaledStore
from warehouse.operational import open_operational

AT = datetime(2026, 11, 1, 10, 0, tzinfo=timezone.utc)


def _row(n: int) -> tuple:
    return (f"lease-{n}", "cancelled", AT, None)


def _transitions(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT lease_id FROM lease_transitions ORDER BY lease_id").fetchall()]


def _journal_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.journal"))


def test_groups_are_durable_before_the_file_and_applied_once_after_a_crash(tmp_path: Path) -> None:
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.commit({"lease_transitions": [_row(1)]})
    store.materialize()
    store.commit({"lease_transitions": [_row(2), _row(3)]})
    store.commit({"lease_transitions": [_row(4)]})
    assert _transitions(conn) == ["lease-1"]          # durable in the journal only
    assert _journal_bytes(tmp_path / "journal") > 0
    conn.close()                                      # a crash: nothing more reaches the file

    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    assert store.recover() == 2
    assert _transitions(conn) == ["lease-1", "lease-2", "lease-3", "lease-4"]
    assert _journal_bytes(tmp_path / "journal") == 0
    store.commit({"lease_transitions": [_row(5)]})
    assert store.seq == 4
    store.close()
    assert _transitions(conn) == ["lease-1", "lease-2", "lease-3", "lease-4", "lease-5"]
    assert list((tmp_path / "journal").glob("*.journal")) == []
    conn.close()


def test_the_applier_thread_applies_while_groups_keep_coming(tmp_path: Path) -> None:
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    for n in range(1, 401):
        store.commit({"lease_transitions": [_row(n)]})
        if n % 50 == 0:
            store.materialize_soon()                  # hands over, or leaves it for later
    conn.close()                                      # a crash with a batch maybe in flight
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.recover()
    assert _transitions(conn) == sorted(f"lease-{n}" for n in range(1, 401))
    store.close()
    conn.close()


def test_a_group_already_in_the_file_is_not_applied_again(tmp_path: Path) -> None:
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.commit({"lease_transitions": [_row(1)]})
    # The file committed the group, the process died before it deleted the segment.
    [segment] = (tmp_path / "journal").glob("*.journal")
    journal_copy = segment.read_bytes()
    store.materialize()
    segment.write_bytes(journal_copy)
    conn.close()
    conn = open_operational(tmp_path / "op.duckdb")
    assert JournaledStore(conn, tmp_path / "journal").recover() == 0
    assert _transitions(conn) == ["lease-1"]
    conn.close()


def test_a_torn_or_corrupt_tail_is_cut_and_what_precedes_it_kept(tmp_path: Path) -> None:
    path = tmp_path / "op.journal"
    journal = Journal(path)
    journal.append(1, {"t": [(1, "a")]})
    journal.append(2, {"t": [(2, "b")]})
    whole = path.read_bytes()
    journal.close()
    path.write_bytes(whole[:-3])                      # the second record never finished
    journal = Journal(path)
    assert [seq for seq, _ in journal.groups()] == [1]
    assert path.stat().st_size < len(whole) - 3       # cut back to the end of the first
    journal.close()
    flipped = bytearray(whole)
    flipped[-1] ^= 0xFF                               # a record whose checksum fails
    path.write_bytes(bytes(flipped))
    journal = Journal(path)
    assert [(seq, tables) for seq, tables in journal.groups()] == [(1, {"t": [(1, "a")]})]
    journal.close()


def test_a_group_that_could_not_be_journaled_leaves_no_trace(tmp_path: Path) -> None:
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.commit({"lease_transitions": [_row(1)]})
    size = store.journal.size
    try:
        store.commit({"lease_transitions": [(object(),)]})  # cannot be encoded
    except TypeError:
        pass
    else:
        raise AssertionError("an unencodable row was accepted")
    assert store.journal.size == size and store.seq == 1
    store.close()
    assert _transitions(conn) == ["lease-1"]
    conn.close()


def test_a_row_the_file_would_refuse_fails_its_group_before_it_is_durable(tmp_path: Path) -> None:
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    try:
        store.commit({"lease_transitions": [_row(1)], "grants": [("acme", "a", "g", 2 ** 63, AT, AT)]})
    except ValueError:
        pass
    else:
        raise AssertionError("a row beyond BIGINT was journaled")
    assert store.seq == 0 and store.journal.size == 0
    store.commit({"lease_transitions": [_row(2)]})
    store.close()
    assert _transitions(conn) == ["lease-2"]
    conn.close()


def test_best_effort_rows_the_file_refuses_never_hold_up_journaled_ones(tmp_path: Path) -> None:
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.commit({"lease_transitions": [_row(1)]})
    store.defer("inline_ratings", [(1, "r1")])          # wrong shape for the table: refused
    store.defer("inline_ratings", [(2, 2 ** 64)])       # beyond BIGINT: dropped at once
    store.materialize()
    store.commit({"lease_transitions": [_row(2)]})
    store.materialize_soon()
    store.close()
    assert _transitions(conn) == ["lease-1", "lease-2"]
    assert conn.execute("SELECT count(*) FROM inline_ratings").fetchone() == (0,)
    assert list((tmp_path / "journal").glob("*.journal")) == []
    conn.close()


def test_a_prefilled_journal_takes_groups_in_place_and_reads_back_to_its_zeros(tmp_path: Path) -> None:
    path = tmp_path / "op.journal"
    journal = Journal(path, prefill=1 << 16)
    assert journal.prefilled and journal.size == 0 and path.stat().st_size == 1 << 16
    journal.append(1, {"t": [(1, "a")]})
    journal.append(2, {"t": [(2, "b")]})
    used = journal.size
    assert 0 < used < 1 << 16 and path.stat().st_size == 1 << 16   # written in place, not grown
    journal.close()
    journal = Journal(path)
    assert [seq for seq, _ in journal.groups()] == [1, 2]
    assert journal.size == used and path.stat().st_size == 1 << 16  # zeros are no torn tail
    journal.close()
    data = bytearray(path.read_bytes())
    data[used - 1] ^= 0xFF                                   # the second record is corrupt
    data[used + 10] = 7                                      # and garbage follows it
    path.write_bytes(bytes(data))
    journal = Journal(path)
    assert [seq for seq, _ in journal.groups()] == [1]
    assert path.stat().st_size < used                        # cut back to the end of the first
    journal.close()


def test_a_prefilled_journal_grows_past_its_zeros_when_a_group_does_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "op.journal"
    journal = Journal(path, prefill=64)
    journal.append(1, {"t": [(n, "x" * 20) for n in range(10)]})
    assert journal.size > 64 and path.stat().st_size == journal.size
    journal.close()
    assert [seq for seq, _ in Journal(path).groups()] == [1]


def _wait_for_spare(store: JournaledStore) -> None:
    store._spare_thread.join(timeout=30)                      # prepared in the background
    assert store._spare is not None


def test_the_store_moves_to_prefilled_segments_and_deletes_those_it_filled(tmp_path: Path) -> None:
    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.SEGMENT_BYTES = 4096
    store.commit({"lease_transitions": [_row(1)]})
    assert not store.journal.prefilled                        # no spare yet at start
    _wait_for_spare(store)
    store.materialize()                                       # hands over, and moves on
    assert store.journal.prefilled and store.journal.size == 0
    assert [p.name for p in (tmp_path / "journal").glob("*.journal")] == [store.journal.path.name]
    n = 1
    while store.journal.size < store.SEGMENT_BYTES:           # fill the prefilled segment
        n += 1
        store.commit({"lease_transitions": [_row(n)]})
    full = store.journal.path
    _wait_for_spare(store)
    store.materialize()
    assert store.journal.path != full and not full.exists()   # applied, so deleted
    for m in range(n + 1, n + 4):
        store.commit({"lease_transitions": [_row(m)]})
    assert store.journal.path.stat().st_size == 4096           # in place
    conn.close()                                               # a crash

    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    assert store.recover() == 3
    assert _transitions(conn) == sorted(f"lease-{k}" for k in range(1, n + 4))
    store.close()
    assert list((tmp_path / "journal").iterdir()) == []
    conn.close()


def test_a_reply_the_wire_cannot_carry_answers_its_own_request_with_a_500() -> None:
    # msgpack holds no integer beyond 64 bits: encoding such an outcome used to end the
    # writer loop, and every later request of the service got 503.
    from warehouse.writer import _LEN, _reply_frame

    fine = _reply_frame((1, True, {"amount": 2 ** 63 - 1}))
    assert msgspec.msgpack.decode(fine[_LEN.size:]) == [1, True, {"amount": 2 ** 63 - 1}]
    frame = _reply_frame((2, True, {"amount": 2 ** 70}))
    rid, ok, failure = msgspec.msgpack.decode(frame[_LEN.size:])
    assert (rid, ok, failure["status"], failure["code"]) == (2, False, 500, "INTERNAL.ERROR")


def test_the_tick_hands_rows_over_once_the_oldest_has_waited_or_many_wait(tmp_path: Path) -> None:
    """A few young rows wait for more (one larger transaction costs DuckDB less an event);
    the oldest's age or their number hands them over."""
    import time

    conn = open_operational(tmp_path / "op.duckdb")
    store = JournaledStore(conn, tmp_path / "journal")
    store.APPLY_AFTER_SECONDS = 0.5
    store.commit({"lease_transitions": [_row(1)]})
    store.materialize_due()
    assert store.pending_rows == 1  # young: kept
    time.sleep(0.6)
    store.commit({"lease_transitions": [_row(2)]})  # a younger row does not reset the age
    store.materialize_due()
    assert store.pending_rows == 0  # handed over
    store.materialize()  # waits for the applier thread
    store.MAX_PENDING_ROWS = 2
    store.commit({"lease_transitions": [_row(3), _row(4)]})
    store.materialize_due()
    assert store.pending_rows == 0  # many: handed over at once, however young
    store.close()
    assert _transitions(conn) == ["lease-1", "lease-2", "lease-3", "lease-4"]
    conn.close()
