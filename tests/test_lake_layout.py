"""The lake's `ratings` view over `rating_rows`, and the upgrade of a lake from before it."""

from __future__ import annotations

import multiprocessing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pytest

from warehouse.lake import (
    LAKE_TABLES,
    RATINGS_VIEW_VERSION,
    _load_extensions,
    connect_lake,
    lake_paths,
)

pytestmark = pytest.mark.lake

OLD_COLUMNS = LAKE_TABLES["rating_rows"].replace(", line_id BIGINT", "")
EVENT = "5f0c2a8e-8e8e-4c1a-9a57-3d8a5a0e2b11"


def _bare_lake(data_dir: Path) -> duckdb.DuckDBPyConnection:
    """The lake attached as `lake` with none of today's set-up: a lake as an older version
    left it is built on that."""
    catalog, data = lake_paths(data_dir)
    catalog.parent.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    conn = duckdb.connect()
    _load_extensions(conn)
    conn.execute(f"ATTACH 'ducklake:sqlite:{catalog}' AS lake (DATA_PATH '{data}/')")
    return conn


def _old_lake(data_dir: Path) -> None:
    """A lake as written before: `ratings` a table with one described row."""
    conn = _bare_lake(data_dir)
    conn.execute(f"CREATE TABLE lake.ratings ({OLD_COLUMNS})")
    conn.execute("INSERT INTO lake.ratings VALUES ('r-1', 'sweep-x-abc', 'event', ?, ?, 'acme', 'acct_a',"
                 " 'rated', 'llm', 'v1', 'llm.chat', 'tokens.in', 10, 'p', 150, 1000, 2,"
                 " TIMESTAMPTZ '2026-11-01 00:00:00+00', TIMESTAMPTZ '2026-11-02 00:00:00+00', 0)",
                 [EVENT, EVENT])
    conn.close()


def _attach(data_dir: str, start: Any, results: Any) -> None:
    start.wait()
    try:
        conn = connect_lake(Path(data_dir))
        results.put(conn.execute("SELECT count(*) FROM lake.ratings").fetchone()[0])
        conn.close()
    except Exception as exc:  # reported to the test, which fails on it
        results.put(repr(exc))


