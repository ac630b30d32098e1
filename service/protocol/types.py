"""Plain data types shared by the protocol layer and the data plane."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# V2 datatype -> NumPy dtype (little-endian on the wire). BYTES is length-prefixed strings
# (an object array), handled separately by the framing.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
BYTES = "BYTES"
BF16 = "BF16"

# Every fixed-size datatype the framing parses and writes. BF16 is kept apart from DATATYPES
# because NumPy has no bfloat16: its elements are carried as the raw bits in a ``<u2`` view,
# the same NumPy dtype as UINT16, so a reverse map built from this table would be ambiguous.
# Model configs and the pipeline use DATATYPES only; a BF16 input reaches the framing, then a
# model's ``check_input`` refuses it by name (no model declares BF16).
WIRE_DTYPES: dict[str, np.dtype[Any]] = {**DATATYPES, BF16: np.dtype("<u2")}


@dataclass(frozen=True)
class RequestInput:
    """One input tensor of a request.

    Attributes:
        name: the input's name.
        datatype: the V2 datatype as sent (``"UINT8"``, ``"BOOL"``, ...).
        shape: the declared shape, already checked against the byte count.
        data: an array of that shape; for binary inputs a read-only ``np.frombuffer`` view
            over the request body (no copy); for BYTES an object array of ``bytes``; for
            BF16 a ``<u2`` array of the raw bfloat16 bits.
        parameters: the tensor's ``parameters`` object (may be empty).
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any]
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SharedOutput:
    """Where an output goes in a client's shared memory (the system shared-memory extension).

    Attributes:
        region: the registered region's name (for messages).
        view: its bytes for this output (``shared_memory_offset``, ``shared_memory_byte_size``),
            writable, checked against the region's bounds.
    """

    region: str
    view: memoryview


@dataclass(frozen=True)
class RequestOutput:
    """One requested output: ``binary_data`` is None when the request did not say;
    ``shared_memory`` is set when it goes into a shared memory region, not the body."""

    name: str
    binary_data: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    shared_memory: SharedOutput | None = None


@dataclass
class InferRequest:
    """A decoded V2 inference request.

    Attributes:
        id: the request ``id`` (echoed in the response), or None.
        inputs: the input tensors, in request order (names are unique).
        outputs: the requested outputs, or None for "all outputs".
        parameters: request-level parameters (``timeout``, ``binary_data_output``, ...).
        binary_data_output: default for outputs that do not set ``binary_data``.
        timeout_us: ``parameters.timeout`` in microseconds, or None.
    """

    id: str | None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    binary_data_output: bool = False
    timeout_us: int | None = None


@dataclass(frozen=True)
class ResponseOutput:
    """One output tensor of a response; ``data`` is a C-contiguous array of ``shape``.

    For a BF16 output ``data`` holds the raw bfloat16 bits as ``uint16``, or floats that the
    framing rounds to bfloat16 (nearest-even). ``in_shared_memory``: the data went into the
    client's shared memory, and the response carries none (Triton's way).
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    in_shared_memory: bool = False


@dataclass
class InferResponse:
    """The result of one inference, before framing."""

    model_name: str
    model_version: str | None
    id: str | None
    outputs: list[ResponseOutput]
    parameters: dict[str, Any] = field(default_factory=dict)
