"""uvicorn's httptools protocol, with each response leaving in one write.

uvicorn writes a response's head when the app sends `http.response.start` and its body when
the app sends `http.response.body`: two system calls and, with TCP_NODELAY, two segments
that the client reads separately. In the gate loop those two writes were about 14 % of the
HTTP process's time. Here the cycle's transport holds the head until the first body write
and sends both together; everything else passes straight through.

The hook is uvicorn's `_start_asgi_task` (present in 0.54, which this was measured with);
where a uvicorn lacks it, the plain protocol is used and nothing changes.

A request the HTTP parser refuses (a malformed request line or header, a bad Content-Length)
never reaches the app; uvicorn answers it with a plain-text 400. Here that answer is the
error envelope with an `X-Request-Id` like every other response.

It also holds the limits that apply before any route or signature (`Limits`, from the
settings; docs/api.md, "Limits"). uvicorn's httptools protocol has none of them: httptools
buffers a header of any size, a connection that never sends a request is never closed, and a
request whose body stalls holds its connection, and the shutdown, for good.

- Open connections: past `max_connections`, a new one is answered 503 `SERVICE.BUSY` with
  `Retry-After` and closed. With several HTTP workers the cap is the service's, not each
  worker's: every worker publishes its count in a slot of a block of memory shared with the
  others (`ConnectionCount`) and adds up the slots as a connection arrives (workers accepting
  at the same instant may pass the cap by one each).
- The head: at most `max_header_bytes` (counted as the bytes arrive, so httptools never holds
  more) and `max_headers` lines, else 431 `REQUEST.HEADERS_TOO_LARGE`; it must be complete
  `header_timeout` seconds after the connection opens or its request's first byte arrives,
  else 408 `REQUEST.TIMEOUT`.
- The whole request: its body must have arrived `request_timeout` seconds after its first
  byte, else 408 `REQUEST.TIMEOUT` (the handler reading it sees the client gone).
- A response sent before its request's body has arrived (a signature refused from the head)
  says `connection: close`; it and every refusal here end the connection: the answer is
  sent, the sending side shut, and
  what the client still sends is discarded for at most a second or 1 MiB, then the connection
  is closed. Closing at once would reset it and could destroy the answer in flight.
- At shutdown, a request still receiving its body is answered 503 `SERVICE.BUSY` and closed
  rather than waited for.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from api.envelope import error_reply, new_trace_id
from api.errors import AppError, BadRequest, ServiceUnavailable
from core.settings import Settings

__all__ = ["ConnectionCount", "Limits", "OneWriteHttpToolsProtocol", "http_protocol"]

# After a refusal, what the client still sends is read and dropped for this long / this much.
LINGER_SECONDS = 1.0
LINGER_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """What the protocol refuses before any route sees a request (`core.settings`)."""

    max_header_bytes: int
    max_headers: int
    header_timeout: float
    request_timeout: float
    max_connections: int

    @staticmethod
    def of(settings: Settings) -> Limits:
        return Limits(settings.max_header_bytes, settings.max_headers, settings.header_timeout_seconds,
                      settings.request_timeout_seconds, settings.max_connections)


class ConnectionCount:
    """The open connections of every HTTP worker: a slot of 8 bytes per worker in a shared
    block of memory (a memfd made by the parent, `api.supervisor`). A worker writes only its
    own slot, so no lock is needed; it reads them all to decide."""

    def __init__(self, fd: int, workers: int, index: int) -> None:
        import mmap

        self._map = mmap.mmap(fd, 8 * workers)
        self._all = struct.Struct(f"<{workers}q")
        self._offset = 8 * (index - 1)
        self._index = index - 1

    def publish(self, count: int) -> None:
        _SLOT.pack_into(self._map, self._offset, count)

    def total(self, own: int) -> int:
        """Every worker's count, this one's being `own`."""
        counts: tuple[int, ...] = self._all.unpack_from(self._map, 0)
        return sum(counts) - counts[self._index] + own


_SLOT = struct.Struct("<q")


class _Refused(Exception):
    """Raised in a parser callback to stop the parser; `send_400_response` answers the
    refusal held in `_refusal` instead of the parser's 400."""


