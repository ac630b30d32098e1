"""FastAPI's routes: thin REST adapters over :class:`service.dataplane.DataPlane` and
:class:`service.controlplane.ControlPlane`.

Each handler takes the HTTP request apart, makes one call of either plane, and writes the
answer.
Inference itself is answered by the infer route (``service.rest.infer_route``) before FastAPI
sees it; its route is registered here too, so ``/openapi.json`` documents it, and it hands the
request to the same handler.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.controlplane import ControlPlane
from service.dataplane import DataPlane
from service.errors import InvalidInput, ModelNotReady, PayloadTooLarge, RequestTimeout
from service.observability.metrics import Metrics
from service.protocol.response import dumps_plain
from service.rest.bodies import CONTROL_BODY_BYTES
from service.rest.infer_route import InferRoute
from service.text import safe_text


def json_response(obj: object, status: int = 200) -> Response:
    """A compact JSON response."""
    return Response(dumps_plain(obj), status_code=status, media_type="application/json")


async def read_json_object(
    request: Request, what: str, timeout_s: float | None, *, failure: str = ""
) -> dict[str, Any]:
    """A small JSON object body; ``{}`` for an empty body.

    Args:
        request: the request.
        what: names the body in messages.
        timeout_s: the most seconds the body may take.
        failure: put before the message of a body that is not a JSON object (Triton's
            clients match on ``failed to load`` for a bad load body).

    Raises:
        InvalidInput: not JSON, not an object, or the client went away.
        PayloadTooLarge: more than 1 MiB. RequestTimeout: slower than ``timeout_s``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > CONTROL_BODY_BYTES:
        raise PayloadTooLarge(f"{what} body of {declared} bytes exceeds {CONTROL_BODY_BYTES}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > CONTROL_BODY_BYTES:
                    raise PayloadTooLarge(f"{what} body exceeds {CONTROL_BODY_BYTES} bytes")
    except TimeoutError:
        raise RequestTimeout(f"the {what} body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise InvalidInput("client disconnected while sending the body") from None
    if not body.strip():
        return {}
    prefix = f"{failure}: " if failure else ""
    try:
        obj = json.loads(bytes(body))
    except (ValueError, RecursionError) as e:
        raise InvalidInput(f"{prefix}{what} request JSON is malformed: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidInput(f"{prefix}{what} request must be a JSON object")
    return obj


class _Delegate(Response):
    """A response that is another ASGI handler: the infer route behind FastAPI's routing."""

    def __init__(self, route: InferRoute, target: tuple[str, str | None]) -> None:
        super().__init__()
        self.route = route
        self.target = target

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = scope.get("state", {}).get("request_id", "-")
        await self.route(scope, receive, send, self.target, rid)


@dataclass
class Endpoints:
    """The route handlers, bound to the server's two planes.

    Attributes:
        dataplane: the server's data plane.
        control: the server's control plane.
        metrics: the metrics ``/metrics`` renders.
        infer_route: the infer route (``POST .../infer`` is handed to it).
        body_timeout_s: the most seconds a control body may take to arrive.
    """

    dataplane: DataPlane
    control: ControlPlane
    metrics: Metrics
    infer_route: InferRoute
    body_timeout_s: float | None = 60.0

    async def live(self) -> Response:
        return json_response({"live": True})

    async def ready(self) -> Response:
        why = self.control.not_ready()
        if why is not None:
            raise ModelNotReady(why)
        return json_response({"ready": True})

    async def server_metadata(self) -> Response:
        return json_response(self.dataplane.server_metadata())

    async def model_metadata(self, model: str, version: str | None = None) -> Response:
        return json_response(self.dataplane.model(model, version).metadata())

    async def model_ready(self, model: str, version: str | None = None) -> Response:
        handle = self.dataplane.model(model, version)  # ModelNotReady (503) when not
        return json_response({"name": handle.name, "version": handle.version, "ready": True})

    async def model_config(self, model: str, version: str | None = None) -> Response:
        return json_response(self.dataplane.model(model, version).config())

    async def statistics(self, model: str | None = None, version: str | None = None) -> Response:
        return json_response(self.dataplane.statistics(model, version))

    async def system_shm_status(self, region: str | None = None) -> Response:
        return json_response(self.control.system_shared_memory_status(region))

    async def system_shm_register(self, region: str, request: Request) -> Response:
        body = await read_json_object(request, "register", self.body_timeout_s)
        await self.control.register_system_shared_memory(
            region, body.get("key"), body.get("offset", 0), body.get("byte_size")
        )
        return json_response({})

    async def system_shm_unregister(self, region: str | None = None) -> Response:
        await self.control.unregister_system_shared_memory(region)
        return json_response({})

    async def cuda_shm_status(self, region: str | None = None) -> Response:
        return json_response(self.control.cuda_shared_memory_status(region))

    async def cuda_shm_register(self, region: str) -> Response:
        self.control.register_cuda_shared_memory(region)
        return json_response({})

    async def cuda_shm_unregister(self, region: str | None = None) -> Response:
        self.control.unregister_cuda_shared_memory(region)
        return json_response({})

    async def logging_get(self) -> Response:
        return json_response(self.control.log_settings())

    async def logging_post(self, request: Request) -> Response:
        changes = await read_json_object(request, "logging", self.body_timeout_s)
        return json_response(await self.control.update_log_settings(changes))

    async def trace_get(self, model: str | None = None) -> Response:
        return json_response(self.control.trace_settings(model))

    async def trace_post(self, request: Request, model: str | None = None) -> Response:
        changes = await read_json_object(request, "trace setting", self.body_timeout_s)
        return json_response(await self.control.update_trace_settings(model, changes))

    async def repository_index(self, request: Request) -> Response:
        opts = {}
        if request.method == "POST":
            opts = await read_json_object(request, "repository index", self.body_timeout_s)
        ready = opts.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("repository index: 'ready' must be a boolean")
        return json_response(self.control.repository_index(ready))

    async def load(self, model: str, request: Request) -> Response:
        body = await read_json_object(
            request,
            "load",
            self.body_timeout_s,
            failure=f"failed to load '{safe_text(model, 128)}'",
        )
        await self.control.load(model, body)
        return json_response({})

    async def unload(self, model: str) -> Response:
        await self.control.unload(model)
        return json_response({})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def infer(self, model: str, version: str | None = None) -> Response:
        """``POST /v2/models/{model}[/versions/{version}]/infer``: a V2 inference request
        (JSON, or a JSON header and binary tensors after it: Triton's binary tensor data
        extension with ``Inference-Header-Content-Length``)."""
        return _Delegate(self.infer_route, (model, version))
