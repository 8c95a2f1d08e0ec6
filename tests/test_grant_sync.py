"""A grant the writer fails to record is recorded on a later tick, not at the next catalog."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pytest

import writer.gate.book
from core.clock import ManualClock
from core.layout import DataFolder
from tests.conftest import FIXTURES
from warehouse.catalog_store import CatalogStore
from warehouse.operational import open_operational
from writer.gate.book import GateBook
from writer.host import CatalogView, sync_catalog

MORE = """
[[realms.acme.accounts.acct_gate_funds.grants]]
id = "gate-funds-top-up"
amount_xusd = "5000"
effective_at = "2026-01-02T00:00:00Z"
"""


def test_a_grant_whose_write_failed_is_written_on_the_next_tick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    folder = DataFolder(tmp_path)
    store = CatalogStore(folder.catalog)
    text = (FIXTURES / "catalog.toml").read_text(encoding="utf-8")
    store.apply(text, "first")
    catalog = CatalogView(folder)
    clock = ManualClock(datetime(2026, 11, 20, tzinfo=timezone.utc))
    gate = GateBook(lambda: catalog.current, clock)
    conn = open_operational(folder.operational)
    gate.rebuild(conn)
    now = clock.now()
    assert gate.balance("acme", "acct_gate_funds", now) == 10000

    store.apply(text + MORE, "second")
    real = writer.gate.book.record_grants
    calls = []

    def fail_once(c: duckdb.DuckDBPyConnection, rows: list) -> None:
        calls.append(rows)
        if len(calls) == 1:
            raise duckdb.IOException("disk full")
        real(c, rows)

    monkeypatch.setattr(writer.gate.book, "record_grants", fail_once)
    with caplog.at_level(logging.ERROR):
        sync_catalog(catalog, gate, conn)  # the write fails
        assert gate.balance("acme", "acct_gate_funds", now) == 10000
        assert gate.grants_pending
        sync_catalog(catalog, gate, conn)  # the next tick: no new catalog, the grant lands
    assert gate.balance("acme", "acct_gate_funds", now) == 15000
    assert not gate.grants_pending
    assert conn.execute("SELECT amount_xusd FROM grants WHERE grant_id = 'gate-funds-top-up'"
                        ).fetchall() == [(5000,)]
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    sync_catalog(catalog, gate, conn)  # nothing pending: nothing written again
    assert len(calls) == 2
    conn.close()
