"""The lake's compaction and its exporter take turns (`warehouse.lake.compaction_turn`).

Under steady ingestion the exporter commits to the lake every second or two. The merge of
the compaction reads a snapshot, writes, and commits; any commit in between made its commit
fail ("database is locked"), and every retry wrote the merged files again."""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from warehouse.compaction import compact_lake
from warehouse.lake import compaction_turn, connect_lake, export_turn, with_lake_retry

pytestmark = pytest.mark.lake


def _export_steadily(data_dir: str, seconds: float, rounds: Any, skipped: Any) -> None:
    """An exporter's shape: a small lake commit every 0.2 s, in its turn."""
    conn = connect_lake(Path(data_dir))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with export_turn(Path(data_dir)) as turn:
            if turn:
                with_lake_retry(lambda: conn.execute(
                    "INSERT INTO lake.t SELECT range, 'y' FROM range(1000)"))
                rounds.value += 1
            else:
                skipped.value += 1
        time.sleep(0.2)
    conn.close()


def _parquet_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*.parquet"))


def test_the_merge_commits_once_while_the_exporter_commits_beside_it(tmp_path: Path) -> None:
    conn = connect_lake(tmp_path)
    conn.execute("CREATE TABLE lake.t (i BIGINT, s VARCHAR)")
    for k in range(150):  # 150 small files to merge
        conn.execute("INSERT INTO lake.t SELECT range + ?, repeat('x', 200) FROM range(20000)",
                     [k * 20000])
    before = _parquet_bytes(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    rounds, skipped = ctx.Value("i", 0), ctx.Value("i", 0)
    exporter = ctx.Process(target=_export_steadily, args=(str(tmp_path), 8.0, rounds, skipped))
    exporter.start()
    try:
        deadline = time.monotonic() + 30
        while rounds.value < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rounds.value >= 3  # the exporter commits steadily by now
        with compaction_turn(tmp_path):
            report = compact_lake(conn, retention=timedelta(days=7))
        assert report.merged_files >= 100
        # The merged files were written once: without the turns every failed try wrote them
        # again (each try about the table's size).
        assert _parquet_bytes(tmp_path) < 2.5 * before
        exported = rounds.value
    finally:
        exporter.join(60)
    assert exporter.exitcode == 0
    assert skipped.value >= 1  # it waited while the compaction held the lake
    assert rounds.value > exported  # and went on after it
    total = conn.execute("SELECT count(*) FROM lake.t").fetchone()
    assert total == (150 * 20000 + rounds.value * 1000,)
    conn.close()


def test_a_step_whose_ducklake_commit_failed_runs_again_and_any_other_error_at_once() -> None:
    """A maintenance step's failed DuckLake commit (its retry of a flush once built SQL with
    an empty table name) kept nothing: `_call` runs the step again in a new transaction. An
    error of another kind is the caller's at the first try."""
    import duckdb

    from warehouse.compaction import _call

    conn = duckdb.connect()
    calls = {"flaky": 0, "broken": 0}

    def flaky() -> int:
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise RuntimeError('Failed to commit: Failed to commit DuckLake transaction.\n'
                               'Failed to flush changes into DuckLake: syntax error at or near "<="')
        return 7

    def broken() -> int:
        calls["broken"] += 1
        raise RuntimeError("Failed to read the Parquet file: no such file")

    conn.create_function("flaky", flaky, [], "INTEGER", side_effects=True)
    conn.create_function("broken", broken, [], "INTEGER", side_effects=True)
    assert _call(conn, "SELECT flaky()") == [(7,)]
    assert calls["flaky"] == 3
    with pytest.raises(duckdb.Error, match="no such file"):
        _call(conn, "SELECT broken()")
    assert calls["broken"] == 1
