"""Launch helpers shared by the stored-band and on-the-fly resample kernels (no kernels here)."""

from __future__ import annotations

import torch
import triton


def block_m(M: int) -> int:
    """BLOCK_M for M functions per row: the smallest of 16, 32, 64 that covers M (at most 64).

    ``tl.dot`` needs every dimension >= 16.
    """
    return 16 if M <= 16 else 32 if M <= 32 else 64


def window_block_ranges(
    first: torch.Tensor, end: torch.Tensor, num_fine: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, fine block ``[b0, b0 + block)``): the windows that reach it, as ``[lo, hi)``.

    Window ``a`` of row ``n`` covers fine points ``[first[n, a], end[n, a])``. With ``first``
    and ``end`` non-decreasing along each row, the windows that reach a block (``end > b0``
    and ``first < b0 + block``) are one contiguous range of ``a``.

    Args:
        first: (N, A) integer, non-decreasing along each row.
        end: (N, A) integer, non-decreasing along each row, same dtype as ``first``.
        num_fine: B, the number of fine points.
        block: the fine block size.

    Returns:
        lo, hi: contiguous (N, ceil(B / block)) int32, ``hi >= lo``.
    """
    N = first.shape[0]
    nblk = triton.cdiv(num_fine, block)
    b0 = torch.arange(nblk, device=first.device, dtype=torch.int32) * block
    b0 = b0.expand(N, nblk).contiguous()
    # First window that ends after b0; first window that starts at or after b0 + block.
    lo = torch.searchsorted(end.contiguous(), b0, right=True).to(torch.int32)
    hi = torch.searchsorted(first.contiguous(), b0 + block, right=False).to(torch.int32)
    return lo.contiguous(), torch.maximum(hi, lo).contiguous()
