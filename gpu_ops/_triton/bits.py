# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton.jit is untyped, and kernel arguments are untyped by convention)
"""Fused Triton kernels for bit unpacking and packing (CUDA; CPU tensors under the interpreter).

Both directions see their tensors as (n_outer, K, n_inner): outer rows, K bytes (8K bits)
along the packed dim, inner elements, each with its own strides, so strided inputs and
``out`` slices are read and written in place. When the packed dim is the last one, the outer
rows play the part of the inner dim, so a program covers several short rows at once.

One program handles a [BLOCK_K, 8, BLOCK_I] tile: it loads the bytes once, shifts and masks
in registers, converts to the output dtype and stores the whole tile. Unit strides are passed
as constexprs so the compiler can prove contiguity and vectorise (16-byte stores along the
bit axis or the inner axis, checked in the sm_90 PTX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_ops._triton import on_device
from gpu_ops._triton._grid import _program_3d

# Packed bytes per program: 8192 output elements, 32 KiB of float32 stores.
_TILE_BYTES = 1024


@triton.jit
def _offsets(base, k_or_pos, stride_b, i64, stride_i, UNIT_B: tl.constexpr, UNIT_I: tl.constexpr):
    """base + k_or_pos * stride_b + i * stride_i, with unit strides known to the compiler.

    A stride that is a literal 1 lets the compiler prove contiguity and emit vector
    loads/stores along that axis.
    """
    along_b = k_or_pos if UNIT_B else k_or_pos * stride_b
    along_i = i64 if UNIT_I else i64 * stride_i
    return base + along_b + along_i


# Sizes that only bound loads or the tail, and the bit-order flag, are not specialised
# (Triton would otherwise compile a variant per divisibility-by-16 pattern of each); strides
# and the sizes that mask the stores are, since they decide whether stores are vectorised.
@triton.jit(do_not_specialize=["n_bytes", "count", "n_kb", "n_ib", "big"])
def _unpack_kernel(
    x_ptr,
    out_ptr,
    n_bytes,
    count,
    n_inner,
    n_kb,
    n_ib,
    sxo,
    sxk,
    sxi,
    soo,
    sob,
    soi,
    big,
    FLOAT_OUT: tl.constexpr,
    X_UNIT_B: tl.constexpr,
    X_UNIT_I: tl.constexpr,
    OUT_UNIT_B: tl.constexpr,
    OUT_UNIT_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # One flat grid: CUDA caps grid dims 1 and 2 at 65535, dim 0 at 2**31 - 1.
    ib, kb, o = _program_3d(n_ib, n_kb)
    o = o.to(tl.int64)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.arange(0, 8)
    k64 = k.to(tl.int64)
    i64 = i.to(tl.int64)
    i_ok = i[None, :] < n_inner
    # Bytes past n_bytes read as 0: they are the zero padding when count > 8n.
    x_offs = _offsets(o * sxo, k64[:, None], sxk, i64[None, :], sxi, X_UNIT_B, X_UNIT_I)
    byte = tl.load(x_ptr + x_offs, mask=(k[:, None] < n_bytes) & i_ok, other=0).to(tl.int32)
    shift = tl.where(big != 0, 7 - j, j)
    bits = (byte[:, None, :] >> shift[None, :, None]) & 1  # [BLOCK_K, 8, BLOCK_I]
    if FLOAT_OUT:
        # Through float32: exact for 0/1, and the interpreter casts ints to bfloat16 wrongly.
        values = bits.to(tl.float32).to(out_ptr.dtype.element_ty)
    else:
        values = bits.to(out_ptr.dtype.element_ty)
    pos = k64[:, None, None] * 8 + j[None, :, None]  # the bit's index along the dim
    out_offs = _offsets(o * soo, pos, sob, i64[None, None, :], soi, OUT_UNIT_B, OUT_UNIT_I)
    i_ok3 = i[None, None, :] < n_inner
    # Whole bytes: a mask that is constant over each byte's 8 bits keeps the stores vectorised.
    full = count // 8
    tl.store(out_ptr + out_offs, values, mask=(k[:, None, None] < full) & i_ok3)
    # The first count % 8 bits of byte `full`, written only by the program that holds it.
    if (count > full * 8) & (full >= kb * BLOCK_K) & (full < kb * BLOCK_K + BLOCK_K):
        tail = (k[:, None, None] == full) & (pos < count) & i_ok3
        tl.store(out_ptr + out_offs, values, mask=tail)


@triton.jit(do_not_specialize=["n", "n_kb", "n_ib", "big"])
def _pack_kernel(
    x_ptr,
    out_ptr,
    n,
    n_bytes,
    n_inner,
    n_kb,
    n_ib,
    sxo,
    sxb,
    sxi,
    soo,
    sok,
    soi,
    big,
    FLOAT_OUT: tl.constexpr,
    X_UNIT_B: tl.constexpr,
    X_UNIT_I: tl.constexpr,
    OUT_UNIT_B: tl.constexpr,
    OUT_UNIT_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    ib, kb, o = _program_3d(n_ib, n_kb)
    o = o.to(tl.int64)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.arange(0, 8)
    k64 = k.to(tl.int64)
    i64 = i.to(tl.int64)
    pos = k64[:, None, None] * 8 + j[None, :, None]
    x_offs = _offsets(o * sxo, pos, sxb, i64[None, None, :], sxi, X_UNIT_B, X_UNIT_I)
    i_ok3 = i[None, None, :] < n_inner
    # Whole groups of 8 with a per-byte mask (vector loads), then the partial last group.
    full = n // 8
    v = tl.load(x_ptr + x_offs, mask=(k[:, None, None] < full) & i_ok3, other=0)
    if (n > full * 8) & (full >= kb * BLOCK_K) & (full < kb * BLOCK_K + BLOCK_K):
        tail = (k[:, None, None] == full) & (pos < n) & i_ok3
        v += tl.load(x_ptr + x_offs, mask=tail, other=0)  # elements past n stay 0: padding
    shift = tl.where(big != 0, 7 - j, j)
    weighted = (v != 0).to(tl.int32) << shift[None, :, None]
    byte = tl.sum(weighted, axis=1)  # [BLOCK_K, BLOCK_I]
    out_offs = _offsets(o * soo, k64[:, None], sok, i64[None, :], soi, OUT_UNIT_B, OUT_UNIT_I)
    mask = (k[:, None] < n_bytes) & (i[None, :] < n_inner)
    tl.store(out_ptr + out_offs, byte.to(tl.uint8), mask=mask)


_Dim = tuple[int, int, int]  # (size, stride in x, stride in out)


def _collapse(dims: list[_Dim]) -> list[_Dim]:
    """Merge adjacent dims that are contiguous with each other in both tensors."""
    merged: list[_Dim] = []
    for size, sx, so in dims:
        if size == 1:
            continue
        if merged:
            psize, psx, pso = merged[-1]
            if psx == sx * size and pso == so * size:
                merged[-1] = (psize * size, sx, so)
                continue
        merged.append((size, sx, so))
    return merged


def _plan(x: torch.Tensor, out: torch.Tensor, dim: int) -> tuple[_Dim, _Dim] | None:
    """The outer and inner dims of the (n_outer, K, n_inner) view; None if it needs more."""
    outer = _collapse([(x.shape[a], x.stride(a), out.stride(a)) for a in range(dim)])
    inner = _collapse([(x.shape[a], x.stride(a), out.stride(a)) for a in range(dim + 1, x.dim())])
    one: _Dim = (1, 0, 0)
    if not inner and len(outer) <= 2:  # rows of the last dim: the row dim becomes n_inner
        return (outer[0] if len(outer) == 2 else one), (outer[-1] if outer else one)
    if len(inner) == 1 and len(outer) <= 1:
        return (outer[0] if outer else one), inner[0]
    return None


# (BLOCK_K, BLOCK_I) tiles of _TILE_BYTES packed bytes, by the length of the axis that is
# contiguous in memory. A short menu keeps the number of compiled variants small.
_TILES_BITS_CONTIGUOUS = ((256, (1024, 1)), (64, (128, 8)), (16, (32, 32)), (0, (16, 64)))
_TILES_INNER_CONTIGUOUS = ((256, (4, 256)), (64, (8, 128)), (16, (32, 32)), (0, (64, 16)))


def _blocks(bits_contiguous: bool, K: int, n_inner: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_I): long runs along the contiguous axis, short rows several per tile."""
    if bits_contiguous:
        return next(tile for limit, tile in _TILES_BITS_CONTIGUOUS if limit < K)
    return next(tile for limit, tile in _TILES_INNER_CONTIGUOUS if limit < n_inner)


