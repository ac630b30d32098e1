"""``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``: thin adapters over the data
plane.

Each handler takes its message apart, makes one :class:`service.dataplane.DataPlane` call and
builds the answer (``service.grpc.codec``); lookups, checks, capacity, metrics and messages
are the data plane's, as for REST. Inference goes through :meth:`DataPlane.infer_with` with
gRPC's decoder and encoder.

ModelStreamInfer computes the requests of a stream concurrently (so they batch with each
other and with everyone else's) and answers them in the order they came; an error is
answered in-band (``error_message``) and the stream goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.config import valid_model_name
from service.dataplane import DataPlane, decode_sized
from service.errors import ModelNotFound, ServiceError, Unimplemented
from service.grpc import codec
from service.grpc.codec import EMPTY_FINAL_RESPONSE
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.proto import health_pb2
from service.grpc.routes import AppRoutes
from service.grpc.rpc import Context, Rpcs, log, safe_details
from service.handle import ModelHandle
from service.observability import request_id_var
from service.protocol.types import InferRequest, InferResponse

SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
STREAM_WINDOW = 64
"""Requests of one stream being computed at once; past it the stream is read no further
(HTTP/2 flow control then holds the client back)."""

_Serving = health_pb2.HealthCheckResponse.ServingStatus


class _UnknownService(ServiceError):
    status_code = 404


def _deadline_us(context: Context, timeout_us: int | None) -> int | None:
    """The request's ``timeout`` parameter, shortened to the call's gRPC deadline (if any)."""
    remaining = context.time_remaining()
    if remaining is None:
        return timeout_us
    left = max(1, int(remaining * 1e6))  # 0 would mean "no timeout" to the batcher
    return left if not timeout_us else min(timeout_us, left)  # timeout 0: none of its own


def _stream_frame(infer_response: bytes) -> bytes:
    """A ``ModelStreamInferResponse`` holding the serialized ``infer_response`` (field 2),
    framed by hand so the response's bytes are not parsed and copied again."""
    n = len(infer_response)
    length = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    return b"\x12" + bytes(length) + infer_response


