"""A model version's inputs and outputs as the wire sees them: the one place requests are checked.

Every transport's decoder calls :meth:`Signature.check_input` on each input's name, datatype
and shape before it converts any data (so a tensor the model refuses costs no element
parsing), and the data plane calls :meth:`Signature.bind` on the decoded request, which adds
only what a per-input check cannot see (missing inputs, batch sizes that disagree, the
requested outputs) and lays the inputs out for the batcher. Nothing is checked twice.

A bit-packed input (``packing = "bits"``) is accepted in two wire forms: ``UINT8`` of the
packed shape (``ceil(L / 8)`` bytes on the last axis) and ``BOOL`` of the logical shape.

An index (``[index]``) also reads the request's ``parameters.k`` (hits per query, 1 ..
``max_k``) and ``parameters.threshold`` (the least Tanimoto similarity, 0 .. 1); its outputs
have ``k`` entries per query, so their metadata says ``-1`` for that axis.

**The dtype rule** (:func:`handed_dtypes`): each input reaches the model in the dtype its
file's signature asks for (torch.export, AOTInductor, ONNX), else in ``[[inputs]] dtype``,
else in its own datatype's (``bool`` for BOOL). Bits unpack straight into it. The operator's
input reaches the model as the operator's output, in ``[operator] dtype``. The host checks
(``service.models.checks``), the input buffers' sizes (``service.models.files``) and the
pipeline's buffers (``service.models.pipeline``) all read it here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.backends.base import ModelFile
from service.errors import InvalidInput
from service.models.codes import wire_parameters
from service.models.config import IndexConfig, InputConfig, ModelConfig
from service.models.dtypes import COMPUTE_DTYPES, torch_dtype
from service.protocol.request import RawInputSpec
from service.protocol.types import DATATYPES, InferRequest, SharedOutput


def handed_dtypes(cfg: ModelConfig, model: ModelFile | None) -> list[torch.dtype]:
    """The dtype each input is handed to the model in (the dtype rule, module docstring).

    Args:
        cfg: the version's config.
        model: its model file (its signature's input dtypes), or None.

    Returns:
        One dtype per ``[[inputs]]`` entry, in config order; the operator's input: the
        operator's dtype.
    """
    specs = None if model is None else model.signature().inputs
    out = []
    for i, spec in enumerate(cfg.inputs):
        if cfg.operator is not None and i == cfg.operator_input:
            out.append(COMPUTE_DTYPES[cfg.operator.dtype])
            continue
        file_dtype = specs[i].dtype if specs is not None and i < len(specs) else None
        if file_dtype is not None and file_dtype in allowed_dtypes(spec.handed_dtypes):
            out.append(file_dtype)
        elif spec.dtype is not None:
            out.append(getattr(torch, spec.dtype))
        else:
            out.append(torch_dtype(spec.datatype))
    return out


def allowed_dtypes(names: Sequence[str]) -> set[torch.dtype]:
    """The torch dtypes of ``names`` (an input's ``handed_dtypes``: what it may be handed in)."""
    return {getattr(torch, n) for n in names}


@dataclass(frozen=True)
class WireInput:
    """One input of one request, as it will be staged.

    Attributes:
        data: a C-contiguous array with the batch dimension first: UINT8 packed
            ``(b, *packed_shape)`` when ``packed``, else the logical ``(b, *shape)`` in the
            wire datatype. Read-only views over the request body are fine.
        packed: whether ``data`` holds bits packed along the last axis.
        bitorder: the request's own bit order of those bits (its input's
            ``parameters.bitorder``); None: the model's.
    """

    data: np.ndarray[Any, Any]
    packed: bool
    bitorder: str | None = None


@dataclass(frozen=True)
class Search:
    """What one request asks of an index.

    Attributes:
        k: hits per query (``parameters.k``, else the config's ``k``).
        threshold: the least similarity of a hit (``parameters.threshold``); None: any.
    """

    k: int
    threshold: float | None = None


@dataclass(frozen=True)
class Bound:
    """A request checked against its model and laid out for the batcher.

    Attributes:
        inputs: one :class:`WireInput` per model input, in config order.
        outputs: indices (into the config's outputs) of the outputs to answer, in the order
            the request asked for them (all of them, in config order, when it did not ask).
        size: the request's batch size (1 for a model without a batch dimension).
        search: an index's ``k`` and ``threshold`` for this request; None: its defaults.
    """

    inputs: tuple[WireInput, ...]
    outputs: tuple[int, ...]
    size: int
    search: Search | None = None


@dataclass(frozen=True)
class _InputForms:
    spec: InputConfig
    forms: dict[str, list[int]]  # wire datatype -> dims of one item


class Signature:
    """What a model version accepts and answers, with the checks and the V2 descriptions.

    Args:
        model: the model name (messages).
        cfg: its configuration.
        output_shapes: each output's shape of one item (found when the pipeline was built).
    """

    def __init__(self, model: str, cfg: ModelConfig, output_shapes: Sequence[list[int]]) -> None:
        self.model = model
        self.batched = cfg.max_batch_size > 0
        self.max_batch_size = cfg.max_batch_size
        self.inputs = list(cfg.inputs)
        self.outputs = list(cfg.outputs)
        self.output_shapes = [list(s) for s in output_shapes]
        self.index: IndexConfig | None = cfg.index
        self._by_name: dict[str, _InputForms] = {}
        for spec in cfg.inputs:
            if spec.packing == "bits":
                forms = {"UINT8": spec.packed_shape, "BOOL": list(spec.shape)}
            elif spec.packing == "codes":
                forms = {"UINT8": spec.packed_shape}
            else:
                forms = {spec.datatype: list(spec.shape)}
            self._by_name[spec.name] = _InputForms(spec, forms)
        self._output_index = {o.name: i for i, o in enumerate(cfg.outputs)}
        self._all_outputs = tuple(range(len(cfg.outputs)))
        self._batch_dims = [-1] if self.batched else []

    def same_as(self, other: Signature) -> bool:
        """Whether ``other`` accepts and answers exactly what this signature does."""
        return (
            self.max_batch_size == other.max_batch_size
            and self.inputs == other.inputs
            and self.outputs == other.outputs
            and self.output_shapes == other.output_shapes
        )

    # --- checks ---------------------------------------------------------------------------

    def _prefix(self) -> str:
        return f"model '{self.model}'"

    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> int:
        """Check one input's name, datatype and shape (no data needed).

        Returns:
            the input's batch size (1 for a model without a batch dimension).

        Raises:
            InvalidInput: naming the input and what is wrong.
        """
        entry = self._by_name.get(name)
        m = self._prefix()
        if entry is None:
            expected = [s.name for s in self.inputs]
            raise InvalidInput(f"{m}: unknown input '{name}' (expected inputs: {expected})")
        dims = entry.forms.get(datatype)
        if dims is None:
            forms = " or ".join(f"{d} {self._batch_dims + s}" for d, s in entry.forms.items())
            packed = " (UINT8: bits packed along the last axis)" if len(entry.forms) > 1 else ""
            raise InvalidInput(
                f"{m}: input '{name}' has datatype {datatype}; expected {forms}{packed}"
            )
        if not self.batched:
            if list(shape) != dims:
                raise InvalidInput(
                    f"{m}: input '{name}' has shape {list(shape)}; expected {dims} for {datatype} "
                    "(this model has max_batch_size 0: no batch dimension)"
                )
            return 1
        if len(shape) != len(dims) + 1 or list(shape[1:]) != dims or shape[0] < 1:
            raise InvalidInput(
                f"{m}: input '{name}' has shape {list(shape)}; expected [batch, "
                f"{', '.join(map(str, dims))}] for {datatype}"
            )
        if shape[0] > self.max_batch_size:
            raise InvalidInput(
                f"{m}: input '{name}' has batch size {shape[0]}, more than the model's "
                f"max_batch_size {self.max_batch_size}"
            )
        return shape[0]

    def bind(self, request: InferRequest) -> Bound:
        """Lay out a decoded request whose inputs each passed :meth:`check_input`.

        Raises:
            InvalidInput: a missing input, batch sizes that differ between inputs, or an
                unknown or repeated output.
        """
        m = self._prefix()
        given = {t.name: t for t in request.inputs}
        wires: list[WireInput] = []
        size = 0
        for spec in self.inputs:
            t = given.get(spec.name)
            if t is None:
                raise InvalidInput(f"{m}: missing input '{spec.name}'")
            b = t.shape[0] if self.batched else 1
            if size and b != size:
                raise InvalidInput(
                    f"{m}: input '{spec.name}' has batch size {b}, but input "
                    f"'{self.inputs[0].name}' has {size}; every input needs the same"
                )
            size = b
            packed = t.datatype == "UINT8" and spec.packing in ("bits", "codes")
            data = t.data if self.batched else t.data.reshape(1, *t.data.shape)
            order = self._bitorder(spec, t.parameters) if t.parameters else None
            wires.append(WireInput(np.ascontiguousarray(data), packed, order))
        if len(request.inputs) != len(self.inputs):  # decoders refuse most of this earlier
            names = [t.name for t in request.inputs]
            repeated = [n for n in names if names.count(n) > 1]
            if repeated:
                raise InvalidInput(f"{m}: input '{repeated[0]}' is given more than once")
            extra = sorted(set(given) - {s.name for s in self.inputs})
            expected = [s.name for s in self.inputs]
            raise InvalidInput(f"{m}: unknown input '{extra[0]}' (expected inputs: {expected})")
        search = None if self.index is None else self._search(self.index, request.parameters)
        return Bound(tuple(wires), self._outputs(request, size, search), size, search)

    def _search(self, index: IndexConfig, parameters: dict[str, Any]) -> Search:
        """A request's ``parameters.k`` and ``parameters.threshold`` for an index.

        Raises:
            InvalidInput: a k that is not an integer in 1 .. max_k, a threshold that is not
                a number in [0, 1], or a threshold for a Hamming index.
        """
        m = self._prefix()
        k = parameters.get("k", index.k)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= index.max_k:
            shown = repr(k)[:40] if isinstance(k, int | float | str) else type(k).__name__
            raise InvalidInput(
                f"{m}: parameters.k must be an integer from 1 to max_k = {index.max_k}, got {shown}"
            )
        threshold = parameters.get("threshold")
        if threshold is None:
            return Search(k)
        if index.metric != "tanimoto":
            raise InvalidInput(
                f"{m}: parameters.threshold is the least Tanimoto similarity; this index's "
                f"metric is {index.metric} (ask for parameters.k nearest rows)"
            )
        ok = isinstance(threshold, int | float) and not isinstance(threshold, bool)
        if not ok or not 0.0 <= float(threshold) <= 1.0:
            shown = (
                repr(threshold)[:40]
                if ok or isinstance(threshold, str)
                else (type(threshold).__name__)
            )
            raise InvalidInput(
                f"{m}: parameters.threshold must be a number from 0 to 1, got {shown}"
            )
        return Search(k, float(threshold))

    def _bitorder(self, spec: InputConfig, parameters: dict[str, Any]) -> str | None:
        """An input's ``parameters.bitorder``: ``"big"`` or ``"little"`` for a bit-packed
        input (its BOOL form ignores it); None when not given."""
        order = parameters.get("bitorder")
        if order is None:
            return None
        m = self._prefix()
        if spec.packing != "bits":
            raise InvalidInput(
                f"{m}: input '{spec.name}' has parameters.bitorder, but it is not bit-packed "
                '(packing = "bits")'
            )
        if order not in ("big", "little"):
            shown = ascii(order)[:40] if isinstance(order, str) else type(order).__name__
            raise InvalidInput(
                f'{m}: input \'{spec.name}\': parameters.bitorder must be "big" or "little", '
                f"not {shown}"
            )
        return str(order)

    def _outputs(
        self, request: InferRequest, size: int, search: Search | None = None
    ) -> tuple[int, ...]:
        if request.outputs is None:
            return self._all_outputs
        indices: list[int] = []
        for o in request.outputs:
            i = self._output_index.get(o.name)
            if i in indices:
                raise InvalidInput(
                    f"{self._prefix()}: output '{o.name}' is requested more than once"
                )
            if i is None:
                names = [x.name for x in self.outputs]
                raise InvalidInput(
                    f"{self._prefix()}: unknown output '{o.name}' (outputs: {names})"
                )
            if o.shared_memory is not None:
                self._check_room(i, o.shared_memory, size, search)
            indices.append(i)
        return tuple(indices)

    def _check_room(
        self, i: int, shared: SharedOutput, size: int, search: Search | None = None
    ) -> None:
        """An output's shared memory holds all of it (checked before anything is computed)."""
        spec = self.outputs[i]
        shape = [search.k] if search is not None else self.output_shapes[i]
        items = math.prod(shape) * (size if self.batched else 1)
        need = items * DATATYPES[spec.datatype].itemsize
        if shared.nbytes < need:
            raise InvalidInput(
                f"{self._prefix()}: output '{spec.name}' needs {need} bytes, but its "
                f"shared_memory_byte_size in region '{shared.region}' is {shared.nbytes}"
            )

    # --- descriptions ---------------------------------------------------------------------

    def _wire(self, spec: InputConfig) -> tuple[str, list[int], dict[str, Any]]:
        if spec.packing == "bits":
            params = {
                "packing": "bits",
                "bitorder": spec.bitorder,
                "logical_shape": list(spec.shape),
                "logical_datatype": spec.datatype,
            }
            return "UINT8", spec.packed_shape, params
        if spec.packing == "codes":
            return "UINT8", spec.packed_shape, wire_parameters(spec)
        return spec.datatype, list(spec.shape), {}

    def _wire_inputs(self) -> list[tuple[str, str, list[int], dict[str, Any]]]:
        """``(name, datatype, dims, parameters)`` of every input in its wire form."""
        return [(spec.name, *self._wire(spec)) for spec in self.inputs]

    def input_metadata(self) -> list[dict[str, Any]]:
        """V2 metadata of the inputs; a packed input is advertised in its wire form (UINT8)."""
        return [
            _entry(params, name=name, datatype=datatype, shape=self._batch_dims + dims)
            for name, datatype, dims, params in self._wire_inputs()
        ]

    def _shown_output_shapes(self) -> list[list[int]]:
        """Each output's item shape as advertised: an index's ``[k]`` varies per request."""
        if self.index is not None:
            return [[-1] for _ in self.outputs]
        return self.output_shapes

    def output_metadata(self) -> list[dict[str, Any]]:
        """V2 metadata of the outputs."""
        return [
            {"name": o.name, "datatype": o.datatype, "shape": self._batch_dims + shape}
            for o, shape in zip(self.outputs, self._shown_output_shapes(), strict=True)
        ]

    def input_config(self) -> list[dict[str, Any]]:
        """Triton-style ``input`` entries of the model configuration."""
        return [
            _entry(params, name=name, data_type=f"TYPE_{datatype}", dims=dims)
            for name, datatype, dims, params in self._wire_inputs()
        ]

    def output_config(self) -> list[dict[str, Any]]:
        """Triton-style ``output`` entries of the model configuration."""
        return [
            {"name": o.name, "data_type": f"TYPE_{o.datatype}", "dims": shape}
            for o, shape in zip(self.outputs, self._shown_output_shapes(), strict=True)
        ]

    def raw_spec(self) -> RawInputSpec:
        """The model's only input in its wire form, for the raw binary request form.

        Raises:
            InvalidInput: the model has several inputs.
        """
        if len(self.inputs) != 1:
            raise InvalidInput(
                f"{self._prefix()} has {len(self.inputs)} inputs; the raw binary form "
                "(Inference-Header-Content-Length: 0) needs a model with exactly one input"
            )
        datatype, dims, _ = self._wire(self.inputs[0])
        return RawInputSpec(self.inputs[0].name, datatype, tuple(self._batch_dims + dims))


def _entry(params: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A metadata or config entry: ``fields``, then ``parameters`` when there are any."""
    return {**fields, "parameters": params} if params else fields
