"""Small PLINK data sets written with NumPy, and plink2's ``--score`` in NumPy (float64)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

DOSAGE = np.array([2.0, np.nan, 1.0, 0.0])  # the first allele's, per .bed code


@dataclass
class Dataset:
    prefix: Path
    codes: np.ndarray  # (samples, variants) codes 0..3
    ids: list[str]
    a1: list[str]
    a2: list[str]
    pat: list[str]

    @property
    def bed(self) -> Path:
        return self.prefix.with_suffix(".bed")

    @property
    def bim(self) -> Path:
        return self.prefix.with_suffix(".bim")


def write_dataset(
    prefix: Path, n: int, L: int, seed: int, missing: float = 0.05, pat: list[str] | None = None
) -> Dataset:
    """A random .bed/.bim/.fam with ``missing`` of the genotypes missing (code 01)."""
    rng = np.random.default_rng(seed)
    codes = rng.choice(np.array([0, 2, 3], np.uint8), size=(n, L), p=[0.3, 0.45, 0.25])
    codes[rng.random((n, L)) < missing] = 1
    nb = (n + 3) // 4
    padded = np.zeros((L, nb * 4), np.uint8)
    padded[:, :n] = codes.T
    blocks = (padded.reshape(L, nb, 4).astype(np.uint32) << (2 * np.arange(4))).sum(-1)
    prefix.with_suffix(".bed").write_bytes(
        bytes([0x6C, 0x1B, 0x01]) + blocks.astype(np.uint8).tobytes()
    )
    alleles = ["A", "C", "G", "T"]
    a1 = [alleles[i % 4] for i in range(L)]
    a2 = [alleles[(i + 1) % 4] for i in range(L)]
    ids = [f"rs{i}" for i in range(L)]
    prefix.with_suffix(".bim").write_text(
        "".join(f"1\t{ids[i]}\t0\t{i + 1}\t{a1[i]}\t{a2[i]}\n" for i in range(L))
    )
    pats = pat or ["0"] * n
    prefix.with_suffix(".fam").write_text(
        "".join(f"F\tS{i}\t{pats[i]}\t0\t1\t-9\n" for i in range(n))
    )
    return Dataset(prefix, codes, ids, a1, a2, pats)


def plink_score(
    data: Dataset, rows: list[tuple[str, str, list[float]]], founders: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """plink2 --score's ALLELE_CT, NAMED_ALLELE_DOSAGE_SUM, SCOREk_AVG, SCOREk_SUM (float64)."""
    n = data.codes.shape[0]
    index = {v: i for i, v in enumerate(data.ids)}
    S = len(rows[0][2])
    ct, ds, sums, used = np.zeros(n), np.zeros(n), np.zeros((n, S)), 0
    keep = np.ones(n, bool) if founders is None else founders
    for vid, allele, w in rows:
        i = index.get(vid)
        if i is None or allele not in (data.a1[i], data.a2[i]):
            continue
        used += 1
        d = DOSAGE[data.codes[:, i]]
        if allele == data.a2[i]:
            d = 2 - d
        mean = np.nanmean(d[keep])
        ct += 2 * ~np.isnan(d)
        ds += np.nan_to_num(d)
        sums += np.where(np.isnan(d), mean, d)[:, None] * np.asarray(w)[None, :]
    return ct, ds, sums / (2 * used), sums
