"""What every authenticated endpoint does first: verify its signature and read the raw body."""

from __future__ import annotations

from typing import Any

from api.auth import AuthContext, replayed
from api.errors import BadRequest, Forbidden, PayloadTooLarge, Unprocessable
from api.runtime import Runtime
from pipelines.catalog import Realm

__all__ = ["account_in_context", "read_body", "read_signed"]


async def read_signed(runtime: Runtime, request: Any) -> tuple[AuthContext, bytes]:
    """The request's signature and its raw body: what every signed endpoint does first.

    A body no larger than `max_body_unsigned_bytes` (declared by Content-Length) is read, then
    the request is checked whole (`Authenticator.check`). A larger one, or one sent without a
    length, is authenticated from its head first (`check_head`: the signature covers the
    declared Content-Digest), so a caller who does not hold a key's secret is refused before
    any of it is read; its body is then read up to `max_body_bytes` and must match the digest.
    A declared length past `max_body_bytes` is refused before anything else."""
    settings = runtime.settings
    scope = request.scope
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    declared = headers.get("content-length")
    if declared is not None:
        length = int(declared) if declared.isdigit() else None
    else:  # no Content-Length: chunked (length unknown), else no body at all (RFC 9112 6.3)
        length = None if "transfer-encoding" in headers else 0
    limit = settings.max_body_bytes
    if length is not None and length > limit:
        raise _too_large(limit)
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode("latin-1")
    query: bytes = scope.get("query_string", b"")
    if query:
        path = f"{path}?{query.decode('latin-1')}"
    method: str = scope["method"]
    auth = runtime.auth
    if length is not None and length <= settings.max_body_unsigned_bytes:
        body = await read_body(request.receive, length)
        head = auth.check(method, path, headers, body)
    else:
        head = auth.check_head(method, path, headers)
        if await runtime.shared.seen(head.key_id, head.nonce):
            raise replayed()
        body = await read_body(request.receive, limit)
        auth.check_body(head, headers, body)
    # The nonce, decided for every worker of the service in one place (`api.shared`).
    if not await runtime.shared.first_use(head.key_id, head.nonce, head.signed_at.timestamp()):
        raise replayed()
    return auth.accept(head, headers), body


async def read_body(receive: Any, limit: int) -> bytes:
    """The raw body, read straight from the ASGI messages (Litestar's `Request.body` runs
    an async generator per request), refused past `limit` as it arrives."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise BadRequest("REQUEST.INCOMPLETE", "the client went away before sending the body")
    body: bytes = message.get("body", b"")
    if message.get("more_body"):
        chunks = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("REQUEST.INCOMPLETE", "the client went away before sending the body")
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        body = b"".join(chunks)
    if len(body) > limit:
        raise _too_large(limit)
    return body


def _too_large(limit: int) -> PayloadTooLarge:
    size = f"{limit // (1024 * 1024)} MiB" if limit % (1024 * 1024) == 0 else f"{limit} bytes"
    return PayloadTooLarge("VALIDATION.BODY_TOO_LARGE", f"request body is larger than {size}")


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
