"""The application: the fast infer path and FastAPI's control routes, error mapping, lifespan.

``create_app(settings)`` receives everything it needs and builds nothing at import time. The
lifespan starts the model repository (loading every model) and, on shutdown, stops it after
the HTTP server has let in-flight requests finish.

Every HTTP request enters through :class:`service.rest.gateway.Gateway` (request id, header
limits, access log); inference goes from there straight to
:class:`service.rest.infer_route.InferRoute`, everything else to FastAPI's routes
(``service.rest.endpoints``). Both call the same :class:`service.dataplane.DataPlane`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.controlplane import ControlPlane
from service.dataplane import DataPlane, Repository
from service.errors import InvalidInput, Relayed, ServiceError, report
from service.metrics import Metrics
from service.observability import printable_path
from service.rest.auth import make_auth_check
from service.rest.endpoints import Endpoints, json_response
from service.rest.errors import error_response
from service.rest.express_lane import ExpressLane
from service.rest.gateway import Gateway
from service.rest.infer_route import InferRoute
from service.rest.inference import RestInference
from service.settings import Settings
from service.shared_memory import SystemSharedMemory
from service.tracing import Tracing, settings_without_tracing

if TYPE_CHECKING:
    from service.cluster import Cluster

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
    repository: Repository | None = None,
    *,
    metrics: Metrics | None = None,
    grpc: bool = False,
    grpc_shared_port: bool = False,
    cluster: Cluster | None = None,
    tracing: Tracing | None = None,
) -> BitserveApp:
    """Build the application.

    Args:
        settings: the server settings.
        repository: the model repository; by default a
            ``service.repository.ModelRepository`` over ``settings.model_repository`` (the
            built-in demo when that is unset), created here but loaded only in the lifespan.
        metrics: the metrics registry shared with ``repository``; a new one by default.
        grpc: also serve gRPC on ``settings.grpc_port`` (unless 0) from the lifespan, over
            the same data plane (``bitserve serve`` does; in-process tests of HTTP alone
            leave it off).
        grpc_shared_port: the gRPC port is shared with other worker processes
            (``SO_REUSEPORT``, as ``--workers`` shares the HTTP port).
        cluster: this worker's peers under ``--workers`` (``service.cluster``): changes
            reach every worker, and readiness waits for them all.
        tracing: OpenTelemetry tracing (``service.tracing.Tracing.from_environ``; a
            repository passed in must have been given the same); None: no traces, and the
            trace extension answers level OFF.

    Returns:
        the ASGI application; ``app.state`` holds ``settings``, ``repository``, ``metrics``,
        ``dataplane``, ``control`` and ``grpc`` (the :class:`service.grpc.server.GrpcServer`,
        or None).
    """
    metrics = metrics if metrics is not None else Metrics()
    if repository is None:
        from service.repository import ModelRepository

        repository = ModelRepository.from_settings(settings, metrics, tracing=tracing)
    repo = repository

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await control.start()
        log.info("repository started: %s", [m.get("name") for m in repo.index()])
        grpc_server = app.state.grpc
        try:
            if grpc_server is not None:
                await grpc_server.start()
            yield
        finally:
            # uvicorn has already drained in-flight HTTP requests (timeout_graceful_shutdown);
            # gRPC's in-flight calls finish next (it stopped taking new ones with HTTP).
            if grpc_server is not None:
                await grpc_server.stop()
            await control.stop(timeout_s=settings.graceful_shutdown_s)
            log.info("repository stopped")
            if tracing is not None:  # the spans still held go out now
                await asyncio.to_thread(tracing.shutdown)

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
    shm = SystemSharedMemory(settings.max_shm_regions) if settings.allow_client_shm else None
    dataplane = DataPlane(repo, metrics, shared_memory=shm, tracing=tracing)
    control = ControlPlane(
        repo,
        shared_memory=shm,
        log_level=settings.log_level,
        cluster=cluster,
        trace_settings=tracing.settings if tracing else settings_without_tracing(os.environ),
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
    app.state.repository = repo
    app.state.metrics = metrics
    app.state.dataplane = dataplane
    app.state.control = control
    app.state.grpc = None
    if grpc and settings.grpc_port:
        from service.grpc.server import GrpcServer  # grpcio only where gRPC is served

        app.state.grpc = GrpcServer(dataplane, control, settings, shared_port=grpc_shared_port)
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
