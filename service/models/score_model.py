"""A ``[score]`` model: plink2's ``--score`` on packed genotype codes, without a model program.

The model folder (written by ``bitserve genotypes score-model``, :mod:`service.genotypes`)
holds one ``packing = "codes"`` input of L variants (PLINK's 2-bit codes, their values the
dosage of each variant's first ``.bim`` allele, the missing code mean-imputed from
``missing_file``) and a safetensors file with ``weights`` (L, S), ``flip`` (L,) uint8 (a
flipped variant's weight is on its second allele, whose dosage is ``2 - value``) and
``scored`` (L,) uint8 (the variants the score file names; the others add nothing). Its four
outputs are plink2's columns for each sample:

=========================  =====  ========================================================
output                     shape  what
=========================  =====  ========================================================
ALLELE_CT                  [1]    2 x the variants with a genotype (non-missing)
NAMED_ALLELE_DOSAGE_SUM    [1]    the scored alleles' dosages summed over those
SCORE_AVG                  [S]    SCORE_SUM / (2 x the variants scored): plink2's SCOREk_AVG
SCORE_SUM                  [S]    sum of weight x dosage, missing genotypes mean-imputed
=========================  =====  ========================================================

All four are one :func:`gpu_ops.score_codes` call over a per-byte lookup table built once at
load (:func:`gpu_ops.score_table`): 256 x (S + 2) float64 values per byte of codes; the
(samples, variants) dosages are never written.
"""

from __future__ import annotations

import math

import torch

import gpu_ops
from service.models.codes import CodeTable
from service.models.config import ConfigError, ModelConfig
from service.models.layout import VersionSource
from service.text import safe_text


def read_score(src: VersionSource, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The score file's ``weights`` (L, S) float64, ``flip`` and ``scored`` (L,) bool, checked.

    Raises:
        ConfigError: naming ``score.file`` and what is wrong.
    """
    from safetensors import safe_open

    assert cfg.score is not None
    where = f"{src.source}: score.file"
    path = src.resolve(cfg.score.file, "score.file")
    L = cfg.inputs[0].shape[0]
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            names = set(fh.keys())
            missing = sorted({"weights", "flip", "scored"} - names)
            if missing:
                raise ConfigError([f"{where}: {safe_text(cfg.score.file)} has no tensor "
                                   f"{', '.join(map(repr, missing))}"])  # fmt: skip
            weights, flip = fh.get_tensor("weights"), fh.get_tensor("flip")
            scored = fh.get_tensor("scored")
    except ConfigError:
        raise
    except Exception as exc:  # safetensors raises several types for a corrupt file
        raise src.error(where, "not a readable safetensors file", exc) from exc
    problems = []
    if weights.dim() != 2 or weights.shape[0] != L or not weights.dtype.is_floating_point:
        problems.append(f"{where}: 'weights' must be float [{L}, S], is {weights.dtype} "
                        f"{list(weights.shape)}")  # fmt: skip
    elif not bool(torch.isfinite(weights).all()):
        problems.append(f"{where}: 'weights' has non-finite values")
    for name, t in (("flip", flip), ("scored", scored)):
        if list(t.shape) != [L]:
            problems.append(f"{where}: {name!r} must have shape [{L}], has {list(t.shape)}")
    if cfg.score.names and weights.dim() == 2 and len(cfg.score.names) != weights.shape[1]:
        problems.append(f"{src.source}: score.names: {len(cfg.score.names)} names for "
                        f"{weights.shape[1]} score columns")  # fmt: skip
    if problems:
        raise ConfigError(problems)
    return {"weights": weights.to(torch.float64), "flip": flip != 0, "scored": scored != 0}


def value_tables(
    weights: torch.Tensor, flip: torch.Tensor, scored: torch.Tensor, codes: CodeTable
) -> torch.Tensor:
    """(L, 2**code_bits, S + 2) float64: what each variant's code adds to each score column,
    then to the named allele's dosage sum and to the allele count.

    Args:
        weights: (L, S) float64.
        flip: (L,) bool: the weight is on the allele the code values do not count.
        scored: (L,) bool: the variants that count (the others' rows are zeros).
        codes: the input's code table: values and missing values (means) are the dosages
            of the allele the codes count (a .bed's first allele).
    """
    L, _S = weights.shape
    value = codes.table.to(torch.float64)[None, :].expand(L, -1)  # (L, K)
    is_missing = torch.isnan(value)
    miss = codes.missing.to(torch.float64).expand(L)[:, None].expand_as(value)
    first = torch.where(is_missing, miss, value)  # what the input decodes to
    imputed = torch.where(flip[:, None], 2.0 - first, first)
    named = torch.where(is_missing, 0.0, imputed)
    present = (~is_missing).to(torch.float64)
    tables = torch.cat(
        [imputed[:, :, None] * weights[:, None, :],  # SCORE_SUM
         named[:, :, None],  # NAMED_ALLELE_DOSAGE_SUM
         (2.0 * present)[:, :, None]],  # ALLELE_CT
        dim=2,
    )  # fmt: skip
    return tables * scored[:, None, None]


class ScoreModule(torch.nn.Module):
    """plink2's ``--score`` of packed codes (n, nb) -> the four outputs (module docstring).

    Args:
        weights: (L, S) float64; flip, scored: (L,) bool; codes: the input's code table.
        device: where the lookup table lives.
    """

    def __init__(
        self,
        weights: torch.Tensor,
        flip: torch.Tensor,
        scored: torch.Tensor,
        codes: CodeTable,
        device: torch.device,
    ) -> None:
        super().__init__()
        tables = value_tables(weights, flip, scored, codes)
        self.lut: torch.Tensor
        self.register_buffer("lut", gpu_ops.score_table(tables, codes.code_bits,
                                                        codes.bitorder).to(device))  # fmt: skip
        self.scores = weights.shape[1]
        self.denominator = 2.0 * float(scored.sum())

    def forward(self, packed: torch.Tensor) -> list[torch.Tensor]:
        S = self.scores
        sums = torch.ops.bitserve.score_codes(packed, self.lut)  # (n, S + 2)
        score = sums[:, :S]
        avg = score / self.denominator if self.denominator else torch.full_like(score, math.nan)
        return [sums[:, S + 1 :], sums[:, S : S + 1], avg, score]
