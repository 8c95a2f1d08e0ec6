"""The write-ahead journal in front of the operational file: durable before DuckDB, applied
once, a torn tail cut off."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

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
