"""A child process ends with the process that started it.

Every process `tollgate serve` starts (the HTTP workers, the writer, the scheduler and its
Prefect API, the HTTP workers' decoding processes) asks Linux for a signal when its parent
dies (`PR_SET_PDEATHSIG`), so a killed service takes them along and never leaves the
operational file locked (docs/operations.md). The signal covers a parent that dies from the
request on; one that died while the child was starting has handed it to another parent
already, which `end_with_parent` tells by comparing the parent's pid.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["end_with_parent"]

_PR_SET_PDEATHSIG = 1


def end_with_parent(signal_number: int, parent_pid: int | None = None) -> bool:
    """Ask for `signal_number` when the parent dies; False if `parent_pid` (when given) is no
    longer the parent, i.e. it died before the request. Not Linux: nothing is asked, and the
    service stops its children itself."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal_number))
    except OSError:
        pass
    return parent_pid is None or os.getppid() == parent_pid
