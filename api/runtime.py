"""The running service's parts, assembled once: settings, the operational file and its
writer, the applied catalog, the service keys and the authenticator.

The catalog and the keys are files written by the CLI; the runtime polls them and swaps in a
new version within `reload_interval_seconds`, so `tollgate catalog apply` and
`tollgate keys disable` take effect on a running server without a restart.

The runtime supervises the writer process. When it ends unexpectedly, every op in flight has
already failed with 503 (`WriterClient.connection_lost`), requests meanwhile get 503 at once,
and a new writer is started: it applies the journal as at any start, so nothing acknowledged
is lost. Restarts are bounded (`MAX_WRITER_RESTARTS` within `RESTART_WINDOW_SECONDS`, the
later ones after a growing pause); past the bound, or when the writer refuses its journal
(which no restart can fix), the runtime records why in `fatal` and calls `on_fatal`, and
`tollgate serve` exits 1 so that its own supervisor acts.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from api.auth import AuthContext, Authenticator, NonceLog
from api.errors import AppError, BadRequest, ServiceUnavailable, Unprocessable
from api.events.decoders import Decoders
from api.gate.limits import RateLimiter
from core.clock import SYSTEM_CLOCK, Clock
from core.constants import WRITER_JOURNAL_REFUSED
from core.settings import Settings
from pipelines.catalog import Catalog, CatalogInvalid, Realm, load_catalog
from warehouse.catalog_store import CatalogStore
from warehouse.keys import ServiceKeyStore
from warehouse.usage_query import LakeReader
from warehouse.writer import RemoteFailure, WriterClient
from writer.ops import BULK_OPS, RESULT_TYPES

__all__ = ["BUSY_RETRY_AFTER_SECONDS", "MAX_WRITER_RESTARTS", "RESTART_WINDOW_SECONDS", "RETRY_AFTER_SECONDS", "Runtime",
           "WriterRefused"]

log = logging.getLogger("tollgate.runtime")
# A 503 STORAGE.UNAVAILABLE tells the client to retry after this many seconds: about the time
# a writer takes to restart.
RETRY_AFTER_SECONDS = 2
# At most this many writer restarts within the window; one more and the service exits 1.
MAX_WRITER_RESTARTS = 5
RESTART_WINDOW_SECONDS = 600.0
# The pause before the n-th restart of the window: none for the first, then 1, 2, 4, 8 s.
MAX_RESTART_PAUSE_SECONDS = 30.0


# A 503 STORAGE.BUSY (the ingest queue is full) tells the client to retry after this many
# seconds: the queue's bound is kept to about a second of the writer's work.
BUSY_RETRY_AFTER_SECONDS = 1


class IngestAdmission:
    """One event request's place in the ingest queue (`Runtime.ingest_admission`)."""

    __slots__ = ("runtime", "held")

    def __init__(self, runtime: Runtime, held: int) -> None:
        self.runtime = runtime
        self.held = held

    def read(self, size: int) -> None:
        """The body was read: hold its real size (a chunked body declared none)."""
        if size > self.held:
            self.runtime.ingest_bytes += size - self.held
            self.held = size

    def __enter__(self) -> IngestAdmission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.runtime.ingest_bytes -= self.held
        self.runtime.ingest_requests -= 1


class WriterRefused(RuntimeError):
    """The writer refused to start for a reason a restart cannot fix (its journal)."""


def restart_pause(n: int) -> float:
    """The pause before the n-th restart within the window.

    >>> [restart_pause(n) for n in range(1, 7)]
    [0.0, 1.0, 2.0, 4.0, 8.0, 16.0]
    """
    return 0.0 if n <= 1 else min(MAX_RESTART_PAUSE_SECONDS, 2.0 ** (n - 2))


