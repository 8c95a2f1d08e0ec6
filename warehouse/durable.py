"""Durability of renames: a file replaced by `os.replace` keeps its new name across a power
loss only once its folder is synced too."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["sync_dir"]


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
