"""``bitserve genotypes score-model``: a ``[score]`` model folder from a PLINK data set and a
plink2 score file.

The model takes every variant of the ``.bim``, in its order (what ``read_bed`` sends), as
2-bit codes whose values are the dosage of each variant's first allele (``[2, nan, 1, 0]``).
Each score row is matched to the ``.bim`` by variant id: its allele is the first allele (the
weight multiplies the dosage), the second (``flip``: ``2 - dosage``), or neither (skipped and
counted, as plink2 does); ids absent from the data are skipped and counted. A missing
genotype is replaced by the mean dosage over the founders that have one (plink2's mean
imputation, from the allele frequencies it computes from the ``.bed``).

Files written: ``config.toml`` and ``score.safetensors`` (``weights`` (L, S) float64,
``flip`` and ``scored`` (L,) uint8, ``means`` (L,) float64: the first allele's mean dosage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.genotypes.plink_files import (
    PlinkError,
    code_counts,
    ids_sha256,
    open_bed,
    read_bim,
    read_fam,
)
from service.genotypes.score_file import read_score_file

MODEL_FILE = "score.safetensors"
PLINK_CODE_VALUES = (2.0, math.nan, 1.0, 0.0)
"""The first allele's dosage of each ``.bed`` code (00, 01 missing, 10, 11)."""


@dataclass(frozen=True)
class ScoreModelReport:
    """What the writer did: counts as plink2 reports them."""

    variants: int
    """Variants in the data (the model's input length)."""
    samples: int
    rows: int
    """Rows of the score file."""
    scored: int
    """Rows matched to a variant and allele: plink2's "N variants processed"."""
    flipped: int
    """Of those, weights on the ``.bim``'s second allele."""
    missing_ids: list[str]
    """Rows whose id is not in the data (skipped)."""
    allele_mismatch: list[str]
    """Rows whose allele is neither of the variant's (skipped)."""
    names: list[str]
    folder: Path

    def lines(self) -> list[str]:
        """The report as printed by the CLI."""
        out = [
            f"{self.folder}: {len(self.names)} score column(s) ({', '.join(self.names)}) over "
            f"{self.variants} variants x {self.samples} samples",
            f"--score: {self.scored} variants processed ({self.flipped} on the second allele)",
        ]
        if self.missing_ids:
            shown = ", ".join(self.missing_ids[:5]) + (", ..." if len(self.missing_ids) > 5 else "")
            out.append(f"{len(self.missing_ids)} score file entries skipped: variant id not in "
                       f"the data ({shown})")  # fmt: skip
        if self.allele_mismatch:
            shown = ", ".join(self.allele_mismatch[:5])
            out.append(f"{len(self.allele_mismatch)} score file entries skipped: allele is "
                       f"neither of the variant's ({shown})")  # fmt: skip
        return out


def mean_dosages(counts: np.ndarray) -> np.ndarray:
    """(L,) float64: the first allele's mean dosage over the genotypes present, from code
    counts (L, 4); 0 where every genotype is missing."""
    present = counts[:, 0] + counts[:, 2] + counts[:, 3]
    dosage = 2.0 * counts[:, 0] + counts[:, 2]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(present > 0, dosage / np.maximum(present, 1), 0.0)


def _config(L: int, sha: str, names: list[str], max_batch_size: int) -> str:
    S = len(names)
    quoted = ", ".join(f'"{n}"' for n in names)
    return f"""# Written by `bitserve genotypes score-model`: plink2 --score over {L} variants.
max_batch_size = {max_batch_size}
device = "auto"

[[inputs]]
name = "genotypes"
datatype = "FP64"
shape = [{L}]
packing = "codes"              # on the wire: UINT8 [batch, {(L + 3) // 4}], a sample's codes
code_bits = 2
bitorder = "little"            # PLINK's: the first code in the lowest bits
code_values = [2.0, nan, 1.0, 0.0]   # the first .bim allele's dosage; nan = missing
missing = "means"              # mean imputation (per variant, from the .bed)
missing_file = "{MODEL_FILE}"
ids_sha256 = "{sha}"

[score]
file = "{MODEL_FILE}"
names = [{quoted}]

[[outputs]]
name = "ALLELE_CT"
datatype = "FP64"
shape = [1]

[[outputs]]
name = "NAMED_ALLELE_DOSAGE_SUM"
datatype = "FP64"
shape = [1]

[[outputs]]
name = "SCORE_AVG"
datatype = "FP64"
shape = [{S}]

[[outputs]]
name = "SCORE_SUM"
datatype = "FP64"
shape = [{S}]
"""


def write_score_model(
    bim: Path,
    bed: Path,
    score: Path,
    out: Path,
    *,
    fam: Path | None = None,
    id_col: int = 1,
    allele_col: int = 2,
    score_cols: list[int] | None = None,
    max_batch_size: int = 1024,
) -> ScoreModelReport:
    """Write the model folder ``out`` (created; refused when it holds a ``config.toml``).

    Args:
        bim, bed: the data set; fam: its ``.fam`` (default: ``bed`` with the suffix ``.fam``).
        score: the score file (see :mod:`service.genotypes.score_file`).
        out: the model folder.
        id_col, allele_col, score_cols: the score file's columns, counted from 1.
        max_batch_size: the model's ``max_batch_size``.

    Raises:
        PlinkError, ScoreFileError: a file that cannot be read (naming it); also a score row
            naming a variant id the ``.bim`` holds more than once, or no row matching.
        FileExistsError: ``out`` already holds a model.
    """
    from safetensors.numpy import save_file

    variants = read_bim(bim)
    samples = read_fam(fam or bed.with_suffix(".fam"))
    rows = read_score_file(score, id_col, allele_col, score_cols)
    L, S = len(variants), len(rows.names)
    where: dict[str, int] = {}
    dup: set[str] = set()
    for i, vid in enumerate(variants.ids):
        if vid in where:
            dup.add(vid)
        where[vid] = i
    weights = np.zeros((L, S), np.float64)
    flip = np.zeros(L, np.uint8)
    scored = np.zeros(L, np.uint8)
    missing_ids: list[str] = []
    mismatch: list[str] = []
    for vid, allele, w in zip(rows.ids, rows.alleles, rows.weights, strict=True):
        found = where.get(vid)
        if found is None:
            missing_ids.append(vid)
            continue
        i = found
        if vid in dup:
            raise PlinkError(f"{bim}: variant id {vid!r} (named in {score}) appears more than "
                             "once in the .bim")  # fmt: skip
        if allele == variants.a1[i]:
            pass
        elif allele == variants.a2[i]:
            flip[i] = 1
        else:
            mismatch.append(vid)
            continue
        weights[i] = w
        scored[i] = 1
    if not scored.any():
        raise PlinkError(f"{score}: no row matches a variant and allele of {bim}")
    data = open_bed(bed, len(samples), L)
    means = mean_dosages(code_counts(data, len(samples), samples.founders()))
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.toml").exists():
        raise FileExistsError(f"{out}: already holds a model (config.toml)")
    save_file({"weights": weights, "flip": flip, "scored": scored, "means": means},
              str(out / MODEL_FILE))  # fmt: skip
    (out / "config.toml").write_text(
        _config(L, ids_sha256(variants), rows.names, max_batch_size), encoding="utf-8"
    )
    return ScoreModelReport(L, len(samples), len(rows.ids), int(scored.sum()), int(flip.sum()),
                            missing_ids, mismatch, rows.names, out)  # fmt: skip
