"""What the client learns about a model, and how it turns user arrays into wire tensors.

A :class:`ModelSpec` is parsed from the model's V2 metadata and (when the server has one) its
Triton-style config. bitserve advertises a bit-packed input in its wire form (``UINT8``, shape
``[-1, ..., ceil(L/8)]``) plus ``parameters`` ``{"packing": "bits", "bitorder": "big",
"logical_shape": [..., L], "logical_datatype": "BOOL"}``; any other V2 server simply has no
packing parameters, and its inputs are sent as plain tensors.

:func:`prepare_inputs` checks every array against the spec before anything is sent, packs
bool or 0/1 arrays with ``np.packbits`` along the last axis, lets already packed ``uint8``
arrays through, and adds the batch dimension to a single item.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ._exceptions import DecodeError, InvalidInputError

# V2 datatype -> NumPy dtype (little-endian on the wire); BYTES is handled by the framing.
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
_KIND_TO_DATATYPE = {(dt.kind, dt.itemsize): name for name, dt in DATATYPES.items()}

Bitorder = Literal["big", "little"]


@dataclass(frozen=True)
class PackInfo:
    """How a bit-packed input is packed.

    Attributes:
        bitorder: ``"big"`` or ``"little"``, as in ``np.packbits``.
        logical_shape: the item's logical (unpacked) shape without the batch dimension;
            the last entry is the bit count L.
    """

    bitorder: Bitorder
    logical_shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the server declares it.

    Attributes:
        name: the tensor's name.
        datatype: the V2 datatype on the wire (``"UINT8"`` for a packed input).
        shape: the item's wire shape without the batch dimension (``-1``: any size).
        packing: packing info for a bit-packed input, else None.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    packing: PackInfo | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A model's inputs and outputs as the client needs them.

    Attributes:
        name: the model's name.
        batched: whether every tensor has a leading batch dimension (not in ``shape``).
        max_batch_size: the largest batch the server accepts; 0 when unknown or unbatched.
        inputs: input specs by name, in the server's order.
        outputs: output specs by name, in the server's order.
    """

    name: str
    batched: bool
    max_batch_size: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]


