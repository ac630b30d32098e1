"""Open Inference Protocol (KServe V2) REST framing, JSON and Triton's binary extension.

A binary request body is the JSON header followed by each input's raw bytes, in input order;
the header's length goes in ``Inference-Header-Content-Length`` and each input says its byte
count in ``parameters.binary_data_size``. Responses are framed the same way; their binary
outputs are decoded with ``np.frombuffer`` over the body, so they are read-only views and
nothing is copied.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._exceptions import DecodeError
from ._spec import BYTES, DATATYPES, WireTensor
from ._types import InferResult

HEADER_LENGTH = "Inference-Header-Content-Length"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class EncodedBody:
    """A request body as a list of chunks (the header, then each tensor's bytes, no copies).

    Attributes:
        chunks: bytes-like pieces whose concatenation is the body.
        headers: the framing headers (``Content-Type``, ``Inference-Header-Content-Length``).
    """

    chunks: list[bytes | memoryview]
    headers: dict[str, str]

    @property
    def length(self) -> int:
        """The body's size in bytes."""
        return sum(memoryview(c).nbytes for c in self.chunks)

    def to_bytes(self) -> bytes:
        """The body in one piece (one copy; used to compress it)."""
        return b"".join(self.chunks)


def _bytes_elements(arr: np.ndarray[Any, Any]) -> list[bytes]:
    out = []
    for v in arr.ravel():
        out.append(v.encode("utf-8") if isinstance(v, str) else bytes(v))
    return out


def _serialize_bytes(arr: np.ndarray[Any, Any]) -> bytes:
    """BYTES tensors on the wire: each element as a 4-byte little-endian length + its bytes."""
    return b"".join(_LEN.pack(len(b)) + b for b in _bytes_elements(arr))


def encode_request(
    tensors: Sequence[WireTensor],
    outputs: Sequence[str] | None = None,
    *,
    request_id: str | None = None,
    deadline_s: float | None = None,
    binary: bool = True,
    priority: int | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> EncodedBody:
    """Frame one inference request.

    Args:
        tensors: the inputs, C-contiguous and little-endian.
        outputs: output names to return (None: all of them).
        request_id: the request's ``id``.
        deadline_s: the server-side deadline in seconds, sent as ``parameters.timeout`` in
            microseconds.
        binary: binary tensors both ways (True) or plain JSON (False).
        priority: the request's priority level, sent as ``parameters.priority`` (1 the
            highest; None: the model's default).
        parameters: more request ``parameters`` (an index's ``k`` and ``threshold``).

    Returns:
        The body's chunks and framing headers.
    """
    header: dict[str, Any] = {}
    if request_id is not None:
        header["id"] = request_id
    params: dict[str, Any] = dict(parameters or {})
    if deadline_s is not None:
        params["timeout"] = max(1, int(deadline_s * 1e6))
    if priority is not None:
        params["priority"] = priority
    if binary:
        params["binary_data_output"] = True
    if params:
        header["parameters"] = params
    entries: list[dict[str, Any]] = []
    payload: list[bytes | memoryview] = []
    for t in tensors:
        entry: dict[str, Any] = {
            "name": t.name,
            "shape": list(t.array.shape),
            "datatype": t.datatype,
        }
        if binary:
            raw: bytes | memoryview
            if t.datatype == BYTES:
                raw = _serialize_bytes(t.array)
            else:
                # A flat byte view of the contiguous array: sent as is, not copied.
                raw = t.array.reshape(-1).view(np.uint8).data
            entry["parameters"] = {"binary_data_size": memoryview(raw).nbytes}
            payload.append(raw)
        elif t.datatype == BYTES:
            entry["data"] = [b.decode("utf-8", "replace") for b in _bytes_elements(t.array)]
        else:
            entry["data"] = t.array.ravel().tolist()
        if t.parameters:
            entry["parameters"] = {**entry.get("parameters", {}), **t.parameters}
        entries.append(entry)
    header["inputs"] = entries
    if outputs is not None:
        header["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    head = json.dumps(header, separators=(",", ":")).encode()
    if binary:
        headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}
    else:
        headers = {"Content-Type": "application/json"}
    return EncodedBody([head, *payload], headers)


def _decode_bytes(buf: memoryview, count: int, name: str) -> np.ndarray[Any, Any]:
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(buf):
            raise DecodeError(f"output {name!r}: BYTES data ends early")
        (n,) = _LEN.unpack_from(buf, pos)
        out[i] = bytes(buf[pos + 4 : pos + 4 + n])
        pos += 4 + n
    if pos != len(buf):
        raise DecodeError(f"output {name!r}: BYTES data has {len(buf) - pos} stray bytes")
    return out


def _decode_output(
    entry: dict[str, Any], body: bytes, offset: int
) -> tuple[np.ndarray[Any, Any], int]:
    if not isinstance(entry, dict):
        raise DecodeError(f"output entry {entry!r} is not an object")
    name = entry.get("name")
    datatype = str(entry.get("datatype", "")).upper()
    try:
        shape = tuple(int(d) for d in entry.get("shape", []))
    except (TypeError, ValueError):
        raise DecodeError(f"output {name!r}: bad shape {entry.get('shape')!r}") from None
    if any(d < 0 for d in shape):
        raise DecodeError(f"output {name!r}: negative dimension in {list(shape)}")
    count = math.prod(shape)
    dtype = DATATYPES.get(datatype)
    if dtype is None and datatype != BYTES:
        raise DecodeError(f"output {name!r}: unknown datatype {datatype!r}")
    params = entry.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None:
        if not isinstance(size, int) or size < 0:
            raise DecodeError(f"output {name!r}: bad binary_data_size {size!r}")
        if offset + size > len(body):
            raise DecodeError(f"output {name!r}: {size} bytes announced, body too short")
        if dtype is None:
            arr = _decode_bytes(memoryview(body)[offset : offset + size], count, str(name))
        else:
            if size != count * dtype.itemsize:
                raise DecodeError(
                    f"output {name!r}: {size} bytes for {datatype} {list(shape)} "
                    f"(needs {count * dtype.itemsize})"
                )
            arr = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
        return arr.reshape(shape), offset + size
    if "data" not in entry:
        raise DecodeError(f"output {name!r} has neither data nor binary_data_size")
    data = entry["data"]
    if not isinstance(data, list):
        raise DecodeError(f"output {name!r}: data is not a list")
    if dtype is None:
        arr = np.array([d.encode() if isinstance(d, str) else d for d in data], dtype=object)
    else:
        try:
            arr = np.asarray(data, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise DecodeError(f"output {name!r}: data is not {datatype}: {exc}") from None
    if arr.size != count:
        raise DecodeError(f"output {name!r}: {arr.size} values for shape {list(shape)}")
    return arr.reshape(shape), offset


def decode_response(
    body: bytes,
    header_length: int | None,
    *,
    single: bool,
    headers: Mapping[str, str] | None = None,
) -> InferResult:
    """Decode a 200 inference response.

    Args:
        body: the whole (decompressed) response body.
        header_length: ``Inference-Header-Content-Length`` or None for a JSON-only body.
        single: drop the leading batch dimension of every output (the request was one item
            given without it).
        headers: the HTTP response headers, kept on the result.

    Returns:
        The outputs, binary ones as read-only views over ``body``.

    Raises:
        DecodeError: the body is not a valid V2 response.
    """
    end = len(body) if header_length is None else header_length
    if not 0 <= end <= len(body):
        raise DecodeError(f"header length {end} outside a body of {len(body)} bytes")
    try:
        header = json.loads(body[:end])
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"response header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("outputs", []), list):
        raise DecodeError("response header is not a V2 inference response")
    offset = end
    outputs: dict[str, np.ndarray[Any, Any]] = {}
    entries: dict[str, dict[str, Any]] = {}
    for entry in header.get("outputs", []):
        arr, offset = _decode_output(entry, body, offset)
        if single:
            if arr.ndim == 0 or arr.shape[0] != 1:
                raise DecodeError(f"output {entry.get('name')!r}: expected a batch of 1")
            arr = arr[0]
        name = str(entry.get("name"))
        outputs[name] = arr
        entries[name] = {k: v for k, v in entry.items() if k != "data"}
    if offset != len(body):
        raise DecodeError(f"{len(body) - offset} bytes after the last output")
    return InferResult(
        outputs,
        model_name=str(header.get("model_name", "")),
        model_version=header.get("model_version"),
        id=header.get("id"),
        parameters=header.get("parameters"),
        entries=entries,
        headers=headers,
    )


def error_message(body: bytes, limit: int = 2000) -> str:
    """The text of a V2 error body ``{"error": "..."}``, else the raw body (truncated)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        return str(parsed["error"])
    text = body[:limit].decode("utf-8", "replace").strip()
    return text or "(empty body)"
