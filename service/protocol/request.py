"""Decoding V2 inference requests: JSON header, Triton binary tensors, and the raw binary form.

Three body layouts are accepted (Triton's binary tensor data extension):

* no ``Inference-Header-Content-Length``: the body is JSON; every input carries ``data``;
* ``Inference-Header-Content-Length: n > 0``: the first ``n`` bytes are the JSON header, the
  rest is the binary data of the inputs that declare ``parameters.binary_data_size``,
  concatenated in the order they appear in ``inputs``;
* ``Inference-Header-Content-Length: 0``: the body is the raw bytes of the model's only input;
  its datatype and shape come from the model (a :class:`RawInputSpec`) and the batch size
  follows from the length. All outputs are returned as binary.

Binary inputs become read-only ``np.frombuffer`` views over the body (no copy). Every declared
size is checked against the bytes present before anything is allocated.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from service.errors import InvalidInput
from service.protocol.shared import SharedMemoryRegions, shared_input, shared_output
from service.protocol.tensors import (
    check_datatype,
    check_shape,
    from_binary,
    from_json,
)
from service.protocol.types import (
    BYTES,
    DATATYPES,
    InferRequest,
    RequestInput,
    RequestOutput,
)

HEADER_LENGTH = "inference-header-content-length"
_LONG_NUMBER = re.compile(rb"[0-9]{19}")
# Request-level parameters this server understands; others are passed through, except the
# ``triton_`` prefix which Triton reserves and we refuse rather than silently ignore.
_RESERVED_PREFIX = "triton_"
MAX_TIMEOUT_US = 2**63 - 1
"""Largest ``parameters.timeout`` (µs) accepted: gRPC carries it as an int64; larger is a 400."""
MAX_NAME_CHARS = 256
"""Longest input or output name accepted (a model's names are at most 128 characters)."""
MAX_ID_CHARS = 1024
"""Longest request ``id`` accepted (it is echoed in the response)."""
# C0 and C1 controls, DEL, and lone surrogates (JSON's "\ud800" escapes make them): echoed
# in a message or a response they would garble logs and terminals, or fail to encode as UTF-8.
_BAD_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


@dataclass(frozen=True)
class RawInputSpec:
    """The one input of a model, for the raw binary request form.

    Attributes:
        name: the input's name.
        datatype: its wire datatype (``"UINT8"`` for bit-packed inputs).
        shape: its wire shape with ``-1`` for the batch dimension (e.g. ``(-1, 20, 6250)``).
    """

    name: str
    datatype: str
    shape: tuple[int, ...]


class InputChecker(Protocol):
    """What the decoder asks of the model a request is for
    (``service.models.signature.Signature``)."""

    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> int:
        """Check one input's name, datatype and shape before its data are converted; returns
        its batch size. Raises InvalidInput for a tensor the model refuses."""
        ...

    def raw_spec(self) -> RawInputSpec:
        """The model's only input, for the raw binary form (InvalidInput if it has several)."""
        ...


def parse_header_length(value: str | None, body_length: int) -> int | None:
    """Parse ``Inference-Header-Content-Length``; None when the header is absent.

    Only ASCII digits, as HTTP's own Content-Length: no sign, spaces, underscores or other
    scripts' digits (all of which Python's ``int`` would take).
    """
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 20:
        raise InvalidInput(
            "Inference-Header-Content-Length must be an integer in ASCII digits (no sign, "
            f"spaces or separators), got {value[:32]!r}"
        )
    n = int(value)
    if n > body_length:
        raise InvalidInput(
            f"Inference-Header-Content-Length {n} is outside the body of {body_length} bytes"
        )
    return n


def decode_infer_request(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    model: InputChecker | None = None,
    shm: SharedMemoryRegions | None = None,
) -> InferRequest:
    """Decode an inference request body.

    Args:
        body: the whole (decompressed) request body.
        header_length: the parsed ``Inference-Header-Content-Length`` (see
            :func:`parse_header_length`), or None when the header was absent.
        model: the model the request is for: each input's name, datatype and shape go to its
            ``check_input`` before the input's data are converted, so a tensor the model
            refuses costs no element parsing; the raw binary form takes its input from
            ``raw_spec``. None decodes without model checks (the raw form is then refused).
        shm: the registered shared memory regions, for tensors that name one
            (``parameters.shared_memory_region``); None refuses such tensors.

    Returns:
        the request; binary input data are read-only views over ``body`` (or over a shared
        memory region).

    Raises:
        InvalidInput: anything malformed, with a message naming the field or tensor.
    """
    view = memoryview(body)
    if header_length == 0:
        if model is None:
            raise InvalidInput("the raw binary form needs a model with a single input")
        return _decode_raw(view, model)
    n = len(view) if header_length is None else header_length
    header = _load_json(view[:n])
    return _decode_header(header, view[n:], binary=header_length is not None, model=model, shm=shm)


def _load_json(buf: memoryview) -> dict[str, Any]:
    try:
        # orjson is several times faster than json on the small headers of V2 requests, but
        # it reads an integer outside [-2**63, 2**64) as a float: such numbers (19 digits or
        # more) go to json, which keeps them integers for the range checks' messages.
        if _LONG_NUMBER.search(buf):
            raise orjson.JSONDecodeError("a long number", "", 0)
        obj = orjson.loads(buf)
    except orjson.JSONDecodeError:
        # And what orjson refuses and json reads: NaN and Infinity (which V2 clients such
        # as tritonclient write for such floats), nesting past 1024 levels. Malformed JSON
        # is refused here with json's message.
        try:
            obj = json.loads(bytes(buf))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise InvalidInput(f"request JSON is malformed: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidInput("request JSON must be an object")
    return obj


def _decode_raw(view: memoryview, model: InputChecker) -> InferRequest:
    spec = model.raw_spec()
    if spec.datatype == BYTES or spec.datatype not in DATATYPES:
        raise InvalidInput(f"the raw binary form does not support {spec.datatype} inputs")
    itemsize = DATATYPES[spec.datatype].itemsize
    fixed = math.prod(d for d in spec.shape if d >= 0)
    item_bytes = fixed * itemsize
    shape = spec.shape
    if any(d < 0 for d in shape):
        if item_bytes == 0 or view.nbytes % item_bytes:
            raise InvalidInput(
                f"raw binary body of {view.nbytes} bytes is not a whole number of "
                f"{spec.datatype} items of shape {[d for d in shape if d >= 0]} "
                f"({item_bytes} bytes each) for input {spec.name!r}"
            )
        batch = view.nbytes // item_bytes
        shape = tuple(batch if d < 0 else d for d in shape)
    model.check_input(spec.name, spec.datatype, shape)
    what = f"input {spec.name!r}"
    data = from_binary(view, spec.datatype, shape, what)
    inp = RequestInput(spec.name, spec.datatype, shape, data, {})
    return InferRequest(id=None, inputs=[inp], outputs=None, binary_data_output=True)


def _check_parameters(params: object, what: str) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidInput(f"{what}: 'parameters' must be an object")
    for key in params:
        if key.startswith(_RESERVED_PREFIX):
            raise InvalidInput(
                f"{what}: unknown parameter {key!r} (the triton_ prefix is reserved)"
            )
    return params


def check_text(value: object, what: str, limit: int) -> str:
    """``value`` if it is a non-empty string of at most ``limit`` characters, without control
    characters or lone surrogates, else InvalidInput naming ``what`` (never echoing it raw)."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{what} must be a non-empty string")
    if len(value) > limit:
        raise InvalidInput(f"{what} is {len(value)} characters long; at most {limit} allowed")
    bad = _BAD_TEXT.search(value)
    if bad is not None:
        kind = "a lone surrogate" if "\ud800" <= bad.group() <= "\udfff" else "a control character"
        raise InvalidInput(
            f"{what} contains {kind} (U+{ord(bad.group()):04X}) at position {bad.start()}"
        )
    return value


def _bool_param(params: Mapping[str, Any], key: str, what: str) -> bool | None:
    v = params.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise InvalidInput(f"{what}: parameter {key!r} must be a boolean, got {v!r}")
    return v


def check_request_fields(
    rid: object, params: object
) -> tuple[str | None, dict[str, Any], int | None]:
    """Check a request's ``id`` and ``parameters`` (every transport's decoder calls this).

    Returns:
        ``(id, parameters, timeout_us)``: the id (None when absent), the parameters ({} when
        absent) and ``parameters.timeout`` in µs (None when absent).

    Raises:
        InvalidInput: an id that is not a string or holds control characters, parameters
            that are not an object or use the reserved ``triton_`` prefix, a timeout that is
            not an integer in ``[0, MAX_TIMEOUT_US]``, a priority that is not an integer in
            ``[0, 2**64 - 1]``.
    """
    if rid is not None and not isinstance(rid, str):
        raise InvalidInput("request 'id' must be a string")
    if rid:  # "" is echoed as it came
        check_text(rid, "request 'id'", MAX_ID_CHARS)
    checked = _check_parameters(params, "request")
    timeout = checked.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
        shown = repr(timeout)[:40]
        raise InvalidInput(f"request: parameter 'timeout' must be an integer (µs), got {shown}")
    if timeout is not None and not 0 <= timeout <= MAX_TIMEOUT_US:
        shown = (
            str(timeout) if abs(timeout) < 10**30 else f"a {len(str(abs(timeout)))}-digit number"
        )
        raise InvalidInput(
            f"request: parameter 'timeout' must be between 0 and {MAX_TIMEOUT_US} µs, got {shown}"
        )
    priority = checked.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority < 2**64
    ):
        shown = repr(priority)[:40]
        raise InvalidInput(
            f"request: parameter 'priority' must be an integer from 0 to 2**64 - 1 (1 is the "
            f"highest level, 0 the model's default), got {shown}"
        )
    return rid, checked, timeout


def _new_name(kind: str, index: int, name: object, seen: set[str], repeated: str) -> str:
    """An input's or output's name, checked as text and against the names before it."""
    checked = check_text(name, f"{kind}s[{index}]: 'name'", MAX_NAME_CHARS)
    if checked in seen:
        raise InvalidInput(f"{kind} {checked!r} {repeated}")
    seen.add(checked)
    return checked


def check_input_head(
    index: int,
    name: object,
    datatype: object,
    shape: object,
    params: object,
    seen: set[str],
    model: InputChecker | None,
) -> tuple[str, str, tuple[int, ...], dict[str, Any]]:
    """Check one input's name, datatype, shape and parameters before its data are converted.

    Every transport's decoder calls this once per input, in request order; the model's
    ``check_input`` is called here (so never a second time elsewhere).

    Args:
        index: the input's position in the request (messages).
        name, datatype, shape, params: as the request gave them.
        seen: the names of the inputs before this one; ``name`` is added.
        model: the model the request is for, or None.

    Returns:
        ``(name, datatype, shape, parameters)``, checked.

    Raises:
        InvalidInput: naming the input and what is wrong.
    """
    checked_name = _new_name("input", index, name, seen, "appears more than once")
    what = f"input {checked_name!r}"
    checked_type = check_datatype(datatype, what)
    dims = check_shape(shape, what)
    checked_params = _check_parameters(params, what)
    if model is not None:
        model.check_input(checked_name, checked_type, dims)
    return checked_name, checked_type, dims, checked_params


def check_requested_output(
    index: int, name: object, params: object, seen: set[str], shm: SharedMemoryRegions | None
) -> RequestOutput:
    """Check one requested output (every transport's decoder calls this, in request order).

    Args:
        index: its position in the request's outputs (messages).
        name, params: as the request gave them.
        seen: the names of the outputs before this one; ``name`` is added.
        shm: the registered shared memory regions, for an output that names one
            (``parameters.shared_memory_region``); None refuses such outputs.

    Raises:
        InvalidInput: a bad or repeated name, bad parameters, the classification extension,
            or a shared memory region that is unknown or too small.
    """
    checked = _new_name("output", index, name, seen, "is requested more than once")
    what = f"output {checked!r}"
    checked_params = _check_parameters(params, what)
    if checked_params.get("classification"):
        raise InvalidInput(f"{what}: the classification extension is not supported")
    binary = _bool_param(checked_params, "binary_data", what)
    shared = shared_output(checked_params, what, shm)
    if shared is not None and binary:
        raise InvalidInput(f"{what}: can't set both 'shared_memory_region' and 'binary_data'")
    return RequestOutput(checked, binary, checked_params, shared)


def _decode_header(
    header: dict[str, Any],
    rest: memoryview,
    *,
    binary: bool,
    model: InputChecker | None,
    shm: SharedMemoryRegions | None,
) -> InferRequest:
    rid, params, timeout = check_request_fields(header.get("id"), header.get("parameters"))
    binary_out = _bool_param(params, "binary_data_output", "request") or False
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("request 'inputs' must be a non-empty list")
    inputs: list[RequestInput] = []
    seen: set[str] = set()
    offset = 0
    for i, item in enumerate(raw_inputs):
        inp, size = _decode_input(item, i, rest, offset, seen, binary=binary, model=model, shm=shm)
        inputs.append(inp)
        offset += size
    if offset != rest.nbytes:
        raise InvalidInput(
            f"the inputs declare {offset} bytes of binary data but the body carries "
            f"{rest.nbytes} after the JSON header"
        )
    outputs = _decode_outputs(header.get("outputs"), shm)
    return InferRequest(
        id=rid,
        inputs=inputs,
        outputs=outputs,
        parameters=params,
        binary_data_output=binary_out,
        timeout_us=timeout,
    )


def _decode_input(
    item: object,
    index: int,
    rest: memoryview,
    offset: int,
    seen: set[str],
    *,
    binary: bool,
    model: InputChecker | None,
    shm: SharedMemoryRegions | None,
) -> tuple[RequestInput, int]:
    if not isinstance(item, dict):
        raise InvalidInput(f"inputs[{index}] must be an object")
    name, datatype, shape, params = check_input_head(
        index, item.get("name"), item.get("datatype"), item.get("shape"),
        item.get("parameters"), seen, model,
    )  # fmt: skip
    what = f"input {name!r}"
    size = params.get("binary_data_size")
    shared = shared_input(params, datatype, shape, what, shm)
    if shared is not None:
        if "data" in item or size is not None:
            raise InvalidInput(
                f"{what}: set only one of 'data', parameters.binary_data_size and "
                "parameters.shared_memory_region"
            )
        return RequestInput(name, datatype, shape, shared, params), 0
    if size is None:
        if "data" not in item:
            raise InvalidInput(f"{what}: has neither 'data' nor parameters.binary_data_size")
        data = from_json(item["data"], datatype, shape, what)
        return RequestInput(name, datatype, shape, data, params), 0
    if "data" in item:
        raise InvalidInput(f"{what}: has both 'data' and parameters.binary_data_size")
    if not binary:
        raise InvalidInput(
            f"{what}: binary_data_size given but the request has no "
            "Inference-Header-Content-Length header"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidInput(f"{what}: binary_data_size must be a non-negative integer")
    if offset + size > rest.nbytes:
        raise InvalidInput(
            f"{what}: binary_data_size {size} runs past the end of the body "
            f"({rest.nbytes - offset} bytes left)"
        )
    data = from_binary(rest[offset : offset + size], datatype, shape, what, "binary_data_size")
    return RequestInput(name, datatype, shape, data, params), size


def _decode_outputs(raw: object, shm: SharedMemoryRegions | None) -> list[RequestOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidInput("request 'outputs' must be a list")
    outputs: list[RequestOutput] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidInput(f"outputs[{i}] must be an object")
        params = item.get("parameters")
        outputs.append(check_requested_output(i, item.get("name"), params, seen, shm))
    return outputs
