"""PLINK 1 binary files for a genotype model: ``.bed`` codes sample-major, ``.bim``, ``.fam``.

A ``.bed`` stores variant-major blocks (after the magic bytes ``6C 1B 01``): per variant
``ceil(samples / 4)`` bytes of 2-bit codes, the first sample in the lowest bits. A genotype
model (``bitserve genotypes score-model``) takes one row per sample: the same 2-bit codes,
variant after variant, four to a byte. :func:`read_bed` transposes the blocks to that form
without unpacking a genotype to a byte: for each group of 4 variants x 4 samples, the 4
input bytes make one 32-bit word whose 4x4 matrix of 2-bit codes is transposed in place by
two masked swaps (a "delta swap"), over whole arrays of words at once (NumPy, the file
memory-mapped, a block of variants at a time)::

    >>> from bitserve_client import plink
    >>> codes = plink.read_bed("data.bed")           # doctest: +SKIP
    >>> codes.shape                                   # (samples, ceil(variants / 4)) uint8

:func:`score_bed` checks the model's variants (their hash in its metadata) against the
``.bim`` and scores every sample through :meth:`Client.infer_many`, with progress.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bitserve_client._client import Client
    from bitserve_client._types import BulkResult

__all__ = [
    "Samples",
    "VariantMismatchError",
    "Variants",
    "check_variants",
    "ids_sha256",
    "read_bed",
    "read_bim",
    "read_fam",
    "score_bed",
]

BED_MAGIC = bytes([0x6C, 0x1B, 0x01])
# Variants transposed per step: their rows of every sample and the step's words stay in
# the cache between passes (4,096 variants x 2,500 bytes for 10,000 samples: 10 MiB).
_BLOCK_VARIANTS = 4096

PathLike = str | os.PathLike[str]


class VariantMismatchError(ValueError):
    """The data's variants (``.bim``) are not the model's: scoring them would be wrong."""


@dataclass(frozen=True)
class Variants:
    """A ``.bim``: per variant its chromosome, id and two alleles (columns 1, 2, 5, 6)."""

    chrom: list[str]
    ids: list[str]
    a1: list[str]
    a2: list[str]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Samples:
    """A ``.fam``: per sample its family and individual ids (columns 1 and 2)."""

    fid: list[str]
    iid: list[str]

    def __len__(self) -> int:
        return len(self.iid)


def _rows(path: PathLike, min_cols: int, what: str) -> Iterator[list[str]]:
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            f = line.split()
            if not f:
                continue
            if len(f) < min_cols:
                raise ValueError(f"{path}: line {n}: {len(f)} columns, a {what} has 6")
            yield f


def read_bim(path: PathLike) -> Variants:
    """The variants of a ``.bim``."""
    rows = list(_rows(path, 6, ".bim"))
    return Variants([r[0] for r in rows], [r[1] for r in rows], [r[4] for r in rows],
                    [r[5] for r in rows])  # fmt: skip


def read_fam(path: PathLike) -> Samples:
    """The samples of a ``.fam``."""
    rows = list(_rows(path, 2, ".fam"))
    return Samples([r[0] for r in rows], [r[1] for r in rows])


def ids_sha256(variants: Variants) -> str:
    """SHA-256 of the variants' ``id\\ta1\\ta2`` lines (UTF-8, each ending in a newline):
    what a genotype model's metadata carries as its input's ``ids_sha256``."""
    h = hashlib.sha256()
    for vid, a1, a2 in zip(variants.ids, variants.a1, variants.a2, strict=True):
        h.update(f"{vid}\t{a1}\t{a2}\n".encode())
    return h.hexdigest()


def _open_bed(path: PathLike, n_samples: int, n_variants: int) -> np.memmap[Any, Any]:
    nb = (n_samples + 3) // 4
    with open(path, "rb") as fh:
        magic = fh.read(3)
    if magic != BED_MAGIC:
        raise ValueError(f"{path}: not a variant-major PLINK .bed (magic {magic.hex()})")
    size = Path(path).stat().st_size
    if size != 3 + n_variants * nb:
        raise ValueError(f"{path}: {size} bytes; {n_variants} variants x {n_samples} samples "
                         f"take {3 + n_variants * nb}")  # fmt: skip
    return np.memmap(path, np.uint8, "r", offset=3, shape=(n_variants, nb))


_S6, _S12 = np.uint32(6), np.uint32(12)
_M6, _M12 = np.uint32(0x00CC00CC), np.uint32(0x0000F0F0)
_BYTE_SHIFTS = [np.uint32(8 * k) for k in range(4)]


def _transpose_words(w: np.ndarray[Any, Any], t: np.ndarray[Any, Any]) -> None:
    """In place: each uint32 of ``w`` holds a 4x4 matrix of 2-bit codes, element (r, c) at
    bit ``8 r + 2 c``; afterwards element (c, r) is there (two delta swaps; ``t`` is scratch
    of w's shape, so no temporaries are allocated)."""
    for shift, mask in ((_S6, _M6), (_S12, _M12)):
        np.right_shift(w, shift, out=t)
        t ^= w
        t &= mask
        w ^= t
        t <<= shift
        w ^= t


def transpose_codes(blocks: np.ndarray[Any, Any], n_samples: int) -> np.ndarray[Any, Any]:
    """Variant-major ``.bed`` blocks (V, ceil(n / 4)) -> sample-major (n, ceil(V / 4)) uint8,
    both with the first code in a byte's lowest bits; padding codes are 00.

    A block of variants at a time (read as whole rows): the bytes of 4 variants at one sample
    byte become one uint32 (shifted in with a widening ufunc, not a byte gather), its 4x4
    codes are transposed, the words are transposed as uint32, and each of their 4 bytes is
    one sample's row (a narrowing copy). Every step is a whole-array ufunc.
    """
    V, nbs = blocks.shape
    V4 = (V + 3) // 4
    out = np.empty((nbs * 4, V4), np.uint8)
    lanes = out.reshape(nbs, 4, V4)
    step = max(4, _BLOCK_VARIANTS)
    w = np.empty((step // 4, nbs), np.uint32)
    t = np.empty_like(w)
    wt = np.empty((nbs, step // 4), np.uint32)
    tt = np.empty_like(wt)
    for v0 in range(0, V, step):
        chunk = np.asarray(blocks[v0 : v0 + step])
        if chunk.shape[0] % 4:
            pad = np.zeros((4 - chunk.shape[0] % 4, nbs), np.uint8)
            chunk = np.concatenate([chunk, pad])
        k4 = chunk.shape[0] // 4
        q = chunk.reshape(k4, 4, nbs)
        wk, tk, wtk, ttk = w[:k4], t[:k4], wt[:, :k4], tt[:, :k4]
        np.copyto(wk, q[:, 0], casting="unsafe")
        for k in (1, 2, 3):
            np.left_shift(q[:, k], _BYTE_SHIFTS[k], out=tk, dtype=np.uint32)
            wk |= tk
        _transpose_words(wk, tk)  # byte s of a word: sample 4 * byte + s, 4 variants
        np.copyto(wtk, wk.T)
        j0 = v0 // 4
        for s in range(4):
            np.right_shift(wtk, _BYTE_SHIFTS[s], out=ttk)
            np.copyto(lanes[:, s, j0 : j0 + k4], ttk, casting="unsafe")
    return out[:n_samples]


def read_bed(
    path: PathLike,
    samples: Sequence[int] | slice | None = None,
    variants: Sequence[int] | slice | None = None,
    *,
    bim: PathLike | None = None,
    fam: PathLike | None = None,
) -> np.ndarray[Any, Any]:
    """A ``.bed``'s genotype codes, one row per sample: (samples, ceil(variants / 4)) uint8.

    Args:
        path: the ``.bed``; its ``.bim`` and ``.fam`` beside it (same stem) unless given.
        samples: which samples, in this order (indices or a slice); None: all.
        variants: which variants, in this order; None: all.
        bim, fam: the ``.bim`` and ``.fam`` when not beside ``path``.

    Returns:
        The 2-bit codes (00 two copies of the ``.bim``'s first allele, 01 missing, 10 one
        copy each, 11 two of the second), the first variant in each byte's lowest bits,
        padding codes 00: what a genotype model takes.
    """
    base = Path(path)
    n = _count_lines(fam or base.with_suffix(".fam"))
    V = _count_lines(bim or base.with_suffix(".bim"))
    data: np.ndarray[Any, Any] = _open_bed(path, n, V)
    if variants is not None:
        data = data[variants] if isinstance(variants, slice) else data[np.asarray(variants)]
    if samples is None:
        return transpose_codes(data, n)
    idx = np.arange(n)[samples] if isinstance(samples, slice) else np.asarray(samples)
    if idx.size == 0:
        return np.zeros((0, (data.shape[0] + 3) // 4), np.uint8)
    lo, hi = int(idx.min()) // 4, int(idx.max()) // 4 + 1  # the sample bytes they lie in
    part = transpose_codes(np.asarray(data[:, lo:hi]), (hi - lo) * 4)
    return part[idx - 4 * lo]


def _count_lines(path: PathLike) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def check_variants(metadata: dict[str, Any], variants: Variants) -> None:
    """Refuse data whose variants are not the model's.

    Args:
        metadata: the model's V2 metadata (``Client.model_metadata``).
        variants: the ``.bim``'s.

    Raises:
        VariantMismatchError: the model's input has another length, or its ``ids_sha256``
            differs from the ``.bim``'s.
    """
    inputs = metadata.get("inputs") or []
    if len(inputs) != 1:
        raise VariantMismatchError(f"model has {len(inputs)} inputs; a genotype model has one")
    params = inputs[0].get("parameters") or {}
    logical = params.get("logical_shape") or []
    if logical != [len(variants)]:
        raise VariantMismatchError(f"the model scores {logical} variants; the .bim has "
                                   f"{len(variants)}")  # fmt: skip
    want = params.get("ids_sha256")
    if want is None:
        raise VariantMismatchError("the model's metadata has no ids_sha256 to check against")
    got = ids_sha256(variants)
    if got != want:
        raise VariantMismatchError(
            f"the .bim's variants (ids and alleles, sha256 {got[:12]}...) are not the model's "
            f"({str(want)[:12]}...): same count, another order or other variants"
        )


def score_bed(
    client: Client,
    model: str,
    path: PathLike,
    *,
    batch_size: int = 1024,
    progress: bool = True,
    **kwargs: Any,
) -> BulkResult:
    """Score every sample of a ``.bed`` through a genotype model, in order, with progress.

    The ``.bim`` is checked against the model's variants first (:func:`check_variants`);
    the codes are transposed one batch of samples at a time as they are sent.

    Args:
        client: a :class:`bitserve_client.Client`.
        model: the model's name.
        path: the ``.bed`` (``.bim`` and ``.fam`` beside it).
        batch_size: samples per request.
        progress: show progress.
        kwargs: more keywords of :meth:`Client.infer_many` (``concurrency``, ``out``, ...).

    Returns:
        :meth:`Client.infer_many`'s result: ``SCORE_SUM``, ``SCORE_AVG``, ``ALLELE_CT``,
        ``NAMED_ALLELE_DOSAGE_SUM`` per sample, in ``.fam`` order.

    Raises:
        VariantMismatchError: the data's variants are not the model's (nothing is sent).
    """
    base = Path(path)
    variants = read_bim(base.with_suffix(".bim"))
    check_variants(client.model_metadata(model), variants)
    n = _count_lines(base.with_suffix(".fam"))
    V = len(variants)
    data = _open_bed(path, n, V)
    step = max(4, batch_size - batch_size % 4)

    def batches() -> Iterator[np.ndarray[Any, Any]]:
        for s0 in range(0, n, step):
            s1 = min(n, s0 + step)
            yield transpose_codes(np.asarray(data[:, s0 // 4 : (s1 + 3) // 4]), s1 - s0)

    return client.infer_many(model, batches(), batch_size=step, progress=progress, **kwargs)
