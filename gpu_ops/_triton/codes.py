# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels of the code ops (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

decode: one program per (row, block of elements): each element loads its byte (neighbours
share the cache line), shifts and masks, looks its code up in the table and, for a missing
code, its own missing value, and stores in the output dtype.

score: one program per block of rows, looping over the byte positions: per position one
byte per row and a gather of S table entries, accumulated in registers in the table's
dtype; the (rows, elements) values are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_ops._triton import on_device

_BLOCK_J = 1024
_BLOCK_N = 64


@triton.jit(do_not_specialize=["nb", "count", "big", "mstride"])
def _decode_kernel(
    x_ptr, out_ptr, table_ptr, miss_ptr, nb, count, big, mstride,
    BITS: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    ok = j < count
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(x_ptr + row * nb + j // PER, mask=ok, other=0).to(tl.int32)
    c = j % PER
    shift = tl.where(big != 0, 8 - BITS * (c + 1), BITS * c)
    code = (byte >> shift) & ((1 << BITS) - 1)
    v = tl.load(table_ptr + code, mask=ok, other=0.0)
    m = tl.load(miss_ptr + j * mstride, mask=ok & (v != v), other=0.0)
    v = tl.where(v != v, m, v)
    tl.store(out_ptr + row * count + j, v.to(out_ptr.dtype.element_ty), mask=ok)


def decode(
    x: torch.Tensor,
    code_bits: int,
    count: int,
    table: torch.Tensor,
    bitorder: str,
    missing: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """x (..., nb) uint8 -> ``dtype`` (..., count); as ``torch.ops.bitserve.decode_codes``."""
    xc = x.contiguous()
    nb = xc.shape[-1]
    out = torch.empty((*x.shape[:-1], count), dtype=dtype, device=x.device)
    rows = out.numel() // count if count else 0
    if rows == 0:
        return out
    # float64 values for a float64 result (means keep their digits), float32 otherwise.
    vdtype = torch.float64 if dtype == torch.float64 else torch.float32
    tab = table.to(device=x.device, dtype=vdtype).contiguous()
    miss = missing.to(device=x.device, dtype=vdtype).contiguous()
    grid = (rows, triton.cdiv(count, _BLOCK_J))
    with on_device(x):
        _decode_kernel[grid](
            xc, out, tab, miss, nb, count, int(bitorder == "big"),
            int(miss.numel() > 1), BITS=code_bits, BLOCK_J=_BLOCK_J,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n", "nb", "xrs"])
def _score_kernel(
    x_ptr, lut_ptr, out_ptr, n, nb, xrs, S: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    r_ok = r < n
    s_ok = s < S
    rows = r.to(tl.int64) * xrs
    acc = tl.zeros((BLOCK_N, BLOCK_S), dtype=lut_ptr.dtype.element_ty)
    for p in range(0, nb):
        byte = tl.load(x_ptr + rows + p, mask=r_ok, other=0).to(tl.int64)
        at = (p * 256 + byte) * S
        acc += tl.load(lut_ptr + at[:, None] + s[None, :], mask=r_ok[:, None] & s_ok[None, :],
                       other=0.0)  # fmt: skip
    tl.store(out_ptr + r[:, None] * S + s[None, :], acc, mask=r_ok[:, None] & s_ok[None, :])


def score(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """x (N, nb) uint8, lut (nb, 256, S) -> (N, S) in lut's dtype (``score_codes``)."""
    n, nb = x.shape
    S = lut.shape[-1]
    out = torch.zeros((n, S), dtype=lut.dtype, device=x.device)
    if n == 0 or nb == 0 or S == 0:
        return out
    xc = x if x.stride(-1) == 1 else x.contiguous()
    xrs = xc.stride(0) if n > 1 else nb
    with on_device(x):
        _score_kernel[(triton.cdiv(n, _BLOCK_N),)](
            xc, lut.contiguous(), out, n, nb, xrs, S=S, BLOCK_S=triton.next_power_of_2(S),
            BLOCK_N=_BLOCK_N,
        )  # fmt: skip
    return out
