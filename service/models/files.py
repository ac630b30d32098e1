"""Reading and checking a model version's files: the one path ``serve`` and ``check-repo`` share.

:func:`load_version` is everything a model version needs before it touches a device: its
``config.toml`` (refused when it is a symlink out of the model's folder), the files it names
(inside the model), the operator's tensors (names, shapes, floating-point dtypes, finite
values, a strictly increasing fine grid) and the size of the operator they would build
(checked against ``max_operator_bytes`` without building it), the ``warmup_file`` sample and
the model file in its format (``service.backends``): the first stage of
:func:`service.models.builder.build_version`, which then checks the files against each other on the
host (the signature, each input buffer's size in the dtype it is handed in), builds the
pipeline on its device and dry-runs it. ``bitserve serve`` and ``bitserve check-repo`` both
build every version through it, so the two cannot disagree about a model. Nothing here
touches a device.

Every problem is reported as ``<file>: <key>: <problem>``; nothing here lets another
exception out for a bad file, and nothing here prints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.backends import ModelFile, load_model_file
from service.index.corpus import CorpusFile, read_corpus
from service.models.codes import CodeTable, read_code_tables
from service.models.config import (
    DEFAULT_MAX_BATCH_BYTES,
    ConfigError,
    ModelConfig,
    library_error,
    load_config,
)
from service.models.dtypes import COMPUTE_DTYPES, torch_dtype
from service.models.layout import VersionSource
from service.models.score_model import read_score
from service.protocol.types import DATATYPES
from service.text import safe_text

# safetensors dtype name -> torch dtype, for the operator's tensors (the compute dtypes).
_FLOAT_DTYPES = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_FLOAT_NAMES = {v: k for k, v in _FLOAT_DTYPES.items()}
_STARTS_ITEMSIZE = 4  # int32 window starts, one per (n, a)
_ORDER_ITEMSIZE = 8  # int64 inverse permutation, kept only when some row of c is unsorted

# (shape, safetensors dtype name) per tensor name
Header = Mapping[str, tuple[list[int], str]]


@dataclass
class Artifacts:
    """A model version's files, loaded on the host (never with pickle).

    Attributes:
        tensors: the operator's tensors (``x``, ``c`` and for a tabulated response
            ``response_x``/``response_y``); empty without an operator.
        model: the model file in its format (``service.backends``), or None.
        warmup: the dry run's sample (``warmup_file``): per input name, items batch first
            in a wire form; None: zeros.
        folder: the model's folder and how messages show it (library messages name files
            relative to it).
        corpus: an index's corpus file, opened (its rows memory-mapped) and checked.
        codes: see below; score: see below.
    """

    tensors: dict[str, torch.Tensor]
    model: ModelFile | None = None
    warmup: dict[str, np.ndarray[Any, Any]] | None = None
    folder: tuple[Path, str] | None = None
    corpus: CorpusFile | None = None
    codes: dict[int, CodeTable] = field(default_factory=dict)
    """Each ``packing = "codes"`` input's code table, by input index."""
    score: dict[str, torch.Tensor] = field(default_factory=dict)
    """A ``[score]`` model's tensors (:func:`service.models.score_model.read_score`)."""


def load_version(
    src: VersionSource,
    *,
    max_operator_bytes: int,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    patch: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, Artifacts]:
    """Read and check one version's config and files, on the host (never with pickle).

    Args:
        src: where the version lives (from :func:`service.models.layout.model_versions`).
        max_operator_bytes: the most bytes its response operator may take once built.
        max_batch_bytes: the most bytes each of its input buffers may take (see
            :func:`check_buffers`).
        patch: ``config.toml`` keys a load's config override replaces (see
            :func:`service.models.config.load_config`).

    Returns:
        Its configuration and its files: the operator's tensors (only those the config
        uses, as stored) and the model program (not yet checked against the config: the
        builder's next stage).

    Raises:
        ConfigError: every problem found, each naming the file and the key.
    """
    cfg = load_config(src.checked_config_path(), src.source, patch=patch)
    errors: list[ConfigError] = []
    try:
        check_buffers(cfg, src.source, max_batch_bytes)
    except ConfigError as exc:
        errors.append(exc)
    model_path: Path | None = None
    if cfg.model is not None:
        try:
            model_path = src.resolve(cfg.model.file, "model.file")
        except ConfigError as exc:
            errors.append(exc)
    tensors: dict[str, torch.Tensor] = {}
    if cfg.operator is not None:
        try:
            tensors = _read_operator(src, cfg, max_operator_bytes)
        except ConfigError as exc:
            errors.append(exc)
    warmup = None
    try:
        warmup = read_warmup(src, cfg)
    except ConfigError as exc:
        errors.append(exc)
    corpus = None
    if cfg.index is not None:
        try:
            path = src.resolve(cfg.index.file, "index.file")
            folder = (src.folder, src.shown_folder)
            corpus = read_corpus(path, cfg.index, cfg.inputs[0], src.source, folder)
        except ConfigError as exc:
            errors.append(exc)
    codes: dict[int, CodeTable] = {}
    score: dict[str, torch.Tensor] = {}
    try:
        codes = read_code_tables(src, cfg)
        if cfg.score is not None:
            score = read_score(src, cfg)
    except ConfigError as exc:
        errors.append(exc)
    if errors:
        raise ConfigError.join(errors)
    if corpus is not None:
        return cfg, Artifacts({}, folder=(src.folder, src.shown_folder), corpus=corpus)
    model = None
    if cfg.model is not None and model_path is not None:
        where = f"{src.source}: model.file"
        model = _load_model(model_path, cfg, where, src)
    folder = (src.folder, src.shown_folder)
    return cfg, Artifacts(tensors, model, warmup, folder, codes=codes, score=score)


