"""The data plane: everything about a request, decided once, for every transport.

Transports (the REST fast path in ``service.rest``, FastAPI's control routes, gRPC) are thin
adapters: they take their envelope apart, call a method here, and write the answer back in
their own envelope. The data plane decodes (the V2 REST framing), checks the request against
the model once (``service.signature``), submits it to the model's batcher, builds the
response, frames it for REST, and decides whether to compress it; it also counts requests in
the metrics. Model state belongs to the repository alone (``service.repository``).

The model layout is after MLServer's ``handlers/dataplane.py`` ("used by both the gRPC and
REST servers").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import service
from service.errors import ModelNotReady, PayloadTooLarge, ServiceError
from service.handle import ModelHandle
from service.metrics import Metrics
from service.protocol import (
    CompressionMode,
    EncodedResponse,
    InferRequest,
    InferResponse,
    ResponseOutput,
    decode_infer_request,
    decompress,
    encode_infer_response,
    parse_header_length,
    worth_compressing,
)
from service.protocol.compression import MIN_BYTES
from service.protocol.response import compress_response, wants_binary

T = TypeVar("T")

# Work above these sizes leaves the event loop for a worker thread; below them the thread hop
# costs more than the work. Decoding is sized by the whole body, not the JSON part: the binary
# part can cost as much (BYTES elements are split in Python, BOOL bytes are scanned).
_THREAD_BYTES = 64 << 10
_THREAD_OUTPUT_BYTES = 64 << 10
# Compressed bodies above this inflate in a worker thread: at ~1000:1 even a small gzip bomb
# is megabytes of inflating.
_THREAD_COMPRESSED_BYTES = 4 << 10
# How many responses reuse one compression trial's verdict for a model's binary outputs.
_VERDICT_REUSE = 32

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration"]


class Repository(Protocol):
    """What the data plane needs of the model repository (``service.repository``)."""

    @property
    def ready(self) -> bool: ...
    async def start(self) -> None: ...
    async def stop(self, timeout_s: float = 30.0) -> None: ...
    def index(self) -> list[dict[str, Any]]: ...
    async def load(self, name: str) -> None: ...
    async def unload(self, name: str) -> None: ...
    def get(self, name: str, version: str | None = None) -> ModelHandle: ...


async def _off_loop(fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def infer(handle: ModelHandle, request: InferRequest) -> InferResponse:
    """Check a decoded request against its model, compute it, and build the response.

    The request's inputs have passed ``handle.signature.check_input`` in their decoder.

    Raises:
        InvalidInput: the request does not fit the model (never queued). Overloaded,
            DeadlineExceeded, ModelNotReady, ServiceError: see ``Batcher.submit``.
    """
    bound = handle.signature.bind(request)
    arrays, info = await handle.submit(bound, request.timeout_us)
    outputs = handle.signature.outputs
    return InferResponse(
        model_name=handle.name,
        model_version=handle.version,
        id=request.id,
        outputs=[
            ResponseOutput(
                name=outputs[i].name,
                datatype=outputs[i].datatype,
                shape=arrays[i].shape,
                data=arrays[i],
            )
            for i in bound.outputs
        ],
        parameters={"batch_size": info.batch_size, "batch_requests": info.batch_requests},
    )


class DataPlane:
    """The server's logic, behind every transport.

    Args:
        repository: the model repository (the only owner of model state).
        metrics: where request outcomes and in-flight counts go.
        max_body_bytes: the limit of a request body after decompression.
        max_json_bytes: the limit of an inference request's JSON part.
        response_compression: the response compression policy (``auto``, ``always``,
            ``never``; see :func:`service.protocol.worth_compressing`).
    """

    def __init__(
        self,
        repository: Repository,
        metrics: Metrics,
        *,
        max_body_bytes: int = 64 << 20,
        max_json_bytes: int = 16 << 20,
        response_compression: CompressionMode = "auto",
    ) -> None:
        self.repository = repository
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_json_bytes = max_json_bytes
        self.response_compression: CompressionMode = response_compression
        # (model, version) -> (compress?, responses left that reuse this trial's verdict)
        self._verdicts: dict[tuple[str, str], tuple[bool, int]] = {}

    # --- server and models ----------------------------------------------------------------

    def ready(self) -> bool:
        """Whether every model is loaded and the server is not stopping."""
        return self.repository.ready

    def server_metadata(self) -> dict[str, Any]:
        """V2 server metadata."""
        return {"name": "bitserve", "version": service.__version__, "extensions": EXTENSIONS}

    def model(self, name: str, version: str | None = None) -> ModelHandle:
        """The READY handle of a model version (the highest READY one by default).

        Raises:
            ModelNotFound: no such model or version. ModelNotReady: not READY.
        """
        return self.repository.get(name, version)

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether the model (version) serves; unknown names raise ModelNotFound."""
        try:
            self.repository.get(name, version)
        except ModelNotReady:
            return False
        return True

    def repository_index(self) -> list[dict[str, Any]]:
        """Triton's repository index."""
        return self.repository.index()

    async def load(self, name: str) -> None:
        """(Re)load a model from the repository."""
        await self.repository.load(name)

    async def unload(self, name: str) -> None:
        """Unload a model."""
        await self.repository.unload(name)

    # --- inference ------------------------------------------------------------------------

    async def infer(self, handle: ModelHandle, request: InferRequest) -> InferResponse:
        """:func:`infer` (for transports that decode on their own, such as gRPC)."""
        return await infer(handle, request)

    async def infer_rest(
        self,
        name: str,
        version: str | None,
        read_body: Callable[[], Awaitable[bytes | bytearray]],
        *,
        content_encoding: str | None = None,
        header_length: str | None = None,
        accept_encoding: str | None = None,
        reserve: Callable[[int], None] | None = None,
    ) -> EncodedResponse:
        """One V2 REST inference: body in, framed (and maybe compressed) response out.

        The model is looked up and its queue checked before ``read_body`` is awaited, so an
        unknown model or a full queue is answered without reading the upload.

        Args:
            name, version: the model (version None: the highest READY one).
            read_body: reads the request body as received (the transport's part).
            content_encoding: its ``Content-Encoding`` header, if any.
            header_length: its ``Inference-Header-Content-Length`` header, if any.
            accept_encoding: an encoding the client accepts (``gzip``/``deflate``; see
                :func:`service.protocol.choose_encoding`), or None.
            reserve: the transport's memory budget for a compressed body's inflated copy:
                called with its size as it grows, possibly from a worker thread (see
                :func:`service.protocol.decompress`); it raises to refuse.

        Raises:
            ServiceError: with the status the transport answers.
        """
        t0 = time.perf_counter()
        label = "_unknown"  # unknown names must not grow the metrics' label set
        outcome = "success"
        self.metrics.in_flight.inc()
        try:
            handle = self.repository.get(name, version)
            label = handle.name
            handle.batcher.check_capacity()
            body = await read_body()
            request = await self._decode(handle, body, content_encoding, header_length, reserve)
            # Looked up again: a reload during a decode off the loop retires the version
            # found first, and the request belongs to the one serving now (decoded again if
            # the reload changed what the model accepts).
            current = self.repository.get(handle.name, version)
            if current is not handle:
                if not current.signature.same_as(handle.signature):
                    request = await self._decode(
                        current, body, content_encoding, header_length, reserve
                    )
                handle = current
            response = await self.infer(handle, request)
            return await self._encode(handle, request, response, accept_encoding)
        except ServiceError as e:
            outcome = type(e).__name__
            raise
        except Exception:
            outcome = "InternalError"
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.observe_request(label, outcome, time.perf_counter() - t0)

    async def _decode(
        self,
        handle: ModelHandle,
        body: bytes | bytearray,
        encoding: str | None,
        header_length: str | None,
        reserve: Callable[[int], None] | None = None,
    ) -> InferRequest:
        limit = self.max_body_bytes
        if encoding and encoding.strip().lower() != "identity":
            raw = body
            if len(body) > _THREAD_COMPRESSED_BYTES:
                body = await _off_loop(
                    lambda: decompress(raw, encoding, limit=limit, reserve=reserve)
                )
            else:
                body = decompress(raw, encoding, limit=limit, reserve=reserve)
        n = parse_header_length(header_length, len(body))
        json_bytes = len(body) if n is None else n
        if json_bytes > self.max_json_bytes:
            raise PayloadTooLarge(
                f"the request's JSON part is {json_bytes} bytes, more than the limit of "
                f"{self.max_json_bytes} bytes; send large tensors as binary data (the "
                "binary_tensor_data extension: Inference-Header-Content-Length and "
                "parameters.binary_data_size)"
            )
        data, signature = body, handle.signature
        if len(body) > _THREAD_BYTES:
            return await _off_loop(lambda: decode_infer_request(data, n, signature))
        return decode_infer_request(data, n, signature)

    async def _encode(
        self,
        handle: ModelHandle,
        request: InferRequest,
        response: InferResponse,
        accept: str | None,
    ) -> EncodedResponse:
        # Binary outputs are one memcpy; JSON lists cost CPU per element.
        all_binary = all(wants_binary(request, o.name) for o in response.outputs)
        if not all_binary and sum(o.data.nbytes for o in response.outputs) > _THREAD_OUTPUT_BYTES:
            enc = await _off_loop(lambda: encode_infer_response(response, request))
        else:
            enc = encode_infer_response(response, request)
        mode = self.response_compression
        if accept is None or mode == "never" or len(enc.body) < MIN_BYTES:
            return enc
        # A model's binary outputs compress about as well from one response to the next, so
        # the trial's verdict is reused for a while: most responses then skip the thread hop.
        key = (handle.name, handle.version)
        verdict = self._verdicts.get(key) if mode == "auto" and enc.binary_from else None
        if verdict is not None and verdict[1] > 0:
            self._verdicts[key] = (verdict[0], verdict[1] - 1)
            if not verdict[0]:
                return enc
            return await _off_loop(lambda: _compressed(enc, accept, "always"))
        out = await _off_loop(lambda: _compressed(enc, accept, mode))
        if mode == "auto" and enc.binary_from:
            self._verdicts[key] = ("Content-Encoding" in out.headers, _VERDICT_REUSE)
        return out


def _compressed(enc: EncodedResponse, encoding: str, mode: CompressionMode) -> EncodedResponse:
    # In a worker thread: even level 1 costs ~1 ms per 100 KB, which the event loop (serving
    # every other connection) must not pay.
    if not worth_compressing(enc.body, enc.binary_from, mode):
        return enc
    return compress_response(enc, encoding)