class GrpcEndpoints:
    """The RPC handlers, bound to one data plane.

    Args:
        dataplane: the server's data plane.
        rpcs: the call envelope (auth, logging, status codes).
        routes: the application's control routes, which state changes and readiness go
            through (``service.grpc.routes``: with ``--workers``, cluster-wide).
    """

    def __init__(self, dataplane: DataPlane, rpcs: Rpcs, routes: AppRoutes) -> None:
        self.dataplane = dataplane
        self.rpcs = rpcs
        self.routes = routes

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """grpcio's handlers of both services."""
        unary = self.rpcs.unary
        table: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "ModelInfer": unary("ModelInfer", None, self.model_infer),  # parsed by the handler
            "ModelStreamInfer": self.rpcs.stream("ModelStreamInfer", self.model_stream_infer),
        }
        for name, fn in (
            ("ServerLive", self.server_live),
            ("ServerReady", self.server_ready),
            ("ModelReady", self.model_ready),
            ("ServerMetadata", self.server_metadata),
            ("ModelMetadata", self.model_metadata),
            ("ModelConfig", self.model_config),
            ("ModelStatistics", self.model_statistics),
            ("RepositoryIndex", self.repository_index),
            ("RepositoryModelLoad", self.repository_model_load),
            ("RepositoryModelUnload", self.repository_model_unload),
            ("SystemSharedMemoryStatus", self.shm_status),
            ("SystemSharedMemoryRegister", self.shm_register),
            ("SystemSharedMemoryUnregister", self.shm_unregister),
            ("CudaSharedMemoryStatus", self.cuda_shm_status),
            ("CudaSharedMemoryRegister", self.cuda_shm_register),
            ("CudaSharedMemoryUnregister", self.cuda_shm_unregister),
            ("TraceSetting", self.trace_setting),
            ("LogSettings", self.log_settings),
        ):
            request_type = getattr(pb, f"{name}Request")  # the service's naming
            open_ = name in ("ServerLive", "ServerReady")  # as REST's health routes
            table[name] = unary(name, request_type, fn, open_=open_)
        health = {"Check": unary("Check", health_pb2.HealthCheckRequest, self.check, open_=True)}
        return [
            grpc.method_handlers_generic_handler(SERVICE, table),
            grpc.method_handlers_generic_handler(HEALTH_SERVICE, health),
        ]

    # --- health and metadata --------------------------------------------------------------

    async def server_live(self, request: Any, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def _ready(self) -> bool:
        return await self.routes.ready()

    async def server_ready(self, request: Any, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._ready())

    async def check(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        """``grpc.health.v1.Health/Check``: the server (``""``) or the inference service is
        SERVING when every model is ready (Kubernetes' gRPC probe asks this)."""
        if request.service not in ("", SERVICE):
            raise _UnknownService(f"unknown service '{safe_details(request.service[:200])}'")
        ready = await self._ready()
        return health_pb2.HealthCheckResponse(
            status=_Serving.SERVING if ready else _Serving.NOT_SERVING
        )

    async def model_ready(
        self, request: pb.ModelReadyRequest, context: Context
    ) -> pb.ModelReadyResponse:
        """Whether the model (version) serves; an unknown model is not ready (as in Triton)."""
        try:
            ready = self.dataplane.model_ready(request.name, request.version or None)
        except ModelNotFound:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(self, request: Any, context: Context) -> pb.ServerMetadataResponse:
        meta = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        handle = self.dataplane.model(request.name, request.version or None)
        return codec.model_metadata(handle.metadata())

    async def model_config(
        self, request: pb.ModelConfigRequest, context: Context
    ) -> pb.ModelConfigResponse:
        handle = self.dataplane.model(request.name, request.version or None)
        return codec.model_config(handle.config())

    # --- repository -----------------------------------------------------------------------

    async def repository_index(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        return codec.repository_index(self.dataplane.repository_index(request.ready))

    async def _change(self, name: str, action: str, body: dict[str, Any]) -> None:
        if valid_model_name(name):
            await self._post(f"/v2/repository/models/{name}/{action}", body)
        elif action == "load":  # a name no route takes: the data plane refuses it, as for REST
            await self.dataplane.load(name, self.dataplane.load_parameters(name, body))
        else:
            await self.dataplane.unload(name)

    async def repository_model_load(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        """Load or reload; ``parameters["config"]`` (a JSON string) overrides the model's
        config for this load, as Triton's; model files (``file:`` parameters) are refused."""
        params = codec.json_safe(codec.parameters_from_proto(request.parameters))
        body = {"parameters": params} if params else {}
        await self._change(request.model_name, "load", body)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        await self._change(request.model_name, "unload", {})
        return pb.RepositoryModelUnloadResponse()

    # --- extensions -----------------------------------------------------------------------

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        stats = self.dataplane.statistics(request.name or None, request.version or None)
        return codec.message(stats, pb.ModelStatisticsResponse)

    async def trace_setting(self, request: Any, context: Context) -> pb.TraceSettingResponse:
        raise Unimplemented(
            "bitserve does not support Triton's trace extension: TraceSetting is not available "
            "(request timings are in the Prometheus metrics at /metrics)"
        )

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await self.routes.post(path, body, request_id_var.get())

    async def shm_status(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        regions = self.dataplane.system_shared_memory_status(request.name or None)
        return codec.regions(regions, pb.SystemSharedMemoryStatusResponse)

    async def shm_register(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        body = {"key": request.key, "offset": request.offset, "byte_size": request.byte_size}
        region = codec.path_part(request.name)
        await self._post(f"/v2/systemsharedmemory/region/{region}/register", body)
        return pb.SystemSharedMemoryRegisterResponse()

    async def shm_unregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        """Unregister a region; ``name`` empty: every region."""
        if request.name:
            region = codec.path_part(request.name)
            await self._post(f"/v2/systemsharedmemory/region/{region}/unregister", {})
        else:
            await self._post("/v2/systemsharedmemory/unregister", {})
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_shm_status(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        regions = self.dataplane.cuda_shared_memory_status(request.name or None)
        return codec.regions(regions, pb.CudaSharedMemoryStatusResponse)

    async def cuda_shm_register(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        """Refused with the data plane's message: CUDA shared memory is not supported."""
        self.dataplane.register_cuda_shared_memory(request.name)
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_shm_unregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        self.dataplane.unregister_cuda_shared_memory(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def log_settings(
        self, request: pb.LogSettingsRequest, context: Context
    ) -> pb.LogSettingsResponse:
        """Triton's logging extension: the settings given are changed (all or nothing, on every
        worker), and every setting is answered."""
        changes = codec.parameters_from_proto(request.settings)
        if changes:
            settings = await self._post("/v2/logging", changes)
        else:
            settings = self.dataplane.log_settings()
        return codec.log_settings(settings)

    # --- inference ------------------------------------------------------------------------

    async def _infer(
        self, msg: pb.ModelInferRequest, size: int, context: Context, *, streamed: bool = False
    ) -> bytes:
        """One inference of a parsed request of ``size`` bytes: the serialized response
        (ServiceError for a refused request). In a stream, a request that asked for
        ``triton_enable_empty_final_response`` gets its (only, so final) response marked
        ``triton_final_response``."""

        async def decode(handle: ModelHandle) -> InferRequest:
            signature, shm = handle.signature, self.dataplane.shared_memory
            request = await decode_sized(
                size, lambda: codec.decode_infer_request(msg, signature, shm)
            )
            request.timeout_us = _deadline_us(context, request.timeout_us)
            return request

        async def encode(
            handle: ModelHandle, request: InferRequest, response: InferResponse
        ) -> bytes:
            final = msg.parameters.get(EMPTY_FINAL_RESPONSE)  # [] would add the key
            if streamed and final is not None and final.bool_param:
                response.parameters["triton_final_response"] = True
            return codec.encode_infer_response(response).SerializeToString()

        return await self.dataplane.infer_with(
            msg.model_name, msg.model_version or None, decode, encode
        )

    async def model_infer(self, raw: bytes, context: Context) -> bytes:
        return await self._infer(codec.parse(pb.ModelInferRequest, raw), len(raw), context)

    async def _stream_one(self, raw: bytes, context: Context) -> bytes:
        """One request of a stream: its response, or its error in ``error_message``."""
        rid = self.rpcs.request_ids(None)
        request_id_var.set(rid)  # in this task's own context
        echo = pb.ModelInferResponse()
        try:
            msg = codec.parse(pb.ModelInferRequest, raw)
            echo = pb.ModelInferResponse(
                model_name=msg.model_name, model_version=msg.model_version, id=msg.id
            )
            return _stream_frame(await self._infer(msg, len(raw), context, streamed=True))
        except ServiceError as e:
            _, message, _ = self.rpcs.status(e, "ModelStreamInfer")
        except Exception:
            log.exception("unhandled error in gRPC ModelStreamInfer")
            message = f"internal error (request id {rid})"
        return pb.ModelStreamInferResponse(
            error_message=message, infer_response=echo
        ).SerializeToString()

    async def model_stream_infer(
        self, requests: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[bytes]:
        """ModelStreamInfer: each request computed as it arrives, answered in arrival order."""
        window: asyncio.Queue[asyncio.Task[bytes] | None] = asyncio.Queue(STREAM_WINDOW)

        async def read() -> None:
            try:
                async for raw in requests:
                    await window.put(asyncio.create_task(self._stream_one(raw, context)))
            finally:
                await window.put(None)

        reader = asyncio.create_task(read())
        task: asyncio.Task[bytes] | None = None
        try:
            while (task := await window.get()) is not None:
                yield await task
            await reader  # the client's half-close, or its error
        finally:  # the call ended early (cancelled, or the client's error): drop the rest
            reader.cancel()
            if task is not None:
                task.cancel()
            while not window.empty():
                pending = window.get_nowait()
                if pending is not None:
                    pending.cancel()