def read_warmup(src: VersionSource, cfg: ModelConfig) -> dict[str, np.ndarray[Any, Any]] | None:
    """The ``warmup_file`` sample, checked against the inputs (names, wire forms, items).

    Raises:
        ConfigError: naming ``warmup_file`` and what does not fit.
    """
    if cfg.warmup_file is None:
        return None
    from safetensors.numpy import load_file

    where = f"{src.source}: warmup_file"
    path = src.resolve(cfg.warmup_file, "warmup_file")
    try:
        sample = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a corrupt file
        raise library_error(where, "not a readable safetensors file", exc, src.folder) from exc
    problems = []
    for spec in cfg.inputs:
        t = sample.get(spec.name)
        forms = {spec.datatype: spec.shape}
        if spec.packing == "bits":
            forms = {"UINT8": spec.packed_shape, "BOOL": spec.shape}
        elif spec.packing == "codes":
            forms = {"UINT8": spec.packed_shape}
        fits = t is not None and t.ndim >= 1 and t.shape[0] >= 1 and any(
            t.dtype == DATATYPES[d] and list(t.shape[1:]) == s for d, s in forms.items()
        )  # fmt: skip
        if not fits:
            got = "nothing" if t is None else f"{t.dtype} {list(t.shape)}"
            want = " or ".join(f"{d} [items, {', '.join(map(str, s))}]" for d, s in forms.items())
            problems.append(f"{where}: input '{safe_text(spec.name)}' needs {want}; has {got}")
    if problems:
        raise ConfigError(problems)
    return {spec.name: sample[spec.name] for spec in cfg.inputs}


def buffer_bytes(cfg: ModelConfig, dtypes: Sequence[torch.dtype] | None = None) -> list[int]:
    """Bytes of each input's device buffer: ``max(max_batch_size, 1)`` items of its logical
    shape, in the dtype it is computed in (the operator's input in the operator's dtype, the
    others in ``dtypes``, by default ``[[inputs]] dtype`` or their own; bit-packed ones
    unpacked)."""
    capacity = max(cfg.max_batch_size, 1)
    sizes = []
    for i, spec in enumerate(cfg.inputs):
        if cfg.score is not None:  # a [score] model's codes stay packed
            sizes.append(capacity * math.prod(spec.packed_shape))
            continue
        if cfg.operator is not None and i == cfg.operator_input:
            itemsize = COMPUTE_DTYPES[cfg.operator.dtype].itemsize
        elif dtypes is not None:
            itemsize = dtypes[i].itemsize
        elif spec.dtype is not None:
            itemsize = getattr(torch, spec.dtype).itemsize
        else:
            itemsize = torch_dtype(spec.datatype).itemsize
        sizes.append(capacity * math.prod(spec.shape) * itemsize)
    return sizes


def check_buffers(
    cfg: ModelConfig, source: str, limit: int, dtypes: Sequence[torch.dtype] | None = None
) -> None:
    """Refuse a config whose input buffers (allocated whole at load) would pass ``limit``
    (the ``max_batch_bytes`` setting).

    A load's config override can raise ``max_batch_size``: without this bound one request
    could make the server allocate, and touch, more memory than the host has.

    Raises:
        ConfigError: naming the input, its size and the limit.
    """
    problems = [
        f"{source}: inputs[{i}] ({safe_text(spec.name)}): max_batch_size "
        f"{cfg.max_batch_size} x shape {spec.shape} needs a device buffer of {n:,} bytes, "
        f"more than max_batch_bytes ({limit:,})"
        for i, (spec, n) in enumerate(zip(cfg.inputs, buffer_bytes(cfg, dtypes), strict=True))
        if n > limit
    ]
    if problems:
        raise ConfigError(problems)


