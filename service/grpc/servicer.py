"""``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``: thin adapters over the data
plane and the control plane.

Each handler takes its message apart, makes one :class:`service.dataplane.DataPlane` or
:class:`service.controlplane.ControlPlane` call and builds the answer (``service.grpc.codec``);
lookups, checks, capacity, state changes, readiness, metrics and messages are the planes', as
for REST. Inference goes through :meth:`DataPlane.infer_with` (the data plane's core,
``service.ticket``, for a coroutine caller) with gRPC's decoder and encoder.

ModelStreamInfer computes the requests of a stream concurrently (so they batch with each
other and with everyone else's) and answers them in the order they came; an error is
answered in-band (``error_message``) and the stream goes on.

A call cancelled by its client, or past its own gRPC deadline, is cancelled here by grpcio:
a request still queued for its batch is dropped and never computed (as an HTTP request
whose client closed its connection), and counted in ``bitserve_requests_cancelled_total``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.controlplane import ControlPlane
from service.dataplane import DataPlane, decode_sized
from service.errors import ModelNotFound, NotFound, ServiceError
from service.grpc import codec
from service.grpc.codec import EMPTY_FINAL_RESPONSE
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.proto import health_pb2
from service.grpc.rpc import Context, Rpcs, log
from service.models.handle import ModelHandle
from service.observability.request_ids import request_id_var
from service.protocol.types import InferRequest, InferResponse
from service.text import safe_text

SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
STREAM_WINDOW = 64
"""Requests of one stream being computed at once; past it the stream is read no further
(HTTP/2 flow control then holds the client back)."""

_Serving = health_pb2.HealthCheckResponse.ServingStatus


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
    """The RPC handlers, bound to the server's two planes.

    Args:
        dataplane: the server's data plane.
        control: the server's control plane (state changes and readiness; under
            ``--workers``, server-wide).
        rpcs: the call envelope (auth, logging, status codes).
    """

    def __init__(self, dataplane: DataPlane, control: ControlPlane, rpcs: Rpcs) -> None:
        self.dataplane = dataplane
        self.control = control
        self.rpcs = rpcs

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

    async def server_ready(self, request: Any, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.control.ready())

    async def check(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        """``grpc.health.v1.Health/Check``: the server (``""``) or the inference service is
        SERVING when every model is ready (Kubernetes' gRPC probe asks this)."""
        if request.service not in ("", SERVICE):
            raise NotFound(f"unknown service '{safe_text(request.service, 200)}'")
        ready = self.control.ready()
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
        return codec.repository_index(self.control.repository_index(request.ready))

    async def repository_model_load(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        """Load or reload; ``parameters["config"]`` (a JSON string) overrides the model's
        config for this load, as Triton's; model files (``file:`` parameters) are refused."""
        params = codec.parameters_from_proto(request.parameters)
        await self.control.load(request.model_name, {"parameters": params} if params else {})
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        await self.control.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # --- extensions -----------------------------------------------------------------------

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        stats = self.dataplane.statistics(request.name or None, request.version or None)
        return codec.message(stats, pb.ModelStatisticsResponse)

    async def trace_setting(
        self, request: pb.TraceSettingRequest, context: Context
    ) -> pb.TraceSettingResponse:
        """Triton's trace extension: the settings given are changed (on every worker; a
        setting with no value is cleared), and the settings in force are answered."""
        model = request.model_name or None
        changes = codec.trace_changes(request.settings)
        if changes:
            return codec.trace_settings(await self.control.update_trace_settings(model, changes))
        return codec.trace_settings(self.control.trace_settings(model))

    async def shm_status(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        regions = self.control.system_shared_memory_status(request.name or None)
        return codec.regions(regions, pb.SystemSharedMemoryStatusResponse)

    async def shm_register(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        await self.control.register_system_shared_memory(
            request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    async def shm_unregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        """Unregister a region; ``name`` empty: every region."""
        await self.control.unregister_system_shared_memory(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_shm_status(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        regions = self.control.cuda_shared_memory_status(request.name or None)
        return codec.regions(regions, pb.CudaSharedMemoryStatusResponse)

    async def cuda_shm_register(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        """Refused with the control plane's message: CUDA shared memory is not supported."""
        self.control.register_cuda_shared_memory(request.name)
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_shm_unregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        self.control.unregister_cuda_shared_memory(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def log_settings(
        self, request: pb.LogSettingsRequest, context: Context
    ) -> pb.LogSettingsResponse:
        """Triton's logging extension: the settings given are changed (all or nothing, on every
        worker), and every setting is answered."""
        changes = codec.parameters_from_proto(request.settings)
        return codec.log_settings(await self.control.update_log_settings(changes))

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
            return await decode_sized(size, lambda: codec.decode_infer_request(msg, signature, shm))

        async def encode(
            handle: ModelHandle, request: InferRequest, response: InferResponse
        ) -> bytes:
            final = msg.parameters.get(EMPTY_FINAL_RESPONSE)  # [] would add the key
            if streamed and final is not None and final.bool_param:
                response.parameters["triton_final_response"] = True
            return codec.encode_infer_response(response).SerializeToString()

        trace = None
        tracing = self.dataplane.tracing
        if tracing is not None:  # tracing off: no metadata is looked at for it
            method = "ModelStreamInfer" if streamed else "ModelInfer"
            attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method}
            metadata = context.invocation_metadata() or ()
            trace = tracing.begin(msg.model_name, metadata, f"{SERVICE}/{method}", attributes)
        return await self.dataplane.infer_with(
            msg.model_name, msg.model_version or None, decode, encode, trace
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
