"""REST's inference: the V2 REST framing around the data plane.

A request body is inflated (``Content-Encoding``, bounded by ``max_body_bytes``, in a worker
thread when it is more than a few KiB), its JSON part bounded by ``max_json_bytes`` and
decoded with Triton's binary tensor extension (``Inference-Header-Content-Length``); the
response is framed the same way and compressed when the client accepts it and the policy
says so (``response_compression``). What is decided about the request itself is the data
plane's (:meth:`service.dataplane.DataPlane.infer_with`, over its core ``service.ticket``), as
for gRPC; the answer's builders (:func:`answer_headers`, :func:`frame`) serve the express lane
too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from service.dataplane import THREAD_BYTES, DataPlane, decode_sized, off_loop
from service.errors import PayloadTooLarge
from service.models.handle import ModelHandle
from service.protocol import (
    CompressionMode,
    EncodedResponse,
    InferRequest,
    InferResponse,
    decompress,
    encode_infer_response,
    parse_header_length,
    worth_compressing,
)
from service.protocol.compression import MIN_BYTES
from service.protocol.response import compress_response, wants_binary

if TYPE_CHECKING:
    from service.observability.tracing import RequestTrace

# Compressed bodies above this inflate in a worker thread: at ~1000:1 even a small gzip bomb
# is megabytes of inflating.
_THREAD_COMPRESSED_BYTES = 4 << 10
# How many responses reuse one compression trial's verdict for a model's binary outputs.
_VERDICT_REUSE = 32


class RestInference:
    """V2 REST inference over one data plane.

    Args:
        dataplane: the server's data plane.
        max_body_bytes: the limit of a request body after decompression.
        max_json_bytes: the limit of an inference request's JSON part.
        response_compression: the response compression policy (``auto``, ``always``,
            ``never``; see :func:`service.protocol.worth_compressing`).
    """

    def __init__(
        self,
        dataplane: DataPlane,
        *,
        max_body_bytes: int = 64 << 20,
        max_json_bytes: int = 16 << 20,
        response_compression: CompressionMode = "auto",
    ) -> None:
        self.dataplane = dataplane
        self.max_body_bytes = max_body_bytes
        self.max_json_bytes = max_json_bytes
        self.response_compression: CompressionMode = response_compression
        # (model, version) -> (compress?, responses left that reuse this trial's verdict)
        self._verdicts: dict[tuple[str, str], tuple[bool, int]] = {}

    async def infer(
        self,
        name: str,
        version: str | None,
        read_body: Callable[[], Awaitable[bytes | bytearray]],
        *,
        content_encoding: str | None = None,
        header_length: str | None = None,
        accept_encoding: str | None = None,
        reserve: Callable[[int], None] | None = None,
        trace: RequestTrace | None = None,
    ) -> EncodedResponse:
        """One V2 REST inference: body in, framed (and maybe compressed) response out.

        The model is looked up and its queue checked before ``read_body`` is awaited, so an
        unknown model or a full queue is answered without reading the upload (see
        :meth:`service.dataplane.DataPlane.infer_with`).

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
            trace: the request's trace, when it is traced
                (:meth:`service.observability.tracing.Tracing.begin`); its body sizes are recorded
                on it.

        Raises:
            ServiceError: with the status the transport answers.
        """
        body: bytes | bytearray | None = None

        async def decode(handle: ModelHandle) -> InferRequest:
            nonlocal body
            if body is None:
                body = await read_body()
                if trace is not None:
                    trace.set("http.request.body.size", len(body))
            return await self._decode(handle, body, content_encoding, header_length, reserve)

        async def encode(
            handle: ModelHandle, request: InferRequest, response: InferResponse
        ) -> EncodedResponse:
            enc = await self._encode(handle, request, response, accept_encoding)
            if trace is not None:
                trace.set("http.response.body.size", len(enc.body))
            return enc

        return await self.dataplane.infer_with(name, version, decode, encode, trace)

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
                body = await off_loop(
                    lambda: decompress(raw, encoding, limit=limit, reserve=reserve)
                )
            else:
                body = decompress(raw, encoding, limit=limit, reserve=reserve)
        data = body
        return await decode_sized(len(body), lambda: self.decode_now(handle, data, header_length))

    def decode_now(
        self, handle: ModelHandle, body: bytes | bytearray, header_length: str | None
    ) -> InferRequest:
        """Decode an uncompressed body for ``handle``'s model (its JSON part bounded by
        ``max_json_bytes``), here and now.

        Raises:
            InvalidInput, PayloadTooLarge: the body does not decode for the model.
        """
        n = parse_header_length(header_length, len(body))
        json_bytes = len(body) if n is None else n
        if json_bytes > self.max_json_bytes:
            raise PayloadTooLarge(
                f"the request's JSON part is {json_bytes} bytes, more than the limit of "
                f"{self.max_json_bytes} bytes; send large tensors as binary data (the "
                "binary_tensor_data extension: Inference-Header-Content-Length and "
                "parameters.binary_data_size)"
            )
        return handle.headers.decode(body, n, handle.signature, self.dataplane.shared_memory)

    async def _encode(
        self,
        handle: ModelHandle,
        request: InferRequest,
        response: InferResponse,
        accept: str | None,
    ) -> EncodedResponse:
        if encodes_in_thread(request, response):
            enc = await off_loop(lambda: encode_infer_response(response, request))
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
            return await off_loop(lambda: _compressed(enc, accept, "always"))
        out = await off_loop(lambda: _compressed(enc, accept, mode))
        if mode == "auto" and enc.binary_from:
            self._verdicts[key] = ("Content-Encoding" in out.headers, _VERDICT_REUSE)
        return out


def answer_headers(enc: EncodedResponse, request_id: str) -> list[tuple[bytes, bytes]]:
    """The headers of an inference's 200 answer, for both REST ways (the infer route's ASGI
    answer and the express lane's bytes: the same headers, framed by
    ``service.rest.http_cycle.frame_head``)."""
    headers = [
        (b"content-type", enc.media_type.encode()),
        (b"content-length", b"%d" % len(enc.body)),
        (b"x-request-id", request_id.encode()),
    ]
    for k, v in enc.headers.items():
        headers.append((k.lower().encode(), v.encode()))
    return headers


def frame(
    request: InferRequest,
    response: InferResponse,
    then: Callable[[EncodedResponse | BaseException], None],
) -> EncodedResponse | asyncio.Task[None]:
    """Frame ``response`` (uncompressed) for a caller without coroutines: returned now, or
    when :func:`encodes_in_thread`, a worker thread's task (returned) gives it to ``then``
    (or its error: a cancelled task, its CancelledError)."""
    if not encodes_in_thread(request, response):
        return encode_infer_response(response, request)

    async def framed() -> None:
        try:
            then(await off_loop(lambda: encode_infer_response(response, request)))
        except (Exception, asyncio.CancelledError) as e:
            then(e)

    return asyncio.get_running_loop().create_task(framed())


def encodes_in_thread(request: InferRequest, response: InferResponse) -> bool:
    """Whether framing ``response`` belongs in a worker thread: binary outputs are one
    memcpy, JSON lists cost CPU per element (outputs in shared memory are not in the body
    at all)."""
    outs = [o for o in response.outputs if not o.in_shared_memory]
    if all(wants_binary(request, o.name) for o in outs):
        return False
    return sum(o.data.nbytes for o in outs) > THREAD_BYTES


def _compressed(enc: EncodedResponse, encoding: str, mode: CompressionMode) -> EncodedResponse:
    # In a worker thread: even level 1 costs ~1 ms per 100 KB, which the event loop (serving
    # every other connection) must not pay.
    if not worth_compressing(enc.body, enc.binary_from, mode):
        return enc
    return compress_response(enc, encoding)
