"""``bitserve genotypes score`` without torch: a ``[score]`` model folder and a ``.bed``,
scored with NumPy and one C kernel.

The model folder is the one ``bitserve genotypes score-model`` writes (:mod:`.writer`); its
``config.toml`` is read with ``tomllib`` and must have that exact form (anything else, or no
C compiler, or ``BITSERVE_CPU_KERNELS=0``, and :func:`load_fast_model` says why not: the
caller then loads the model as ``bitserve serve`` does, :mod:`.bulk`). Its tensors are read
with ``safetensors.numpy``.

Scoring never transposes the ``.bed``: ``bs_score_bed`` (``gpu_ops/_codes_c.c``, built by
``gpu_ops/_cbuild.py`` and loaded here through ctypes, both without importing the
``gpu_ops`` package and so without torch) reads the memory-mapped variant-major blocks, a
block of variants at a time, and adds per sample what each variant's code adds: the
(variants, 4, S + 2) value tables of :func:`value_tables` (the same numbers
:func:`service.models.score_model.value_tables` folds into the served model's lookup table).
:func:`score_bed_reference` is the plain NumPy sum the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from service.genotypes.bulk import write_sscore
from service.genotypes.plink_files import check_variants, open_bed, read_bim, read_fam

PLINK_CODE_VALUES = [2.0, math.nan, 1.0, 0.0]
BLOCK_VARIANTS = 8192
"""Variants per kernel call (a multiple of 8): the progress step."""

_SCRATCH_PER_COLUMN = 2 * 256 + 32  # the kernel's per-thread tables, in doubles per column
_INPUT_KEYS = {"name", "datatype", "shape", "packing", "code_bits", "bitorder", "code_values",
               "missing", "missing_file", "ids_sha256"}  # fmt: skip
_OUTPUTS = [("ALLELE_CT", [1]), ("NAMED_ALLELE_DOSAGE_SUM", [1]), ("SCORE_AVG", None),
            ("SCORE_SUM", None)]  # fmt: skip


def _load_cbuild() -> ModuleType:
    """``gpu_ops._cbuild`` (stdlib only), loaded from its file: importing it as a submodule
    would run ``gpu_ops/__init__.py`` and import torch."""
    loaded = sys.modules.get("gpu_ops._cbuild")
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("gpu_ops")  # finds the package; does not import it
    assert spec is not None
    assert spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "_cbuild.py"
    mod_spec = importlib.util.spec_from_file_location("bitserve_genotypes_cbuild", path)
    assert mod_spec is not None
    assert mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bs_score_bed.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, cint]
    lib.bs_score_bed.restype = None
    return lib


_LIBRARY: Any = None


def kernels() -> ctypes.CDLL | None:
    """The compiled ``gpu_ops/_codes_c.c`` (the same cached build gpu_ops uses); None when
    there is no compiler or ``BITSERVE_CPU_KERNELS=0``."""
    global _LIBRARY
    if _LIBRARY is None:
        cbuild = _load_cbuild()
        assert cbuild.__file__ is not None
        source = Path(cbuild.__file__).with_name("_codes_c.c")
        _LIBRARY = cbuild.Library(source, "codes_c", _bind, "CPU code kernels")
    lib: ctypes.CDLL | None = _LIBRARY.get()
    return lib


def score_bed_reference(blocks: np.ndarray, n_samples: int, values: np.ndarray) -> np.ndarray:
    """Plain NumPy: ``out[s, c] = sum_v values[v, code(v, s), c]``.

    Args:
        blocks: (V, ceil(n_samples / 4)) uint8, a ``.bed``'s variant-major blocks.
        n_samples: the samples.
        values: (V, 4, C) float64.

    Returns:
        (n_samples, C) float64.
    """
    s = np.arange(n_samples)
    codes = (np.asarray(blocks)[:, s // 4] >> (2 * (s % 4)).astype(np.uint8)) & 3  # (V, n)
    picked = np.take_along_axis(values, codes[:, :, None].astype(np.intp), axis=1)  # (V, n, C)
    out: np.ndarray = picked.sum(axis=0)
    return out


def score_bed_blocks(
    blocks: np.ndarray,
    n_samples: int,
    values: np.ndarray,
    *,
    threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """:func:`score_bed_reference` by the C kernel, :data:`BLOCK_VARIANTS` variants a call.

    Args:
        blocks: (V, ceil(n_samples / 4)) uint8 with contiguous rows (a ``np.memmap`` of the
            ``.bed`` is read in place).
        n_samples, values: as :func:`score_bed_reference`.
        threads: the sample bytes are split over this many threads.
        progress: called with (variants done, variants) after each call.

    Raises:
        RuntimeError: the C kernel is unavailable (see :func:`kernels`).
    """
    lib = kernels()
    if lib is None:
        raise RuntimeError("the CPU code kernels are unavailable (no C compiler, or "
                           "BITSERVE_CPU_KERNELS=0)")  # fmt: skip
    V, nbs = blocks.shape
    if nbs != (n_samples + 3) // 4 or values.shape[:2] != (V, 4):
        raise ValueError(f"blocks {blocks.shape} and values {values.shape} do not fit "
                         f"{n_samples} samples")  # fmt: skip
    if blocks.dtype != np.uint8 or (V > 1 and blocks.strides[1] != 1):
        raise ValueError("blocks must be uint8 rows of contiguous bytes")
    C = values.shape[2]
    vals = np.ascontiguousarray(values, np.float64)
    out = np.zeros((4 * nbs, C), np.float64)
    threads = max(1, min(threads, 64, nbs))
    scratch = np.empty(threads * _SCRATCH_PER_COLUMN * max(C, 1), np.float64)
    for v0 in range(0, V, BLOCK_VARIANTS):
        v1 = min(V, v0 + BLOCK_VARIANTS)
        block = blocks[v0:v1]
        lib.bs_score_bed(block.ctypes.data, v1 - v0, block.strides[0], nbs,
                         vals[v0:v1].ctypes.data, C, out.ctypes.data, scratch.ctypes.data,
                         threads)  # fmt: skip
        if progress is not None:
            progress(v1, V)
    return out[:n_samples]


def value_tables(
    weights: np.ndarray, flip: np.ndarray, scored: np.ndarray, means: np.ndarray
) -> np.ndarray:
    """(L, 4, S + 2) float64: what each variant's ``.bed`` code adds to each score column
    (weight x the scored allele's dosage, a missing code's the mean), to the scored allele's
    dosage sum (nothing when missing), and to the allele count (2 when present); zeros for
    variants not scored. As :func:`service.models.score_model.value_tables` (torch) computes them.

    Args:
        weights: (L, S); flip, scored: (L,) bool; means: (L,) the first allele's mean dosage.
    """
    value = np.asarray(PLINK_CODE_VALUES)[None, :]  # (1, 4)
    is_missing = np.isnan(value)
    first = np.where(is_missing, means[:, None], value)  # (L, 4)
    imputed = np.where(flip[:, None], 2.0 - first, first)
    named = np.where(is_missing, 0.0, imputed)
    present = np.broadcast_to(2.0 * ~is_missing, imputed.shape)
    tables = np.concatenate([imputed[:, :, None] * weights[:, None, :], named[:, :, None],
                             present[:, :, None]], axis=2)  # fmt: skip
    out: np.ndarray = tables * scored[:, None, None]
    return out


@dataclass(frozen=True)
class FastScoreModel:
    """A ``[score]`` model read without torch.

    Attributes:
        name: the model; ids_sha256: its variants' hash; variants: L.
        names: the score columns' names (S).
        values: (L, 4, S + 2) float64 (:func:`value_tables`).
        denominator: 2 x the variants scored (SCORE_AVG = SCORE_SUM / it).
        input: the input's name (score-model writes ``genotypes``).
    """

    name: str
    ids_sha256: str
    variants: int
    names: list[str]
    values: np.ndarray
    denominator: float
    input: str = "genotypes"


def load_fast_model(
    repository: Path, model: str, version: str | None = None
) -> FastScoreModel | str:
    """The model's ``version`` (None: its highest) as a :class:`FastScoreModel`, or why it
    cannot be one (then load it as ``bitserve serve`` does, which also names what is wrong
    with it).

    Raises:
        ConfigError: no such model (as ``bitserve serve`` says it).
    """
    from service.models.layout import model_versions

    if kernels() is None:
        return "the CPU code kernels are unavailable"
    versions = model_versions(repository, model)
    if not versions:
        return f"{model}: no version of the model"
    if version is not None and version not in versions:
        return f"{model}: no version {version}"
    src = versions[version if version is not None else max(versions, key=int)]
    try:
        with open(src.checked_config_path(), "rb") as fh:
            cfg = tomllib.load(fh)
        form = _score_form(cfg)
        if isinstance(form, str):
            return f"{src.source}: {form}"
        L, missing_file, score_file, names = form
        from safetensors.numpy import load_file

        tensors = load_file(str(src.resolve(score_file, "score.file")))
        if missing_file != score_file:
            tensors["means"] = load_file(str(src.resolve(missing_file, "inputs[0].missing_file"
                                                         )))["means"]  # fmt: skip
    except Exception as e:  # unreadable, malformed: the full load reports it properly
        return f"{src.source}: {type(e).__name__}: {e}"
    w, flip, scored, means = (tensors.get(k) for k in ("weights", "flip", "scored", "means"))
    if w is None or flip is None or scored is None or means is None:
        return f"{src.source}: {score_file} lacks a tensor"
    if (w.ndim != 2 or w.shape != (L, len(names)) or flip.shape != (L,)
            or scored.shape != (L,) or means.shape != (L,)):  # fmt: skip
        return f"{src.source}: tensor shapes do not fit {L} variants"
    if not (np.isfinite(w).all() and np.isfinite(means).all()):
        return f"{src.source}: non-finite weights or means"
    scored_b = scored != 0
    values = value_tables(w.astype(np.float64), flip != 0, scored_b, means.astype(np.float64))
    spec = cfg["inputs"][0]
    return FastScoreModel(model, spec["ids_sha256"], L, names, values,
                          2.0 * float(scored_b.sum()), str(spec["name"]))  # fmt: skip


def _score_form(cfg: dict[str, Any]) -> tuple[int, str, str, list[str]] | str:
    """(L, missing_file, score file, names) of a config of the form ``score-model`` writes;
    else what differs."""
    if set(cfg) - {"max_batch_size", "device", "inputs", "score", "outputs"}:
        return "keys beyond those score-model writes"
    if cfg.get("device", "auto") not in ("auto", "cpu"):
        return f"device {cfg['device']!r}"
    inputs, score, outputs = cfg.get("inputs"), cfg.get("score"), cfg.get("outputs")
    if not (isinstance(inputs, list) and len(inputs) == 1 and isinstance(score, dict)
            and isinstance(outputs, list)):  # fmt: skip
        return "not one codes input and a [score] table"
    spec = inputs[0]
    shape = spec.get("shape")
    values = spec.get("code_values")
    if (set(spec) != _INPUT_KEYS or spec["packing"] != "codes" or spec["code_bits"] != 2
            or spec["bitorder"] != "little" or spec["missing"] != "means"
            or spec["datatype"] not in ("FP32", "FP64")
            or not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int))
            or not isinstance(values, list) or len(values) != 4
            or not all(isinstance(v, float) for v in values)
            or not np.array_equal(values, PLINK_CODE_VALUES, equal_nan=True)):  # fmt: skip
        return "its input is not PLINK's 2-bit codes with means as score-model writes it"
    names = score.get("names")
    if set(score) != {"file", "names"} or not isinstance(names, list):
        return "its [score] table is not score-model's"
    want = [(n, [len(names)] if s is None else s) for n, s in _OUTPUTS]
    got = [(o.get("name"), o.get("shape")) for o in outputs]
    if got != want or any(o.get("datatype") != "FP64" or len(o) != 3 for o in outputs):
        return "its outputs are not score-model's"
    return shape[0], spec["missing_file"], score["file"], [str(n) for n in names]


def default_threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def score_samples(
    fm: FastScoreModel,
    blocks: np.ndarray,
    start: int,
    stop: int,
    *,
    threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Samples ``start`` to ``stop - 1`` of a ``.bed``'s blocks (:func:`open_bed`) scored.

    Args:
        threads: C threads; progress: (variants done, variants) after each block.

    Returns:
        As :func:`service.genotypes.bulk.score_bed`: output name -> (stop - start, ...)
        float64.
    """
    first = start - start % 4  # the kernel starts at a byte: four samples
    part = blocks[:, first // 4 : math.ceil(stop / 4)]
    sums = score_bed_blocks(part, stop - first, fm.values, threads=threads,
                            progress=progress)[start - first :]  # fmt: skip
    S = len(fm.names)
    score = sums[:, :S]
    avg = score / fm.denominator if fm.denominator else np.full_like(score, math.nan)
    return {"ALLELE_CT": sums[:, S + 1 :], "NAMED_ALLELE_DOSAGE_SUM": sums[:, S : S + 1],
            "SCORE_AVG": avg, "SCORE_SUM": score}  # fmt: skip


def score_bed_fast(
    fm: FastScoreModel,
    bed: Path,
    out: Path | None = None,
    *,
    threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Score every sample of ``bed`` (``.bim``, ``.fam`` beside it) with ``fm``.

    Args:
        out: write plink2's ``.sscore`` columns there (as :func:`.bulk.score_bed`).
        threads: C threads; progress: (variants done, variants) after each block.

    Returns:
        As :func:`service.genotypes.bulk.score_bed`: output name -> (samples, ...) float64,
        in ``.fam`` order.

    Raises:
        PlinkError: unreadable data, or variants that are not the model's.
    """
    variants = read_bim(bed.with_suffix(".bim"))
    samples = read_fam(bed.with_suffix(".fam"))
    check_variants(bed.with_suffix(".bim"), variants, [fm.variants], fm.ids_sha256, fm.name)
    n = len(samples)
    blocks = open_bed(bed, n, len(variants))
    result = score_samples(fm, blocks, 0, n, threads=threads, progress=progress)
    if out is not None:
        write_sscore(out, samples.fid, samples.iid, result)
    return result
