"""gRPC framing: Triton's protobuf messages to the protocol's types and back.

The gRPC counterpart of ``service.protocol.request``/``response``: nothing here decides about a
request on its own. Ids, parameters, input heads and requested outputs go through the same
checks as REST's (``check_request_fields``, ``check_input_head``, ``check_requested_output``),
which call the model's ``check_input`` once per input before any data are converted; raw
contents become tensors with REST's ``from_binary`` (the same byte-count, BOOL and BYTES
checks). What is gRPC's own is the typed contents (``InferTensorContents``), the pairing of
``raw_input_contents`` with inputs, and the messages' shapes.

Outputs always go back as ``raw_output_contents`` (as Triton's server does): packed bits stay
packed, ``UINT8`` along the last axis, exactly as over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from typing import Any, TypeVar

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from service.errors import InvalidInput
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.proto import model_config_pb2 as mc
from service.protocol.request import (
    InputChecker,
    check_input_head,
    check_request_fields,
    check_requested_output,
)
from service.protocol.response import binary_payload
from service.protocol.shared import SharedMemoryRegions, shared_input
from service.protocol.tensors import element_count, from_binary
from service.protocol.types import (
    BYTES,
    DATATYPES,
    REGISTRY,
    InferRequest,
    InferResponse,
    RequestInput,
)

M = TypeVar("M", bound=Message)

# The NumPy type of each typed-contents field's elements (before they are narrowed to the
# datatype: INT8 comes in int_contents' int32); which field a datatype uses is the registry's.
_ELEMENTS: dict[str, np.dtype[Any]] = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
    "bytes_contents": np.dtype(object),
}
_CONTENT_FIELDS = sorted(_ELEMENTS)
_INT64_MAX = 2**63 - 1
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
"""The one ``triton_`` request parameter gRPC accepts (a boolean; REST refuses every
``triton_`` one): Triton's gRPC clients send it (perf_analyzer always,
``async_stream_infer(enable_empty_final_response=True)``) to learn when a streamed request is
complete. Every response of a model that is not decoupled is its request's final one, which a
stream then marks with the ``triton_final_response`` parameter."""


def parse(message_type: type[M], raw: bytes) -> M:
    """Parse one request message.

    Raises:
        InvalidInput: the bytes are not a valid ``message_type`` (a client's mistake, never an
            internal error).
    """
    try:
        return message_type.FromString(raw)
    except (DecodeError, RecursionError) as e:
        raise InvalidInput(f"malformed {message_type.DESCRIPTOR.name} message: {e}") from None


# --- parameters ---------------------------------------------------------------------------


def parameters_from_proto(params: Mapping[str, Any]) -> dict[str, Any]:
    """``map<string, InferParameter>`` (or ``ModelRepositoryParameter``) as a dict of plain
    values (a parameter with no value set is None)."""
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(p, which)
    return out


def parameters_to_proto(values: Mapping[str, Any], target: MutableMapping[str, Any]) -> None:
    """Write plain values into a ``map<string, InferParameter>``: bool, int (int64, else
    uint64), float and str as themselves, anything else as its JSON text."""
    for key, v in values.items():
        p = target[key]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int | np.integer):
            if int(v) > _INT64_MAX:
                p.uint64_param = int(v)
            else:
                p.int64_param = int(v)
        elif isinstance(v, float | np.floating):
            p.double_param = float(v)
        elif isinstance(v, str):
            p.string_param = v
        else:
            p.string_param = json.dumps(v, default=str)


# --- inference ----------------------------------------------------------------------------


def from_contents(
    contents: pb.InferTensorContents, datatype: str, shape: tuple[int, ...], what: str
) -> np.ndarray[Any, Any]:
    """An input's typed contents as an array of ``shape`` in the datatype's NumPy type.

    Raises:
        InvalidInput: a datatype without typed contents (FP16, BF16), data in another
            datatype's field, an element count that does not match the shape, or values out
            of the datatype's range.
    """
    field = REGISTRY[datatype].contents
    if field is None:
        raise InvalidInput(
            f"{what}: {datatype} has no typed contents; send its bytes in raw_input_contents"
        )
    wide = _ELEMENTS[field]
    for other in _CONTENT_FIELDS:
        if other != field and len(getattr(contents, other)):
            raise InvalidInput(f"{what}: {datatype} data go in contents.{field}, not {other}")
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidInput(
            f"{what}: contents.{field} has {len(values)} elements, shape {list(shape)} "
            f"needs {count}"
        )
    if datatype == BYTES:
        out = np.empty(count, dtype=object)
        for i, v in enumerate(values):
            out[i] = v
        return out.reshape(shape)
    arr = np.fromiter(values, dtype=wide, count=count)
    target = DATATYPES[datatype]
    if target != wide and arr.size:
        info = np.iinfo(target)
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise InvalidInput(f"{what}: {datatype} data out of range [{info.min}, {info.max}]")
    return arr.astype(target, copy=False).reshape(shape)


def decode_infer_request(
    msg: pb.ModelInferRequest, model: InputChecker, shm: SharedMemoryRegions | None = None
) -> InferRequest:
    """A ``ModelInferRequest`` as the protocol's request, checked as REST checks its own.

    Each input's data are in the shared memory region its parameters name (``shm``: the
    registered regions; None refuses such inputs), or its typed ``contents``, or the next
    entry of ``raw_input_contents`` (entries pair with the inputs that have neither, in order,
    as tritonclient sends them; Triton's rule is that a request uses contents or raw
    contents, not both). Raw data are read-only views over the message's bytes; outputs may
    name shared memory regions too. ``triton_enable_empty_final_response`` is checked and
    left out of the request's parameters (see :data:`EMPTY_FINAL_RESPONSE`).

    Raises:
        InvalidInput: naming the field or tensor that is wrong.
    """
    params = parameters_from_proto(msg.parameters)
    if not isinstance(params.pop(EMPTY_FINAL_RESPONSE, False), bool):
        raise InvalidInput(f"request: parameter {EMPTY_FINAL_RESPONSE!r} must be a boolean")
    rid, params, timeout = check_request_fields(msg.id or None, params)
    if not msg.inputs:
        raise InvalidInput("request 'inputs' must be a non-empty list")
    raw = msg.raw_input_contents
    if raw and any(t.HasField("contents") for t in msg.inputs):
        raise InvalidInput(
            "a request with raw_input_contents must not give any input's contents (use one "
            "form for all inputs)"
        )
    inputs: list[RequestInput] = []
    seen: set[str] = set()
    used = 0
    for i, t in enumerate(msg.inputs):
        name, datatype, shape, tparams = check_input_head(
            i, t.name, t.datatype, list(t.shape), parameters_from_proto(t.parameters), seen, model
        )
        what = f"input {name!r}"
        shared = shared_input(tparams, datatype, shape, what, shm)
        if shared is not None:
            if t.HasField("contents"):
                raise InvalidInput(
                    f"{what}: set only one of contents and parameters.shared_memory_region"
                )
            data = shared
        elif t.HasField("contents"):
            data = from_contents(t.contents, datatype, shape, what)
        elif used < len(raw):
            data = from_binary(memoryview(raw[used]), datatype, shape, what)
            used += 1
        else:
            raise InvalidInput(
                f"{what} has no data: neither contents nor an entry of raw_input_contents "
                f"({len(raw)} given for {len(msg.inputs)} inputs)"
            )
        inputs.append(RequestInput(name, datatype, shape, data, tparams))
    if used != len(raw):
        raise InvalidInput(
            f"the request has {len(raw)} raw_input_contents for {used} inputs; give one "
            "entry per input, in the order of 'inputs'"
        )
    outputs = None
    if msg.outputs:
        seen_out: set[str] = set()
        outputs = [
            check_requested_output(i, o.name, parameters_from_proto(o.parameters), seen_out, shm)
            for i, o in enumerate(msg.outputs)
        ]
    return InferRequest(
        id=rid, inputs=inputs, outputs=outputs, parameters=params, timeout_us=timeout
    )


def encode_infer_response(response: InferResponse) -> pb.ModelInferResponse:
    """The protocol's response as a ``ModelInferResponse`` with ``raw_output_contents`` (an
    empty entry for an output written into shared memory)."""
    msg = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version or "",
        id=response.id or "",
    )
    parameters_to_proto(response.parameters, msg.parameters)
    for out in response.outputs:
        tensor = msg.outputs.add(
            name=out.name, datatype=out.datatype, shape=[int(d) for d in out.shape]
        )
        parameters_to_proto(out.parameters, tensor.parameters)
        # an output written into the client's shared memory keeps its place, empty (Triton)
        data = b"" if out.in_shared_memory else bytes(binary_payload(out))
        msg.raw_output_contents.append(data)
    return msg


# --- descriptions -------------------------------------------------------------------------


def model_metadata(meta: Mapping[str, Any]) -> pb.ModelMetadataResponse:
    """V2 model metadata (``ModelHandle.metadata``) as a ``ModelMetadataResponse``.

    The message has no parameters: a packed input's packing is in ``ModelConfig``.
    """

    def tensors(entries: list[dict[str, Any]]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [
            pb.ModelMetadataResponse.TensorMetadata(
                name=e["name"], datatype=e["datatype"], shape=e["shape"]
            )
            for e in entries
        ]

    return pb.ModelMetadataResponse(
        name=meta["name"],
        versions=meta["versions"],
        platform=meta["platform"],
        inputs=tensors(meta["inputs"]),
        outputs=tensors(meta["outputs"]),
    )


def model_config(config: Mapping[str, Any]) -> pb.ModelConfigResponse:
    """Triton's model configuration (``ModelHandle.config``) as a ``ModelConfigResponse``.

    ``ModelInput`` has no parameters, so a packed input's (``packing``, ``bitorder``,
    ``logical_shape``, ``logical_datatype``) go to the model's ``parameters`` as
    ``"<input>.<key>"``, each value a string (JSON for lists). Keys Triton's message does not
    know are left out.
    """
    cfg = dict(config)
    extra: dict[str, dict[str, str]] = {}
    inputs = []
    for entry in cfg.get("input", []):
        e = dict(entry)
        for key, value in (e.pop("parameters", None) or {}).items():
            text = value if isinstance(value, str) else json.dumps(value)
            extra[f"{e['name']}.{key}"] = {"string_value": text}
        inputs.append(e)
    cfg["input"] = inputs
    if extra:
        cfg["parameters"] = {**cfg.get("parameters", {}), **extra}
    proto = json_format.ParseDict(cfg, mc.ModelConfig(), ignore_unknown_fields=True)
    return pb.ModelConfigResponse(config=proto)


def repository_index(index: list[dict[str, Any]]) -> pb.RepositoryIndexResponse:
    """Triton's repository index as a ``RepositoryIndexResponse``."""
    return pb.RepositoryIndexResponse(
        models=[
            pb.RepositoryIndexResponse.ModelIndex(
                name=str(m.get("name", "")),
                version=str(m.get("version", "")),
                state=str(m.get("state", "")),
                reason=str(m.get("reason", "")),
            )
            for m in index
        ]
    )


