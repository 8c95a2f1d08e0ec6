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
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.envelope import error_reply, new_trace_id
from api.errors import BadRequest

__all__ = ["OneWriteHttpToolsProtocol", "http_protocol"]


class _OneWriteTransport:
    """A transport that holds a response head until the body, then writes both at once."""

    __slots__ = ("_transport", "_head")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
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
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        transport = cycle.transport = _OneWriteTransport(cycle.transport)
        completed = cycle.on_response

        def on_response() -> None:
            transport._flush()  # a response without a body write (HEAD) is complete too
            completed()

        cycle.on_response = on_response
        super()._start_asgi_task(cycle, app)

    def send_400_response(self, msg: str) -> None:
        trace = new_trace_id()
        body = error_reply(trace, BadRequest("REQUEST.INVALID", "the request is not valid HTTP/1.1")).body
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n"
                    b"connection: close\r\n\r\n" % (len(body), trace.encode()))
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def http_protocol() -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`."""
    if hasattr(HttpToolsProtocol, "_start_asgi_task"):
        return OneWriteHttpToolsProtocol
    return HttpToolsProtocol
