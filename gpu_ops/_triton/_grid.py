# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Program-id helpers shared by the Triton kernels (bits, resample, on-the-fly resample)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program_3d(N, n1):
    """(n, i1, i2) of this program in a 1-D grid of N * n1 * n2 programs, n varying fastest.

    One flat grid axis: CUDA caps grid axes 1 and 2 at 65535 blocks, which a long A or B
    would exceed; the order of the programs is that of the old (N, n1, n2) grid.
    """
    pid = tl.program_id(0)
    rest = pid // N
    return pid % N, rest % n1, rest // n1
