"""The one assembly point of the HTTP service: `create_app(settings)` returns the Litestar app."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from litestar import Litestar, Request, Response, get, head

from api.direct import DirectRoutes
from api.docs import DOCS_HANDLERS
from api.envelope import Reply, TraceIdMiddleware, handle_exception, ok
from api.events.controller import EventsController, record_event, record_event_batch
from api.gate import controller as gate
from api.gate.controller import GateController
from api.gate.reads import LimitsController
from api.metrics import CONTENT_TYPE_LATEST, HttpMetrics
from api.observe import Observe
from api.reports import ReportsController
from api.runtime import Runtime
from api.wallet.balance import WalletController
from core.settings import Settings

__all__ = ["create_app"]


STORAGE_REFUSES = "storage refuses writes"


def _readiness(runtime: Runtime) -> list[str]:
    """Why the service is not ready; empty when it is."""
    if not runtime.ready:
        return ["starting"]
    if runtime.writer.closed:
        return ["writer restarting" if runtime.writer_state == "restarting" else "writer down"]
    if runtime.writer.refusing:
        return [STORAGE_REFUSES]  # the writer's own words are in its log and metrics
    return []


@get("/healthz", operation_id="healthz", tags=["ops"])
async def healthz(request: Request[Any, Any, Any]) -> Reply:
    """Unsigned, so it names nothing of the catalog's content (no realm, account or key)."""
    runtime: Runtime = request.app.state.runtime
    reasons = _readiness(runtime)
    data = {
        "status": "ready" if not reasons else "starting" if not runtime.ready else "down",
        "reasons": reasons,
        "catalog": runtime.catalog.fingerprint,
        "schema_version": getattr(runtime, "schema_version", 0),
        "writer": ("running" if not runtime.writer.closed else runtime.writer_state
                   if runtime.writer_state == "restarting" else "down") if runtime.ready else "down",
    }
    return ok(data, status=503 if reasons else 200)


@head("/healthz", operation_id="healthz_head", tags=["ops"])
async def healthz_head(request: Request[Any, Any, Any]) -> Response[None]:
    """The readiness of GET /healthz as a status alone, for load balancers that probe with HEAD."""
    runtime: Runtime = request.app.state.runtime
    return Response(content=None, status_code=503 if _readiness(runtime) else 200)


@get("/metrics", operation_id="metrics", tags=["ops"], sync_to_thread=False)
def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Unsigned, like /healthz: the Prometheus text format (docs/operations.md lists the
    metrics); not in the OpenAPI document, which describes the JSON API."""
    registry: HttpMetrics = request.app.state.metrics
    return Response(content=registry.exposition(), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: Settings, *, on_stop: Sequence[Callable[[], None]] = ()) -> Litestar:
    """The app; `on_stop` runs first when the server shuts down (the caller's processes
    beside this one, such as the flows' scheduler: uvicorn ends the process by the signal
    that stopped it once it has shut down, so nothing after `run()` is sure to run)."""
    runtime = Runtime(settings)
    observed = HttpMetrics(settings.folder.metrics) if settings.metrics_on else None
    if observed is not None:
        observed.runtime = runtime
        runtime.on_writer_reply = observed.observe_writer_reply
    elsewhere: list[Any] = []

    async def start(app: Litestar) -> None:
        await runtime.start()
        if observed is not None and settings.metrics_address is not None:
            elsewhere.append(observed.serve_elsewhere(*settings.metrics_address))

    async def stop(app: Litestar) -> None:
        for hook in on_stop:
            await asyncio.to_thread(hook)
        for server in elsewhere:
            server.shutdown()
        await runtime.stop()

    ops: list[Any] = [healthz, healthz_head]
    if observed is not None and settings.metrics_address is None:
        ops.append(metrics)

    app = Litestar(
        route_handlers=[*ops, EventsController, GateController, LimitsController,
                        WalletController, ReportsController, *DOCS_HANDLERS],
        on_startup=[start],
        on_shutdown=[stop],
        exception_handlers={Exception: handle_exception},  # type: ignore[dict-item]
        # The OpenAPI document is the route table's (api/openapi.py), served by api/docs.py.
        openapi_config=None,
        logging_config=None,  # core.logs configures the process's logging
        request_max_body_size=settings.max_body_bytes,
        debug=False,
    )
    app.state.runtime = runtime
    app.state.metrics = observed
    # The hot POST routes skip Litestar's routing and middleware (see api/direct.py); the
    # access log and request metrics wrap both (api/observe.py).
    app.asgi_handler = DirectRoutes(TraceIdMiddleware(app.asgi_handler), app, {
        "/mgt/v1/gate/authorize": gate.authorize,
        "/mgt/v1/gate/commits": gate.commit,
        "/mgt/v1/gate/cancel": gate.cancel,
        "/mgt/v1/gate/commits/batch": gate.commit_batch,
        "/mgt/v1/gate/ingest": gate.ingest,
        "/mgt/v1/events": record_event,
        "/mgt/v1/events/batch": record_event_batch,
    })
    direct: DirectRoutes = app.asgi_handler
    app.asgi_handler = Observe(direct, observed, dict(direct.routes))
    return app
