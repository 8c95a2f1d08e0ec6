"""The HTTP process's decoding processes: event batches are decoded, validated and hashed there
(`api.events.prepare`), so that a batch never holds the HTTP loop, and a gate call arriving
meanwhile is answered at once.

Why processes and not threads: the work is Python (validation, canonical JSON), which holds
the GIL; in a thread it would still take the loop's turns, about 5 ms at a time (the GIL's
switch interval). Measured in docs/measurements.md ("The gate next to event ingestion").

The processes run at a lower CPU priority (`core.priority`): when the cores are short, the HTTP loop
and the writer, which answer the gate, go first, and batches take what is left. They are
started with `spawn` (a fork of a process with an event loop and threads is unsafe) and end
with the HTTP process (PR_SET_PDEATHSIG). A batch smaller than `INLINE_BYTES` is prepared on
the loop: the trip to a process costs more than the work. If the pool breaks (a process
killed), a new one is started and the batch is prepared on the loop meanwhile.

Stopping waits (at most `STOP_SECONDS`) for each pool's manager thread to end. On Python 3.11
the interpreter's exit hook wakes every such thread still registered through its pipe, without
the pool's lock; a thread closing that pipe at the same moment makes the exit print an
`OSError` traceback into the service's JSON log. A joined thread is no longer woken.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime

import msgspec

from api.events.prepare import Prepared, prepare_batch, prepare_batch_wire
from core.lifetime import end_with_parent
from core.priority import run_in_background

__all__ = ["INLINE_BYTES", "STOP_SECONDS", "Decoders"]

log = logging.getLogger("tollgate.api")
# A body below this is prepared on the loop (a few events: well under a millisecond).
INLINE_BYTES = 32 * 1024
# How long a stop waits for the pools to end (the service's whole stop is bounded at 10 s).
STOP_SECONDS = 3.0
_decode_prepared = msgspec.msgpack.Decoder(Prepared).decode


def _start_process() -> None:
    """In each decoding process: lower priority, and end with the HTTP process.

    The death signal covers a parent that dies from now on; one that died while this process
    was starting (a service stopped or killed right after its start) has left it to init
    already, and it would wait for batches for good: each process holds the write end of its
    pool's queue, so no end of file ever comes. So it checks, after asking for the signal."""
    run_in_background()
    parent = multiprocessing.parent_process()
    if not end_with_parent(signal.SIGKILL, parent.pid if parent is not None else None):
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the service, which stops these


def _end(pool: ProcessPoolExecutor) -> asyncio.Future[None]:
    """Shut `pool` down in a thread: queued batches are cancelled, its thread is joined."""
    return asyncio.ensure_future(asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True))


def _ready() -> int:
    return os.getpid()


class Decoders:
    """`processes` decoding processes (0: every batch is prepared on the loop)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._ending: list[asyncio.Future[None]] = []  # broken pools' shutdowns, awaited by stop()
        self.restarts = 0

    async def start(self) -> None:
        if self.processes > 0:
            self._pool = self._new_pool()
            loop = asyncio.get_running_loop()
            # Spawn them now (an interpreter start each), not on the first batch.
            await asyncio.gather(*(loop.run_in_executor(self._pool, _ready) for _ in range(self.processes)))

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_process)

    async def prepare(self, body: bytes, realm: str, account: str, now: datetime, skew: int,
                      limit: int) -> Prepared:
        pool = self._pool
        if pool is None or len(body) < INLINE_BYTES:
            return prepare_batch(body, realm, account, now, skew, limit)
        loop = asyncio.get_running_loop()
        try:
            wire = await loop.run_in_executor(pool, prepare_batch_wire, body, realm, account, now, skew, limit)
        except BrokenProcessPool:
            if self._pool is pool:
                log.error("a decoding process ended; starting new ones")
                self.restarts += 1
                self._pool = self._new_pool()
                self._ending.append(_end(pool))
            return prepare_batch(body, realm, account, now, skew, limit)
        return _decode_prepared(wire)

    async def stop(self) -> None:
        """End the processes and wait for the pools' manager threads (see the module's text)."""
        if self._pool is not None:
            self._ending.append(_end(self._pool))
            self._pool = None
        ending, self._ending = self._ending, []
        if ending:
            try:
                await asyncio.wait_for(asyncio.gather(*ending), STOP_SECONDS)
            except TimeoutError:
                log.warning("the decoding processes did not end within %.0f s", STOP_SECONDS)
