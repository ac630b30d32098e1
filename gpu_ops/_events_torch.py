"""Plain-torch kernels of the resampler's bit-input paths (every device; float64 everywhere).

- :func:`bit_counts`: set bits per row by a 256-entry table.
- :func:`unpacked`: the bits as floats, for the band path and the event path's torch kernel
  (on devices without an event kernel of their own the event path is the band path: the
  same sums, in another order).
- :func:`prefix`: the prefix-sum path of a piecewise polynomial response, by cumulative sums
  over the fine grid in float64 (moments of x about the grid's middle).
"""

from __future__ import annotations

import torch

_POPCOUNT = torch.tensor([bin(v).count("1") for v in range(256)], dtype=torch.int64)


def bit_counts(packed: torch.Tensor) -> torch.Tensor:
    """Set bits per row of ``packed (R, nbytes)`` uint8: int64 ``(R,)``."""
    return _POPCOUNT.to(packed.device)[packed.long()].sum(-1)


def unpacked(packed: torch.Tensor, B: int, big: bool, dtype: torch.dtype) -> torch.Tensor:
    """``packed (M, N, nbytes)`` unpacked to ``(M, N, B)`` in ``dtype``."""
    order = "big" if big else "little"
    out: torch.Tensor = torch.ops.bitserve.unpackbits(packed, 2, B, order, dtype)
    return out


def piece_bounds(x: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Fine-point bounds of the pieces ``[t[k], t[k + 1]]`` of a response at coarse points c.

    Args:
        x: (B,) float64 sorted grid; c: (N, A) float64; t: (P + 1,) increasing breakpoints in
            offsets ``d = c - x``.

    Returns:
        (P + 1, N, A) int64: piece k of (n, a) is the fine points
        ``[bounds[k + 1, n, a], bounds[k, n, a])``, i.e. ``t[k] <= d < t[k + 1]`` (the last
        piece includes ``d = t[P]``); all pieces together are the window
        ``t[0] <= d <= t[P]``, as :func:`gpu_ops.responses.windows` cuts it.
    """
    c = c.contiguous()
    out = [
        torch.searchsorted(x, c - float(tk), side="left" if k == t.numel() - 1 else "right")
        for k, tk in enumerate(t.tolist())
    ]
    return torch.stack(out)


def prefix_bounds(
    bits: torch.Tensor, x: torch.Tensor, c: torch.Tensor, bounds: torch.Tensor, coef: torch.Tensor
) -> torch.Tensor:
    """out (M, N, A) float64 of the piecewise polynomial response (``bounds``, ``coef``).

    Args:
        bits: (M, N, B) 0/1 (any float dtype).
        x: (B,) float64 grid; c: (N, A) float64 coarse points, any order.
        bounds: (P + 1, N, A) from :func:`piece_bounds`; coef: (P, 3) float64, see
            :func:`gpu_ops.responses.pieces`.
    """
    M, N, _ = bits.shape
    bounds = bounds.long()
    mid = 0.5 * (x[0] + x[-1])
    xr, cr = x - mid, c - mid
    f = bits.to(torch.float64)
    zero = f.new_zeros(M, N, 1)
    # P_j[..., i] = sum_{b < i} xr[b]^j f[b]
    sums = [torch.cat([zero, torch.cumsum(f * xr**j, -1)], -1) for j in range(3)]
    out = torch.zeros(M, N, c.shape[1], dtype=torch.float64, device=bits.device)
    for k in range(coef.shape[0]):
        lo, hi = bounds[k + 1].expand(M, -1, -1), bounds[k].expand(M, -1, -1)
        s0, s1, s2 = (p.gather(-1, hi) - p.gather(-1, lo) for p in sums)
        moments = (s0, cr * s0 - s1, cr * cr * s0 - 2 * cr * s1 + s2)  # sum (c - x)^j
        out += sum(float(coef[k, j]) * moments[j] for j in range(3))
    return out
