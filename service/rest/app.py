"""The REST application: the fast infer path and FastAPI's control routes, error mapping.

``create_app(settings, dataplane, control, metrics)`` receives the planes it serves and builds
nothing at import time; it starts and stops nothing (``service.server`` does, for every
transport alike).

Every HTTP request enters through :class:`service.rest.gateway.Gateway` (request id, header
limits, access log); inference goes from there straight to
:class:`service.rest.infer_route.InferRoute`, everything else to FastAPI's routes
(``service.rest.endpoints``). Both call the same :class:`service.dataplane.DataPlane`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.controlplane import ControlPlane
from service.dataplane import DataPlane
from service.errors import InvalidInput, Relayed, ServiceError, report
from service.observability.metrics import Metrics
from service.observability.request_ids import printable_path
from service.rest.auth import make_auth_check
from service.rest.endpoints import Endpoints, json_response
from service.rest.errors import error_response
from service.rest.express_lane import ExpressLane
from service.rest.gateway import Gateway
from service.rest.infer_route import InferRoute
from service.rest.inference import RestInference
from service.settings import Settings

log = logging.getLogger(__name__)


async def _service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    report(log, f"{request.method} {printable_path(request.scope['path'])}", exc)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's router's own answers (no such route, a method it does not take)."""
    assert isinstance(exc, StarletteHTTPException)
    path = printable_path(request.scope["path"])  # the path as sent can be 64 KiB of anything
    if exc.status_code == 404:
        message = f"no route {request.method} {path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {path}"
    else:
        message = str(exc.detail)
    return error_response(Relayed(exc.status_code, message, headers=dict(exc.headers or {})))


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return error_response(InvalidInput("invalid request: " + "; ".join(parts)))


