"""A model's device-resident pipeline: unpack bits -> banded response operator -> optional model.

Everything a batch needs stays on the device between requests: the operator's weights, the
model, and a preallocated input buffer of ``max_batch_size`` items in the compute dtype. One
batch costs one gather of the request payloads into a (pinned) staging buffer, one
``non_blocking`` host-to-device copy, one unpack per run of same-form requests straight into
the compute dtype, the operator, the model, and one device-to-host copy per output into pinned
memory; the results are split per request as NumPy views.

:meth:`Pipeline.run` is called from the device's single worker thread only (see
``service.batcher``); it is not re-entrant.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.config import (
    ConfigError,
    InputConfig,
    ModelConfig,
    OperatorConfig,
    VersionSource,
    hidden_error,
)
from service.protocol.types import DATATYPES

COMPUTE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
TORCH_DTYPES = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}

_NUMPY_TO_TORCH = {DATATYPES[k]: v for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class WireInput:
    """One request's input as it will be staged.

    Attributes:
        data: a C-contiguous array with the batch dimension first: UINT8 packed
            ``(b, *packed_shape)`` when ``packed``, else the logical ``(b, *shape)`` in the
            wire datatype. Read-only views over the request body are fine.
        packed: whether ``data`` holds bits packed along the last axis.
        size: ``b``, the number of items.
    """

    data: np.ndarray[Any, Any]
    packed: bool
    size: int


@dataclass
class Artifacts:
    """A model version's files, loaded on the host (never with pickle).

    Attributes:
        tensors: the operator's tensors (``x``, ``c`` and for a tabulated response
            ``response_x``/``response_y``); empty without an operator.
        model: a ``torch.export.ExportedProgram`` or a TorchScript module, or None.
    """

    tensors: dict[str, torch.Tensor]
    model: Any = None


def load_artifacts(src: VersionSource, cfg: ModelConfig) -> Artifacts:
    """Read the files a version's config names: safetensors, ``torch.export`` or TorchScript.

    Raises:
        ConfigError: a file is missing, outside the model, or unreadable (naming the key).
    """
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    if cfg.operator is not None:
        path = src.resolve(cfg.operator.file, "operator.file")
        try:
            tensors = load_file(str(path), device="cpu")
        except Exception as exc:  # corrupt headers raise several types
            reason = hidden_error(f"{src.source}: operator.file", "cannot read", exc)
            raise ConfigError([reason]) from None
    model = None
    if cfg.model is not None:
        path = src.resolve(cfg.model.file, "model.file")
        try:
            model = _load_model(path, cfg.model.format)
        except Exception as exc:
            reason = hidden_error(f"{src.source}: model.file", "cannot load", exc)
            raise ConfigError([reason]) from None
    return Artifacts(tensors, model)


def _load_model(path: Path, fmt: str) -> Any:
    if fmt == "torch_export":
        import gpu_ops  # noqa: F401 - registers torch.ops.bitserve.*, which programs may call

        return torch.export.load(str(path))
    with warnings.catch_warnings():
        # TorchScript is deprecated in favour of torch.export but still the common format.
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]


def resolve_device(device: str, default: str = "auto", *, source: str = "config.toml") -> str:
    """A concrete device string (``"cpu"`` or ``"cuda:N"``) for a config's ``device``.

    ``"auto"`` in the config defers to ``default`` (the server's setting); ``"auto"`` there
    means CUDA device 0 when available, else the CPU.

    Raises:
        ConfigError: a CUDA device that this host does not have.
    """
    if device == "auto":
        device = default
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu"
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise ConfigError([f"{source}: device: {device!r}, but this host has {count} CUDA devices"])
    return f"cuda:{index}"


def build_operator(
    op: OperatorConfig, tensors: dict[str, torch.Tensor], device: torch.device
) -> torch.nn.Module:
    """The banded response operator of ``op``, built once on ``device``."""
    from gpu_ops.resample import BandedResampler

    dtype = COMPUTE_DTYPES[op.dtype]
    # Windows and weights are found in float64 (from_response converts), then stored in dtype.
    x, c = tensors["x"], tensors["c"]
    if op.response == "tabulated":
        table = (tensors["response_x"].double(), tensors["response_y"].double())
        return BandedResampler.from_response(x, c, table, dtype=dtype, device=device)
    params: dict[str, Any] = op.parameters  # e.g. sigma=125.0
    return BandedResampler.from_response(
        x, c, op.response, op.support, dtype=dtype, device=device, **params
    )


def _prepare_model(model: Any, device: torch.device) -> Callable[..., Any]:
    if isinstance(model, torch.export.ExportedProgram):
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(model, device).module()
    module: torch.nn.Module = model.to(device)
    module.eval()
    return module


def _module_bytes(module: Any) -> int:
    if not isinstance(module, torch.nn.Module):
        return 0
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


class Pipeline:
    """A model version resident on its device.

    Args:
        name: the model name (messages).
        cfg: its configuration.
        artifacts: its loaded files (moved to the device once, here).
        device: ``"cpu"`` or ``"cuda:N"``.
        warmup: also run a full-size batch at load (the first run compiles kernels and
            grows allocator pools; without it the first request pays for that).
        source: the config's path for messages.

    Raises:
        ConfigError: the operator tensors do not fit the input, or the model's outputs do
            not match ``[[outputs]]`` (count, or a declared shape).
    """

    def __init__(
        self,
        name: str,
        cfg: ModelConfig,
        artifacts: Artifacts,
        device: str,
        *,
        warmup: bool = True,
        source: str = "config.toml",
    ) -> None:
        from gpu_ops.transfer import StagingPool

        self.name = name
        self.cfg = cfg
        self.device = torch.device(device)
        self.source = source
        self.input: InputConfig = cfg.inputs[0]
        self.capacity = max(cfg.max_batch_size, 1)
        self.batched = cfg.max_batch_size > 0
        op = cfg.operator
        self.compute_dtype = COMPUTE_DTYPES[op.dtype] if op is not None else torch.float32
        self._pool = StagingPool(self.device)
        self._out_dtypes = [TORCH_DTYPES[o.datatype] for o in cfg.outputs]
        with torch.inference_mode(), self._device_context():
            self.operator = (
                None if op is None else build_operator(op, artifacts.tensors, self.device)
            )
            self.model = (
                None if artifacts.model is None else _prepare_model(artifacts.model, self.device)
            )
            # Each batch is unpacked into (a prefix of) this buffer: no allocation per batch.
            self._buffer = torch.zeros(
                (self.capacity, *self.input.shape), dtype=self.compute_dtype, device=self.device
            )
            # A single item gives the output shapes (and checks the model against the config).
            probe = self._forward(self._buffer[:1])
            self.output_shapes = [list(t.shape[1:]) for t in probe]
            self._check_outputs()
            if warmup:
                for _ in range(2):
                    self._forward(self._buffer)
                self._synchronize()
        self.device_memory_bytes = (
            self._buffer.numel() * self._buffer.element_size()
            + _module_bytes(self.operator)
            + _module_bytes(self.model)
        )

    # --- loading checks -------------------------------------------------------------------

    def _check_outputs(self) -> None:
        outs = self.cfg.outputs
        for i, (o, shape) in enumerate(zip(outs, self.output_shapes, strict=True)):
            if o.shape is not None and o.shape != shape:
                raise ConfigError(
                    [f"{self.source}: outputs[{i}].shape: {o.shape}, but the model gives {shape}"]
                )

    # --- compute --------------------------------------------------------------------------

    def _device_context(self) -> Any:
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _forward(self, u: torch.Tensor) -> list[torch.Tensor]:
        """Operator then model on ``u`` (M, *shape) in the compute dtype; outputs batch-first."""
        y = u if self.operator is None else self.operator(u)
        outs: Any = y if self.model is None else self.model(y)
        if isinstance(outs, torch.Tensor):
            outs = [outs]
        elif isinstance(outs, dict):
            outs = list(outs.values())
        if not isinstance(outs, list | tuple) or not all(isinstance(t, torch.Tensor) for t in outs):
            got = type(outs).__name__
            raise ConfigError([f"{self.source}: model.file: the model returned {got}, not tensors"])
        if len(outs) != len(self.cfg.outputs):
            n = len(self.cfg.outputs)
            raise ConfigError(
                [f"{self.source}: outputs: {n} declared, the model returns {len(outs)}"]
            )
        m = u.shape[0]
        for i, t in enumerate(outs):
            if t.dim() == 0 or t.shape[0] != m:
                shape = list(t.shape)
                raise ConfigError(
                    [f"{self.source}: outputs[{i}]: shape {shape} has no batch dimension of {m}"]
                )
        return [t.to(d) for t, d in zip(outs, self._out_dtypes, strict=True)]

    def _stage(self, inputs: Sequence[WireInput]) -> int:
        """Gather the payloads, move them with one copy, unpack into the buffer; returns M."""
        from gpu_ops.bits import unpackbits

        sizes = [w.data.nbytes for w in inputs]
        with self._pool.acquire(sum(sizes)) as buf:
            offset = 0
            for w in inputs:
                offset = buf.write(w.data, offset)
            raw = buf.to_device(self.device)  # one non_blocking copy on CUDA
        spec = self.input
        row = offset = 0
        i = 0
        # Consecutive requests of the same wire form are contiguous in ``raw``: one call each.
        while i < len(inputs):
            j = i
            while j < len(inputs) and (inputs[j].packed, inputs[j].data.dtype) == (
                inputs[i].packed,
                inputs[i].data.dtype,
            ):
                j += 1
            m = sum(w.size for w in inputs[i:j])
            nbytes = sum(sizes[i:j])
            part = raw[offset : offset + nbytes]
            dst = self._buffer[row : row + m]
            if inputs[i].packed:
                packed = part.view(m, *spec.packed_shape)
                unpackbits(
                    packed, dim=-1, count=spec.shape[-1], bitorder=spec.bitorder,
                    dtype=self.compute_dtype, out=dst,
                )  # fmt: skip
            else:
                wire = _NUMPY_TO_TORCH[inputs[i].data.dtype]
                if wire == torch.bool:
                    # Every request path already refuses BOOL bytes other than 0/1 (the
                    # framing checks binary and JSON data), so this clamp is defence for
                    # direct callers of ``run`` (tools, tests, an embedding program): their
                    # BOOL arrays may hold any byte, and a bool tensor over byte 2 converts
                    # to 2.0. Like NumPy, nonzero counts as 1. It costs one pass over the
                    # buffer, only on the unpacked BOOL form.
                    dst.copy_(part.view(m, *spec.shape)).clamp_(max=1)
                else:
                    dst.copy_(part.view(wire).view(m, *spec.shape))
            row += m
            offset += nbytes
            i = j
        return row

    def run(self, inputs: Sequence[WireInput]) -> list[list[np.ndarray[Any, Any]]]:
        """Compute one batch.

        Args:
            inputs: the batch's requests, validated (shapes, dtypes, total size at most
                ``capacity``).

        Returns:
            Per request, one array per configured output, in config order: ``(b, *shape)``
            C-contiguous views into a fresh host buffer (no batch dimension when the model
            has ``max_batch_size = 0``).
        """
        total = sum(w.size for w in inputs)
        if not 0 < total <= self.capacity:
            raise ValueError(f"batch of {total} items outside 1..{self.capacity}")
        with torch.inference_mode(), self._device_context():
            m = self._stage(inputs)
            outs = self._forward(self._buffer[:m])
            hosts = []
            for t in outs:
                # A fresh pinned buffer per batch: the views handed out must outlive this
                # call (responses are serialised while the next batch runs). torch's
                # caching host allocator makes this allocation cheap.
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device.type == "cuda")
                host.copy_(t, non_blocking=True)
                hosts.append(host)
            self._synchronize()
        arrays = [h.numpy() for h in hosts]
        results: list[list[np.ndarray[Any, Any]]] = []
        row = 0
        for w in inputs:
            sl = [a[row : row + w.size] for a in arrays]
            results.append(sl if self.batched else [a[0] for a in sl])
            row += w.size
        return results

    def __repr__(self) -> str:
        return (
            f"Pipeline({self.name!r}, device={self.device}, capacity={self.capacity}, "
            f"input={self.input.shape}, dtype={self.compute_dtype}, "
            f"memory={math.ceil(self.device_memory_bytes / 2**20)} MiB)"
        )
