"""What must be decided in one place whatever HTTP worker a request reaches.

`tollgate serve --workers N` runs N HTTP processes on one port. Four things cannot be decided
by each of them alone: a nonce is accepted once (`AUTH.REPLAYED_NONCE`), a principal's rate
window is one window (`LIMIT.RATE_EXCEEDED`), an Idempotency-Key is in flight once
(`IDEMPOTENCY.IN_PROGRESS`), and the nonces accepted survive a restart (the data folder's
nonce log). `StateBook` holds all four. With one worker it lives in that worker
(`LocalState`: no cost beyond today's); with more it lives in the service's parent process,
which answers each worker over a socket pair of its own (`StateServer`, `RemoteState`).

Wire: frames of a 4-byte big-endian length and a msgpack body; a request `[id, name, args]`,
its reply `[id, value]`. A key's release is answered too, before the worker answers its
request: a client's next try, on any worker, finds the key free. Requests of one turn of a worker's event loop
leave in one write, and the parent answers all it read in one write. Measured in
docs/measurements.md ("Workers"): what this costs a gate call.

The parent forgets the Idempotency-Keys held by a worker whose connection closes (the
worker ended; its requests were never answered).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import struct
import time
from typing import Any, Protocol

import msgspec

from api.auth import NonceLog, _NonceWindow
from api.errors import ServiceUnavailable
from api.gate.limits import RateLimiter, RatePlan

__all__ = ["LocalState", "RemoteState", "SharedState", "StateBook", "StateServer", "serve_state"]

log = logging.getLogger("tollgate.shared")
_LEN = struct.Struct(">I")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
Scope = tuple[str, str, str, str]


class StateBook:
    """The nonces in force (and their log), the rate windows, the Idempotency-Keys in flight."""

    def __init__(self, skew_seconds: int, nonce_log: NonceLog | None = None) -> None:
        self.skew = skew_seconds
        # A nonce must be refused for as long as its ts could still pass the skew check.
        self.nonces = _NonceWindow(2 * skew_seconds + 1)
        self.nonce_log = nonce_log
        if nonce_log is not None:
            # Before the first request: the nonces an earlier process accepted are refused still.
            self.nonces.preload(nonce_log.load(time.time()))
        self.rates = RateLimiter()
        self.in_flight: dict[Scope, object] = {}

    def first_use(self, key_id: str, nonce: str, signed_at: float) -> bool:
        """Record the nonce (and log it); False when it is in force already."""
        if not self.nonces.first_use(key_id, nonce):
            return False
        if self.nonce_log is not None:
            # Refused until its ts fails the skew check: ts + skew, rounded up.
            self.nonce_log.append(key_id, nonce, math.ceil(signed_at) + self.skew + 1)
        return True

    def seen(self, key_id: str, nonce: str) -> bool:
        return self.nonces.seen(key_id, nonce)

    def acquire(self, scope: Scope, owner: object = None) -> bool:
        if scope in self.in_flight:
            return False
        self.in_flight[scope] = owner
        return True

    def release(self, scope: Scope) -> None:
        self.in_flight.pop(scope, None)

    def release_all(self, owner: object) -> int:
        held = [scope for scope, who in self.in_flight.items() if who is owner]
        for scope in held:
            del self.in_flight[scope]
        return len(held)

    def sync(self) -> None:
        """Sync the nonce log (every second, off the request path)."""
        if self.nonce_log is not None:
            self.nonce_log.sync(time.time())

    def close(self) -> None:
        if self.nonce_log is not None:
            self.nonce_log.close()


class SharedState(Protocol):
    """What a worker asks; the answers of `StateBook`."""

    async def first_use(self, key_id: str, nonce: str, signed_at: float) -> bool:
        ...

    async def seen(self, key_id: str, nonce: str) -> bool:
        ...

    async def admit(self, plan: RatePlan, stamp: float) -> tuple[int, int] | None:
        ...

    async def used(self, plan: RatePlan, stamp: float) -> list[int]:
        ...

    async def acquire(self, scope: Scope) -> bool:
        ...

    async def release(self, scope: Scope) -> None:
        ...

    async def tick(self) -> None:
        """Every second: sync what must reach the disk (nothing, unless a state keeps some)."""
        return None

    def close(self) -> None:
        """At the end of the process (nothing to release, unless a state holds something)."""
        return None


class LocalState(SharedState):
    """The book in this process: the one worker of a service, or a test."""

    def __init__(self, book: StateBook) -> None:
        self.book = book

    async def first_use(self, key_id: str, nonce: str, signed_at: float) -> bool:
        return self.book.first_use(key_id, nonce, signed_at)

    async def seen(self, key_id: str, nonce: str) -> bool:
        return self.book.seen(key_id, nonce)

    async def admit(self, plan: RatePlan, stamp: float) -> tuple[int, int] | None:
        return self.book.rates.admit_planned(plan, stamp)

    async def used(self, plan: RatePlan, stamp: float) -> list[int]:
        return self.book.rates.used(plan, stamp)

    async def acquire(self, scope: Scope) -> bool:
        return self.book.acquire(scope)

    async def release(self, scope: Scope) -> None:
        self.book.release(scope)

    async def tick(self) -> None:
        await asyncio.to_thread(self.book.sync)

    def close(self) -> None:
        self.book.close()


def _frames(buf: bytearray) -> list[bytes]:
    out = []
    start = 0
    while len(buf) - start >= 4:
        (size,) = _LEN.unpack_from(buf, start)
        if len(buf) - start - 4 < size:
            break
        out.append(bytes(buf[start + 4:start + 4 + size]))
        start += 4 + size
    del buf[:start]
    return out


def _frame(value: Any) -> bytes:
    body = _encode(value)
    return _LEN.pack(len(body)) + body


def _parent_gone() -> ServiceUnavailable:
    """What a request that needs the shared state gets once the parent is gone: the service is
    stopping (this worker ends with its parent), so 503 `SERVICE.BUSY`, never a 500."""
    return ServiceUnavailable("SERVICE.BUSY", "the service is stopping; retry",
                              headers={"Retry-After": "1"})


class RemoteState(SharedState, asyncio.Protocol):
    """A worker's end: asks the parent. The parent never goes away before its workers (they
    end with it), so a lost connection ends the worker (`lost`)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._next = 1
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._outgoing: list[bytes] = []
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lost: asyncio.Future[None] | None = None

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.lost = loop.create_future()
        await loop.create_unix_connection(lambda: self, sock=self._sock)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        for body in _frames(self._buf):
            rid, value = _decode(body)
            fut = self._waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(value)

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(_parent_gone())
        self._waiting.clear()
        self._transport = None
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def _send(self, message: Any) -> None:
        if not self._outgoing:
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush)
        self._outgoing.append(_frame(message))

    def _flush(self) -> None:
        frames, self._outgoing = self._outgoing, []
        if self._transport is not None:
            self._transport.write(b"".join(frames))

    async def _ask(self, name: str, *args: Any) -> Any:
        if self._transport is None:
            raise _parent_gone()
        rid = self._next
        self._next += 1
        fut: asyncio.Future[Any] = (self._loop or asyncio.get_running_loop()).create_future()
        self._waiting[rid] = fut
        self._send((rid, name, args))
        return await fut

    async def first_use(self, key_id: str, nonce: str, signed_at: float) -> bool:
        return bool(await self._ask("first_use", key_id, nonce, signed_at))

    async def seen(self, key_id: str, nonce: str) -> bool:
        return bool(await self._ask("seen", key_id, nonce))

    async def admit(self, plan: RatePlan, stamp: float) -> tuple[int, int] | None:
        refused = await self._ask("admit", plan, stamp)
        return None if refused is None else (int(refused[0]), int(refused[1]))

    async def used(self, plan: RatePlan, stamp: float) -> list[int]:
        return list(await self._ask("used", plan, stamp))

    async def acquire(self, scope: Scope) -> bool:
        return bool(await self._ask("acquire", scope))

    async def release(self, scope: Scope) -> None:
        await self._ask("release", scope)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class StateServer(asyncio.Protocol):
    """The parent's end of one worker's socket pair."""

    def __init__(self, book: StateBook) -> None:
        self.book = book
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        book = self.book
        replies = []
        for body in _frames(self._buf):
            try:
                rid, name, args = _decode(body)
                if name == "first_use":
                    value: Any = book.first_use(args[0], args[1], args[2])
                elif name == "seen":
                    value = book.seen(args[0], args[1])
                elif name == "admit":
                    value = book.rates.admit_planned(_plan(args[0]), args[1])
                elif name == "used":
                    value = book.rates.used(_plan(args[0]), args[1])
                elif name == "acquire":
                    value = book.acquire(tuple(args[0]), self)
                elif name == "release":
                    book.release(tuple(args[0]))
                    value = None
                else:
                    raise ValueError(f"unknown request {name!r}")
            except Exception:
                log.exception("a worker's request could not be answered")
                if self._transport is not None:
                    self._transport.close()  # the worker fails its requests and ends
                return
            replies.append(_frame((rid, value)))
        if replies and self._transport is not None:
            self._transport.write(b"".join(replies))

    def connection_lost(self, exc: Exception | None) -> None:
        released = self.book.release_all(self)
        if released:
            log.info("released %d Idempotency-Keys held by a worker that ended", released)
        self._transport = None


def _plan(raw: Any) -> RatePlan:
    return tuple((str(r), str(i), str(s), int(p), int(n)) for r, i, s, p, n in raw)


async def serve_state(book: StateBook, sock: socket.socket) -> StateServer:
    """Answer the worker at the other end of `sock` (the parent's end of its pair)."""
    loop = asyncio.get_running_loop()
    _, server = await loop.create_unix_connection(lambda: StateServer(book), sock=sock)
    return server