# --- extensions ---------------------------------------------------------------------------


def message(data: Mapping[str, Any], message_type: type[M]) -> M:
    """A response message from the extension's JSON form (the field names are Triton's, the
    same over REST and gRPC); keys the message lacks are left out."""
    return json_format.ParseDict(dict(data), message_type(), ignore_unknown_fields=True)


R = TypeVar("R", pb.SystemSharedMemoryStatusResponse, pb.CudaSharedMemoryStatusResponse)


def regions(status: list[dict[str, Any]], message_type: type[R]) -> R:
    """Shared memory status (a list of regions, as REST answers it) as the map gRPC answers."""
    return message({"regions": {r["name"]: r for r in status}}, message_type)


def log_settings(settings: Mapping[str, Any]) -> pb.LogSettingsResponse:
    """The log settings: booleans, integers (``uint32``) and strings."""
    out = pb.LogSettingsResponse()
    for key, value in settings.items():
        v = out.settings[key]
        if isinstance(value, bool):
            v.bool_param = value
        elif isinstance(value, int):
            v.uint32_param = value
        else:
            v.string_param = str(value)
    return out


def trace_changes(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A ``TraceSettingRequest``'s settings as the REST body's: ``trace_level`` a list, the
    others one string; a setting with no value clears it (None), as Triton's.

    Raises:
        InvalidInput: a setting other than ``trace_level`` with several values.
    """
    out: dict[str, Any] = {}
    for key, setting in settings.items():
        values = list(setting.value)
        if key == "trace_level" or not values:
            out[key] = values or None
        elif len(values) == 1:
            out[key] = values[0]
        else:
            raise InvalidInput(f"trace setting: {ascii(key[:64])[1:-1]} takes one value")
    return out


def trace_settings(settings: Mapping[str, Any]) -> pb.TraceSettingResponse:
    """The trace settings (strings, or lists of them), each as a ``SettingValue``."""
    out = pb.TraceSettingResponse()
    for key, value in settings.items():
        out.settings[key].value.extend(value if isinstance(value, list) else [str(value)])
    return out