def check_operator(
    cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str, *, max_operator_bytes: int
) -> None:
    """The checks of :func:`load_version` on operator tensors already in memory (the demo's).

    Raises:
        ConfigError: as :func:`load_version` would for the same tensors in a file.
    """
    header = {
        k: (list(t.shape), _FLOAT_NAMES.get(t.dtype, str(t.dtype))) for k, t in tensors.items()
    }
    _check_header(cfg, header, source, "the operator's tensors", max_operator_bytes)
    _check_values(cfg, tensors, source, max_operator_bytes)


def operator_bytes(
    cfg: ModelConfig, num_coarse: int, band_width: int, *, sorted_rows: bool, table_points: int = 0
) -> int:
    """Bytes the built operator keeps on its device (:attr:`BandedResampler.nbytes`).

    Weights ``(N, A, W)`` in the compute dtype, int32 starts ``(N, A)``, and an int64 inverse
    permutation ``(N, A)`` when some row of ``c`` is not sorted; on the fly, float64 x and c
    and the float32 parameter, or the float32 table ``(2, table_points)``.
    """
    assert cfg.operator is not None
    _, (n, B) = _operator_input(cfg)
    if cfg.operator.on_the_fly:
        return 8 * (B + n * num_coarse) + 4 * (2 * table_points if table_points else 1)
    itemsize = COMPUTE_DTYPES[cfg.operator.dtype].itemsize
    per_point = band_width * itemsize + _STARTS_ITEMSIZE + (0 if sorted_rows else _ORDER_ITEMSIZE)
    return n * num_coarse * per_point


# --- the operator -------------------------------------------------------------------------


def _operator_input(cfg: ModelConfig) -> tuple[int, tuple[int, int]]:
    """The index of the input the operator applies to, and its logical shape ``(N, B)``."""
    i = cfg.operator_input
    assert i is not None  # the config's own validation names a missing input
    N, B = cfg.inputs[i].shape
    return i, (N, B)


def _needed(cfg: ModelConfig) -> dict[str, int]:
    """The tensors the operator needs, with their number of dimensions."""
    assert cfg.operator is not None
    need = {"x": 1, "c": 2}
    if cfg.operator.response == "tabulated":
        need |= {"response_x": 1, "response_y": 1}
    return need


def _read_operator(src: VersionSource, cfg: ModelConfig, limit: int) -> dict[str, torch.Tensor]:
    """The operator's tensors, checked from the header before any value is read."""
    from safetensors import safe_open

    assert cfg.operator is not None
    file = cfg.operator.file
    path = src.resolve(file, "operator.file")
    where = f"{src.source}: operator.file"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            header = {}
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = fh.get_slice(k)
                header[k] = (list(sl.get_shape()), str(sl.get_dtype()))
            _check_header(cfg, header, src.source, safe_text(file), limit)
            tensors = {k: fh.get_tensor(k) for k in _needed(cfg)}
    except ConfigError:
        raise
    except Exception as exc:  # safetensors raises several types for a corrupt file
        raise src.error(where, "not a readable safetensors file", exc) from exc
    _check_values(cfg, tensors, src.source, limit)
    return tensors


def _check_header(cfg: ModelConfig, header: Header, source: str, file: str, limit: int) -> None:
    """Names, dimensions, dtypes and shapes; the operator's least size (band width 1)."""
    where = f"{source}: operator.file"
    problems: list[str] = []
    has = [safe_text(n, 40) for n in sorted(header)[:20]]
    for k, ndim in _needed(cfg).items():
        if k not in header:
            problems.append(f"{where}: {file} has no tensor {k!r} (has {has})")
        elif len(header[k][0]) != ndim:
            problems.append(f"{where}: tensor {k!r} has shape {header[k][0]}; needs {ndim}-D")
        elif header[k][1] not in _FLOAT_DTYPES:
            problems.append(
                f"{where}: tensor {k!r} is {header[k][1]}; needs floating point "
                f"({', '.join(_FLOAT_DTYPES)})"
            )
    if problems:
        raise ConfigError(problems)
    i, (N, B) = _operator_input(cfg)
    x_shape, c_shape = header["x"][0], header["c"][0]
    if x_shape != [B]:
        problems.append(f"{where}: x has shape {x_shape}; inputs[{i}].shape needs [{B}]")
    if c_shape[0] != N or c_shape[1] < 1:
        problems.append(f"{where}: c has shape {c_shape}; inputs[{i}].shape needs [{N}, A], A >= 1")
    if "response_x" in _needed(cfg):
        rx, ry = header["response_x"][0], header["response_y"][0]
        if rx != ry or rx[0] < 2:
            problems.append(f"{where}: response_x {rx} and response_y {ry} differ or < 2 long")
    out = cfg.outputs[0]
    if cfg.model is None and out.shape is not None and out.shape != c_shape:
        problems.append(
            f"{source}: outputs[0].shape: {out.shape}, but the operator gives {c_shape}"
        )
    if problems:
        raise ConfigError(problems)
    K = header["response_x"][0][0] if "response_x" in _needed(cfg) else 0
    least = operator_bytes(cfg, c_shape[1], 1, sorted_rows=True, table_points=K)
    if least > limit:  # refused before a value is read
        raise ConfigError([_too_big(cfg, source, least, c_shape[1], None, limit)])


