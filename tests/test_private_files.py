"""The data folder is its user's alone: the folder 0700, what tollgate creates in it 0600."""

from __future__ import annotations

import os
import stat
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import make_service

pytestmark = pytest.mark.server


def _modes(root: Path, skip: set[Path]) -> dict[str, int]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path not in skip and not path.is_symlink():
                found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


def test_the_data_folder_is_0700_and_its_files_0600_after_a_start(tmp_path: Path) -> None:
    svc = make_service(tmp_path / "var")  # the commands create the folder
    assert stat.S_IMODE(svc.data_dir.stat().st_mode) == 0o700
    os.chmod(svc.data_dir, 0o755)  # serve makes an existing folder private again
    svc.start()
    try:
        body = {"semantic_kind": "activity", "event_type": "modes.check",
                "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": str(uuid.uuid4())}
        assert svc.post("/mgt/v1/events", body, account="acct_events").status_code == 201
        time.sleep(2)  # the applier's and the exporter's rounds
        assert stat.S_IMODE(svc.data_dir.stat().st_mode) == 0o700
        modes = _modes(svc.data_dir, {svc.log_path})  # the log is this test's own file
        for name in ("operational.duckdb", "keys.json", "catalog/current.toml", "lake/catalog.sqlite"):
            assert name in modes, sorted(modes)
        assert any(name.startswith("journal/") for name in modes)
        assert any(name.startswith("nonces/") for name in modes)
        loose = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
        assert loose == {}
    finally:
        svc.stop()
