"""Progress of a long flow, shown twice: a bar on the terminal (stderr) and a progress
artifact in Prefect, updated at most every half second."""

from __future__ import annotations

import sys
import time
from typing import TextIO, cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

__all__ = ["RunProgress"]

_WIDTH = 30


class RunProgress:
    """Call with (done, total) as work advances; `finish()` at the end."""

    def __init__(self, title: str, *, key: str | None = None, stream: TextIO | None = None) -> None:
        self.title = title
        self.stream = stream or sys.stderr
        self._artifact = cast(UUID | None, create_progress_artifact(0.0, key=key, description=title))
        self._shown = -1.0
        self._last = 0.0
        self._done, self._total = 0, 0

    def __call__(self, done: int, total: int) -> None:
        self._done, self._total = done, total
        percent = 100.0 if total <= 0 else min(100.0, 100.0 * done / total)
        now = time.monotonic()
        if percent < 100.0 and (now - self._last < 0.5 or percent == self._shown):
            return
        self._last, self._shown = now, percent
        filled = int(_WIDTH * percent / 100)
        self.stream.write(f"\r{self.title} [{'#' * filled}{'.' * (_WIDTH - filled)}]"
                          f" {percent:5.1f}% {done}/{total}")
        self.stream.flush()
        if self._artifact is not None:
            update_progress_artifact(self._artifact, percent)

    def finish(self) -> None:
        if self._shown < 100.0:
            self(self._total, self._total)
        self.stream.write("\n")
        self.stream.flush()
