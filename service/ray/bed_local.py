"""A PLINK ``.bed`` scored by ``bitserve score`` in this process, without Ray.

``bitserve score ... DATA.bed OUTPUT/`` without ``--address`` (and without ``--ray``) scores
here: Ray's start-up (10 to 30 s on a small host) would dwarf the work, which one process
does in about a second for 10,000 samples x 100,000 variants. The output is what the Ray
path writes for the same ``.bed`` (:mod:`service.ray.bed_input`, :mod:`service.ray.job`):
``OUTPUT/DATA/<start>-<stop>.parquet`` with the columns ``FID`` and ``IID`` (strings, from
the ``.fam``), with ``keep_inputs`` the model's input (each sample's codes,
``fixed_size_binary``), then one column per model output as Ray Data's tensor columns
(:func:`service.ray.outputs.tensor_column`), its rows in ``.fam`` order. Files of
:data:`FILE_ROWS` samples (fewer with ``keep_inputs``: :func:`file_rows`), each written whole
under a temporary name and then renamed (:func:`service.ray.outputs.write_run`). Resumable
as the Ray path is, and with its files: the rows already in OUTPUT, written by either path,
are skipped.

Two scorers, chosen as ``bitserve genotypes score`` chooses them: a ``[score]`` model folder
as ``score-model`` writes it, on the CPU (device ``auto`` or ``cpu``), is scored without
torch by the C kernel reading the memory-mapped ``.bed`` where it lies
(:func:`service.genotypes.fast.score_samples`); any other genotype model (one ``codes``
input), or device ``cuda``, is loaded as the Ray path's actors load it
(:class:`service.ray.scorer.BatchScorer`: the server's own pipeline) and fed each sample's
codes (:func:`service.genotypes.plink_files.sample_rows`). Either way the ``.bim``'s variants
are checked against the model's ``ids_sha256`` before anything is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from service.genotypes import fast
from service.genotypes.plink_files import (
    Samples,
    Variants,
    check_variants,
    open_bed,
    read_bim,
    read_fam,
    sample_rows,
)
from service.ray.bed_input import codes_column
from service.ray.errors import ScoringError
from service.ray.inputs import BLOCK_ROWS, filesystem
from service.ray.outputs import JobReport, check_complete, settle, tensor_column, write_run

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

FILE_ROWS = BLOCK_ROWS
"""Samples per output file (the Ray path's block): one kernel pass over the ``.bed`` each."""
KEPT_BYTES = 256 << 20
"""With ``keep_inputs``, the most bytes of codes one output file holds."""

Score = Callable[[np.ndarray, int, int], dict[str, np.ndarray]]
"""Samples ``start`` to ``stop - 1`` of a ``.bed``'s blocks -> output name -> (rows, ...)."""


def file_rows(row_bytes: int, keep_inputs: bool) -> int:
    """Samples per output file: :data:`FILE_ROWS`, or with ``keep_inputs`` as many as hold
    :data:`KEPT_BYTES` of codes (``row_bytes`` a sample), a multiple of 4, at least 4."""
    if not keep_inputs:
        return FILE_ROWS
    rows = min(FILE_ROWS, KEPT_BYTES // max(row_bytes, 1))
    return max(4, rows - rows % 4)


def score_bed_here(
    bed: str | Path,
    output: str,
    repository: str | Path,
    model: str,
    *,
    version: str | None = None,
    device: str = "auto",
    threads: int | None = None,
    keep_inputs: bool = False,
) -> JobReport:
    """Score every sample of ``bed`` (its ``.bim`` and ``.fam`` beside it) into ``output``
    as the Ray path does, skipping the samples already there.

    Args:
        bed: the ``.bed``; output: the output folder (a path or URI).
        repository, model, version: the model (None: its highest version).
        device: ``auto`` or ``cpu`` (the C kernel where the model allows, else as ``auto``
            places it: the GPU, if any), ``cuda`` or ``cuda:N`` (the model as serve loads it).
        threads: CPU threads (the C kernel's or torch's); None: every CPU this process may
            use.
        keep_inputs: also write each sample's codes, as the model's input column.

    Raises:
        ScoringError: no such model or version, not a genotype model, or a model that does
            not load; PlinkError: unreadable files, or variants that are not the model's
            (both before anything is written). IncompleteOutput: rows missing at the end.
    """
    t0 = time.perf_counter()
    bed = Path(bed)
    bim = bed.with_suffix(".bim")
    try:
        variants = read_bim(bim)
        samples = read_fam(bed.with_suffix(".fam"))
    except OSError as e:
        raise ScoringError(str(e)) from e
    threads = threads or fast.default_threads()
    name, score = _scorer(Path(repository), model, version, device, threads, bim, variants)
    n = len(samples)
    blocks = open_bed(bed, n, len(variants))
    fs, out_path = filesystem(output)
    folder = f"{out_path}/{bed.stem}"
    before = settle(fs, folder, n)
    step = file_rows((len(variants) + 3) // 4, keep_inputs)
    for a, b in before.missing:
        for s0 in range(a, b, step):
            s1 = min(b, s0 + step)
            kept = None
            if keep_inputs:
                kept = (name, next(sample_rows(blocks, s0, s1, s1 - s0))[2])
            write_run(fs, folder, s0, s1, _table(samples, s0, s1, kept, score(blocks, s0, s1)))
    check_complete(fs, [folder], [n], [str(bed)])
    return JobReport(1, n, before.done, n - before.done, time.perf_counter() - t0, output)


def _table(
    samples: Samples,
    start: int,
    stop: int,
    kept: tuple[str, np.ndarray] | None,
    outputs: dict[str, np.ndarray],
) -> pa.Table:
    """One output file's rows: FID, IID, the kept codes, the outputs (the Ray path's order)."""
    import pyarrow as pa

    fields = [pa.field("FID", pa.string()), pa.field("IID", pa.string())]
    columns = [_strings(samples.fid[start:stop]), _strings(samples.iid[start:stop])]
    if kept is not None:
        column = codes_column(kept[1])
        fields.append(pa.field(kept[0], column.type))
        columns.append(column)
    for name, values in outputs.items():
        field, column = tensor_column(name, values)
        fields.append(field)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _strings(values: list[str]) -> pa.Array:
    """A ``string`` column built on its buffers (``pa.array`` would import pandas, see
    :func:`service.ray.outputs.flat_array`)."""
    import pyarrow as pa

    encoded = [v.encode() for v in values]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:  # beyond a string array's offsets
        return pa.array(values, pa.string())
    return pa.StringArray.from_buffers(len(encoded), pa.py_buffer(offsets.astype(np.int32)),
                                       pa.py_buffer(b"".join(encoded)))  # fmt: skip


def _scorer(
    repository: Path,
    model: str,
    version: str | None,
    device: str,
    threads: int,
    bim: Path,
    variants: Variants,
) -> tuple[str, Score]:
    """The model's input name and its scorer, its variants checked against ``variants``."""
    from service.models.config_errors import ConfigError

    if device in ("auto", "cpu"):
        try:
            fm = fast.load_fast_model(repository, model, version)
        except ConfigError as e:
            raise ScoringError("; ".join(e.problems)) from None
        if isinstance(fm, fast.FastScoreModel):
            check_variants(bim, variants, [fm.variants], fm.ids_sha256, model)

            def score_fast(blocks: np.ndarray, start: int, stop: int) -> dict[str, np.ndarray]:
                return fast.score_samples(fm, blocks, start, stop, threads=threads)

            return fm.input, score_fast
        log.warning("%s: loading it as serve does", fm)
    return _served(repository, model, version, device, threads, bim, variants)


def _served(
    repository: Path,
    model: str,
    version: str | None,
    device: str,
    threads: int,
    bim: Path,
    variants: Variants,
) -> tuple[str, Score]:
    """The model loaded as the Ray path's actors load it (torch), fed a batch of samples'
    codes at a time (:func:`service.ray.data.batch_rows`)."""
    from service.ray.bed_input import genotype_input
    from service.ray.scorer import BatchScorer, read_config

    version, cfg = read_config(repository, model, version)
    spec = genotype_input(bim.with_suffix(".bed"), cfg)
    check_variants(bim, variants, spec.shape, spec.ids_sha256, model)
    import torch

    from service.ray.data import batch_rows

    torch.set_num_threads(threads)
    scorer = BatchScorer(repository, model, version=version, device=device)
    step = batch_rows(cfg)

    def score_served(blocks: np.ndarray, start: int, stop: int) -> dict[str, np.ndarray]:
        parts = []
        for _, _, codes in sample_rows(blocks, start, stop, step):
            scored = scorer({spec.name: codes})
            assert isinstance(scored, dict)  # NumPy columns in, NumPy columns out
            parts.append(scored)
        return {k: np.concatenate([p[k] for p in parts]) for k in scorer.outputs}

    return spec.name, score_served
