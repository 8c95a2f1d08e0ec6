"""The hot POST routes served by `api.direct.DirectRoutes` answer exactly as Litestar would."""

from __future__ import annotations

import asyncio
from typing import Any

from api.direct import DirectRoutes
from api.errors import Conflict
from tests.conftest import Service


def _call(routes: DirectRoutes, method: str, path: str, headers: list[tuple[bytes, bytes]]
          ) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(routes(scope, receive, send))
    return sent


def test_errors_and_crashes_become_the_envelope_and_other_requests_pass_through() -> None:
    passed: list[str] = []

    async def fallback(scope: Any, receive: Any, send: Any) -> None:
        passed.append(f"{scope['method']} {scope['path']}")

    async def conflict(request: Any) -> Any:
        raise Conflict("IDEMPOTENCY.IN_PROGRESS", "in flight", headers={"Retry-After": "1"})

    async def crash(request: Any) -> Any:
        raise RuntimeError("boom")

    routes = DirectRoutes(fallback, None, {"/a": conflict, "/b": crash})  # type: ignore[arg-type]
    start, body = _call(routes, "POST", "/a", [(b"x-request-id", b"caller-1")])
    assert start["status"] == 409
    assert (b"x-request-id", b"caller-1") in start["headers"]
    assert (b"retry-after", b"1") in start["headers"]
    assert b'"code":"IDEMPOTENCY.IN_PROGRESS"' in body["body"] and b'"trace_id":"caller-1"' in body["body"]

    start, body = _call(routes, "POST", "/b", [(b"x-request-id", b"not sane!")])
    assert start["status"] == 500 and b'"code":"INTERNAL.ERROR"' in body["body"]
    trace = dict(start["headers"])[b"x-request-id"]
    assert trace != b"not sane!" and b'"trace_id":"' + trace + b'"' in body["body"]

    assert _call(routes, "GET", "/a", []) == [] and _call(routes, "POST", "/a/", []) == []
    assert passed == ["GET /a", "POST /a/"]


def test_over_http_the_direct_and_litestar_paths_agree(service: Service) -> None:
    direct = service.post("/mgt/v1/events", {"nope": 1}, headers={"x-request-id": "t-direct"})
    routed = service.post("/mgt/v1/events/", {"nope": 1}, headers={"x-request-id": "t-routed"})
    assert direct.status_code == routed.status_code == 400  # no billing account in the context
    assert direct.headers["x-request-id"] == "t-direct" and routed.headers["x-request-id"] == "t-routed"
    a, b = direct.json(), routed.json()
    assert a["trace_id"] == "t-direct" and b["trace_id"] == "t-routed"
    assert {**a, "trace_id": None} == {**b, "trace_id": None}
    assert service.request("GET", "/mgt/v1/gate/authorize").status_code == 405
