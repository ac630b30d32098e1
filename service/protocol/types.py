"""Plain data types shared by the protocol layer and the data plane."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Datatype:
    """One V2 datatype, as every layer sees it: the registry below is the only table of them.

    Attributes:
        name: the V2 name (``"FP32"``).
        wire: the NumPy dtype of its elements on the wire, little-endian; for BF16, which
            NumPy lacks, the raw bits as ``<u2``; None for BYTES (length-prefixed strings).
        torch: the name of the matching ``torch`` dtype (``"float32"``), or None.
        model_input: whether a model's ``[[inputs]]`` may declare it.
        model_output: whether a model's ``[[outputs]]`` may declare it.
        contents: the field of gRPC's ``InferTensorContents`` that carries its elements
            (``"fp32_contents"``); None where gRPC has none (FP16, BF16: raw contents only).
    """

    name: str
    wire: np.dtype[Any] | None
    torch: str | None
    model_input: bool = True
    model_output: bool = True
    contents: str | None = None


def _fixed(
    name: str, wire: str, torch: str, contents: str | None, *, output: bool = True
) -> Datatype:
    return Datatype(name, np.dtype(wire), torch, model_output=output, contents=contents)


BYTES = "BYTES"
BF16 = "BF16"
REGISTRY: dict[str, Datatype] = {
    d.name: d
    for d in (
        _fixed("BOOL", "?", "bool", "bool_contents", output=False),
        _fixed("UINT8", "<u1", "uint8", "uint_contents"),
        _fixed("UINT16", "<u2", "uint16", "uint_contents", output=False),
        _fixed("UINT32", "<u4", "uint32", "uint_contents", output=False),
        _fixed("UINT64", "<u8", "uint64", "uint64_contents", output=False),
        _fixed("INT8", "<i1", "int8", "int_contents"),
        _fixed("INT16", "<i2", "int16", "int_contents"),
        _fixed("INT32", "<i4", "int32", "int_contents"),
        _fixed("INT64", "<i8", "int64", "int64_contents"),
        _fixed("FP16", "<f2", "float16", None),
        _fixed("FP32", "<f4", "float32", "fp32_contents"),
        _fixed("FP64", "<f8", "float64", "fp64_contents"),
        # NumPy has no bfloat16: the framing carries BF16 elements as their raw bits in a
        # ``<u2`` view (the NumPy dtype of UINT16 too), and no model declares it.
        Datatype(BF16, np.dtype("<u2"), "bfloat16", model_input=False, model_output=False),
        Datatype(
            BYTES, None, None, model_input=False, model_output=False, contents="bytes_contents"
        ),
    )
}

# Views of the registry that the framing reads on every tensor.
WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    n: d.wire for n, d in REGISTRY.items() if d.wire is not None
}
"""Every fixed-size datatype the framing parses and writes, BF16 included."""
DATATYPES: dict[str, np.dtype[Any]] = {n: w for n, w in WIRE_DTYPES.items() if n != BF16}
"""The fixed-size datatypes whose NumPy dtype is their own (no BF16): a reverse map from
NumPy dtypes to these names is unambiguous."""
MODEL_INPUT_DATATYPES = tuple(n for n, d in REGISTRY.items() if d.model_input)
MODEL_OUTPUT_DATATYPES = tuple(n for n, d in REGISTRY.items() if d.model_output)


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
        nbytes: the bytes it may take (``shared_memory_byte_size``), checked against the
            region's bounds.
        write: writes the output's bytes there, once (at most ``nbytes``); raises
            ``InvalidInput`` when the client's object shrank below them.
    """

    region: str
    nbytes: int
    write: Callable[[memoryview], None]


@dataclass(frozen=True)
class RequestOutput:
    """One requested output: ``binary_data`` is None when the request did not say;
    ``shared_memory`` is set when it goes into a shared memory region, not the body."""

    name: str
    binary_data: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    shared_memory: SharedOutput | None = None


class RequestForm:
    """What the requests decoded from one header share: all of each but its inputs' data
    (names, datatypes, shapes, every parameter, the outputs asked for), so work that
    depends on these alone is done once per form.

    Attributes:
        key_head: the response cache's, for its key (``service.models.response_cache``);
            None until a request of this form is first cached.
    """

    __slots__ = ("key_head",)

    def __init__(self) -> None:
        self.key_head: Any = None


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
        form: the :class:`RequestForm` shared by every request decoded from the same
            header (``service.protocol.header_cache``: those differ in their inputs' data
            alone; their parameter dicts and output list are the same objects, never
            changed); None: this request's own.
    """

    id: str | None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    binary_data_output: bool = False
    timeout_us: int | None = None
    form: RequestForm | None = None


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
