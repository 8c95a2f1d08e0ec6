"""The running service's parts, assembled once: settings, the operational file and its
writer, the applied catalog, the service keys and the authenticator.

The catalog and the keys are files written by the CLI; the runtime polls them and swaps in a
new version within `reload_interval_seconds`, so `tollgate catalog apply` and
`tollgate keys disable` take effect on a running server without a restart.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import subprocess
import sys
from typing import Any

import msgspec

from api.auth import AuthContext, Authenticator, NonceLog
from api.errors import AppError, BadRequest, Unprocessable
from api.gate.limits import RateLimiter
from core.clock import SYSTEM_CLOCK, Clock
from core.constants import WRITER_JOURNAL_REFUSED
from core.settings import Settings
from pipelines.catalog import Catalog, CatalogInvalid, Realm, load_catalog
from warehouse.catalog_store import CatalogStore
from warehouse.keys import ServiceKeyStore
from warehouse.usage_query import LakeReader
from warehouse.writer import RemoteFailure, WriterClient
from writer.ops import RESULT_TYPES

__all__ = ["Runtime"]

log = logging.getLogger("tollgate.runtime")


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
        # The lake, read by POST /reports/usage: attached on first use.
        self.lake_reader = LakeReader(settings.data_dir)

    # ---- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.refresh()
        ours, theirs = socket.socketpair()
        self.settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Before the first request: the nonces an earlier process accepted are refused still.
        self.auth.keep_nonces(NonceLog(self.settings.folder.nonces, self.settings.signature_skew_seconds))
        self._writer_proc = subprocess.Popen(
            [sys.executable, "-m", "writer.host", "--fd", str(theirs.fileno()),
             "--data-dir", str(self.settings.data_dir)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        hello = await asyncio.to_thread(_read_hello, ours, self._writer_proc)
        self.schema_version = int(hello["schema_version"])
        self.writer = WriterClient(ours, RESULT_TYPES)
        await self.writer.start()
        self._tasks.append(asyncio.create_task(self._poll_files()))
        # What is loaded by now lives as long as the process: out of the collector's full
        # scans, which otherwise walk every module and catalog object now and then.
        gc.collect()
        gc.freeze()
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        self.lake_reader.close()
        for task in self._tasks:
            task.cancel()
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
            raise AppError.from_wire(exc.payload) from None

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
                raise RuntimeError("the writer process refused to start: its journal may have lost"
                                   " acknowledged groups (its message above says which, and what"
                                   " to run)")
            raise RuntimeError("the writer process could not open the data folder (its error is above;"
                               " is another `tollgate serve` using this data folder?)")
        body = sock.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
    finally:
        sock.settimeout(None)
    return msgspec.msgpack.decode(body)  # type: ignore[no-any-return]
