"""Where the applied catalog lives: the current document, and every applied version.

`apply` writes the new document next to the current one and renames it into place, so the
switch is atomic and a reader sees the old catalog or the new one, never a mix. Each applied
document is also kept under `history/` with its time and fingerprint.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from core.clock import SYSTEM_CLOCK, Clock
from warehouse.durable import sync_dir

__all__ = ["CatalogStore"]


class CatalogStore:
    def __init__(self, folder: Path, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.folder = folder
        self.current = folder / "current.toml"

    def signature(self) -> tuple[int, int] | None:
        try:
            st = self.current.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_ino)

    def read(self) -> str | None:
        try:
            return self.current.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """An exclusive lock on a file beside the catalog, held by one apply from its check
        against the history to its switch, so two applies at once run one after the other."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / ".apply.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def apply(self, text: str, fingerprint: str) -> Path:
        history = self.folder / "history"
        history.mkdir(parents=True, exist_ok=True)
        stamp = self.clock.now().strftime("%Y%m%dT%H%M%S%fZ")
        kept = history / f"{stamp}-{fingerprint}.toml"
        kept.write_text(text, encoding="utf-8")
        tmp = self.folder / f".current.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.current)
        sync_dir(self.folder)  # the rename itself survives a power loss
        return kept
