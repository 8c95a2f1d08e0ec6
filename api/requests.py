"""What every authenticated endpoint does first: read the raw body and verify its signature."""

from __future__ import annotations

from typing import Any

from litestar import Request

from api.auth import AuthContext
from api.errors import BadRequest, Forbidden, PayloadTooLarge, Unprocessable
from api.runtime import Runtime
from pipelines.catalog import Realm

__all__ = ["account_in_context", "authenticate", "read_body"]


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


def account_in_context(realm: Realm, ctx: AuthContext) -> str | None:
    """The billing account a read is about: the principal's (X-Principal-Id), which an
    X-Billing-Account-Id sent beside it must name, else X-Billing-Account-Id; None when the
    call names neither."""
    account = ctx.billing_account_id
    if ctx.principal_id:
        owner = realm.principal_account.get(ctx.principal_id)
        if owner is None:
            raise Unprocessable("RESOURCE.NOT_FOUND", f"unknown principal {ctx.principal_id!r}")
        if account and account != owner:
            raise Forbidden("AUTH.BILLING_ACCOUNT_MISMATCH",
                            "X-Billing-Account-Id is not the principal's billing account")
        account = owner
    return account or None
