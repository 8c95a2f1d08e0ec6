"""Direct routes: the hot POST endpoints served without Litestar's request machinery.

The gate calls and event posts are the service's traffic. Each of their handlers reads the
raw body from ASGI `receive`, authenticates, and returns a pre-encoded `Reply`, so Litestar
only routed them and ran its middleware and exception layers around them: about a fifth of
the HTTP process's time per gate call (measured with py-spy under `bench/gate.py`).

`DirectRoutes` sits in front of the Litestar app. A POST whose path is exactly one of
`DIRECT_ROUTES` goes straight to its handler, with the same trace id rule as
`TraceIdMiddleware`, the same error mapping (`api.envelope.error_reply`) and the same
`X-Request-Id` on the response. Every other request (other methods, other paths, trailing
slashes, lifespan) goes to Litestar unchanged, and Litestar still declares these routes, so a
server that bypasses this wrapper gives the same answers. The OpenAPI document describes them
from the route table of `api.openapi`, as every route.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Litestar
from litestar.enums import ScopeType
from litestar.types import ASGIApp, HTTPResponseStartEvent, HTTPScope, Receive, Scope, Send

from api.envelope import Reply, error_reply, request_trace_id

__all__ = ["DirectRequest", "DirectRoutes", "Handler"]

log = logging.getLogger("tollgate.api")


class DirectRequest:
    """What the handlers use of a request: the app (for its state), the scope and receive."""

    __slots__ = ("app", "scope", "receive")

    def __init__(self, app: Litestar, scope: Scope, receive: Receive) -> None:
        self.app = app
        self.scope = scope
        self.receive = receive


Handler = Callable[[Any], Awaitable[Reply]]


class DirectRoutes:
    def __init__(self, app: ASGIApp, litestar: Litestar, routes: dict[str, Handler]) -> None:
        self.app = app
        self.litestar = litestar
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
            if handler is not None:
                await self._serve(handler, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, handler: Handler, scope: HTTPScope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        trace = state.get("trace_id") or request_trace_id(scope["headers"])
        state["trace_id"] = trace
        try:
            reply = await handler(DirectRequest(self.litestar, scope, receive))
        except Exception as exc:
            reply = error_reply(trace, exc)
        status, body, headers = reply.status_code, reply.body, reply.encode_headers()
        headers = [*headers, (b"x-request-id", trace.encode())]
        start: HTTPResponseStartEvent = {"type": "http.response.start", "status": status,
                                         "headers": headers}
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})