class Runtime:
    def __init__(self, settings: Settings, clock: Clock = SYSTEM_CLOCK) -> None:
        self.settings = settings
        self.clock = clock
        self.catalog = Catalog.empty()
        self.auth = Authenticator(settings.signature_skew_seconds, clock,
                                  max_nonce_chars=settings.max_nonce_chars,
                                  max_idempotency_key_chars=settings.max_idempotency_key_chars)
        self.key_store = ServiceKeyStore(settings.keys_path)
        self.catalog_store = CatalogStore(settings.catalog_dir)
        self._key_sig: Any = None
        self._catalog_sig: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.rate_limiter = RateLimiter()
        # Idempotency scopes whose first request is still being answered (409 IN_PROGRESS).
        self.idempotency_in_flight: set[tuple[str, str, str, str]] = set()
        self.ready = False
        # `running`, `restarting` (after the writer ended, until a new one is ready) or `down`.
        self.writer_state = "down"
        # Why the service must stop (set once), and what stops it (`tollgate serve` sets it).
        self.fatal: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.writer_restarts = 0
        self._stopping = False
        # Told each writer reply's lane and time (the HTTP process's metrics set it).
        self.on_writer_reply: Callable[[str, float], None] | None = None
        # The ingest queue of this process: event requests admitted and not yet answered, and
        # their body bytes (bounded by `ingest_queue_bytes`); batches are prepared by `decoders`.
        self.ingest_bytes = 0
        self.ingest_requests = 0
        self.ingest_refused = 0
        self.decoders = Decoders(settings.decode_processes)
        # The lake, read by POST /reports/usage: attached on first use.
        self.lake_reader = LakeReader(settings.data_dir)

    # ---- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.refresh()
        ours, theirs = socket.socketpair()
        self.settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Before the first request: the nonces an earlier process accepted are refused still.
        self.auth.keep_nonces(NonceLog(self.settings.folder.nonces, self.settings.signature_skew_seconds))
        await self._start_writer()
        await self.decoders.start()
        self._tasks.append(asyncio.create_task(self._poll_files()))
        self._tasks.append(asyncio.create_task(self._supervise()))
        # What is loaded by now lives as long as the process: out of the collector's full
        # scans, which otherwise walk every module and catalog object now and then.
        gc.collect()
        gc.freeze()
        self.ready = True

    async def _start_writer(self) -> None:
        """Start a writer process and wait until it has opened the file (and applied the
        journal); raises `WriterRefused` or RuntimeError when it does not."""
        ours, theirs = socket.socketpair()
        self._writer_proc = subprocess.Popen(
            [sys.executable, "-m", "writer.host", "--fd", str(theirs.fileno()),
             "--data-dir", str(self.settings.data_dir)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        try:
            hello = await asyncio.to_thread(_read_hello, ours, self._writer_proc)
        except BaseException:
            ours.close()
            raise
        self.schema_version = int(hello["schema_version"])
        writer = WriterClient(ours, RESULT_TYPES, deadline_seconds=self.settings.writer_deadline_seconds,
                              bulk=BULK_OPS, on_reply=self.on_writer_reply)
        await writer.start()
        self.writer = writer
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
                self._fail(_REFUSED)
                return
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
                    self._fail(_REFUSED)
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
        try:
            return await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return await asyncio.to_thread(proc.wait)

    def _fail(self, message: str) -> None:
        self.fatal = message
        self.writer_state = "down"
        log.critical("%s", message)
        if self.on_fatal is not None:
            self.on_fatal()

    async def stop(self) -> None:
        self._stopping = True
        self.ready = False
        self.lake_reader.close()
        for task in self._tasks:
            task.cancel()
        self.decoders.stop()
        if hasattr(self, "writer"):
            await self.writer.close()
        if self.auth.nonce_log is not None:
            self.auth.nonce_log.close()
        if hasattr(self, "_writer_proc"):
            try:
                await asyncio.to_thread(self._writer_proc.wait, 30)
            except subprocess.TimeoutExpired:
                self._writer_proc.kill()

    async def write(self, op: Any) -> Any:
        """Send one op to the writer process; its failure arrives as the matching AppError."""
        try:
            return await self.writer.submit(op)
        except RemoteFailure as exc:
            error = AppError.from_wire(exc.payload)
            if error.status == 503:
                error.headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
            raise error from None

    def ingest_admission(self, size: int) -> IngestAdmission:
        """Admit an event request of `size` body bytes (as declared; 0 when not) to the ingest
        queue, or refuse it with 503 STORAGE.BUSY and Retry-After when the queue's bytes would
        pass `ingest_queue_bytes`. A request alone in the queue is always admitted (one body
        larger than the bound would otherwise never be). Use it in a `with` block: the place
        is held until the request is answered. Gate calls never queue here."""
        bound = self.settings.ingest_queue_bytes
        if self.ingest_requests and self.ingest_bytes + size > bound:
            self.ingest_refused += 1
            raise ServiceUnavailable(
                "STORAGE.BUSY",
                f"event ingestion is at its bound ({bound} bytes of requests waiting for storage);"
                f" nothing of this request was read or stored: retry after {BUSY_RETRY_AFTER_SECONDS} s",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_SECONDS)})
        self.ingest_bytes += size
        self.ingest_requests += 1
        return IngestAdmission(self, size)

    # ---- catalog and keys -------------------------------------------------------------
    def refresh(self) -> None:
        sig = self.key_store.signature()
        if sig != self._key_sig:
            try:
                self.auth.keys = self.key_store.load()
                self._key_sig = sig
            except Exception:
                log.exception("could not read the service keys; keeping the previous ones")
        sig = self.catalog_store.signature()
        if sig != self._catalog_sig:
            text = self.catalog_store.read()
            if text is not None:
                try:
                    self.catalog = load_catalog(text)
                    log.info("catalog %s loaded", self.catalog.fingerprint)
                except CatalogInvalid as exc:
                    log.error("applied catalog is invalid, keeping the previous one: %s", exc)
            self._catalog_sig = sig

    async def _poll_files(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reload_interval_seconds)
            try:
                self.refresh()
            except Exception:
                log.exception("refresh failed")
            nonce_log = self.auth.nonce_log
            if nonce_log is not None:
                try:
                    await asyncio.to_thread(nonce_log.sync, self.clock.now().timestamp())
                except Exception:
                    log.exception("nonce log sync failed")

    # ---- request context --------------------------------------------------------------
    def realm(self, ctx: AuthContext) -> Realm:
        realm = self.catalog.realms.get(ctx.realm)
        if realm is None:
            raise Unprocessable("RESOURCE.NOT_FOUND", f"realm {ctx.realm!r} has no catalog")
        return realm

    def account_of_event_call(self, ctx: AuthContext) -> tuple[Realm, str]:
        if not ctx.billing_account_id:
            raise BadRequest("VALIDATION.MISSING_CONTEXT",
                             "the X-Billing-Account-Id header is required for event calls")
        realm = self.realm(ctx)
        if ctx.billing_account_id not in realm.accounts:
            raise Unprocessable("RESOURCE.NOT_FOUND",
                                f"unknown billing account {ctx.billing_account_id!r}")
        return realm, ctx.billing_account_id


_REFUSED = ("the writer process refused to start: its journal may have lost acknowledged groups"
            " (its message above says which, and what to run)")


def _read_hello(sock: socket.socket, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Wait for the writer process to open the file and say it is ready."""
    sock.settimeout(120)
    try:
        head = sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            try:
                code = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            if code == WRITER_JOURNAL_REFUSED:
                raise WriterRefused(_REFUSED)
            raise RuntimeError("the writer process could not open the data folder (its error is above;"
                               " is another `tollgate serve` using this data folder?)")
        body = sock.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
    finally:
        sock.settimeout(None)
    return msgspec.msgpack.decode(body)  # type: ignore[no-any-return]
