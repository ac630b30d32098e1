"""A model's file checked against its config on the host, and the dry run on its device: two
stages of :func:`service.models.builder.build_version`.

One set of rules for every format (``service.backends``), after the dtype rule
(:func:`service.models.signature.handed_dtypes`):

- **The signature check** (:func:`check_signature`, on the host): the config's inputs
  against the file's, by position: their number, each dtype, each rank and every dim
  (static sizes, the batch dimension's range against ``1..max_batch_size``), and an input
  the program never reads (a torch.export graph's placeholder without users) is refused.
- **The dry run** (:func:`dry_run`, on the device): a zero batch (or the ``warmup_file``
  sample) through the whole pipeline at batch 1 and at ``max_batch_size``, each output
  checked against ``[[outputs]]``. ``bitserve serve`` runs it before a version is READY and
  ``bitserve check-repo`` runs the same (on the CPU unless ``--device``), so the two agree.

Messages say what the model expects against what the config gives, e.g.
``model.pt2: input 'x' (inputs[0]) expects float32 [batch <= 64, 2048]; the config gives
BOOL [batch <= 16, 1024] (bit-packed)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from service.backends import Dim, ModelFile, TensorSpec
from service.models.config import ConfigError, InputConfig, ModelConfig, library_error
from service.models.signature import Bound, WireInput, allowed_dtypes, handed_dtypes
from service.protocol.types import DATATYPES
from service.text import safe_text


class Runnable(Protocol):
    """What the dry run needs of a pipeline (``service.models.pipeline.Pipeline`` and its kinds)."""

    cfg: ModelConfig
    inputs: list[InputConfig]
    capacity: int
    batched: bool
    source: str

    def run(
        self, requests: Sequence[Bound], *, check: bool = False
    ) -> list[list[np.ndarray[Any, Any]]]: ...


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _given(cfg: ModelConfig, i: int, operator_shape: Sequence[int] | None) -> str:
    """How the config gives input ``i`` to the model, e.g. ``BOOL [batch <= 16, 1024]``."""
    spec = cfg.inputs[i]
    # The model is called batch first; without batching (max_batch_size 0), with 1 item.
    batch = [f"batch <= {cfg.max_batch_size}" if cfg.max_batch_size > 0 else "1"]
    if cfg.operator is not None and i == cfg.operator_input and operator_shape is not None:
        dims = ", ".join([*batch, *map(str, operator_shape)])
        return f"the operator's output, {cfg.operator.dtype} [{dims}]"
    dims = ", ".join([*batch, *map(str, spec.shape)])
    how = {"bits": " (bit-packed)", "codes": f" ({spec.code_bits}-bit codes)"}.get(spec.packing, "")
    dtype = f" as {spec.dtype}" if spec.dtype is not None else ""
    return f"{spec.datatype} [{dims}]{how}{dtype}"


def _expects(spec: TensorSpec) -> str:
    dtype = _name(spec.dtype) if spec.dtype is not None else "any dtype"
    if spec.dims is None:
        return dtype
    shown = [d.shown("batch" if k == 0 else "") for k, d in enumerate(spec.dims)]
    return f"{dtype} [{', '.join(shown)}]"


def check_signature(
    cfg: ModelConfig, model: ModelFile, where: str, operator_shape: Sequence[int] | None
) -> None:
    """The config's inputs against what the model file says (see the module docstring).

    Args:
        cfg: the version's config.
        model: its model file.
        where: ``<config>: model.file`` for messages.
        operator_shape: the operator's output shape of one item ``[N, A]``, when it has one.

    Raises:
        ConfigError: one problem per input that does not fit, expected against given.
    """
    file = safe_text(model.path.name)
    specs = model.signature().inputs
    if specs is None:
        return
    n = len(cfg.inputs)
    if len(specs) != n:
        names = ", ".join(safe_text(s.name) for s in specs)
        given = ", ".join(safe_text(s.name) for s in cfg.inputs)
        raise ConfigError([f"{where}: {file} takes {len(specs)} input(s) ({names}); the config "
                           f"gives {n} ({given})"])  # fmt: skip
    problems = []
    handed = handed_dtypes(cfg, model)
    for i, (spec, dtype) in enumerate(zip(specs, handed, strict=True)):
        inp = cfg.inputs[i]
        is_op = cfg.operator is not None and i == cfg.operator_input
        dims = list(operator_shape) if is_op and operator_shape is not None else inp.shape
        why = _misfit(spec, dtype, dims, cfg.max_batch_size)
        if why == "" and spec.dtype is not None and spec.dtype != dtype:
            if is_op:
                why = f'set [operator] dtype = "{_name(spec.dtype)}"'
            elif spec.dtype not in allowed_dtypes(inp.handed_dtypes):
                why = f"{_given(cfg, i, None).split(' [')[0]} is handed in " + ", ".join(
                    inp.handed_dtypes
                )
        wrong_key = inp.dtype is not None and getattr(torch, inp.dtype) != spec.dtype
        if why is None and spec.dtype is not None and not is_op and wrong_key:
            why = f"[[inputs]] dtype is {inp.dtype}"
        if why is None and spec.used is False:
            problems.append(
                f"{where}: {file}: input '{safe_text(spec.name)}' (inputs[{i}] "
                f"'{safe_text(inp.name)}') is never read by the program: its answers would "
                "not depend on it (was one example tensor passed for two inputs at export?)"
            )
        if why is not None:
            problems.append(
                f"{where}: {file}: input '{safe_text(spec.name)}' (inputs[{i}] "
                f"'{safe_text(inp.name)}') expects {_expects(spec)}; the config "
                f"gives {_given(cfg, i, operator_shape)}{why and f' ({why})'}"
            )
    if problems:
        raise ConfigError(problems)


def _misfit(spec: TensorSpec, dtype: torch.dtype, dims: Sequence[int], mbs: int) -> str | None:
    """Why a file's input spec does not take what the config hands it ('' when the reason
    is plain from the two shapes), or None when it does."""
    if spec.dtype is not None and spec.dtype != dtype:
        return ""
    if spec.dims is None:
        return None
    want: list[Dim] = list(spec.dims)
    if not want:
        return "the model is called with a batch dimension first"
    batch, most = want.pop(0), max(mbs, 1)
    if batch.size is not None and not batch.size == 1 == most:
        return (
            f"a static batch of {batch.size}: export with a dynamic batch dimension, "
            f"e.g. torch.export.Dim('batch', max={most})"
        )
    if not batch.fits_range(1, most):
        return f"max_batch_size {mbs} does not fit the batch dimension"
    if len(want) != len(dims) or not all(d.fits(n) for d, n in zip(want, dims, strict=True)):
        return ""
    return None


# --- the dry run ------------------------------------------------------------------------------


def _requests(pipe: Runnable, m: int, sample: Mapping[str, np.ndarray[Any, Any]] | None) -> Bound:
    """One request of ``m`` items: the sample's items cycled, or zeros in the packed form."""
    wires = []
    for spec in pipe.inputs:
        if sample is not None:
            items = sample[spec.name]
            data = np.ascontiguousarray(np.resize(items, (m, *items.shape[1:])))
            packed = spec.packing in ("bits", "codes") and items.dtype == np.uint8
        elif spec.packing in ("bits", "codes"):
            data, packed = np.zeros((m, *spec.packed_shape), np.uint8), True
        else:
            data, packed = np.zeros((m, *spec.shape), DATATYPES[spec.datatype]), False
        wires.append(WireInput(data, packed))
    return Bound(tuple(wires), tuple(range(len(pipe.cfg.outputs))), m)


