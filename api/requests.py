"""What every authenticated endpoint does first: read the raw body and verify its signature."""

from __future__ import annotations

from typing import Any

from litestar import Request

from api.auth import AuthContext
from api.errors import BadRequest, PayloadTooLarge
from api.runtime import Runtime

__all__ = ["authenticate", "read_body"]


async def read_body(request: Request[Any, Any, Any]) -> bytes:
    """The raw body, read straight from the ASGI messages (Litestar's `Request.body` runs
    an async generator per request), refused past the size limit as it arrives."""
    limit = request.app.state.runtime.settings.max_body_bytes
    for name, value in request.scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise PayloadTooLarge("VALIDATION.BODY_TOO_LARGE", "request body is larger than 16 MiB")
    receive = request.receive
    message = await receive()
    if message["type"] == "http.disconnect":
        raise BadRequest("REQUEST.INCOMPLETE", "the client went away before sending the body")
    body: bytes = message.get("body", b"")  # type: ignore[assignment]
    if message.get("more_body"):
        chunks = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("REQUEST.INCOMPLETE", "the client went away before sending the body")
            chunk: bytes = message.get("body", b"")  # type: ignore[assignment]
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge("VALIDATION.BODY_TOO_LARGE", "request body is larger than 16 MiB")
            chunks.append(chunk)
        body = b"".join(chunks)
    if len(body) > limit:
        raise PayloadTooLarge("VALIDATION.BODY_TOO_LARGE", "request body is larger than 16 MiB")
    return body


def authenticate(runtime: Runtime, request: Request[Any, Any, Any], body: bytes) -> AuthContext:
    scope = request.scope
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode("latin-1")
    query: bytes = scope.get("query_string", b"")
    if query:
        path = f"{path}?{query.decode('latin-1')}"
    return runtime.auth.verify(scope["method"], path, headers, body)
