"""The data folder's layout: every file and folder tollgate keeps under it, named once.

    operational.duckdb   the writer's operational file (outbox, gate book, idempotency)
    journal/             the writer's journal segments, ahead of the operational file
    index/               the writer's event index and idempotency records (RocksDB,
                         `warehouse.event_index`)
    journal-quarantine/  segments kept aside by `tollgate journal accept-loss`, and its log
    keys.json            service keys (mode 0600), never in the lake
    nonces/              the nonces of signed requests accepted within the skew window,
                         so a restarted service refuses their replay (`api.auth.NonceLog`)
    catalog/             the applied catalog and its history, written by the CLI
    lake/                DuckLake: its SQLite catalog and Parquet files; `spill/` for flows,
                         `rating.lock` serialising rating runs
    reports/             usage reports as Parquet, written by publish-usage-reports;
                         `charts/` its usage charts, one PNG per account and month
    .serve.lock          held by the one `tollgate serve` of this folder
    writer.sock          the writer's Unix socket, where each HTTP worker connects
    metrics/             `writer.prom` and `scheduler.prom`: those processes' Prometheus
                         metrics, rewritten as they change, served by the HTTP process
    prefect-api.json     the address of the folder's local Prefect API (`flows.prefect_api`);
                         `prefect-api.log` its output, `.prefect-api.lock` held while one starts

The folder is its user's alone: mode 0700, and every tollgate process that writes in it runs
with the umask 077 (`keep_private`), so what it creates there is 0600 (folders 0700).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PRIVATE_UMASK", "DataFolder", "keep_private", "unix_socket_call"]

PRIVATE_UMASK = 0o077


def keep_private() -> None:
    """What this process creates from now on is its user's alone: files 0600, folders 0700.
    Called first by every tollgate process that writes in a data folder (the command, the
    writer, the flows' processes), so DuckDB, SQLite and Parquet files get these modes too."""
    os.umask(PRIVATE_UMASK)


@dataclass(frozen=True, slots=True)
class DataFolder:
    root: Path

    def create(self) -> None:
        """Create the folder (and its parents) mode 0700, or make an existing one 0700."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.chmod(self.root, 0o700)
        except PermissionError:
            pass  # a folder of another user: the caller's writability check says so

    @property
    def operational(self) -> Path:
        return self.root / "operational.duckdb"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def index(self) -> Path:
        return self.root / "index"

    @property
    def journal_quarantine(self) -> Path:
        return self.root / "journal-quarantine"

    @property
    def keys(self) -> Path:
        return self.root / "keys.json"

    @property
    def writer_socket(self) -> Path:
        return self.root / "writer.sock"

    @property
    def nonces(self) -> Path:
        return self.root / "nonces"

    @property
    def catalog(self) -> Path:
        return self.root / "catalog"

    @property
    def lake(self) -> Path:
        return self.root / "lake"

    @property
    def lake_spill(self) -> Path:
        """Where flows spill and keep work in progress: next to the lake, on the same disk."""
        return self.lake / "spill"

    @property
    def rating_lock(self) -> Path:
        return self.lake / "rating.lock"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def report_charts(self) -> Path:
        """`<realm>/<account>/<YYYY-MM>.png`: the usage charts of the latest publication."""
        return self.reports / "charts"

    @property
    def serve_lock(self) -> Path:
        return self.root / ".serve.lock"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def prefect_api(self) -> Path:
        return self.root / "prefect-api.json"

    @property
    def prefect_api_log(self) -> Path:
        return self.root / "prefect-api.log"

    @property
    def prefect_api_lock(self) -> Path:
        return self.root / ".prefect-api.lock"


def unix_socket_call(path: Path, call: object) -> None:
    """`call(address)` (a socket's bind or connect) with an address for the Unix socket at
    `path`: the path itself, or, past what a socket address holds (108 bytes), the same file
    reached through this process's handle on its folder."""
    name = str(path)
    if len(name.encode()) < 100:
        call(name)  # type: ignore[operator]
        return
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        call(f"/proc/self/fd/{folder}/{path.name}")  # type: ignore[operator]
    finally:
        os.close(folder)