@dataclass(frozen=True)
class WireTensor:
    """An input ready to frame: C-contiguous, little-endian, with the batch dimension."""

    name: str
    datatype: str
    array: np.ndarray[Any, Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    """The tensor's own ``parameters`` (``bitorder`` when the call gave one)."""


@dataclass(frozen=True)
class PreparedInputs:
    """The checked inputs of one request.

    Attributes:
        tensors: the wire tensors, in the order the user gave them.
        single: True when the user gave one item without the batch dimension (the outputs
            are then returned without it).
        batch_size: the number of items (1 for a single item; 0 for an unbatched model).
    """

    tensors: list[WireTensor]
    single: bool
    batch_size: int


def _param(params: Mapping[str, Any], key: str) -> Any:
    """A parameter value, unwrapping Triton's ``{"string_value": ...}`` form."""
    value = params.get(key)
    if isinstance(value, Mapping):
        for k in ("string_value", "int64_value", "bool_value", "double_value"):
            if k in value:
                return value[k]
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # Triton config parameters are strings: "[20, 50000]"
        value = [int(v) for v in value.strip("[]() ").replace(",", " ").split()]
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise DecodeError(f"{where}: shape {value!r} is not a list of integers") from None


def _pack_info(params: Mapping[str, Any], wire_item: tuple[int, ...], where: str) -> PackInfo:
    bitorder = str(_param(params, "bitorder") or "big")
    if bitorder not in ("big", "little"):
        raise DecodeError(f"{where}: bitorder {bitorder!r} is neither 'big' nor 'little'")
    logical = _shape(_param(params, "logical_shape"), where)
    if len(logical) == len(wire_item) + 1:  # given with the batch dimension
        logical = logical[1:]
    if not logical or len(logical) != len(wire_item):
        raise DecodeError(f"{where}: logical_shape {list(logical)} does not match {wire_item}")
    L, packed = logical[-1], wire_item[-1]
    if L >= 0 and packed >= 0 and math.ceil(L / 8) != packed:
        raise DecodeError(f"{where}: {L} bits do not pack into {packed} bytes")
    return PackInfo(bitorder="big" if bitorder == "big" else "little", logical_shape=logical)


def parse_model_spec(
    metadata: Mapping[str, Any], config: Mapping[str, Any] | None = None
) -> ModelSpec:
    """Parse a V2 model metadata object (and optionally a Triton-style config).

    Args:
        metadata: the body of ``GET /v2/models/{m}``.
        config: the body of ``GET /v2/models/{m}/config``, or None where the server has none.

    Returns:
        The model's spec.

    Raises:
        DecodeError: the metadata is malformed.
    """
    name = str(metadata.get("name", "?"))
    try:
        raw_inputs = list(metadata.get("inputs") or [])
        raw_outputs = list(metadata.get("outputs") or [])
    except TypeError:
        raise DecodeError(f"model {name!r}: metadata inputs/outputs are not lists") from None
    max_batch_size = 0
    batched: bool | None = None
    config_params: dict[str, Mapping[str, Any]] = {}
    if config is not None:
        if isinstance(config.get("max_batch_size"), int):
            max_batch_size = int(config["max_batch_size"])
            batched = max_batch_size > 0
        for entry in config.get("input") or []:
            if isinstance(entry, Mapping) and isinstance(entry.get("parameters"), Mapping):
                config_params[str(entry.get("name"))] = entry["parameters"]
    shapes = [_shape(t.get("shape"), f"model {name!r}") for t in raw_inputs + raw_outputs]
    if batched is None:  # no config: a leading -1 everywhere is the batch dimension
        batched = bool(shapes) and all(s and s[0] == -1 for s in shapes)

    def spec(entry: Mapping[str, Any], shape: tuple[int, ...], is_input: bool) -> TensorSpec:
        tname = str(entry.get("name"))
        where = f"model {name!r} {'input' if is_input else 'output'} {tname!r}"
        item = shape[1:] if batched and shape and shape[0] == -1 else shape
        params = dict(config_params.get(tname, {}))
        params.update(entry.get("parameters") or {})
        packing = None
        if is_input and str(_param(params, "packing") or "").lower() == "bits":
            packing = _pack_info(params, item, where)
        return TensorSpec(tname, str(entry.get("datatype", "")).upper(), item, packing)

    n_in = len(raw_inputs)
    inputs = {
        t.name: t for t in (spec(e, s, True) for e, s in zip(raw_inputs, shapes, strict=False))
    }
    outputs = {
        t.name: t
        for t in (spec(e, s, False) for e, s in zip(raw_outputs, shapes[n_in:], strict=True))
    }
    return ModelSpec(name, batched, max_batch_size, inputs, outputs)


def to_numpy(value: Any, name: str) -> np.ndarray[Any, Any]:
    """An input value as an ndarray; torch tensors go through ``.detach().cpu().numpy()``.

    torch is looked up in ``sys.modules`` and never imported here: a caller holding a tensor
    has imported it already.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            return np.asarray(value.detach().cpu().numpy())
        except TypeError as exc:  # bfloat16 and friends have no NumPy dtype
            raise InvalidInputError(
                f"input {name!r}: torch dtype {value.dtype} has no NumPy equivalent; "
                "convert it first (e.g. .float())"
            ) from exc
    return np.asarray(value)


def datatype_of(dtype: np.dtype[Any], name: str) -> str:
    """The V2 datatype for a NumPy dtype."""
    if dtype.kind in "OSU":
        return BYTES
    found = _KIND_TO_DATATYPE.get((dtype.kind, dtype.itemsize))
    if found is None:
        raise InvalidInputError(f"input {name!r}: dtype {dtype} has no V2 datatype")
    return found


def _fmt(item: tuple[int, ...], batched: bool) -> str:
    dims = ["batch" if batched else None, *("any" if d < 0 else str(d) for d in item)]
    return "[" + ", ".join(d for d in dims if d is not None) + "]"


def _matches(shape: tuple[int, ...], item: tuple[int, ...]) -> bool:
    return len(shape) == len(item) and all(
        d < 0 or d == s for s, d in zip(shape, item, strict=True)
    )


def _bits_to_packed(arr: np.ndarray[Any, Any], name: str, info: PackInfo) -> np.ndarray[Any, Any]:
    if arr.dtype != np.bool_:
        if arr.dtype.kind in "ui":
            bad = arr.size > 0 and (arr.min() < 0 or arr.max() > 1)
        elif arr.dtype.kind == "f":
            bad = bool(((arr != 0) & (arr != 1)).any())
        else:
            raise InvalidInputError(f"input {name!r}: bits must be bool or 0/1, got {arr.dtype}")
        if bad:
            raise InvalidInputError(f"input {name!r}: bit arrays may only hold 0 and 1")
        if arr.dtype.kind == "f":
            arr = arr != 0
    return np.packbits(arr, axis=-1, bitorder=info.bitorder)


def _prepare_one(
    name: str,
    arr: np.ndarray[Any, Any],
    spec: TensorSpec | None,
    batched: bool,
    bitorder: Bitorder | None = None,
) -> tuple[np.ndarray[Any, Any], str, bool]:
    """(wire array, datatype, had batch dim) for one input; bits are packed in ``bitorder``
    (default: the model's)."""
    if spec is None:  # nothing known: send as given
        return arr, datatype_of(arr.dtype, name), True
    item = spec.shape
    n = len(item)
    if spec.packing is not None:
        logical = spec.packing.logical_shape
        for candidate, packed in ((item, True), (logical, False)):
            if packed and arr.dtype != np.uint8:
                continue
            for has_batch in (True, False) if batched else (False,):
                trailing = arr.shape[1:] if has_batch else arr.shape
                if _matches(trailing, candidate):
                    info = spec.packing
                    if bitorder is not None:
                        info = PackInfo(bitorder, info.logical_shape)
                    wire = arr if packed else _bits_to_packed(arr, name, info)
                    return wire, "UINT8", has_batch or not batched
        raise InvalidInputError(
            f"input {name!r} expects bits of shape {_fmt(logical, batched)} (bool or 0/1) "
            f"or packed uint8 {_fmt(item, batched)} (packbits along the last axis, bitorder "
            f"{spec.packing.bitorder!r}); got {arr.dtype} {list(arr.shape)}"
        )
    if batched and arr.ndim == n + 1:
        has_batch = True
    elif arr.ndim == n:
        has_batch = not batched
    else:
        raise InvalidInputError(
            f"input {name!r} expects shape {_fmt(item, batched)}, got {list(arr.shape)}"
        )
    trailing = arr.shape[1:] if batched and has_batch else arr.shape
    if not _matches(trailing, item):
        raise InvalidInputError(
            f"input {name!r} expects shape {_fmt(item, batched)}, got {list(arr.shape)}"
        )
    datatype = spec.datatype
    target = DATATYPES.get(datatype)
    if target is not None and arr.dtype != target:
        # Same-kind casts (float64 -> FP32, int64 -> INT32) are what users mean; a float for
        # an integer input is a mistake worth an error.
        if not np.can_cast(arr.dtype, target, casting="same_kind"):
            raise InvalidInputError(
                f"input {name!r} expects {datatype} ({target}), got {arr.dtype}"
            )
        arr = arr.astype(target)
    elif target is None and datatype != BYTES:
        datatype = datatype_of(arr.dtype, name)
    return arr, datatype, has_batch


def prepare_inputs(
    spec: ModelSpec | None, inputs: Mapping[str, Any], bitorder: Bitorder | None = None
) -> PreparedInputs:
    """Check, convert and pack a request's inputs.

    Args:
        spec: the model's spec, or None to send every array as given.
        inputs: input name -> array (bool/0-1 bits or packed uint8 for packed inputs;
            torch tensors accepted), each with or without the batch dimension (all alike).
        bitorder: the bit order of this request's packed inputs (sent as each one's
            ``parameters.bitorder``; bool arrays are packed in it; uint8 ones are taken to
            be packed in it); None: the model's.

    Returns:
        The wire tensors, with the batch dimension added to a single item.

    Raises:
        InvalidInputError: an unknown, missing or malformed input; mixed single/batched
            inputs; unequal batch sizes; a batch larger than the model's max_batch_size.
    """
    if spec is not None:
        unknown = sorted(set(inputs) - set(spec.inputs))
        missing = [n for n in spec.inputs if n not in inputs]
        if unknown or missing:
            raise InvalidInputError(
                f"model {spec.name!r} takes inputs {list(spec.inputs)}"
                + (f"; unknown: {unknown}" if unknown else "")
                + (f"; missing: {missing}" if missing else "")
            )
    batched = spec.batched if spec is not None else True
    tensors: list[WireTensor] = []
    with_batch: set[bool] = set()
    for name, value in inputs.items():
        arr = to_numpy(value, name)
        tspec = spec.inputs.get(name) if spec is not None else None
        wire, datatype, has_batch = _prepare_one(name, arr, tspec, batched, bitorder)
        with_batch.add(has_batch)
        if not has_batch:
            wire = wire[np.newaxis]
        if wire.dtype.byteorder == ">":
            wire = wire.astype(wire.dtype.newbyteorder("<"))
        packed = tspec is not None and tspec.packing is not None
        params = {"bitorder": bitorder} if bitorder is not None and packed else {}
        tensors.append(WireTensor(name, datatype, np.ascontiguousarray(wire), params))
    if len(with_batch) > 1:
        raise InvalidInputError(
            "inputs mix single items and batches: give every input the batch dimension, or none"
        )
    single = batched and with_batch == {False}
    if spec is None or not batched:
        # Nothing to check across inputs: an unknown model's first dims need not agree.
        return PreparedInputs(tensors, single=False, batch_size=0)
    sizes = {t.name: t.array.shape[0] for t in tensors}
    if len(set(sizes.values())) > 1:
        raise InvalidInputError(f"inputs have different batch sizes: {sizes}")
    batch = next(iter(sizes.values()), 0)
    if spec is not None and tensors and batch == 0:
        raise InvalidInputError(f"model {spec.name!r}: the batch is empty")
    if spec is not None and spec.max_batch_size > 0 and batch > spec.max_batch_size:
        raise InvalidInputError(
            f"batch of {batch} exceeds model {spec.name!r}'s max_batch_size "
            f"{spec.max_batch_size}; split it (infer_many does)"
        )
    return PreparedInputs(tensors, single=single, batch_size=batch)
