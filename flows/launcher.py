"""The flow schedules of a running service: a child process, `python -m flows.scheduler`.

`tollgate serve` starts it next to the writer so that the first command of the README gives
the whole system (sweeps every minute, aggregate days, reports, compaction). It starts
without waiting and imports nothing heavy before its first run, one interval later, so the
HTTP service starts as fast as without it. It runs in a session of its own so that `stop`
ends it together with the local Prefect API it may have started (`flows.prefect_api`), and
it ends itself when the service dies. A scheduler that dies while the service runs is logged and started
again. TOLLGATE_SCHEDULES=off turns it off; `on` (the default) runs it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from core.settings import Settings
from flows.prefect_api import server_environment
from flows.process_memory import environment

__all__ = ["FlowScheduler"]

log = logging.getLogger("tollgate.runtime")

# A scheduler that died is started again after this long (seconds).
_RESTART_PAUSE = 5.0


class FlowScheduler:
    def __init__(self, proc: subprocess.Popen[bytes] | None,
                 settings: Settings | None = None) -> None:
        self._proc = proc
        self._settings = settings
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        if proc is not None:
            threading.Thread(target=self._watch, name="flow-scheduler-watch", daemon=True).start()

    @classmethod
    def start(cls, settings: Settings) -> FlowScheduler:
        if not settings.schedules_on:
            log.info("TOLLGATE_SCHEDULES=%s: the flow schedules are off", settings.schedules)
            return cls(None)
        if not settings.schedules_value_known:
            log.error("TOLLGATE_SCHEDULES=%r is neither on nor off; running the schedules",
                      settings.schedules)
        return cls(cls._spawn(settings), settings)

    @staticmethod
    def _spawn(settings: Settings) -> subprocess.Popen[bytes]:
        # glibc's tunables for a flow's process apply from its first allocation there.
        return subprocess.Popen(
            [sys.executable, "-m", "flows.scheduler", "--data-dir", str(settings.data_dir),
             "--parent-pid", str(os.getpid()), "--stop-on-eof"],
            start_new_session=True, env=server_environment(environment(os.environ)),
            stdin=subprocess.PIPE,
        )

    def _watch(self) -> None:
        """Start the scheduler again when it dies while the service runs."""
        while True:
            with self._lock:
                proc = self._proc
            if proc is None:
                return
            code = proc.wait()
            if self._stopping.wait(_RESTART_PAUSE):
                return
            with self._lock:
                if self._stopping.is_set() or self._settings is None:
                    return
                log.error("the flow scheduler ended (exit code %s); starting it again", code)
                try:
                    # Whatever it left in its session (its Prefect API) goes too.
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._proc = self._spawn(self._settings)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            # The scheduler alone: it ends its flow run through its Prefect API, which
            # ends after it. Signalled with it, the server went first and the flow engine
            # retried its API calls past `timeout`.
            proc.send_signal(signal.SIGTERM)
            # Then the end of its input: the scheduler interrupts the query under way, which
            # would hold the signal until it ends (the signal first, so the run is taken
            # for stopped, not failed).
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the flow scheduler did not stop in %.0f s; killing it", timeout)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in its session
        except ProcessLookupError:
            pass
        proc.wait()
