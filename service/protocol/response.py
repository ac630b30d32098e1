"""Encoding V2 inference responses: JSON outputs, Triton binary outputs, compression.

An output is sent as binary when its requested ``parameters.binary_data`` is true, or when it
does not say and the request's ``parameters.binary_data_output`` is true (the raw binary form
sets that). Binary outputs follow the JSON header in output order; the header's length goes in
``Inference-Header-Content-Length`` (of the uncompressed body, as Triton does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from service.protocol.compression import compress
from service.protocol.tensors import as_bf16_bits, to_binary_bytes, to_json_data
from service.protocol.types import BF16, BYTES, InferRequest, InferResponse, ResponseOutput

JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


@dataclass
class EncodedResponse:
    """A framed response body and the headers that describe it."""

    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str = JSON_TYPE
    binary_from: int | None = None
    """Where binary tensor data starts in the uncompressed body (None: JSON only)."""


def dumps(obj: object) -> bytes:
    """Compact JSON bytes (``NaN``/``Infinity`` as Python's json writes them, like Triton)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def dumps_plain(obj: object) -> bytes:
    """:func:`dumps` for objects without floats (orjson, many times faster; it would write
    a NaN as ``null``): the headers of binary responses, error bodies, descriptions."""
    return orjson.dumps(obj)


def binary_payload(out: ResponseOutput) -> bytes | memoryview:
    """An output's data as Triton's binary form (little-endian elements, BYTES
    length-prefixed, BF16 as its bits): REST's binary outputs and gRPC's raw contents."""
    if out.datatype == BYTES:
        return to_binary_bytes(out.data)
    arr = np.ascontiguousarray(as_bf16_bits(out.data) if out.datatype == BF16 else out.data)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # A flat uint8 view exposes the buffer protocol without copying the data.
    return arr.reshape(-1).view(np.uint8).data


def wants_binary(request: InferRequest | None, name: str) -> bool:
    """Whether output ``name`` goes out as binary for ``request``."""
    if request is None:
        return False
    for ro in request.outputs or ():
        if ro.name == name and ro.binary_data is not None:
            return ro.binary_data
    return request.binary_data_output


def encode_infer_response(response: InferResponse, request: InferRequest | None) -> EncodedResponse:
    """Frame ``response`` for the client that sent ``request``.

    Args:
        response: the data plane's result.
        request: the decoded request (its output and binary preferences), or None for JSON.

    Returns:
        the body and its headers (``Inference-Header-Content-Length`` when any output is
        binary); :func:`compress_response` compresses it.
    """
    outs: list[dict[str, Any]] = []
    payloads: list[bytes | memoryview] = []
    for out in response.outputs:
        entry: dict[str, Any] = {
            "name": out.name,
            "datatype": out.datatype,
            "shape": [int(d) for d in out.shape],
        }
        params = dict(out.parameters)
        if out.in_shared_memory:
            pass  # written into the client's region: no data here
        elif wants_binary(request, out.name):
            payload = binary_payload(out)
            params["binary_data_size"] = len(payload)
            payloads.append(payload)
        else:
            entry["data"] = to_json_data(out.data, out.datatype)
        if params:
            entry["parameters"] = params
        outs.append(entry)
    head: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version or "",
    }
    if response.id is not None:
        head["id"] = response.id
    if response.parameters:
        head["parameters"] = response.parameters
    head["outputs"] = outs
    # Without JSON tensor data the header holds names, shapes and sizes: no floats.
    plain = all("data" not in o for o in outs)
    header = dumps_plain(head) if plain else dumps(head)
    headers: dict[str, str] = {}
    media_type = JSON_TYPE
    if payloads:
        headers["Inference-Header-Content-Length"] = str(len(header))
        media_type = BINARY_TYPE
        body = b"".join([header, *payloads])  # the one copy of the output data
    else:
        body = header
    return EncodedResponse(body, headers, media_type, len(header) if payloads else None)


def compress_response(enc: EncodedResponse, encoding: str) -> EncodedResponse:
    """``enc`` with its body compressed with ``gzip`` or ``deflate`` (see ``choose_encoding``);
    ``Inference-Header-Content-Length`` keeps describing the uncompressed body, as Triton's
    does."""
    headers = {**enc.headers, "Content-Encoding": encoding}
    return EncodedResponse(compress(enc.body, encoding), headers, enc.media_type, enc.binary_from)
