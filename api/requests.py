"""What every authenticated endpoint does first: read the raw body and verify its signature."""

from __future__ import annotations

from typing import Any

from litestar import Request

from api.auth import AuthContext
from api.errors import PayloadTooLarge
from api.runtime import Runtime

__all__ = ["authenticate", "read_body"]


async def read_body(request: Request[Any, Any, Any]) -> bytes:
    body = await request.body()
    if len(body) > request.app.state.runtime.settings.max_body_bytes:
        raise PayloadTooLarge("VALIDATION.BODY_TOO_LARGE", "request body is larger than 16 MiB")
    return body


def authenticate(runtime: Runtime, request: Request[Any, Any, Any], body: bytes) -> AuthContext:
    scope = request.scope
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    path = scope.get("raw_path") or scope["path"].encode()
    if isinstance(path, bytes):
        path = path.decode("latin-1")
    if scope.get("query_string"):
        path = f"{path}?{scope['query_string'].decode('latin-1')}"
    return runtime.auth.verify(scope["method"], path, headers, body)