def dry_run(
    pipe: Runnable,
    sample: Mapping[str, np.ndarray[Any, Any]] | None,
    file: str,
    folder: tuple[Path, str] | None,
    *,
    again: bool = False,
) -> list[list[int]]:
    """Run a batch of 1 and one of ``max_batch_size`` through ``pipe`` and check its outputs.

    Args:
        pipe: the pipeline, built on its device.
        sample: the ``warmup_file`` sample (``Artifacts.warmup``); None: zeros.
        file: the model file's name (or "the operator"), for messages.
        folder: the model's folder and how messages show it (``Artifacts.folder``).
        again: run the full batch a second time (``--warmup``: kernels compiled, pools
            grown before the first request).

    Returns:
        Each output's shape of one item.

    Raises:
        ConfigError: what failed: the model's own message (cleaned, see
            :func:`service.models.config.library_error`), or an output that does not match.
    """
    sizes = [1, pipe.capacity] + ([pipe.capacity] if again else [])
    shapes: list[list[int]] | None = None
    for m in sizes if pipe.capacity > 1 else sizes[:1]:
        try:
            out = pipe.run([_requests(pipe, m, sample)], check=True)[0]
        except ConfigError:
            raise
        except Exception as exc:  # the model's own error, for the client and check-repo
            where, shown = folder or (None, "")
            raise library_error(
                f"{pipe.source}: model.file",
                f"{safe_text(file)}: the dry run at batch {m} failed",
                exc,
                where,
                shown,
            ) from exc
        got = [list(a.shape[1:]) if pipe.batched else list(a.shape) for a in out]
        if shapes is not None and got != shapes:
            raise ConfigError([f"{pipe.source}: outputs: the model gives item shapes {shapes} at "
                               f"batch 1 but {got} at batch {m}"])  # fmt: skip
        shapes = got
    assert shapes is not None
    return shapes
