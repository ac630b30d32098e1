"""A model's device-resident pipeline: bits -> banded response operator -> optional model.

Everything a batch needs stays on the device between requests: the operator's weights, the
model, and a preallocated input buffer of ``max_batch_size`` items in the compute dtype. One
batch costs one gather of the request payloads into a (pinned) staging buffer, one
``non_blocking`` host-to-device copy, the operator, the model, and one device-to-host copy
per output into pinned memory; the results are split per request as NumPy views. The
operator's input, when every request of the batch sends it bit-packed, goes to the operator
packed (``forward_bits``: the band, an event scatter or prefix sums, by the batch's density);
other inputs, and an operator input sent unpacked by some request, are unpacked once per run
of same-form requests straight into the compute dtype.

:meth:`Pipeline.run` is called from the device's single worker thread only (see
``service.batching.batcher``); it is not re-entrant. It times its three phases once per batch for
the statistics extension: staging and unpacking the inputs (``compute_input``), operator and
model (``compute_infer``), the copy of the outputs to the host (``compute_output``); on CUDA
with events on the device's stream, read after the batch's one synchronisation.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import gpu_ops  # noqa: F401 - registers torch.ops.bitserve.*
from gpu_ops import BandedResampler, OnTheFlyResampler
from service.backends import ModelFile
from service.models.config import (
    ConfigError,
    InputConfig,
    ModelConfig,
    OperatorConfig,
)
from service.models.dtypes import COMPUTE_DTYPES, torch_dtype
from service.models.files import Artifacts
from service.models.score_model import ScoreModule
from service.models.signature import Bound, handed_dtypes
from service.observability.statistics import ModelStats
from service.protocol.types import DATATYPES
from service.text import safe_text

# The wire's NumPy dtype of an unpacked input -> the torch dtype to view its bytes as.
_NUMPY_TO_TORCH = {wire: torch_dtype(name) for name, wire in DATATYPES.items()}


def build_operator(
    op: OperatorConfig, tensors: dict[str, torch.Tensor], device: torch.device
) -> BandedResampler | OnTheFlyResampler:
    """The banded response operator of ``op``, built once on ``device``: a stored band, or
    with ``on_the_fly`` the response evaluated in the kernels (nothing stored)."""
    dtype = COMPUTE_DTYPES[op.dtype]
    x, c = tensors["x"], tensors["c"]
    table = None
    if op.response == "tabulated":
        table = (tensors["response_x"].double(), tensors["response_y"].double())
    if op.on_the_fly:  # computes in float32 (the inputs may come in any dtype)
        if table is not None:
            return OnTheFlyResampler(x, c, table, device=device, **op.options)
        kw: dict[str, Any] = {**op.options, **op.parameters}
        return OnTheFlyResampler(x, c, op.response, op.support, device=device, **kw)
    # Windows and weights are found in float64 (from_response converts), then stored in dtype.
    # The config asked for a stored band and the size check counted it: no cap here.
    kw = {"dtype": dtype, "device": device, "max_band_bytes": None, **op.options}
    if table is not None:
        return BandedResampler.from_response(x, c, table, **kw)
    params: dict[str, Any] = op.parameters  # e.g. sigma=125.0
    return BandedResampler.from_response(x, c, op.response, op.support, **kw, **params)


def _score_module(artifacts: Artifacts, device: torch.device) -> Any:
    """A ``[score]`` model's module (:class:`service.models.score_model.ScoreModule`) on
    ``device``."""
    t = artifacts.score
    return ScoreModule(t["weights"], t["flip"], t["scored"], artifacts.codes[0], device)


def _module_bytes(module: Any) -> int:
    if not isinstance(module, torch.nn.Module):
        return 0
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


class Pipeline:
    """A model version resident on its device (the builder's device stage).

    The builder dry-runs it next (:func:`service.models.checks.dry_run`, as Triton's
    ModelWarmup: a zero batch, or the ``warmup_file`` sample, through :meth:`run` at batch 1
    and at ``max_batch_size``, every output checked against ``[[outputs]]``) before it is
    handed out; build one with :func:`service.models.builder.build_version` (from files) or
    :func:`service.models.builder.build_pipeline` (files already in memory).

    Args:
        name: the model name (messages).
        cfg: its configuration.
        artifacts: its loaded files (moved to the device once, here).
        device: ``"cpu"`` or ``"cuda:N"``.
        source: the config's path for messages.

    Raises:
        ConfigError: the model cannot run on the device.
    """

    def __init__(
        self,
        name: str,
        cfg: ModelConfig,
        artifacts: Artifacts,
        device: str,
        *,
        source: str = "config.toml",
    ) -> None:
        self._init_state(name, cfg, device, source)
        op = cfg.operator
        self.operator_input = cfg.operator_input
        self.compute_dtype = COMPUTE_DTYPES[op.dtype] if op is not None else torch.float32
        # What each input is on the device: the operator's in its compute dtype, the others
        # in the dtype the model is handed them in (bits unpacked straight into it).
        self._dtypes = handed_dtypes(cfg, artifacts.model)
        with torch.inference_mode(), self._device_context():
            self.operator = (
                None if op is None else build_operator(op, artifacts.tensors, self.device)
            )
            self.model = None if artifacts.model is None else self._on_device(artifacts.model)
            self._codes = {i: t.to(self.device) for i, t in artifacts.codes.items()}
            if cfg.score is not None:  # a [score] model: the codes stay packed
                self.model = _score_module(artifacts, self.device)
            # Each batch is unpacked into (a prefix of) these buffers: no allocation per batch.
            # A bit-packed operator input stays packed: its buffer holds bytes (the probe's
            # and warm-up's zeros; a batch's own bytes are read where they arrived).
            self._buffers = [
                torch.zeros(
                    (self.capacity, *spec.packed_shape), dtype=torch.uint8, device=self.device
                )
                if self._packs(i)
                else torch.zeros((self.capacity, *spec.shape), dtype=dtype, device=self.device)
                for i, (spec, dtype) in enumerate(zip(self.inputs, self._dtypes, strict=True))
            ]
        model_bytes = 0
        if artifacts.model is not None and self.model is not None:
            model_bytes = artifacts.model.device_bytes(self.model)
        self.device_memory_bytes = (
            sum(b.numel() * b.element_size() for b in self._buffers)
            + _module_bytes(self.operator)
            + (_module_bytes(self.model) if cfg.score is not None else 0)
            + model_bytes
        )

    def _init_state(self, name: str, cfg: ModelConfig, device: str, source: str) -> None:
        """The state every pipeline kind shares (this class and
        :class:`service.index.pipeline.IndexPipeline` both start with it)."""
        from gpu_ops.transfer import StagingPool

        self.name = name
        self.cfg = cfg
        self.device = torch.device(device)
        self.source = source
        self.stats: ModelStats | None = None
        """Where each batch's phase durations go (set by the repository once built: the
        warm-up runs are not counted)."""
        self.last_phases_ns: tuple[int, int, int] | None = None
        """The last batch's ``compute_input``, ``compute_infer`` and ``compute_output`` ns
        (the device's own times on CUDA): the phases of a traced batch."""
        self._events: list[Any] = []
        self.inputs: list[InputConfig] = list(cfg.inputs)
        self.capacity = max(cfg.max_batch_size, 1)
        self.batched = cfg.max_batch_size > 0
        self._pool = StagingPool(self.device) if self.device.type == "cuda" else None
        self._out_dtypes = [torch_dtype(o.datatype) for o in cfg.outputs]
        self._out_names = [o.name for o in cfg.outputs]
        # The operator input's packed bytes of the batch being run (forward_bits).
        self._packed: torch.Tensor | None = None
        self._bit_reversal: torch.Tensor | None = None
        self.output_shapes: list[list[int]] = []
        """Each output's shape of one item, as the dry run found it (set by the builder's
        dry-run stage, ``service.models.builder``)."""

    def after_dry_run(self) -> None:
        """What a kind does once its dry run has passed (the builder's last stage): nothing
        here; an index brings its whole corpus to the device."""

    # --- loading checks -------------------------------------------------------------------

    def _on_device(self, model: ModelFile) -> Callable[..., Any]:
        try:
            return model.to(self.device)
        except ValueError as exc:
            raise self._bad_model(f"{safe_text(model.path.name)}: {exc}") from None

    def check_outputs(self, outs: Sequence[torch.Tensor], m: int) -> None:
        """The dry run's check of a batch of ``m`` items' outputs against ``[[outputs]]``:
        a model's datatypes, and each declared shape.

        Raises:
            ConfigError: naming the output, what the model gives and what is declared.
        """
        for i, (o, t) in enumerate(zip(self.cfg.outputs, outs, strict=True)):
            where = f"{self.source}: outputs[{i}]"
            name = safe_text(o.name)
            # A wider datatype than the model's is a lossless conversion; another is refused.
            want = self._out_dtypes[i]
            if self.model is not None and torch.promote_types(t.dtype, want) != want:
                got = f"{str(t.dtype).removeprefix('torch.')} {[m, *t.shape[1:]]}"
                raise ConfigError([f"{where}.datatype: {o.datatype} for '{name}', but the model "
                                   f"gives {got}"])  # fmt: skip
            if o.shape is not None and o.shape != list(t.shape[1:]):
                by = "model" if self.model is not None else "operator"
                raise ConfigError([f"{where}.shape: {o.shape} for '{name}', but the {by} gives "
                                   f"{list(t.shape[1:])}"])  # fmt: skip

    def _bad_model(self, problem: str) -> ConfigError:
        return ConfigError([f"{self.source}: model.file: {problem}"])

    # --- compute --------------------------------------------------------------------------

    def _device_context(self) -> Any:
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _forward(self, m: int) -> list[torch.Tensor]:
        """Operator then model on the first ``m`` items of the buffers; outputs batch-first,
        in config order, as the model gives them."""
        us = [b[:m] for b in self._buffers]
        i = self.operator_input
        if self.operator is not None and i is not None:
            if self._packs(i):
                packed = us[i] if self._packed is None else self._packed[:m]
                us[i] = self.operator.forward_bits(
                    packed, self.inputs[i].bitorder, dtype=self.compute_dtype
                )
            else:
                us[i] = self.operator(us[i])
        elif self.cfg.score is not None and self._packed is not None:
            us[0] = self._packed[:m]
        outs: Any = us[0] if self.model is None else self.model(*us)
        if isinstance(outs, torch.Tensor):
            outs = [outs]
        elif isinstance(outs, dict):
            missing = [n for n in self._out_names if n not in outs]
            if missing:
                raise self._bad_model(f"the model's outputs {sorted(outs)} lack {missing}")
            outs = [outs[n] for n in self._out_names]
        if not isinstance(outs, list | tuple) or not all(isinstance(t, torch.Tensor) for t in outs):
            raise self._bad_model(f"the model returned {type(outs).__name__}, not tensors")
        if len(outs) != len(self.cfg.outputs):
            n = len(self.cfg.outputs)
            raise ConfigError(
                [f"{self.source}: outputs: {n} declared, the model returns {len(outs)}"]
            )
        for i, t in enumerate(outs):
            if t.dim() == 0 or t.shape[0] != m:
                shape = list(t.shape)
                raise ConfigError(
                    [f"{self.source}: outputs[{i}]: shape {shape} has no batch dimension of {m}"]
                )
        return list(outs)

    def _gather(self, requests: Sequence[Bound]) -> tuple[torch.Tensor, list[int]]:
        """Every request's payloads, input by input, as one uint8 tensor on the device: one
        host copy, and on CUDA one ``non_blocking`` copy from pinned memory.

        Returns:
            the bytes, and where each input's block starts in them (8-byte aligned, so any
            datatype can be viewed in place).
        """
        parts: list[np.ndarray[Any, Any]] = []
        starts = []
        offset = 0
        for i in range(len(self.inputs)):
            pad = -offset % 8
            if pad:
                parts.append(np.zeros(pad, np.uint8))
                offset += pad
            starts.append(offset)
            for r in requests:
                data = r.inputs[i].data
                parts.append(data)
                offset += data.nbytes
        if self._pool is None:
            flat = [p.reshape(-1).view(np.uint8) for p in parts]
            return torch.from_numpy(np.concatenate(flat)), starts  # fresh and writable
        with self._pool.acquire(offset) as buf:
            pos = 0
            for p in parts:
                pos = buf.write(p, pos)
            return buf.to_device(self.device), starts

    def _stage(self, requests: Sequence[Bound]) -> int:
        """Move the batch's inputs to the device and unpack them into the buffers; returns M."""
        # The op itself, not gpu_ops.unpackbits: that checks a caller's arguments (device,
        # dtype, overlap), which these buffers of the pipeline's own always pass.
        unpack = torch.ops.bitserve.unpackbits_into

        raw, starts = self._gather(requests)
        m = 0
        self._packed = None
        for i, (spec, buffer) in enumerate(zip(self.inputs, self._buffers, strict=True)):
            wires = [r.inputs[i] for r in requests]
            offset = starts[i]
            if self._packs(i):
                self._packed = self._packed_input(spec, requests, wires, raw[offset:])
                m = self._packed.shape[0]
                continue
            row = 0
            k = 0
            # Consecutive requests of the same wire form are contiguous in ``raw``: one call
            # each.
            while k < len(wires):
                form = (wires[k].packed, wires[k].data.dtype, wires[k].bitorder)
                j = k
                while (
                    j < len(wires)
                    and (wires[j].packed, wires[j].data.dtype, wires[j].bitorder) == form
                ):
                    j += 1
                n = sum(r.size for r in requests[k:j])
                nbytes = sum(w.data.nbytes for w in wires[k:j])
                part = raw[offset : offset + nbytes]
                dst = buffer[row : row + n]
                if wires[k].packed and spec.packing == "codes":
                    self._codes[i].decode_into(part.view(n, *spec.packed_shape), dst)
                elif wires[k].packed:
                    packed = part.view(n, *spec.packed_shape)
                    unpack(packed, packed.dim() - 1, form[2] or spec.bitorder, dst)
                elif form[1] == np.bool_:
                    # Every request path already refuses BOOL bytes other than 0/1 (the
                    # framing checks binary and JSON data), so this clamp is defence for
                    # direct callers of ``run`` (tools, tests, an embedding program): their
                    # BOOL arrays may hold any byte, and a bool tensor over byte 2 converts
                    # to 2.0. Like NumPy, nonzero counts as 1. It costs one pass over the
                    # buffer, only on the unpacked BOOL form.
                    dst.copy_(part.view(n, *spec.shape).clamp(max=1))
                else:
                    dst.copy_(part.view(_NUMPY_TO_TORCH[form[1]]).view(n, *spec.shape))
                row += n
                offset += nbytes
                k = j
            m = row
        return m

    def _packs(self, i: int) -> bool:
        """Whether input i reaches the operator packed (``forward_bits``), or a ``[score]``
        model its codes."""
        if self.cfg.score is not None:
            return True
        return i == self.operator_input and self.inputs[i].packing == "bits"

    def _reversed_bits(self) -> torch.Tensor:
        """(256,) uint8 on the device: each byte with its bit order reversed (made once)."""
        if self._bit_reversal is None:
            bits = torch.arange(256, dtype=torch.uint8).unsqueeze(-1)
            unpacked = torch.ops.bitserve.unpackbits(bits, 1, 8, "big", torch.uint8)
            reversed_ = torch.ops.bitserve.packbits(unpacked, 1, "little")
            self._bit_reversal = reversed_.reshape(256).to(self.device)
        return self._bit_reversal

    def _packed_input(
        self, spec: InputConfig, requests: Sequence[Bound], wires: list[Any], raw: torch.Tensor
    ) -> torch.Tensor:
        """The operator's input of the batch as packed bytes (n, *packed_shape) for
        ``forward_bits``: the request bytes themselves when every request sent them packed,
        else a buffer where BOOL requests are packed on the device (so that a request gives
        the same bits in either form, whatever it is batched with)."""
        n = sum(r.size for r in requests)
        if all(w.packed and (w.bitorder or spec.bitorder) == spec.bitorder for w in wires):
            return raw[: sum(w.data.nbytes for w in wires)].view(n, *spec.packed_shape)
        out = torch.empty((n, *spec.packed_shape), dtype=torch.uint8, device=self.device)
        row = offset = 0
        for r, w in zip(requests, wires, strict=True):
            part = raw[offset : offset + w.data.nbytes]
            if w.packed:
                packed = part.view(r.size, *spec.packed_shape)
                if (w.bitorder or spec.bitorder) != spec.bitorder:
                    # A request's own bit order (parameters.bitorder): each byte's bits
                    # reversed is the same bits in the model's order (padding included).
                    packed = self._reversed_bits()[packed.long()]
                out[row : row + r.size] = packed
            else:  # BOOL bytes: nonzero is 1, as NumPy's packbits counts them
                logical = part.view(r.size, *spec.shape)
                out[row : row + r.size] = torch.ops.bitserve.packbits(
                    logical, logical.dim() - 1, spec.bitorder
                )
            row += r.size
            offset += w.data.nbytes
        return out

    def run(
        self, requests: Sequence[Bound], *, check: bool = False
    ) -> list[list[np.ndarray[Any, Any]]]:
        """Compute one batch.

        Args:
            requests: the batch's requests, checked by the model's signature (shapes, dtypes;
                total size at most ``capacity``).
            check: check the outputs against ``[[outputs]]`` (the dry run's
                :meth:`check_outputs`).

        Returns:
            Per request, one array per configured output, in config order: ``(b, *shape)``
            C-contiguous views into fresh host memory (no batch dimension when the model
            has ``max_batch_size = 0``).
        """
        total = sum(r.size for r in requests)
        if not 0 < total <= self.capacity:
            raise ValueError(f"batch of {total} items outside 1..{self.capacity}")
        clock = time.perf_counter_ns
        events = self._timing_events()
        with torch.inference_mode(), self._device_context():
            t0 = clock()
            if events:
                events[0].record()
            m = self._stage(requests)
            t1 = clock()
            if events:
                events[1].record()
            outs = self._forward(m)
            self._packed = None  # the batch's bytes: not held until the next batch
            if check:
                self.check_outputs(outs, m)
            outs = [t.to(d) for t, d in zip(outs, self._out_dtypes, strict=True)]
            t2 = clock()
            if events:
                events[2].record()
            arrays = [self._to_host(t) for t in outs]
            if events:
                events[3].record()
            self._synchronize()
            t3 = clock()
        if self.stats is not None:
            if events:  # the host only queued the work; the device's own times
                t0, t1, t2, t3 = (0, *(int(events[0].elapsed_time(e) * 1e6) for e in events[1:]))
            self.stats.executed(total, len(requests), t1 - t0, t2 - t1, t3 - t2)
        self.last_phases_ns = (t1 - t0, t2 - t1, t3 - t2)
        return self._split(requests, arrays)

    def _split(
        self, requests: Sequence[Bound], arrays: list[np.ndarray[Any, Any]]
    ) -> list[list[np.ndarray[Any, Any]]]:
        """The batch's outputs (config order, batch first) cut into each request's rows."""
        results: list[list[np.ndarray[Any, Any]]] = []
        row = 0
        for r in requests:
            sl = [a[row : row + r.size] for a in arrays]
            results.append(sl if self.batched else [a[0] for a in sl])
            row += r.size
        return results

    def parameters(self) -> dict[str, Any]:
        """What the model's metadata says of the pipeline beyond its tensors (its kind's)."""
        return {}

    def _timing_events(self) -> list[Any]:
        """Four timing events on a CUDA device (made once), none elsewhere."""
        if self.device.type != "cuda" or self.stats is None:
            return []
        if not self._events:
            with self._device_context():
                self._events = [
                    torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    for _ in range(4)
                ]
        return self._events

    def _to_host(self, t: torch.Tensor) -> np.ndarray[Any, Any]:
        """An output as host memory of its own: the views handed out must outlive this batch
        (responses are framed while the next batch runs)."""
        if self.device.type == "cuda":
            # torch's caching host allocator makes a pinned buffer per batch cheap.
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host.numpy()
        storage = t.untyped_storage().data_ptr()
        if not t.is_contiguous() or any(
            storage == b.untyped_storage().data_ptr() for b in self._buffers
        ):
            t = t.contiguous() if not t.is_contiguous() else t.clone()  # not a reused buffer
        return t.numpy()

    def __repr__(self) -> str:
        return (
            f"Pipeline({self.name!r}, device={self.device}, capacity={self.capacity}, "
            f"inputs={[spec.shape for spec in self.inputs]}, dtype={self.compute_dtype}, "
            f"memory={math.ceil(self.device_memory_bytes / 2**20)} MiB)"
        )