def _run(
    kernel: triton.JITFunction,
    x: torch.Tensor,
    out: torch.Tensor,
    dim: int,
    bitorder: str,
    n_in: int,
    n_out: int,
    K: int,
    bits_stride: int,
) -> None:
    plan = _plan(x, out, dim)
    if plan is None:
        x = x.contiguous()
        plan = _plan(x, out, dim)
    if plan is None:  # ``out`` has a layout of more dims than the kernel takes
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        _run(kernel, x, tmp, dim, bitorder, n_in, n_out, K, tmp.stride(dim))
        out.copy_(tmp)
        return
    (n_outer, sxo, soo), (n_inner, sxi, soi) = plan
    block_k, block_i = _blocks(bits_stride == 1, K, n_inner)
    n_kb, n_ib = triton.cdiv(K, block_k), triton.cdiv(n_inner, block_i)
    grid = (n_outer * n_kb * n_ib,)
    with on_device(x):
        kernel[grid](
            x,
            out,
            n_in,
            n_out,
            n_inner,
            n_kb,
            n_ib,
            sxo,
            x.stride(dim),
            sxi,
            soo,
            out.stride(dim),
            soi,
            int(bitorder == "big"),
            FLOAT_OUT=out.dtype.is_floating_point,
            X_UNIT_B=x.stride(dim) == 1,
            X_UNIT_I=sxi == 1,
            OUT_UNIT_B=out.stride(dim) == 1,
            OUT_UNIT_I=soi == 1,
            BLOCK_K=block_k,
            BLOCK_I=block_i,
            num_warps=8,  # 8192 outputs per tile: 32 per thread
        )


