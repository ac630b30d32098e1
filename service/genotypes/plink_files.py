"""PLINK 1 binary files (``.bed`` / ``.bim`` / ``.fam``) as the score-model writer reads them.

``.bed``: the magic bytes ``6C 1B 01`` (variant-major), then one block of
``ceil(samples / 4)`` bytes per variant, four 2-bit genotype codes a byte, the first sample
in the lowest bits: 00 = two copies of the ``.bim``'s first allele (column 5), 01 = missing,
10 = one copy of each, 11 = two copies of the second (column 6). The client reads the same
files for sending (``bitserve_client.plink``); the two agree on :func:`ids_sha256`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BED_MAGIC = bytes([0x6C, 0x1B, 0x01])
# Variants counted per step: bounds the (variants, bytes, 4) counting table to ~64 MiB.
_COUNT_BLOCK_BYTES = 4 << 20


class PlinkError(ValueError):
    """A PLINK file that cannot be read as one; the message names the file and the line."""


@dataclass(frozen=True)
class Variants:
    """A ``.bim``: one entry per variant, in file order."""

    chrom: list[str]
    ids: list[str]
    a1: list[str]
    """Column 5: the allele a ``.bed``'s code 00 has two copies of."""
    a2: list[str]
    """Column 6."""

    def __len__(self) -> int:
        return len(self.ids)


def read_bim(path: Path) -> Variants:
    """The variants of a ``.bim`` (six whitespace-separated columns).

    Raises:
        PlinkError: a line without six columns, naming the file and the line.
    """
    chrom, ids, a1, a2 = [], [], [], []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            f = line.split()
            if not f:
                continue
            if len(f) != 6:
                raise PlinkError(f"{path}: line {n}: {len(f)} columns, a .bim has 6")
            chrom.append(f[0])
            ids.append(f[1])
            a1.append(f[4])
            a2.append(f[5])
    return Variants(chrom, ids, a1, a2)


@dataclass(frozen=True)
class Samples:
    """A ``.fam``: family and individual ids, parents, in file order."""

    fid: list[str]
    iid: list[str]
    pat: list[str]
    mat: list[str]

    def __len__(self) -> int:
        return len(self.iid)

    def founders(self) -> np.ndarray:
        """(samples,) bool: no parent in the data set (plink2 counts allele frequencies over
        founders)."""
        present = set(zip(self.fid, self.iid, strict=True))
        return np.array([(f, p) not in present and (f, m) not in present
                         for f, p, m in zip(self.fid, self.pat, self.mat, strict=True)],
                        dtype=bool)  # fmt: skip


def read_fam(path: Path) -> Samples:
    """The samples of a ``.fam`` (six columns: FID IID PAT MAT SEX PHENO).

    Raises:
        PlinkError: a line with fewer than four columns.
    """
    fid, iid, pat, mat = [], [], [], []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            f = line.split()
            if not f:
                continue
            if len(f) < 4:
                raise PlinkError(f"{path}: line {n}: {len(f)} columns, a .fam has 6")
            fid.append(f[0])
            iid.append(f[1])
            pat.append(f[2])
            mat.append(f[3])
    return Samples(fid, iid, pat, mat)


def ids_sha256(variants: Variants, index: Sequence[int] | None = None) -> str:
    """SHA-256 of the variants' ``id\\ta1\\ta2`` lines (UTF-8, each ending in a newline):
    what a score model's metadata carries and a client checks its ``.bim`` against."""
    h = hashlib.sha256()
    order = range(len(variants)) if index is None else index
    for i in order:
        h.update(f"{variants.ids[i]}\t{variants.a1[i]}\t{variants.a2[i]}\n".encode())
    return h.hexdigest()


def check_variants(
    bim: Path, variants: Variants, shape: Sequence[int], sha256: str | None, model: str = ""
) -> None:
    """That ``variants`` (read from ``bim``) are a model's: its input's ``shape`` is
    ``[len(variants)]`` and its ``ids_sha256`` is their :func:`ids_sha256`.

    Raises:
        PlinkError: other variants, or the same in another order (or a model without
            ``ids_sha256``), naming ``bim`` and the model.
    """
    if list(shape) != [len(variants)] or ids_sha256(variants) != sha256:
        named = f" {model!r}" if model else ""
        raise PlinkError(f"{bim}: its variants (ids and alleles, in order) are not the "
                         f"model's{named}")  # fmt: skip


def open_bed(path: Path, n_samples: int, n_variants: int) -> np.memmap:
    """The ``.bed``'s variant-major blocks, memory-mapped: (variants, ceil(samples / 4)).

    Raises:
        PlinkError: not a variant-major ``.bed``, or its size does not fit the ``.bim`` and
            ``.fam``.
    """
    nb = (n_samples + 3) // 4
    with open(path, "rb") as fh:
        magic = fh.read(3)
    if magic != BED_MAGIC:
        raise PlinkError(f"{path}: not a variant-major PLINK .bed (magic {magic.hex()})")
    size = path.stat().st_size
    want = 3 + n_variants * nb
    if size != want:
        raise PlinkError(f"{path}: {size} bytes; {n_variants} variants x {n_samples} samples "
                         f"take {want}")  # fmt: skip
    return np.memmap(path, np.uint8, "r", offset=3, shape=(n_variants, nb))


_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], np.uint8)