class BitserveApp(FastAPI):
    """FastAPI with :class:`Gateway` in front: every HTTP request passes the gateway once."""

    gateway: Gateway | None = None
    express: ExpressLane | None = None
    """The infer route's express lane, which bitserve's HTTP connection is given
    (``service.rest.server.uvicorn_config``) to take plain infer requests to."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.gateway is not None and scope["type"] == "http":
            await self.gateway(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(
    settings: Settings,
    dataplane: DataPlane,
    control: ControlPlane,
    metrics: Metrics,
    *,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> BitserveApp:
    """Build the REST transport's application over the planes it is given.

    The server is assembled in ``service.server`` (:class:`service.server.BitServer`): it
    builds the planes once and hands them to REST and gRPC alike, and starts and stops them;
    this application builds nothing else and starts nothing.

    Args:
        settings: the server settings (limits, token, access log, compression).
        dataplane: the server's data plane.
        control: the server's control plane.
        metrics: the metrics registry (``/metrics``).
        lifespan: the application's ASGI lifespan, for an application served without
            ``BitServer.run`` (``service.server.in_process_app``); none by default.

    Returns:
        the ASGI application; ``app.state`` holds ``settings``, ``metrics``, ``dataplane``,
        ``control`` and ``repository`` (the data plane's).
    """
    app = BitserveApp(
        title="bitserve",
        # No interactive docs (their page loads scripts from a CDN); the schema is served
        # below, behind the token like every route but health.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
        # Paths are answered without redirects (the gateway drops a trailing slash).
        redirect_slashes=False,
    )
    token = settings.token
    rest = RestInference(
        dataplane,
        max_body_bytes=settings.max_body_bytes,
        max_json_bytes=settings.max_json_bytes,
        response_compression=settings.response_compression,
    )
    infer = InferRoute(
        rest,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        max_inflight_bytes=settings.max_inflight_bytes,
        auth_token=token,
    )
    app.state.settings = settings
    app.state.repository = dataplane.repository
    app.state.metrics = metrics
    app.state.dataplane = dataplane
    app.state.control = control
    ep = Endpoints(dataplane, control, metrics, infer, body_timeout_s=settings.body_timeout_s)

    # Every route gets its own operation id (FastAPI derives ids from the function name, and
    # one function serves several paths and methods here), so the OpenAPI schema is valid.
    open_routes = APIRouter()
    # Load balancers and Kubernetes probes may ask with HEAD: the same answer, no body.
    for path, endpoint, op in (
        ("/v2/health/live", ep.live, "server_live"),
        ("/v2/health/ready", ep.ready, "server_ready"),
    ):
        open_routes.add_api_route(path, endpoint, methods=["GET"], operation_id=op)
        open_routes.add_api_route(path, endpoint, methods=["HEAD"], operation_id=op + "_head")

    # No dependency at all without a token: each one costs a little on every request.
    auth = [Depends(make_auth_check(settings.auth_token))] if settings.auth_token else []
    routes = APIRouter(dependencies=auth)

    def add(path: str, endpoint: Any, method: str, operation_id: str) -> None:
        routes.add_api_route(path, endpoint, methods=[method], operation_id=operation_id)

    add("/v2", ep.server_metadata, "GET", "server_metadata")
    # Before /v2/models/{model}: "stats" is the statistics of every model, as in Triton.
    add("/v2/models/stats", ep.statistics, "GET", "model_statistics_all")
    for base, suffix in (
        ("/v2/models/{model}", ""),
        ("/v2/models/{model}/versions/{version}", "_version"),
    ):
        add(base, ep.model_metadata, "GET", "model_metadata" + suffix)
        add(base + "/ready", ep.model_ready, "GET", "model_ready" + suffix)
        add(base + "/config", ep.model_config, "GET", "model_config" + suffix)
        add(base + "/stats", ep.statistics, "GET", "model_statistics" + suffix)
        add(base + "/infer", ep.infer, "POST", "model_infer" + suffix)
    add("/v2/trace/setting", ep.trace_get, "GET", "trace_settings_get")
    add("/v2/trace/setting", ep.trace_post, "POST", "trace_settings")
    add("/v2/models/{model}/trace/setting", ep.trace_get, "GET", "model_trace_settings_get")
    add("/v2/models/{model}/trace/setting", ep.trace_post, "POST", "model_trace_settings")
    add("/v2/repository/index", ep.repository_index, "GET", "repository_index_get")
    add("/v2/repository/index", ep.repository_index, "POST", "repository_index")
    add("/v2/repository/models/{model}/load", ep.load, "POST", "repository_model_load")
    add("/v2/repository/models/{model}/unload", ep.unload, "POST", "repository_model_unload")
    for kind, status, register, unregister in (
        ("system", ep.system_shm_status, ep.system_shm_register, ep.system_shm_unregister),
        ("cuda", ep.cuda_shm_status, ep.cuda_shm_register, ep.cuda_shm_unregister),
    ):
        base, op = f"/v2/{kind}sharedmemory", f"{kind}_shared_memory"
        add(base + "/status", status, "GET", op + "_status_all")
        add(base + "/region/{region}/status", status, "GET", op + "_status")
        add(base + "/region/{region}/register", register, "POST", op + "_register")
        add(base + "/unregister", unregister, "POST", op + "_unregister_all")
        add(base + "/region/{region}/unregister", unregister, "POST", op + "_unregister")
    add("/v2/logging", ep.logging_get, "GET", "log_settings_get")
    add("/v2/logging", ep.logging_post, "POST", "log_settings")
    add("/metrics", ep.metrics_text, "GET", "metrics")

    async def openapi() -> Response:
        return json_response(app.openapi())

    routes.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
    app.include_router(open_routes)
    app.include_router(routes)

    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.gateway = Gateway(
        functools.partial(FastAPI.__call__, app),
        infer,
        access_log=settings.access_log,
        limit_concurrency=settings.limit_concurrency,
    )
    app.express = ExpressLane(infer, app.gateway)
    return app