class _OneWriteTransport:
    """A transport that holds a response head until the body, then writes both at once.

    With `protocol` (one holding limits) and its `cycle`: a response that starts before its
    request's body has arrived says `connection: close`, and its connection ends by the
    protocol's lingering close rather than at once."""

    __slots__ = ("_transport", "_head", "_protocol", "_cycle", "_linger")

    def __init__(self, transport: Any, protocol: OneWriteHttpToolsProtocol | None = None,
                 cycle: Any = None) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._protocol = protocol
        self._cycle = cycle
        self._linger = False

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            cycle = self._cycle
            if self._protocol is not None and cycle.more_body:
                # Answered from the head (a refused signature): the rest of the body is never
                # read, so the connection cannot carry another request.
                self._linger = True
                if cycle.keep_alive:
                    cycle.keep_alive = False  # uvicorn closes the transport after the body
                    data = data[:-2] + b"connection: close\r\n\r\n"
            self._head = data  # a response head: wait for its body
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        """Write a held head (a response that ends without a body write)."""
        head, self._head = self._head, None
        if head is not None:
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        if self._linger and self._protocol is not None:
            self._protocol._linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    # None: no limits (the class itself); `http_protocol(settings)` makes a subclass with them.
    limits: ClassVar[Limits | None] = None
    # The other workers' connections too, when there are other workers.
    counter: ClassVar[ConnectionCount | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True        # the bytes arriving now belong to a head (counted)
        self._head_started = False  # a request's first byte arrived, its head not yet complete
        self._head_bytes = 0
        self._heads = 0             # heads completed on this connection
        self._began = 0.0           # loop time of the current request's first byte
        self._timer: asyncio.TimerHandle | None = None
        self._refusal: AppError | None = None
        self._lingering = False
        self._discarded = 0

    # ---- connections ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        if limits is None:
            return
        own = len(self.connections)
        counter = self.counter
        if counter is not None:
            counter.publish(own)
        if (own if counter is None else counter.total(own)) > limits.max_connections:
            self._refuse(ServiceUnavailable(
                "SERVICE.BUSY", f"the service holds {limits.max_connections} connections; retry later",
                headers={"Retry-After": "1"}))
            return
        self._began = self.loop.time()
        self._timer = self.loop.call_later(limits.header_timeout, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)
        if self.counter is not None:
            self.counter.publish(len(self.connections))

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._discarded += len(data)
            if self._discarded > LINGER_BYTES:
                self.transport.close()
            return
        limits = self.limits
        if limits is None or not self._in_head:
            super().data_received(data)
        else:
            room = limits.max_header_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                super().data_received(data)
            else:
                # Feed only what the head may still take: httptools would buffer the rest.
                heads = self._heads
                self._head_bytes += room
                super().data_received(data[:room])
                if self._lingering or self.transport.is_closing():
                    return
                if self._heads == heads:
                    self._refuse(AppError.of_status(
                        431, "REQUEST.HEADERS_TOO_LARGE",
                        f"the request's head is larger than {limits.max_header_bytes} bytes"))
                    return
                self.data_received(data[room:])
                return
        if limits is not None and self._timer is None and not self._lingering:
            if self._head_started:
                self._timer = self.loop.call_later(limits.header_timeout, self._timed_out)
            elif self._receiving_body():
                left = self._began + limits.request_timeout - self.loop.time()
                self._timer = self.loop.call_later(max(left, 0.0), self._timed_out)

    def _receiving_body(self) -> bool:
        cycle = self.cycle
        return cycle is not None and cycle.more_body and not cycle.response_complete

    # ---- parser callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.limits is not None:
            self._head_started = True
            self._began = self.loop.time()

    def on_headers_complete(self) -> None:
        limits = self.limits
        if limits is not None:
            self._in_head = self._head_started = False
            self._heads += 1
            self._cancel_timer()
            if len(self.headers) > limits.max_headers:
                self._refusal = AppError.of_status(
                    431, "REQUEST.HEADERS_TOO_LARGE", f"the request has more than {limits.max_headers} headers")
                raise _Refused
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self.limits is not None:
            self._in_head = True
            self._head_bytes = 0
            self._cancel_timer()
        super().on_message_complete()

    # ---- limits --------------------------------------------------------------------------
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self._lingering or self.transport.is_closing():
            return
        limits = self.limits
        assert limits is not None
        if self._receiving_body():
            self._abort_request(AppError.of_status(
                408, "REQUEST.TIMEOUT", f"the request did not arrive within {limits.request_timeout:g} s"))
        elif self._in_head:
            self._refuse(AppError.of_status(
                408, "REQUEST.TIMEOUT", f"the request's head did not arrive within {limits.header_timeout:g} s"))

    def _abort_request(self, error: AppError) -> None:
        """End a request whose body is still arriving: its handler sees the client gone, and
        the client gets `error` unless an answer has begun."""
        cycle = self.cycle
        started = cycle.response_started
        cycle.disconnected = True
        cycle.message_event.set()
        if started:
            self.transport.close()
        else:
            self._refuse(error)

    def _refuse(self, error: AppError) -> None:
        """Answer `error` as the envelope, then end the connection (`_linger`)."""
        trace = new_trace_id()
        body = error_reply(trace, error).body
        head = [STATUS_LINE[error.status]]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        for header, text in error.headers.items():
            head.extend([header.lower().encode(), b": ", text.encode(), b"\r\n"])
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n"
                    b"connection: close\r\n\r\n" % (len(body), trace.encode()))
        self.transport.write(b"".join(head) + body)
        self._linger()

    def _linger(self) -> None:
        """Shut the sending side and drop what arrives for a while, then close: a close with
        unread data resets the connection, which can destroy the answer before it is read."""
        if self._lingering:
            return
        self._lingering = True
        self._cancel_timer()
        self._unset_keepalive_if_required()
        try:
            self.transport.write_eof()
        # A transport that cannot half-close (asyncio's SSL transport raises
        # NotImplementedError), or one already closing: close it outright.
        except (OSError, RuntimeError, NotImplementedError):
            self.transport.close()
            return
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def shutdown(self) -> None:
        if self.limits is not None and self._receiving_body() and not self.cycle.response_started:
            # A body still arriving would hold the shutdown for as long as its client likes.
            self._abort_request(ServiceUnavailable("SERVICE.BUSY", "the service is stopping; retry",
                                                   headers={"Retry-After": "1"}))
            return
        super().shutdown()

    # ---- one write per response ----------------------------------------------------------
    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        transport = cycle.transport = _OneWriteTransport(
            cycle.transport, self if self.limits is not None else None, cycle)
        completed = cycle.on_response

        def on_response() -> None:
            transport._flush()  # a response without a body write (HEAD) is complete too
            completed()

        cycle.on_response = on_response
        super()._start_asgi_task(cycle, app)

    def send_400_response(self, msg: str) -> None:
        refusal, self._refusal = self._refusal, None
        if refusal is not None:
            self._refuse(refusal)
            return
        trace = new_trace_id()
        body = error_reply(trace, BadRequest("REQUEST.INVALID", "the request is not valid HTTP/1.1")).body
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n"
                    b"connection: close\r\n\r\n" % (len(body), trace.encode()))
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def http_protocol(settings: Settings | None = None,
                  counter: ConnectionCount | None = None) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`: with `settings`, one that holds
    their limits; with `counter`, the connection cap counts every worker's connections."""
    if not hasattr(HttpToolsProtocol, "_start_asgi_task"):
        return HttpToolsProtocol
    if settings is None:
        return OneWriteHttpToolsProtocol
    limited: type[OneWriteHttpToolsProtocol] = type(
        "LimitedHttpToolsProtocol", (OneWriteHttpToolsProtocol,),
        {"limits": Limits.of(settings), "counter": counter})
    return limited
