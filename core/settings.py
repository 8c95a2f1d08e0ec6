"""The one configuration of the service and the CLI: flags, then environment, then defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ConfigError", "Settings", "parse_port"]


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and says what it must be."""


def parse_port(text: str | int, name: str = "the port") -> int:
    """A TCP port, 1-65535 (0 would bind a random port, larger ones wrap around)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name} must be a port number from 1 to 65535, not {str(text)!r}")
    return port


def _positive_int(name: str, default: int) -> int:
    text = os.environ.get(name) or str(default)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name} must be a positive whole number, not {text!r}")
    return value


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
        folder = Path(data_dir or env.get("TOLLGATE_DATA_DIR") or "var").resolve()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"the data folder {folder} is not a folder")
        return Settings(
            data_dir=folder,
            host=host or env.get("TOLLGATE_HOST") or "127.0.0.1",
            port=parse_port(port) if port is not None else
            parse_port(env.get("TOLLGATE_PORT") or 8040, "TOLLGATE_PORT"),
            signature_skew_seconds=_positive_int("TOLLGATE_SIGNATURE_SKEW_SECONDS", 300),
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
