"""``bitserve genotypes score``: every sample of a ``.bed`` through a ``[score]`` model in this
process (no server, no Ray), written as plink2's ``.sscore``.

The model is loaded as ``bitserve serve`` loads it (:func:`service.models.builder.build_version`:
the same checks and dry run) and each block of samples is one :meth:`Pipeline.run` batch:
the ``.bed``'s variant-major blocks are read memory-mapped, transposed to one row of codes
per sample (:func:`service.genotypes.plink_files.sample_major`) and scored by the lookup
kernel. The data's variants are checked against the model's ``ids_sha256`` first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from service.genotypes.plink_files import (
    PlinkError,
    check_variants,
    open_bed,
    read_bim,
    read_fam,
    sample_rows,
)


def load_score_model(repository: Path, model: str, device: str = "cpu") -> tuple[Any, Any]:
    """A ``[score]`` model's config and pipeline (its highest version), built as
    ``bitserve serve`` builds it.

    Raises:
        ConfigError: the model cannot be loaded; PlinkError: not a ``[score]`` model.
    """
    from service.models.builder import build_version
    from service.models.config import DEFAULT_MAX_OPERATOR_BYTES
    from service.models.layout import model_versions

    versions = model_versions(repository, model)
    src = versions[max(versions, key=int)]
    cfg, pipe = build_version(model, src, default_device=device, warmup=False,
                              patch={"device": device},
                              max_operator_bytes=DEFAULT_MAX_OPERATOR_BYTES)  # fmt: skip
    if cfg.score is None:
        raise PlinkError(f"{src.source}: not a [score] model")
    return cfg, pipe


def score_bed(
    repository: Path,
    model: str,
    bed: Path,
    out: Path | None = None,
    *,
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Score every sample of ``bed`` (``.bim``, ``.fam`` beside it) with a ``[score]`` model.

    Args:
        repository, model: where the model is (its highest version).
        bed: the data.
        out: write plink2's ``.sscore`` columns there (``#FID IID ALLELE_CT
            NAMED_ALLELE_DOSAGE_SUM SCOREk_AVG... SCOREk_SUM...``, tab-separated).
        device: where the model runs.
        progress: called with (samples done, samples) after each batch.
        loaded: :func:`load_score_model`'s result, to reuse (default: load it here).

    Returns:
        Output name -> (samples, ...) float64, in ``.fam`` order.

    Raises:
        PlinkError: unreadable data, or variants that are not the model's.
        ConfigError: the model cannot be loaded.
    """
    from service.models.signature import Bound, WireInput

    cfg, pipe = loaded or load_score_model(repository, model, device)
    variants = read_bim(bed.with_suffix(".bim"))
    samples = read_fam(bed.with_suffix(".fam"))
    spec = cfg.inputs[0]
    check_variants(bed.with_suffix(".bim"), variants, spec.shape, spec.ids_sha256, model)
    n = len(samples)
    data = open_bed(bed, n, len(variants))
    step = max(4, pipe.capacity - pipe.capacity % 4)
    parts: list[list[np.ndarray]] = []
    for _, s1, codes in sample_rows(data, 0, n, step):
        parts.append(pipe.run([Bound((WireInput(codes, True),), (0, 1, 2, 3), len(codes))])[0])
        if progress is not None:
            progress(s1, n)
    names = [o.name for o in cfg.outputs]
    result = {k: np.concatenate([p[i] for p in parts]) for i, k in enumerate(names)}
    if out is not None:
        write_sscore(out, samples.fid, samples.iid, result)
    return result


def write_sscore(path: Path, fid: list[str], iid: list[str], r: dict[str, np.ndarray]) -> None:
    """plink2's ``.sscore`` columns of :func:`score_bed`'s result, tab-separated."""
    S = r["SCORE_SUM"].shape[1]
    avg = [f"SCORE{k + 1}_AVG" for k in range(S)]
    head = ["#FID", "IID", "ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM", *avg,
            *(f"SCORE{k + 1}_SUM" for k in range(S))]  # fmt: skip
    cols = np.column_stack([r["ALLELE_CT"], r["NAMED_ALLELE_DOSAGE_SUM"], r["SCORE_AVG"],
                            r["SCORE_SUM"]])  # fmt: skip
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\t".join(head) + "\n")
        for f, i, row in zip(fid, iid, cols, strict=True):
            fh.write(f"{f}\t{i}\t{int(row[0])}\t{row[1]:.17g}\t"
                     + "\t".join(f"{v:.17g}" for v in row[2:]) + "\n")  # fmt: skip
