"""The one clock of the service: UTC, timezone-aware."""

from __future__ import annotations

from datetime import datetime, timezone

__all__ = ["utcnow"]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)
