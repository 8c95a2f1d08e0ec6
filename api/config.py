"""The one configuration of the service and the CLI: flags, then environment, then defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8040
    signature_skew_seconds: int = 300
    reload_interval_seconds: float = 1.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_batch_items: int = 1000

    @staticmethod
    def from_env(data_dir: str | None = None, host: str | None = None,
                 port: int | None = None) -> Settings:
        env = os.environ
        return Settings(
            data_dir=Path(data_dir or env.get("TOLLGATE_DATA_DIR") or "var").resolve(),
            host=host or env.get("TOLLGATE_HOST") or "127.0.0.1",
            port=int(port or env.get("TOLLGATE_PORT") or 8040),
            signature_skew_seconds=int(env.get("TOLLGATE_SIGNATURE_SKEW_SECONDS") or 300),
        )

    @property
    def operational_path(self) -> Path:
        return self.data_dir / "operational.duckdb"

    @property
    def keys_path(self) -> Path:
        return self.data_dir / "keys.json"

    @property
    def catalog_dir(self) -> Path:
        return self.data_dir / "catalog"

    @property
    def lake_dir(self) -> Path:
        return self.data_dir / "lake"
