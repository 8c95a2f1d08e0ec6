"""The envelope: the one builder of success and error bodies, and the one error mapping.

Success: `{"ok": true, "code": "OK", "data": {...}, "hints": [...]}` (hints only when there
are any). Error: `{"ok": false, "code", "message", "trace_id", "meta": {"status"}, "errors",
"hints"}`. Every response carries `X-Request-Id` equal to the trace id (see `TraceIdMiddleware`).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import msgspec
from litestar import Request
from litestar.enums import ScopeType
from litestar.exceptions import HTTPException
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import AppError

__all__ = ["CLIENT_TRACE_ID", "Reply", "TraceIdMiddleware", "error_reply", "handle_exception", "ok",
           "request_trace_id", "trace_id_of"]

log = logging.getLogger("tollgate.api")
_encode = msgspec.json.encode
CLIENT_TRACE_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
JSON = "application/json"
# Trace ids need to be unique, not secret: a per-process random prefix and a counter.
_TRACE_PREFIX = os.urandom(6).hex()
_trace_counter = itertools.count(1)


def new_trace_id() -> str:
    return f"{_TRACE_PREFIX}{next(_trace_counter):012x}"


class Reply(ASGIResponse):
    """A JSON reply whose body is already encoded, sent as is.

    Litestar's `Response` builds a header mapping, resolves the media type and converts to an
    `ASGIResponse` on every request: about 60 us here, a fifth of a gate call's time in the
    HTTP process. Routes that return this (annotated `-> Reply`) skip all of that."""

    __slots__ = ("_raw_headers",)

    def __init__(self, body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.body = body
        self.status_code = status
        self.content_length = len(body)
        self.background = None
        self.is_head_response = False
        self.encoding = "utf-8"
        self._encoded_cookies = ()
        raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if headers:
            raw.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
        self._raw_headers = raw

    def encode_headers(self) -> list[tuple[bytes, bytes]]:
        return self._raw_headers

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Reply:
        """Already an ASGI response (Litestar's exception layer asks for one)."""
        return self


def ok(data: Any, *, status: int = 200, hints: list[dict[str, Any]] | None = None,
       headers: dict[str, str] | None = None) -> Reply:
    body: dict[str, Any] = {"ok": True, "code": "OK", "data": data}
    if hints:
        body["hints"] = hints
    return Reply(_encode(body), status, headers)


def _error_body(trace_id: str, status: int, code: str, message: str,
               errors: list[dict[str, Any]] | None = None,
               hints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "ok": False,
        "code": code,
        "message": message,
        "trace_id": trace_id,
        "meta": {"status": status},
        "errors": errors or [],
        "hints": hints or [],
    }


def trace_id_of(scope: Scope) -> str:
    return str(scope["state"].get("trace_id") or new_trace_id())


_HTTP_CODES = {
    400: "VALIDATION.MALFORMED_JSON",
    401: "AUTH.UNAUTHORIZED",
    404: "RESOURCE.ROUTE_NOT_FOUND",
    405: "REQUEST.METHOD_NOT_ALLOWED",
    413: "VALIDATION.BODY_TOO_LARGE",
}


def error_reply(trace_id: str, error: BaseException) -> Reply:
    """The one place where an error becomes a response, for every route (Litestar's, the
    direct routes', the gate's decided outcomes via `AppError.of_status`, and the HTTP
    parser's refusals):

    - an `AppError`: its status, code, message, errors, hints and headers;
    - Litestar's own refusals below 500 (no route, wrong method, body too large): their
      status, with the code of `_HTTP_CODES`;
    - anything else: 500 `INTERNAL.ERROR`, logged with its trace id, no detail sent.
    """
    if isinstance(error, AppError):
        status, code, message, headers = error.status, error.code, error.message, error.headers
        body = _error_body(trace_id, status, code, message, error.errors, error.hints)
    elif isinstance(error, HTTPException) and error.status_code < 500:
        status, headers = error.status_code, dict(error.headers or {})
        code = _HTTP_CODES.get(status, "REQUEST.INVALID")
        message = "request body is larger than 16 MiB" if status == 413 else str(error.detail)
        body = _error_body(trace_id, status, code, message)
    else:
        log.error("unhandled error (trace_id=%s)", trace_id, exc_info=error,
                  extra={"trace_id": trace_id})
        status, headers = 500, {}
        body = _error_body(trace_id, 500, "INTERNAL.ERROR", "internal error")
    return Reply(_encode(body), status, headers)


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Reply:
    """Litestar's exception handler: `error_reply` with the request's trace id."""
    return error_reply(trace_id_of(request.scope), exc)


def request_trace_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The caller's X-Request-Id when it is sane, else a new trace id."""
    for name, value in headers:
        if name == b"x-request-id" and CLIENT_TRACE_ID.fullmatch(value):
            return value.decode()
    return new_trace_id()


class TraceIdMiddleware:
    """Gives each request a trace id (the caller's X-Request-Id when it is sane) and stamps it
    on the response as X-Request-Id. Raw ASGI, so it costs next to nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        trace = state.get("trace_id") or request_trace_id(scope["headers"])  # api.observe's
        state["trace_id"] = trace
        raw = trace.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", raw))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)