def _ones(x: np.ndarray) -> np.ndarray:
    """(rows,) int64: the set bits of each row of uint8 ``x``."""
    counted = np.bitwise_count(x) if hasattr(np, "bitwise_count") else _POPCOUNT[x]
    total: np.ndarray = counted.sum(axis=1, dtype=np.int64)
    return total


def code_counts(bed: np.ndarray, n_samples: int, keep: np.ndarray | None = None) -> np.ndarray:
    """(variants, 4) int64: each variant's count of codes 00, 01, 10, 11 over the samples
    ``keep`` selects (all when None), read in blocks of variants.

    All samples: popcounts of the codes' low and high bits (``lo & hi`` is 11, ``lo & ~hi``
    01, ``hi & ~lo`` 10; 00 is the rest, the last byte's 00 padding left out by counting
    from ``n_samples``). A subset decodes its samples' codes.
    """
    L, nb = bed.shape
    out = np.zeros((L, 4), np.int64)
    step = max(1, _COUNT_BLOCK_BYTES // max(nb, 1))
    cols = None if keep is None or keep.all() else np.flatnonzero(keep)
    for v0 in range(0, L, step):
        block = np.asarray(bed[v0 : v0 + step])
        if cols is None:
            lo = block & np.uint8(0x55)
            hi = (block >> np.uint8(1)) & np.uint8(0x55)
            n11 = _ones(lo & hi)
            n01 = _ones(lo & ~hi)
            n10 = _ones(hi & ~lo)
            out[v0 : v0 + step] = np.stack([n_samples - n01 - n10 - n11, n01, n10, n11], 1)
        else:
            codes = (block[:, cols // 4] >> (2 * (cols % 4)).astype(np.uint8)) & 3
            out[v0 : v0 + step] = (codes[:, :, None] == np.arange(4)).sum(1)
    return out


_S6, _S12 = np.uint32(6), np.uint32(12)
_M6, _M12 = np.uint32(0x00CC00CC), np.uint32(0x0000F0F0)
_BYTE_SHIFTS = [np.uint32(8 * k) for k in range(4)]


def _transpose_words(w: np.ndarray, t: np.ndarray) -> None:
    """In place: each uint32 of ``w`` holds a 4x4 matrix of 2-bit codes, element (r, c) at
    bit ``8 r + 2 c``; afterwards element (c, r) is there (two delta swaps, ``t`` scratch)."""
    for shift, mask in ((_S6, _M6), (_S12, _M12)):
        np.right_shift(w, shift, out=t)
        t ^= w
        t &= mask
        w ^= t
        t <<= shift
        w ^= t


def sample_major(blocks: np.ndarray, n_samples: int, block_variants: int = 4096) -> np.ndarray:
    """Variant-major ``.bed`` blocks (V, ceil(n / 4)) -> (n, ceil(V / 4)) uint8 codes, one row
    per sample (what a genotype model takes). The client's ``bitserve_client.plink`` does the
    same for sending (the client and the server share no code); tests check they agree.

    ``block_variants`` variants at a time: the bytes of 4 variants at one sample byte become
    one uint32 (widening shifts), its 4x4 codes are transposed, the words are transposed as
    uint32, and each of their 4 bytes is one sample's row (narrowing copies).
    """
    V, nbs = blocks.shape
    V4 = (V + 3) // 4
    out = np.empty((nbs * 4, V4), np.uint8)
    lanes = out.reshape(nbs, 4, V4)
    step = max(4, block_variants - block_variants % 4)
    w = np.empty((step // 4, nbs), np.uint32)
    t = np.empty_like(w)
    wt = np.empty((nbs, step // 4), np.uint32)
    tt = np.empty_like(wt)
    for v0 in range(0, V, step):
        chunk = np.asarray(blocks[v0 : v0 + step])
        if chunk.shape[0] % 4:
            chunk = np.concatenate([chunk, np.zeros((4 - chunk.shape[0] % 4, nbs), np.uint8)])
        k4 = chunk.shape[0] // 4
        q = chunk.reshape(k4, 4, nbs)
        wk, tk, wtk, ttk = w[:k4], t[:k4], wt[:, :k4], tt[:, :k4]
        np.copyto(wk, q[:, 0], casting="unsafe")
        for k in (1, 2, 3):
            np.left_shift(q[:, k], _BYTE_SHIFTS[k], out=tk, dtype=np.uint32)
            wk |= tk
        _transpose_words(wk, tk)
        np.copyto(wtk, wk.T)
        for s in range(4):
            np.right_shift(wtk, _BYTE_SHIFTS[s], out=ttk)
            np.copyto(lanes[:, s, v0 // 4 : v0 // 4 + k4], ttk, casting="unsafe")
    return out[:n_samples]


def sample_rows(
    blocks: np.ndarray, start: int, stop: int, step: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Samples ``start`` to ``stop - 1`` of variant-major ``.bed`` blocks (a memory map is
    read a slice at a time) as rows of codes, ``step`` samples at a time:
    ``(s0, s1, (s1 - s0, ceil(V / 4)) uint8)`` (:func:`sample_major` of the bytes that hold
    them; a first sample within a byte is cut from the rows)."""
    for s0 in range(start, stop, step):
        s1 = min(stop, s0 + step)
        first = s0 - s0 % 4
        codes = sample_major(np.asarray(blocks[:, first // 4 : math.ceil(s1 / 4)]), s1 - first)
        yield s0, s1, codes[s0 - first :]
