"""The outermost layer of the HTTP app: a trace id per request, the access log, request metrics.

`Observe` wraps everything (the direct routes and Litestar alike), so each request gets:

- its trace id (the caller's sane X-Request-Id, else a new one) in `scope["state"]` and in
  `core.logs.TRACE_ID`, so every log line written while it is served carries it;
- one access log line (logger `tollgate.access`, INFO): method, path, route, status,
  duration_ms, bytes and trace_id;
- an X-Tollgate-Worker header naming the HTTP worker that answered (`api.supervisor`);
- a count and a latency observation in `tollgate_http_requests_total` and
  `tollgate_http_request_seconds`, labelled by method, route and status. The route is the
  direct route's path or Litestar's path template; a request no route matched counts as
  `unmatched`, so a scan of random paths cannot grow the label set.

Its cost per request, measured with bench/gate.py, is in docs/operations.md.
"""

from __future__ import annotations

import logging
import time

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from api.envelope import request_trace_id
from api.metrics import HttpMetrics
from core.logs import TRACE_ID

__all__ = ["Observe"]

access = logging.getLogger("tollgate.access")


class Observe:
    def __init__(self, app: ASGIApp, metrics: HttpMetrics | None, routes: dict[str, object], *,
                 worker: int | None = None) -> None:
        self.app = app
        # X-Tollgate-Worker: which HTTP worker answered (`tollgate serve --workers N`).
        self.worker_header = (b"x-tollgate-worker", str(worker).encode()) if worker is not None else None
        self.metrics = metrics
        self.routes = routes  # the direct routes, by path
        self.direct = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        path = scope["path"]
        method = scope["method"]
        trace = request_trace_id(scope["headers"])
        scope.setdefault("state", {})["trace_id"] = trace
        token = TRACE_ID.set(trace)
        status = 500
        sent = 0
        worker_header = self.worker_header

        async def watch(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                if worker_header is not None:
                    message["headers"] = [*message.get("headers", ()), worker_header]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            seconds = time.perf_counter() - began
            if method == "POST" and path in self.direct:
                route = path
            else:
                route = scope.get("path_template") or "unmatched"
            if self.metrics is not None:
                self.metrics.observe_request(method, route, status, seconds)
            if access.isEnabledFor(logging.INFO):
                access.info("request", extra={
                    "method": method, "path": path, "route": route, "status": status,
                    "duration_ms": round(seconds * 1000, 3), "bytes": sent, "trace_id": trace})
            TRACE_ID.reset(token)
