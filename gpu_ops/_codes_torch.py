"""Torch kernels of the code ops, for any device (and the CPU without a C compiler).

Plain tensor arithmetic, obviously correct rather than fast: the shifts of each byte as a
broadcast, the code table as an index, ``embedding_bag`` for the score's gather-sum (an
indexed gather, ``torch.take``, was measured ~10x slower on the CPU).
"""

from __future__ import annotations

import torch

# Rows of the score's gather-sum per step: bounds its int64 index tensor to ~64 MiB.
_SCORE_INDEX_ELEMENTS = 8 << 20


def shifts(code_bits: int, bitorder: str, device: torch.device) -> torch.Tensor:
    """(8 // code_bits,) int: where code c of a byte starts; little: the first code in the
    lowest bits."""
    per = 8 // code_bits
    c = torch.arange(per, device=device)
    return 8 - code_bits * (c + 1) if bitorder == "big" else code_bits * c


def codes(x: torch.Tensor, code_bits: int, count: int, bitorder: str) -> torch.Tensor:
    """x (..., nb) uint8 -> (..., count) int64: the codes, in order."""
    sh = shifts(code_bits, bitorder, x.device)
    c = (x.unsqueeze(-1).long() >> sh) & ((1 << code_bits) - 1)
    return c.flatten(-2)[..., :count]


def decode(
    x: torch.Tensor,
    code_bits: int,
    count: int,
    table: torch.Tensor,
    bitorder: str,
    missing: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """x (..., nb) uint8 -> ``dtype`` (..., count): ``table[code]``, or ``missing`` (one
    value, or one per element) where that is NaN."""
    c = codes(x, code_bits, count, bitorder)
    tab = table.to(torch.float64)
    values = tab[c]
    miss = missing.to(torch.float64)
    values = torch.where(torch.isnan(values), miss.expand(count), values)
    return values.to(dtype)


def byte_table(tables: torch.Tensor, code_bits: int, bitorder: str) -> torch.Tensor:
    """Per-element code tables -> the per-byte lookup table of ``score_codes``.

    Args:
        tables: (L, 2**code_bits, S): the value element l's code k adds to score s.

    Returns:
        (ceil(L * code_bits / 8), 256, S) in ``tables``' dtype: entry [p, b, s] the sum over
        the codes of byte value b at byte position p (elements past L add nothing).
    """
    L, K, S = tables.shape
    per = 8 // code_bits
    nb = (L + per - 1) // per
    padded = tables.new_zeros((nb * per, K, S))
    padded[:L] = tables
    padded = padded.view(nb, per, K, S)
    # A byte is a number of `per` base-K digits, code c one digit: the table of every byte
    # is the broadcast sum of the codes' tables, each along its digit's axis (most
    # significant first), with no gather.
    lut = tables.new_zeros((nb, *([K] * per), S))
    for c in range(per):
        digit = per - 1 - c if bitorder == "little" else c
        shape = [nb] + [1] * per + [S]
        shape[1 + digit] = K
        lut += padded[:, c].reshape(shape)
    return lut.view(nb, 256, S)


def score(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """x (N, nb) uint8, lut (nb, 256, S) -> (N, S): sum_p lut[p, x[n, p], :]."""
    n, nb = x.shape
    S = lut.shape[-1]
    out = torch.zeros((n, S), dtype=lut.dtype, device=x.device)
    if n == 0 or nb == 0:
        return out
    weight = lut.reshape(nb * 256, S)
    base = torch.arange(nb, device=x.device) * 256
    step = max(1, _SCORE_INDEX_ELEMENTS // nb)
    for r0 in range(0, n, step):
        xs = x[r0 : r0 + step]
        idx = (xs.long() + base).reshape(-1)
        offsets = torch.arange(xs.shape[0], device=x.device) * nb
        out[r0 : r0 + step] = torch.nn.functional.embedding_bag(idx, weight, offsets, mode="sum")
    return out