def _check_values(
    cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str, limit: int
) -> None:
    """Finite values, a strictly increasing grid and table; the built operator's exact size.

    The band width W is found as :meth:`BandedResampler.from_response` finds it (the same
    window search on the same float64 values), without evaluating a weight.
    """
    from gpu_ops import responses

    op = cfg.operator
    assert op is not None
    where = f"{source}: operator.file"
    x = tensors["x"].detach().to(torch.float64)
    c = tensors["c"].detach().to(torch.float64)
    problems = [
        f"{where}: tensor {k!r} has non-finite values"
        for k, t in tensors.items()
        if k in _needed(cfg) and not bool(torch.isfinite(t).all())
    ]
    for k, grid in (("x", x), ("response_x", tensors.get("response_x"))):
        if grid is None or grid.numel() < 2:
            continue
        step = grid[1:] > grid[:-1]
        if not bool(step.all()):
            i = int((~step).nonzero()[0])
            problems.append(
                f"{where}: tensor {k!r} must be strictly increasing; "
                f"{k}[{i}] = {float(grid[i]):g} and {k}[{i + 1}] = {float(grid[i + 1]):g}"
            )
    if problems:
        raise ConfigError(problems)
    options = responses.Options(**op.options)
    K = 0
    ties = (False, False)
    if op.response == "tabulated":
        table = (tensors["response_x"], tensors["response_y"])
        try:  # its centring moves its ends
            lo, hi = responses.parse_table(table, options, torch.device("cpu")).window()
        except ValueError as exc:
            raise ConfigError([f"{where}: the table (response_x, response_y): {exc}"]) from None
        K = table[0].numel()
    else:
        shape = responses.parse_named(op.response, op.support, op.parameters, options)
        lo, hi = shape.window(shape.value)
        lo, hi = lo - shape.shift * shape.value, hi - shape.shift * shape.value
        ties = shape.spec.tie_ends
    _, _, W = responses.windows(x, c, lo, hi, ties)
    sorted_rows = bool((c[:, 1:] >= c[:, :-1]).all())
    size = operator_bytes(cfg, c.shape[1], W, sorted_rows=sorted_rows, table_points=K)
    if size > limit:
        raise ConfigError([_too_big(cfg, source, size, c.shape[1], W, limit)])


def _too_big(cfg: ModelConfig, source: str, size: int, A: int, W: int | None, limit: int) -> str:
    assert cfg.operator is not None
    _, (N, B) = _operator_input(cfg)
    dtype = cfg.operator.dtype
    if W is None:
        band = f"at least {N} x {A} window starts and weights"
    elif W >= B:
        band = (
            f"a band of {N} x {A} x {W} {dtype} weights, every window spanning all B = {B} fine "
            "points (the dense operator: check the response's width and support against x)"
        )
    else:
        band = f"a band of {N} x {A} x {W} {dtype} weights (W = {W} of B = {B} fine points)"
    return (
        f"{source}: operator: would take {_size(size)}: {band}; "
        f"more than max_operator_bytes = {_size(limit)}"
    )


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1 << 20 else f"{n} bytes ({n / 2**20:.1f} MiB)"


# --- the model ----------------------------------------------------------------------------


def _load_model(path: Path, cfg: ModelConfig, where: str, src: VersionSource) -> ModelFile:
    """The model file in its format, on the host; its loader's message when it cannot."""
    assert cfg.model is not None
    try:
        return load_model_file(path, cfg.model.format)
    except Exception as exc:  # each format's loader raises its own types for a bad file
        file = safe_text(cfg.model.file)
        raise src.error(where, f"{file}: cannot load", exc) from exc
