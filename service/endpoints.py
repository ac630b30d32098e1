"""Thin REST adapters: HTTP in, repository / protocol calls, HTTP out.

The routes themselves are registered in :func:`service.app.create_app`; nothing here runs at
import time.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

import service
from service.errors import (
    InvalidInput,
    ModelNotReady,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
)
from service.metrics import Metrics
from service.protocol import (
    HEADER_LENGTH,
    CompressionMode,
    EncodedResponse,
    InferRequest,
    InferResponse,
    choose_encoding,
    compress,
    decode_infer_request,
    decompress,
    dumps,
    encode_infer_response,
    parse_header_length,
    raw_input_spec,
    worth_compressing,
)
from service.protocol.compression import MIN_BYTES
from service.protocol.response import wants_binary

# Work above these sizes leaves the event loop for a worker thread; below them the thread hop
# costs more than the work. Decoding is sized by the whole body, not the JSON part: the binary
# part can cost as much (BYTES elements are split in Python, BOOL bytes are scanned).
_THREAD_BYTES = 64 << 10
_THREAD_OUTPUT_BYTES = 64 << 10
# Compressed bodies above this inflate in a worker thread: at ~1000:1 even a small gzip bomb
# is megabytes of inflating.
_THREAD_COMPRESSED_BYTES = 4 << 10
# A body with a Content-Length is read into a buffer of at most this size up front; past it
# the buffer grows as bytes arrive, so a slow client pins only what it has actually sent.
_PREALLOCATE_BYTES = 1 << 20
# How many responses reuse one compression trial's verdict for a model's binary outputs.
_VERDICT_REUSE = 32

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration"]


class Handle(Protocol):
    """What the transport needs of a loaded model (``service.repository.ModelHandle``)."""

    name: str
    version: str

    def is_ready(self) -> bool: ...
    def metadata(self) -> dict[str, Any]: ...
    def config(self) -> dict[str, Any]: ...
    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> object: ...
    async def infer(self, request: InferRequest) -> InferResponse: ...


class Repository(Protocol):
    """What the transport needs of the model repository (``service.repository``)."""

    @property
    def ready(self) -> bool: ...
    async def start(self) -> None: ...
    async def stop(self, timeout_s: float = 30.0) -> None: ...
    def index(self) -> list[dict[str, Any]]: ...
    async def load(self, name: str) -> None: ...
    async def unload(self, name: str) -> None: ...
    def get(self, name: str, version: str | None = None) -> Handle: ...


def json_response(obj: object, status: int = 200) -> Response:
    """A compact JSON response."""
    return Response(dumps(obj), status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytearray:
    """Read the whole body into one buffer, refusing more than ``limit`` bytes.

    A ``Content-Length`` is checked against the limit before a byte is read; a chunked body is
    checked as it arrives. The buffer grows with the bytes received (up to 1 MiB is allocated
    up front), so a client that declares 64 MiB and trickles bytes holds only what it sent.

    Args:
        request: the request whose body to read.
        limit: the most bytes accepted.
        timeout_s: the most seconds the whole body may take to arrive; None: no limit.

    Raises:
        PayloadTooLarge: the body is (or would become) larger than ``limit``.
        InvalidInput: a malformed Content-Length, or the client went away mid-body.
        RequestTimeout: the body took longer than ``timeout_s``.
    """
    declared = request.headers.get("content-length")
    n: int | None = None
    if declared is not None:
        # int() would also take "-1", "+5", "1_0" and " 7 "; HTTP allows only digits.
        if not (declared.isascii() and declared.isdigit()):
            raise InvalidInput(f"malformed Content-Length {declared[:64]!r}") from None
        n = int(declared)
        if n > limit:
            raise PayloadTooLarge(f"request body of {n} bytes exceeds the limit of {limit} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_chunks(request, limit, n)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s (body timeout)"
        ) from None
    except ClientDisconnect:
        raise InvalidInput("client disconnected while sending the body") from None


async def _read_chunks(request: Request, limit: int, n: int | None) -> bytearray:
    if n is not None and n <= _PREALLOCATE_BYTES:
        buf = bytearray(n)  # small: one allocation, each chunk copied once into place
        pos = 0
        async for chunk in request.stream():
            end = pos + len(chunk)
            if end > n:  # the HTTP server enforces this; belt and braces
                raise InvalidInput("request body is longer than its Content-Length")
            buf[pos:end] = chunk
            pos = end
        if pos != n:
            raise InvalidInput(f"request body ended after {pos} of {n} bytes")
        return buf
    # Large or chunked: append as bytes arrive. ``+=`` grows geometrically, and glibc moves a
    # big buffer by remapping its pages, so this is about one copy per byte as well.
    out = bytearray()
    bound = limit if n is None else n
    async for chunk in request.stream():
        if len(out) + len(chunk) > bound:
            if n is not None:
                raise InvalidInput("request body is longer than its Content-Length")
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        out += chunk
    if n is not None and len(out) != n:
        raise InvalidInput(f"request body ended after {len(out)} of {n} bytes")
    return out


class Endpoints:
    """The route handlers, bound to one repository, metrics and settings.

    Args:
        repository: the model repository (see :class:`Repository`).
        metrics: where request outcomes and in-flight counts go.
        max_body_bytes: the body limit, before and after decompression.
        max_json_bytes: the limit of an inference request's JSON part (see ``Settings``).
        body_timeout_s: the most seconds a request body may take to arrive.
        response_compression: the response compression policy (``auto``, ``always``,
            ``never``; see :func:`service.protocol.worth_compressing`).
    """

    def __init__(
        self,
        repository: Repository,
        metrics: Metrics,
        max_body_bytes: int,
        response_compression: CompressionMode = "auto",
        *,
        max_json_bytes: int = 16 << 20,
        body_timeout_s: float | None = 60.0,
    ) -> None:
        self.repository = repository
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_json_bytes = max_json_bytes
        self.body_timeout_s = body_timeout_s
        self.response_compression: CompressionMode = response_compression
        # (model, version) -> (compress?, responses left that reuse this trial's verdict)
        self._verdicts: dict[tuple[str, str], tuple[bool, int]] = {}

    async def live(self) -> Response:
        return json_response({"live": True})

    async def ready(self) -> Response:
        if not self.repository.ready:
            raise ModelNotReady("server is not ready: models are still loading or failed")
        return json_response({"ready": True})

    async def server_metadata(self) -> Response:
        return json_response(
            {"name": "bitserve", "version": service.__version__, "extensions": EXTENSIONS}
        )

    async def model_metadata(self, model: str, version: str | None = None) -> Response:
        return json_response(self.repository.get(model, version).metadata())

    async def model_ready(self, model: str, version: str | None = None) -> Response:
        handle = self.repository.get(model, version)
        if not handle.is_ready():
            raise ModelNotReady(f"model {model!r} is not ready")
        return json_response({"name": handle.name, "version": handle.version, "ready": True})

    async def model_config(self, model: str, version: str | None = None) -> Response:
        return json_response(self.repository.get(model, version).config())

    async def repository_index(self, request: Request) -> Response:
        only_ready = False
        if request.method == "POST":
            body = await read_body(request, 64 << 10, self.body_timeout_s)
            if body.strip():
                try:
                    opts = json.loads(bytes(body))
                except ValueError as e:
                    raise InvalidInput(f"repository index request JSON is malformed: {e}") from None
                if not isinstance(opts, dict):
                    raise InvalidInput("repository index request must be a JSON object")
                ready = opts.get("ready", False)
                if not isinstance(ready, bool):
                    raise InvalidInput("repository index: 'ready' must be a boolean")
                only_ready = ready
        index = self.repository.index()
        if only_ready:
            index = [m for m in index if m.get("state") == "READY"]
        return json_response(index)

    async def load(self, model: str) -> Response:
        await self.repository.load(model)
        return json_response({})

    async def unload(self, model: str) -> Response:
        await self.repository.unload(model)  # it forgets the model's metrics
        return json_response({})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def infer(self, request: Request, model: str, version: str | None = None) -> Response:
        """``POST /v2/models/{model}[/versions/{version}]/infer``."""
        t0 = time.perf_counter()
        label = "_unknown"  # unknown names must not grow the metrics' label set
        outcome = "success"
        self.metrics.in_flight.inc()
        try:
            # Looked up before the body is read, so an unknown model is a fast 404...
            handle = self.repository.get(model, version)
            label = handle.name
            return await self._infer(request, handle, version)
        except ServiceError as e:
            outcome = type(e).__name__
            raise
        except Exception:
            outcome = "InternalError"
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.observe_request(label, outcome, time.perf_counter() - t0)

    async def _infer(self, request: Request, handle: Handle, version: str | None) -> Response:
        limit = self.max_body_bytes
        body: bytes | bytearray = await read_body(request, limit, self.body_timeout_s)
        encoding = request.headers.get("content-encoding")
        if encoding and encoding.strip().lower() != "identity":
            if len(body) > _THREAD_COMPRESSED_BYTES:
                raw = body
                body = await anyio.to_thread.run_sync(
                    lambda: decompress(raw, encoding, limit=limit)
                )
            else:
                body = decompress(body, encoding, limit=limit)
        header_length = parse_header_length(request.headers.get(HEADER_LENGTH), len(body))
        json_bytes = len(body) if header_length is None else header_length
        if json_bytes > self.max_json_bytes:
            raise PayloadTooLarge(
                f"the request's JSON part is {json_bytes} bytes, more than the limit of "
                f"{self.max_json_bytes} bytes; send large tensors as binary data (the "
                "binary_tensor_data extension: Inference-Header-Content-Length and "
                "parameters.binary_data_size)"
            )
        data = body
        model = handle

        def decode() -> InferRequest:
            spec = lambda: raw_input_spec(model.metadata())  # noqa: E731 - only raw bodies call it
            return decode_infer_request(data, header_length, spec, model.check_input)

        if len(body) > _THREAD_BYTES:
            infer_request = await anyio.to_thread.run_sync(decode)
        else:
            infer_request = decode()
        # ...and again now: a reload while the body arrived has retired the version found
        # then (UNLOADING), and the request belongs to the one serving now.
        handle = self.repository.get(handle.name, version)
        result = await handle.infer(infer_request)
        accept = None
        if self.response_compression != "never":
            accept = choose_encoding(request.headers.get("accept-encoding"))
        mode = self.response_compression

        def encode() -> EncodedResponse:
            return encode_infer_response(result, infer_request)

        # Binary outputs are one memcpy; JSON lists cost CPU per element.
        all_binary = all(wants_binary(infer_request, o.name) for o in result.outputs)
        if not all_binary and sum(o.data.nbytes for o in result.outputs) > _THREAD_OUTPUT_BYTES:
            enc = await anyio.to_thread.run_sync(encode)
        else:
            enc = encode()
        if accept is None or len(enc.body) < MIN_BYTES:
            return Response(enc.body, media_type=enc.media_type, headers=enc.headers)
        # A model's binary outputs compress about as well from one response to the next, so
        # the trial's verdict is reused for a while: most responses then skip the thread hop.
        key = (handle.name, handle.version)
        verdict = self._verdicts.get(key) if mode == "auto" and enc.binary_from else None
        if verdict is not None and verdict[1] > 0:
            self._verdicts[key] = (verdict[0], verdict[1] - 1)
            if not verdict[0]:
                return Response(enc.body, media_type=enc.media_type, headers=enc.headers)
            enc = await anyio.to_thread.run_sync(_compressed, enc, accept, "always")
        else:
            enc = await anyio.to_thread.run_sync(_compressed, enc, accept, mode)
            if mode == "auto" and enc.binary_from:
                self._verdicts[key] = ("Content-Encoding" in enc.headers, _VERDICT_REUSE)
        return Response(enc.body, media_type=enc.media_type, headers=enc.headers)


def _compressed(enc: EncodedResponse, encoding: str, mode: CompressionMode) -> EncodedResponse:
    # In a worker thread: even level 1 costs ~1 ms per 100 KB, which the event loop (serving
    # every other connection) must not pay.
    if not worth_compressing(enc.body, enc.binary_from, mode):
        return enc
    headers = {**enc.headers, "Content-Encoding": encoding}
    return EncodedResponse(compress(enc.body, encoding), headers, enc.media_type, enc.binary_from)