def unpack_into(x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str) -> None:
    """Unpack the bytes of ``x`` along ``dim`` into ``out`` with one kernel launch.

    Args:
        x: (..., n, ...) uint8, ``dim`` a non-negative axis of it.
        out: ``x``'s shape with ``count`` along ``dim``; uint8 (a bool result viewed as
            uint8), float16, bfloat16, float32 or float64; any strides without overlap.
            Bits past 8n are written as zeros.
        dim: the packed axis.
        bitorder: "big" or "little".
    """
    count = out.shape[dim]
    if out.numel() == 0:
        return
    K = triton.cdiv(count, 8)  # output bytes' worth of bits to write
    _run(_unpack_kernel, x, out, dim, bitorder, x.shape[dim], count, K, out.stride(dim))


def pack_into(x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str) -> None:
    """Pack the nonzero elements of ``x`` along ``dim`` into ``out`` with one kernel launch.

    Args:
        x: (..., n, ...) integer (a bool input viewed as uint8), ``dim`` a non-negative axis.
        out: uint8, ``x``'s shape with ceil(n / 8) along ``dim``.
        dim: the axis to pack.
        bitorder: "big" or "little".
    """
    if out.numel() == 0:
        return
    n_bytes = out.shape[dim]
    _run(_pack_kernel, x, out, dim, bitorder, x.shape[dim], n_bytes, n_bytes, out.stride(dim))