def test_an_old_lake_is_upgraded_once_even_by_two_processes_at_once(tmp_path: Path) -> None:
    _old_lake(tmp_path)
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=_attach, args=(str(tmp_path), start, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(120)
    assert [results.get(timeout=5) for _ in workers] == [1, 1]
    conn = connect_lake(tmp_path)
    assert conn.execute("SELECT rating_id, source_id, status, line_index, amount_xusd FROM lake.ratings"
                        ).fetchall() == [("r-1", EVENT, "rated", 0, 2)]
    assert conn.execute("SELECT line_id FROM lake.rating_rows").fetchall() == [(None,)]


def test_a_row_with_a_line_id_reads_as_a_described_row(tmp_path: Path) -> None:
    conn = connect_lake(tmp_path)
    conn.execute("INSERT INTO lake.rating_line_kinds (line_id, status, policy_id, policy_version,"
                 " feature_code, meter_code, line_index) VALUES (42, 'rated', 'llm', 'v2', 'llm.chat', 'tokens.out', 1)")
    conn.execute("INSERT INTO lake.rating_rows (run_id, source, event_id, realm, billing_account_id,"
                 " quantity_minor, amount_xusd, line_id) VALUES ('sweep-20261101T000000000000Z-a1b2c3', 'event',"
                 " ?, 'acme', 'acct_a', 7, 3, 42)", [EVENT])
    assert conn.execute(
        "SELECT rating_id, source_id, status, policy_id, policy_version, feature_code, meter_code, line_index,"
        " quantity_minor, amount_xusd FROM lake.ratings").fetchall() == [
        (f"{EVENT}:1:a1b2c3", EVENT, "rated", "llm", "v2", "llm.chat", "tokens.out", 1, 7, 3)]
    # Read-only, under another name, the view binds to its own lake.
    other = duckdb.connect()
    _load_extensions(other)
    catalog, data = lake_paths(tmp_path)
    other.execute(f"ATTACH 'ducklake:sqlite:{catalog}' AS elsewhere (DATA_PATH '{data}/', READ_ONLY)")
    assert other.execute("SELECT status FROM elsewhere.ratings").fetchall() == [("rated",)]


def test_a_view_of_another_version_is_replaced_on_the_next_writable_attach(tmp_path: Path) -> None:
    conn = connect_lake(tmp_path)
    conn.execute("CREATE OR REPLACE VIEW lake.ratings AS SELECT 1 AS stale")
    conn.close()
    conn = connect_lake(tmp_path, read_only=True)               # a reader changes nothing
    assert [c[0] for c in conn.execute("SELECT * FROM lake.ratings").description] == ["stale"]
    conn.close()
    conn = connect_lake(tmp_path)
    assert "rating_id" in [c[0] for c in conn.execute("SELECT * FROM lake.ratings").description]
    assert conn.execute("SELECT comment FROM duckdb_views() WHERE view_name = 'ratings'").fetchone()[0] \
        == RATINGS_VIEW_VERSION


def test_a_lake_made_with_an_absolute_path_attaches_through_a_relative_one(
        tmp_path: Path, monkeypatch: Any) -> None:
    conn = connect_lake(tmp_path / "var")
    conn.execute("INSERT INTO lake.catalog_versions VALUES ('fp', TIMESTAMPTZ '2026-11-01 00:00:00+00', 'test')")
    conn.close()
    monkeypatch.chdir(tmp_path)
    reader = connect_lake(Path("var"), read_only=True)
    assert reader.execute("SELECT fingerprint FROM lake.catalog_versions").fetchall() == [("fp",)]
    reader.close()


def _die_inside_a_catalog_write(catalog: str) -> None:
    import os
    import sqlite3

    db = sqlite3.connect(catalog, isolation_level=None)
    # A lake from before its catalog was kept in WAL mode (the mode a hot journal needs).
    db.execute("PRAGMA journal_mode = DELETE")
    db.execute("PRAGMA cache_size = 1")  # pages reach the file before the commit
    db.execute("BEGIN IMMEDIATE")
    db.execute("CREATE TABLE half_done (x)")
    db.executemany("INSERT INTO half_done VALUES (?)", [("x" * 1000,)] * 2000)
    os._exit(0)  # killed mid-transaction: the rollback journal is left behind, hot


def test_a_read_only_attach_rolls_back_what_a_killed_writer_left_half_done(tmp_path: Path) -> None:
    conn = connect_lake(tmp_path)
    conn.execute("INSERT INTO lake.rating_runs VALUES ('r1', 'sweep', 'completed', now(), now(), '{}', 1, 1)")
    conn.close()
    catalog, _ = lake_paths(tmp_path)
    child = multiprocessing.get_context("spawn").Process(target=_die_inside_a_catalog_write, args=(str(catalog),))
    child.start()
    child.join()
    assert catalog.with_name(catalog.name + "-journal").exists()
    reader = connect_lake(tmp_path, read_only=True)  # failed with "attempt to write a readonly database"
    assert reader.execute("SELECT run_id FROM lake.rating_runs").fetchall() == [("r1",)]
    reader.close()
    with duckdb.connect() as db:
        tables = db.execute(f"SELECT name FROM sqlite_scan('{catalog}', 'sqlite_master')").fetchall()
    assert ("half_done",) not in tables


def test_a_lake_from_before_rating_lines_gets_them_and_priced_kinds(tmp_path: Path) -> None:
    # Line kinds of seven columns and a view of rating_rows alone: the next writable attach
    # adds rating_lines, the kinds' price columns and the view that reads both.
    conn = _bare_lake(tmp_path)
    conn.execute(f"CREATE TABLE lake.rating_rows ({LAKE_TABLES['rating_rows']})")
    conn.execute("CREATE TABLE lake.rating_line_kinds (line_id BIGINT, status VARCHAR,"
                 " policy_id VARCHAR, policy_version VARCHAR, feature_code VARCHAR,"
                 " meter_code VARCHAR, line_index INTEGER)")
    conn.execute("INSERT INTO lake.rating_line_kinds VALUES (42, 'rated', 'llm', 'v2', 'llm.chat', 'tokens.out', 1)")
    conn.close()
    conn = connect_lake(tmp_path)
    assert conn.execute("SELECT price_id, unit_price_xusd, unit_quantity_minor FROM lake.rating_line_kinds"
                        ).fetchall() == [(None, None, None)]
    conn.execute("INSERT INTO lake.rating_line_kinds VALUES (7, 'rated', 'llm', 'v2', 'llm.chat',"
                 " 'tokens.in', 0, 'tokens.in@x', 150, 1000)")
    conn.execute("INSERT INTO lake.rating_runs VALUES ('sweep-20261101T000000000000Z-a1b2c3', 'sweep',"
                 " 'completed', TIMESTAMPTZ '2026-11-02 00:00:00+00', TIMESTAMPTZ '2026-11-02 00:00:01+00',"
                 " '{}', 1, 1)")
    conn.execute("INSERT INTO lake.rating_lines VALUES ('sweep-20261101T000000000000Z-a1b2c3', ?, 'acme',"
                 " 'acct_a', TIMESTAMPTZ '2026-11-01 00:00:00+00', 7, 1000, 150)", [EVENT])
    assert conn.execute(
        "SELECT rating_id, source_id, status, meter_code, price_id, unit_price_xusd, amount_xusd,"
        " rated_at FROM lake.ratings").fetchall() == [
        (f"{EVENT}:0:a1b2c3", EVENT, "rated", "tokens.in", "tokens.in@x", 150, 150,
         datetime(2026, 11, 2, tzinfo=timezone.utc))]
    conn.close()


def _hold_a_read_transaction(catalog: str, held: Any, release: Any) -> None:
    import sqlite3

    db = sqlite3.connect(catalog, isolation_level=None)
    db.execute("BEGIN")
    db.execute("SELECT count(*) FROM ducklake_snapshot").fetchall()
    held.set()
    release.wait(60)
    db.execute("ROLLBACK")


def _commit_a_run(data_dir: str, run_id: str) -> None:
    conn = connect_lake(Path(data_dir))
    conn.execute(f"INSERT INTO lake.rating_runs VALUES ('{run_id}', 'sweep', 'completed', now(),"
                 " now(), '{}', 1, 1)")
    conn.close()


def test_a_commit_goes_through_while_another_process_reads_and_leaves_no_lock(tmp_path: Path) -> None:
    """A reader's open transaction in another process (a sweep, `tollgate sql`) does not fail
    a lake commit; and the lake stays open to every other connection afterwards. In SQLite's
    rollback-journal mode the commit failed with "database is locked" after its busy wait
    and its connection kept the catalog's PENDING lock until the process ended, so that the
    next connection, here or in any process, waited for good."""
    writer = connect_lake(tmp_path)
    catalog, _ = lake_paths(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    reader = ctx.Process(target=_hold_a_read_transaction, args=(str(catalog), held, release))
    reader.start()
    try:
        assert held.wait(30)
        writer.execute("INSERT INTO lake.rating_runs VALUES ('r1', 'sweep', 'completed', now(),"
                       " now(), '{}', 1, 1)")
    finally:
        release.set()
        reader.join(30)
    writer.close()
    other = ctx.Process(target=_commit_a_run, args=(str(tmp_path), "r2"))
    other.start()
    other.join(60)
    assert other.exitcode == 0  # None: it waited for a lock nobody would release
    check = connect_lake(tmp_path, read_only=True)
    assert check.execute("SELECT run_id FROM lake.rating_runs ORDER BY run_id").fetchall() == [
        ("r1",), ("r2",)]
    check.close()
    if other.is_alive():
        other.kill()
