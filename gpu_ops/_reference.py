"""Slow, obviously correct implementations that the tests compare the fast paths with.

Nothing here is meant to be fast; everything here is meant to be easy to check by eye.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# --- bits: numpy.packbits / numpy.unpackbits semantics, in plain torch ---------------------


def _bit_shifts(bitorder: str, device: torch.device) -> torch.Tensor:
    """Shift of the j-th bit of a byte, j = 0..7: 7-j for "big", j for "little"."""
    j = torch.arange(8, device=device)
    return 7 - j if bitorder == "big" else j


def packbits_reference(
    x: torch.Tensor, dim: int | None = None, bitorder: str = "big"
) -> torch.Tensor:
    """numpy.packbits: nonzero elements become 1 bits, eight to a byte along ``dim``.

    Args:
        x: (...) bool or integer tensor; no argument checking is done here.
        dim: the axis to pack, or None to pack the C-order flattening.
        bitorder: "big" (first element in the top bit) or "little".

    Returns:
        uint8, the shape of ``x`` with ``dim`` shortened to ceil(n/8) (1-D when dim is None).
    """
    if dim is None or x.dim() == 0:
        x, dim = x.reshape(-1), 0
    bits = (x != 0).movedim(dim, -1).long()  # (..., n)
    n = bits.shape[-1]
    bits = torch.nn.functional.pad(bits, (0, -n % 8))  # (..., 8 * ceil(n/8))
    groups = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)  # (..., ceil(n/8), 8)
    packed = (groups << _bit_shifts(bitorder, x.device)).sum(-1)
    return packed.to(torch.uint8).movedim(-1, dim)


def unpackbits_reference(
    x: torch.Tensor,
    dim: int | None = None,
    count: int | None = None,
    bitorder: str = "big",
    dtype: torch.dtype = torch.uint8,
) -> torch.Tensor:
    """numpy.unpackbits: each uint8 becomes eight 0/1 elements along ``dim``.

    Args:
        x: (...) uint8 tensor; no argument checking is done here.
        dim: the axis to unpack, or None to unpack the C-order flattening.
        count: keep this many bits along ``dim`` (zero-padded past 8n); negative counts
            from the end (8n + count). None keeps all 8n.
        bitorder: "big" (top bit first) or "little".
        dtype: the output dtype.

    Returns:
        ``dtype``, the shape of ``x`` with ``dim`` of length ``count`` (8n when None).
    """
    if dim is None or x.dim() == 0:
        x, dim = x.reshape(-1), 0
    moved = x.movedim(dim, -1).long()  # (..., n)
    bits = (moved[..., None] >> _bit_shifts(bitorder, x.device)) & 1  # (..., n, 8)
    bits = bits.reshape(*moved.shape[:-1], 8 * moved.shape[-1])  # (..., 8n)
    total = bits.shape[-1]
    if count is None:
        count = total
    elif count < 0:
        count = total + count
    bits = torch.nn.functional.pad(bits, (0, max(count - total, 0)))[..., :count]
    return bits.to(dtype).movedim(-1, dim)


# --- resample: the banded response operator, densely ---------------------------------------


def banded_to_dense(starts: torch.Tensor, weights: torch.Tensor, num_fine: int) -> torch.Tensor:
    """The dense operator T (N, A, B) of a band: T[n, a, starts[n, a] + j] = weights[n, a, j]."""
    N, A, W = weights.shape
    T = torch.zeros(N, A, num_fine + W, dtype=weights.dtype, device=weights.device)
    cols = starts.long()[..., None] + torch.arange(W, device=weights.device)
    T.scatter_(-1, cols, weights)
    return T[..., :num_fine]


def banded_resample_reference(
    f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """out[..., n, a] = sum_j weights[n, a, j] * f[..., n, starts[n, a] + j], via gathered windows.

    Args:
        f: (N, B) or (M, N, B).
        starts: (N, A) integer.
        weights: (N, A, W).

    Returns:
        (N, A) or (M, N, A) in the promoted dtype of f and weights; autograd works throughout.
    """
    N, _, W = weights.shape
    cols = starts.long()[..., None] + torch.arange(W, device=f.device)  # (N, A, W)
    rows = torch.arange(N, device=f.device)[:, None, None]
    windows = f[..., rows, cols]  # (..., N, A, W)
    return (windows * weights).sum(-1)


def dense_response_operator(
    x: torch.Tensor, c: torch.Tensor, response: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """T[n, a, b] = response(c[n, a] - x[b]) for every fine point, shape (N, A, B)."""
    return response(c[..., None] - x)
