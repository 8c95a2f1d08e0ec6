"""The parent process of `tollgate serve`: it starts and watches the others, and stops them.

    tollgate serve (this process)
      ├── writer        python -m writer.host      the operational file, one for the service
      ├── worker 1..N   python -m api.worker       HTTP on the one listening socket
      └── scheduler     python -m flows.scheduler  the flows' schedules (flows/launcher.py)

`cli/serve.py` checks the data folder, takes its lock, binds the port, then hands over here.
The parent binds the writer's Unix socket (`writer.sock` in the data folder) once, starts the
writer with it and waits until it is ready, then starts N HTTP workers. Each worker inherits
the listening TCP socket (the kernel hands each new connection to one worker) and connects
to the writer on `writer.sock`. With N > 1 the parent also decides, for every worker, what
must be decided once (`api.shared`: nonces, rate windows, Idempotency-Keys in flight), over a
socket pair per worker.

Supervision:
- A worker that ends is started again (at once, then after a growing pause); at most
  `MAX_RESTARTS` restarts of workers within `RESTART_WINDOW_SECONDS`, then the service exits 1
  (so a worker that cannot start stops the service after about 15 s of tries).
- A writer that ends is started again the same way (it applies the journal, so nothing
  acknowledged is lost); the workers connect to the new one on their own. Past the bound, or
  when the writer refuses its journal (no restart can fix that), the service exits 1 so that
  its own supervisor acts.
- Every child ends with this process (PR_SET_PDEATHSIG), so a killed service never leaves
  the operational file locked.

Graceful stop, on SIGTERM or SIGINT (docs/operations.md): the workers stop accepting and
answer the requests they hold (at most half of `stop_seconds`), the scheduler stops at the
same time (its run is interrupted and left to the next start), then the writer's end is
closed: it commits what it holds, applies its journal to the file, ends the lake export round
under way and exits. The service exits 0 within `stop_seconds` (a writer still running then
is killed: its journal keeps what it acknowledged, and the next start applies it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.auth import NonceLog
from api.metrics import http_metrics_folder, worker_ended
from api.runtime import read_hello
from api.shared import StateBook, serve_state
from core.constants import WRITER_JOURNAL_REFUSED, WRITER_REOPEN
from core.layout import unix_socket_call
from core.settings import Settings

__all__ = ["MAX_RESTARTS", "MAX_WRITER_RESTARTS", "RESTART_WINDOW_SECONDS", "Supervisor",
           "WriterRefused", "restart_pause"]

log = logging.getLogger("tollgate.serve")
# At most this many restarts (of the writer; of the workers, counted together) within the
# window; one more and the service exits 1.
MAX_WRITER_RESTARTS = 5
MAX_RESTARTS = MAX_WRITER_RESTARTS
RESTART_WINDOW_SECONDS = 600.0
# The pause before the n-th restart of the window: none for the first, then 1, 2, 4, 8 s.
MAX_RESTART_PAUSE_SECONDS = 30.0
# How often the parent looks at its children.
WATCH_SECONDS = 0.1


class WriterRefused(RuntimeError):
    """The writer refused to start for a reason a restart cannot fix (its journal)."""


REFUSED = ("the writer process refused to start: its journal may have lost acknowledged groups"
           " (its message above says which, and what to run)")


def restart_pause(n: int) -> float:
    """The pause before the n-th restart within the window.

    >>> [restart_pause(n) for n in range(1, 7)]
    [0.0, 1.0, 2.0, 4.0, 8.0, 16.0]
    """
    return 0.0 if n <= 1 else min(MAX_RESTART_PAUSE_SECONDS, 2.0 ** (n - 2))


class _Control(asyncio.Protocol):
    """The parent's end of the writer's socket pair: `lost` completes when the writer ends;
    closing it tells the writer to stop."""

    def __init__(self) -> None:
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.BaseTransport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        pass  # the writer sends nothing after its greeting

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.lost.done():
            self.lost.set_result(None)

    async def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    ready_fd: int
    ready: bool = False
    state: Any = None  # the parent's StateServer for it, with N > 1
    started: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, settings: Settings, listen: socket.socket,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.listen = listen
        self.on_stop = on_stop  # stops the flows' scheduler (blocking; run in a thread)
        self.workers: dict[int, _Worker] = {}
        self.writer: Any = None  # the writer's _Control
        self.writer_state = "down"
        self.writer_restarts = 0
        self.worker_restarts = 0
        self.fatal: str | None = None
        self._writer_proc: subprocess.Popen[bytes] | None = None
        self._writer_listen: socket.socket | None = None
        self._stopping = False
        self._stop = asyncio.Event()
        self._worker_restart_times: deque[float] = deque()
        self.book: StateBook | None = None
        self._connections_fd: int | None = None  # the workers' connection counts

    # ---- the whole life ------------------------------------------------------------------
    def run(self) -> int:
        """Run until a signal (exit 0) or a failure no restart fixes (exit 1)."""
        return asyncio.run(self._main())

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled, sig)
        self._bind_writer_socket()
        try:
            await self._start_writer()
        except WriterRefused:
            self.fatal = REFUSED
        except Exception as exc:
            self.fatal = f"the writer process did not start: {exc}"
        if self.fatal is not None:
            log.critical("%s", self.fatal)
            await self._stop_all()
            return 1
        if self.settings.workers > 1:
            self._connections_fd = os.memfd_create("tollgate-connections")
            os.ftruncate(self._connections_fd, 8 * self.settings.workers)
            self.book = StateBook(self.settings.signature_skew_seconds,
                                  NonceLog(self.settings.folder.nonces, self.settings.signature_skew_seconds))
        for index in range(1, self.settings.workers + 1):
            await self._start_worker(index)
        log.info("serving with %d HTTP worker(s)", self.settings.workers)
        watch = asyncio.create_task(self._watch_workers())
        writer = asyncio.create_task(self._supervise())
        syncing = asyncio.create_task(self._sync_book())
        await self._stop.wait()
        for task in (watch, writer, syncing):
            task.cancel()
        await self._stop_all()
        return 0 if self.fatal is None else 1

    def _signalled(self, sig: int) -> None:
        if not self._stopping:
            log.info("%s: stopping (at most %g s)", signal.Signals(sig).name, self.settings.stop_seconds)
        self._stop.set()

    def _fail(self, message: str) -> None:
        if self.fatal is None:
            self.fatal = message
            log.critical("%s", message)
        self.writer_state = "down"
        self._stop.set()

    async def _sync_book(self) -> None:
        """The nonce log, synced every second off the requests' path (`api.auth.NonceLog`)."""
        while True:
            await asyncio.sleep(self.settings.reload_interval_seconds)
            if self.book is not None:
                try:
                    await asyncio.to_thread(self.book.sync)
                except Exception:
                    log.exception("nonce log sync failed")

    # ---- the writer ----------------------------------------------------------------------
    def _bind_writer_socket(self) -> None:
        path = self.settings.folder.writer_socket
        try:
            path.unlink()  # an earlier service's (this one holds the folder's lock)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix_socket_call(path, sock.bind)
        sock.listen(128)
        self._writer_listen = sock

    async def _start_writer(self) -> None:
        """Start a writer process and wait until it has opened the file (and applied the
        journal); raises `WriterRefused` or RuntimeError when it does not."""
        assert self._writer_listen is not None
        ours, theirs = socket.socketpair()
        listen_fd = self._writer_listen.fileno()
        self._writer_proc = subprocess.Popen(
            [sys.executable, "-m", "writer.host", "--fd", str(theirs.fileno()),
             "--listen-fd", str(listen_fd), "--data-dir", str(self.settings.data_dir)],
            pass_fds=[theirs.fileno(), listen_fd], env=_child_environment(),
        )
        theirs.close()
        proc = self._writer_proc
        try:
            await asyncio.to_thread(read_hello, ours, 120.0)
        except BaseException as exc:
            ours.close()
            try:
                code = await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                code = None
            if code == WRITER_JOURNAL_REFUSED:
                raise WriterRefused(REFUSED) from None
            if isinstance(exc, Exception):
                raise RuntimeError("the writer process could not open the data folder (its error is"
                                   " above; is another `tollgate serve` using this data folder?)") from None
            raise
        loop = asyncio.get_running_loop()
        _, control = await loop.create_unix_connection(_Control, sock=ours)
        self.writer = control
        self.writer_state = "running"

    async def _supervise(self) -> None:
        """Restart the writer whenever it ends while the service runs (see the module's doc)."""
        restarts: deque[float] = deque()
        while True:
            assert self.writer.lost is not None
            await asyncio.shield(self.writer.lost)
            if self._stopping:
                return
            self.writer_state = "restarting"
            code = await self._reap_writer()
            if code == WRITER_JOURNAL_REFUSED:
                self._fail(REFUSED)
                return
            if code == WRITER_REOPEN:
                log.warning("the writer process ended to reopen the operational file, which a"
                            " failed write had invalidated; starting a new one")
            else:
                log.error("the writer process ended (exit code %s); starting a new one", code)
            while True:
                now = time.monotonic()
                while restarts and restarts[0] < now - RESTART_WINDOW_SECONDS:
                    restarts.popleft()
                if len(restarts) >= MAX_WRITER_RESTARTS:
                    self._fail(f"the writer process ended or failed to start {len(restarts) + 1} times within"
                               f" {RESTART_WINDOW_SECONDS:g} s; the service stops (exit 1) so that"
                               " its supervisor restarts it")
                    return
                restarts.append(now)
                await asyncio.sleep(restart_pause(len(restarts)))
                if self._stopping:
                    return
                try:
                    await self._start_writer()
                except WriterRefused:
                    self._fail(REFUSED)
                    return
                except Exception as exc:
                    log.error("the new writer process did not start: %s", exc)
                    await self._reap_writer()
                    continue
                break
            self.writer_restarts += 1
            log.warning("a new writer process is ready (restart %d); the journal was applied",
                        self.writer_restarts)

    async def _reap_writer(self) -> int | None:
        """Wait for the writer process that went away to end (killing it if it lingers), so
        that the operational file is free for the next one; its exit code."""
        proc = self._writer_proc
        if proc is None:
            return None
        try:
            return await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return await asyncio.to_thread(proc.wait)

    # ---- the workers ---------------------------------------------------------------------
    async def _start_worker(self, index: int) -> None:
        settings = self.settings
        ready_r, ready_w = os.pipe()
        os.set_blocking(ready_r, False)
        keep = [self.listen.fileno(), ready_w]
        argv = [sys.executable, "-m", "api.worker", "--data-dir", str(settings.data_dir),
                "--host", settings.host, "--port", str(settings.port),
                "--listen-fd", str(self.listen.fileno()), "--ready-fd", str(ready_w),
                "--index", str(index), "--workers", str(settings.workers)]
        ours = theirs = None
        if self.book is not None:
            ours, theirs = socket.socketpair()
            keep.append(theirs.fileno())
            argv += ["--state-fd", str(theirs.fileno())]
        if self._connections_fd is not None:
            keep.append(self._connections_fd)
            argv += ["--connections-fd", str(self._connections_fd)]
        # Started from this (the main) thread: PR_SET_PDEATHSIG follows the thread that
        # started a child, and the worker ends with this process.
        proc = subprocess.Popen(argv, pass_fds=keep, env=_child_environment(
            http_metrics_folder(settings.folder.metrics) if settings.metrics_on else None))
        os.close(ready_w)
        worker = _Worker(index, proc, ready_r)
        if ours is not None and theirs is not None:
            theirs.close()
            worker.state = await serve_state(self.book, ours)  # type: ignore[arg-type]
        self.workers[index] = worker

    async def _watch_workers(self) -> None:
        """Note each worker's readiness; start again the ones that end."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            for index, worker in list(self.workers.items()):
                if not worker.ready:
                    try:
                        worker.ready = bool(os.read(worker.ready_fd, 1))
                    except BlockingIOError:
                        pass
                code = worker.proc.poll()
                if code is None or self._stopping:
                    continue
                if code == 0 and not self._stop.is_set():
                    # A worker stops cleanly only when told to: a Ctrl-C reaches the whole
                    # process group, and this process's own signal may come a moment later.
                    await asyncio.sleep(0.5)
                    if self._stop.is_set():
                        return
                self._forget(worker)
                now = time.monotonic()
                times = self._worker_restart_times
                while times and times[0] < now - RESTART_WINDOW_SECONDS:
                    times.popleft()
                if len(times) >= MAX_RESTARTS:
                    self._fail(f"HTTP workers ended {len(times) + 1} times within {RESTART_WINDOW_SECONDS:g} s;"
                               " the service stops (exit 1) so that its supervisor restarts it")
                    return
                times.append(now)
                log.error("HTTP worker %d ended (exit code %s%s); starting a new one", index, code,
                          "" if worker.ready else ", before it was ready")
                await asyncio.sleep(restart_pause(len(times)))
                if self._stopping:
                    return
                await self._start_worker(index)
                self.worker_restarts += 1

    def _forget(self, worker: _Worker) -> None:
        if self._connections_fd is not None:  # its connections are gone with it
            os.pwrite(self._connections_fd, bytes(8), 8 * (worker.index - 1))
        if self.settings.metrics_on:
            try:
                worker_ended(self.settings.folder.metrics, worker.proc.pid)
            except OSError:
                pass
        try:
            os.close(worker.ready_fd)
        except OSError:
            pass
        if worker.state is not None and worker.state._transport is not None:
            worker.state._transport.close()  # releases what it held in flight

    # ---- the stop ------------------------------------------------------------------------
    async def _stop_all(self) -> None:
        """The graceful stop (the module's doc): workers, then the writer; the scheduler
        beside them."""
        self._stopping = True
        began = time.monotonic()
        budget = self.settings.stop_seconds
        scheduler = asyncio.create_task(asyncio.to_thread(self.on_stop)) if self.on_stop else None
        # New connections are no longer this process's to keep: the workers close their
        # copies of the listening socket as they stop.
        self.listen.close()
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)
        drain_until = began + budget * 0.6
        for worker in self.workers.values():
            left = max(0.1, drain_until - time.monotonic())
            try:
                await asyncio.to_thread(worker.proc.wait, left)
            except subprocess.TimeoutExpired:
                log.error("HTTP worker %d did not stop in time; killing it", worker.index)
                worker.proc.kill()
                await asyncio.to_thread(worker.proc.wait)
            self._forget(worker)
        # Every worker is gone: nothing more reaches the writer. Closing its end of the pair
        # ends its loop after the group under way; it applies its journal and exits.
        if self.writer is not None:
            await self.writer.close()
        proc = self._writer_proc
        if proc is not None:
            left = max(0.1, began + budget - 0.5 - time.monotonic())
            try:
                code = await asyncio.to_thread(proc.wait, left)
                if code not in (0, None) and self.fatal is None:
                    log.error("the writer process exited with code %s while stopping", code)
            except subprocess.TimeoutExpired:
                log.error("the writer did not stop within %g s; killing it (its journal holds what"
                          " it acknowledged: the next start applies it)", budget)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._writer_listen is not None:
            self._writer_listen.close()
            try:
                self.settings.folder.writer_socket.unlink()
            except FileNotFoundError:
                pass
        if self.book is not None:
            self.book.close()
        if scheduler is not None:
            try:
                await asyncio.wait_for(scheduler, max(0.1, began + budget - 0.2 - time.monotonic()))
            except TimeoutError:
                log.error("the flow scheduler did not stop in time")
        log.info("stopped in %.1f s", time.monotonic() - began)


def _child_environment(metrics_dir: Path | None = None) -> dict[str, str]:
    """The environment of a child: this one's, with the workers' shared metrics folder
    (`api.metrics`) for workers only."""
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    return env
