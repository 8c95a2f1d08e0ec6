"""The running HTTP worker's parts, assembled once: settings, its connection to the writer,
the applied catalog, the service keys, the authenticator and the state shared with the
other workers.

The catalog and the keys are files written by the CLI; the runtime polls them and swaps in a
new version within `reload_interval_seconds`, so `tollgate catalog apply` and
`tollgate keys disable` take effect on every worker of a running server without a restart.

The writer process is started and supervised by the service's parent process
(`api.supervisor`); a worker connects to it on the data folder's `writer.sock`. When the
writer ends, every op in flight has already failed with 503 (`WriterClient.connection_lost`),
requests meanwhile get 503 at once, and the worker connects again: the connection waits on
the socket until the new writer, which applies the journal as at any start, accepts it and
says it is ready.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable
from typing import Any

import msgspec

from api.auth import AuthContext, Authenticator, NonceLog
from api.errors import AppError, BadRequest, ServiceUnavailable, Unprocessable
from api.events.decoders import Decoders
from api.shared import LocalState, SharedState, StateBook
from core.clock import SYSTEM_CLOCK, Clock
from core.layout import unix_socket_call
from core.settings import Settings
from pipelines.catalog import Catalog, CatalogInvalid, Realm, load_catalog
from warehouse.catalog_store import CatalogStore
from warehouse.keys import ServiceKeyStore
from warehouse.usage_query import LakeReader
from warehouse.writer import RemoteFailure, WriterClient
from writer.ops import BULK_OPS, RESULT_TYPES

__all__ = ["BUSY_RETRY_AFTER_SECONDS", "RETRY_AFTER_SECONDS", "Runtime", "read_hello"]

log = logging.getLogger("tollgate.runtime")
# A 503 STORAGE.UNAVAILABLE tells the client to retry after this many seconds: about the time
# a writer takes to restart.
RETRY_AFTER_SECONDS = 2
# How long a worker waits, each try, for the writer to accept its connection and say it is
# ready (the writer may be applying its journal after a restart); it then tries again.
CONNECT_WAIT_SECONDS = 5.0


# A 503 STORAGE.BUSY (the ingest queue is full) tells the client to retry after this many
# seconds: the queue's bound is kept to about a second of the writer's work.
BUSY_RETRY_AFTER_SECONDS = 1
# And while the lake export's backlog is at its bound (`warehouse.writer.LoopStatus`): the
# export takes seconds to bring it down to where ingestion is taken again.
BACKLOG_RETRY_AFTER_SECONDS = 2


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
            self.runtime.ingest_changed()

    def __enter__(self) -> IngestAdmission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.runtime.ingest_bytes -= self.held
        self.runtime.ingest_requests -= 1
        self.runtime.ingest_changed()


class Runtime:
    def __init__(self, settings: Settings, clock: Clock = SYSTEM_CLOCK, *,
                 shared: SharedState | None = None) -> None:
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
        # Nonces, rate windows and Idempotency-Keys in flight: this worker's own when it is the
        # only one (made at start), else the parent's (`api.shared`).
        self._shared = shared
        self.ready = False
        # `running`, `restarting` (after the writer ended, until a new one is ready) or `down`.
        self.writer_state = "down"
        self.writer_restarts = 0
        self._stopping = False
        # Told each writer reply's lane and time (the HTTP process's metrics set it).
        self.on_writer_reply: Callable[[str, float], None] | None = None
        # The ingest queue of this process: event requests admitted and not yet answered, and
        # their body bytes (bounded by `ingest_queue_bytes`); batches are prepared by `decoders`.
        self.ingest_bytes = 0
        self.ingest_requests = 0
        self.ingest_refused = 0
        # Told of each refusal (the workers' shared metrics count them; `api.metrics`).
        self.on_ingest_refused: Callable[[], None] | None = None
        self.on_ingest_bytes: Callable[[int], None] | None = None
        self.decoders = Decoders(settings.decode_processes)
        # The lake, read by POST /reports/usage: attached on first use.
        self.lake_reader = LakeReader(settings.data_dir)

    @property
    def shared(self) -> SharedState:
        if self._shared is None:
            self._shared = LocalState(StateBook(
                self.settings.signature_skew_seconds,
                NonceLog(self.settings.folder.nonces, self.settings.signature_skew_seconds)))
        return self._shared

    # ---- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.refresh()
        _ = self.shared  # the nonces of an earlier process are loaded before the first request
        await self._connect_writer(wait=120.0)
        await self.decoders.start()
        self._tasks.append(asyncio.create_task(self._poll_files()))
        self._tasks.append(asyncio.create_task(self._reconnect()))
        # What is loaded by now lives as long as the process: out of the collector's full
        # scans, which otherwise walk every module and catalog object now and then.
        gc.collect()
        gc.freeze()
        self.ready = True

    async def _connect_writer(self, wait: float = CONNECT_WAIT_SECONDS) -> None:
        """Connect to the writer and wait until it says it is ready; raises OSError or
        RuntimeError when it does not within `wait` seconds."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix_socket_call(self.settings.folder.writer_socket, sock.connect)
            hello = await asyncio.to_thread(read_hello, sock, wait)
        except BaseException:
            sock.close()
            raise
        self.schema_version = int(hello["schema_version"])
        writer = WriterClient(sock, RESULT_TYPES, deadline_seconds=self.settings.writer_deadline_seconds,
                              bulk=BULK_OPS, on_reply=self.on_writer_reply)
        await writer.start()
        self.writer = writer
        self.writer_state = "running"

    async def _reconnect(self) -> None:
        """Connect again whenever the writer goes away (the parent starts a new one)."""
        while True:
            assert self.writer.lost is not None
            await asyncio.shield(self.writer.lost)
            if self._stopping:
                return
            self.writer_state = "restarting"
            while not self._stopping:
                try:
                    await self._connect_writer()
                except (OSError, RuntimeError) as exc:
                    log.info("the writer is not ready yet (%s); trying again", exc)
                    await asyncio.sleep(0.2)
                    continue
                self.writer_restarts += 1
                log.info("connected to the new writer process")
                break

    async def stop(self) -> None:
        self._stopping = True
        self.ready = False
        self.lake_reader.close()
        for task in self._tasks:
            task.cancel()
        await self.decoders.stop()
        if hasattr(self, "writer"):
            await self.writer.close()
        if self._shared is not None:
            self._shared.close()

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
        pass `ingest_queue_bytes`, or while the writer says the lake export's backlog is at
        its bound. A request alone in the queue is always admitted (one body
        larger than the bound would otherwise never be). Use it in a `with` block: the place
        is held until the request is answered. Gate calls never queue here."""
        busy = self.writer.ingest_busy
        if busy:
            # The writer's word (a status frame): the lake export's backlog is at its bound.
            self._refuse_ingest(f"event ingestion waits for the lake export ({busy})",
                                BACKLOG_RETRY_AFTER_SECONDS)
        bound = self.settings.ingest_queue_bytes
        if self.ingest_requests and self.ingest_bytes + size > bound:
            self._refuse_ingest(f"event ingestion is at its bound ({bound} bytes of requests"
                                " waiting for storage)", BUSY_RETRY_AFTER_SECONDS)
        self.ingest_bytes += size
        self.ingest_requests += 1
        self.ingest_changed()
        return IngestAdmission(self, size)

    async def pace_ingest(self) -> None:
        """Wait the writer's pace before an admitted event request is read: while the lake
        export falls behind, the writer slows event ingestion instead of refusing it
        (`warehouse.writer.LoopStatus.pace_ms`; 0 almost always). The wait holds the
        request's place in the ingest queue and nothing else: gate calls go on."""
        pace = self.writer.ingest_pace
        if pace > 0:
            await asyncio.sleep(pace)

    def _refuse_ingest(self, why: str, retry_after: int) -> None:
        """Count an event request refused before it was read, and raise its 503 STORAGE.BUSY."""
        self.ingest_refused += 1
        if self.on_ingest_refused is not None:
            self.on_ingest_refused()
        raise ServiceUnavailable(
            "STORAGE.BUSY",
            f"{why}; nothing of this request was read or stored: retry after {retry_after} s",
            headers={"Retry-After": str(retry_after)})

    def ingest_changed(self) -> None:
        if self.on_ingest_bytes is not None:
            self.on_ingest_bytes(self.ingest_bytes)

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
            try:
                await self.shared.tick()
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


def read_hello(sock: socket.socket, wait: float) -> dict[str, Any]:
    """Wait for the writer process to say it is ready (it has opened the file and applied
    its journal); RuntimeError when it ends first, TimeoutError past `wait` seconds."""
    sock.settimeout(wait)
    try:
        head = sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            raise RuntimeError("the writer process ended before it was ready")
        body = sock.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
    finally:
        sock.settimeout(None)
    return msgspec.msgpack.decode(body)  # type: ignore[no-any-return]
