"""The one clock of tollgate: UTC, timezone-aware, injected.

Every part that reads the time takes a `Clock` (its constructor's or its function's
`clock` argument, `SYSTEM_CLOCK` by default), so a test moves time with a `ManualClock`
instead of sleeping:

>>> from datetime import datetime, timezone
>>> clock = ManualClock(datetime(2026, 11, 1, tzinfo=timezone.utc))
>>> clock.advance(90)
>>> clock.now().isoformat()
'2026-11-01T00:01:30+00:00'
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    def now(self) -> datetime:
        """The current instant, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The machine's clock."""

    def now(self) -> datetime:
        return datetime.now(timezone.utc)


class ManualClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("a clock's instant needs an offset")
        self._now = start.astimezone(timezone.utc)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)

    def set(self, moment: datetime) -> None:
        self._now = moment.astimezone(timezone.utc)


SYSTEM_CLOCK: Clock = SystemClock()
