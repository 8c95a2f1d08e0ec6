"""The flow schedules of a running service: a child process, `python -m flows.scheduler`.

`tollgate serve` starts it next to the writer so that the first command of the README gives
the whole system (sweeps every minute, aggregate days, reports, compaction). It starts
without waiting and imports nothing heavy before its first run, one interval later, so the
HTTP service starts as fast as without it. It runs in a session of its own so that `stop`
ends it together with the temporary Prefect server it may have started, and it ends itself
when the service dies. TOLLGATE_SCHEDULES=off turns it off.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from api.config import Settings

__all__ = ["FlowScheduler"]

log = logging.getLogger("tollgate.runtime")


class FlowScheduler:
    def __init__(self, proc: subprocess.Popen[bytes] | None) -> None:
        self._proc = proc

    @classmethod
    def start(cls, settings: Settings) -> FlowScheduler:
        if os.environ.get("TOLLGATE_SCHEDULES", "on").lower() in ("off", "0", "false", "no"):
            return cls(None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.scheduler", "--data-dir", str(settings.data_dir),
             "--parent-pid", str(os.getpid())],
            start_new_session=True,
        )
        return cls(proc)

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the flow scheduler did not stop in %.0f s; killing it", timeout)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
