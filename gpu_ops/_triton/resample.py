# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels of the banded operator (see ``gpu_ops/resample.py``).

Each forward program takes one function ``n``, a block of consecutive coarse points and a
block of the M inputs. It walks the union of the block's windows once, in tiles of fine
points: each f tile (fine points x inputs) is loaded once and shared by all coarse points of
the block; each weight is loaded once (the tile is the band's dense (coarse x fine) patch,
with zeros where a window does not reach) and all M inputs accumulate in one ``tl.dot``.

The backward with respect to f is the transposed band: a program per block of fine points
sums over the coarse points whose windows overlap it. With sorted starts that is a
contiguous range of coarse points (computed by the launcher with ``searchsorted``); every
output is written by one program, so there are no atomics and the result is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_ops._triton import on_device
from gpu_ops._triton._grid import _program_3d
from gpu_ops._triton._launch import block_m, window_block_ranges


@triton.jit
def _forward_kernel(
    f_ptr, w_ptr, s_ptr, out_ptr, M, N, A, B, W,
    BLOCK_A: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_U: tl.constexpr,
):  # fmt: skip
    n, ab, mb = _program_3d(N, tl.cdiv(A, BLOCK_A))
    a = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    a_ok = a < A
    m_ok = m < M
    s = tl.load(s_ptr + n * A + a, mask=a_ok, other=0)
    lo = tl.min(tl.where(a_ok, s, B), axis=0)
    hi = tl.max(tl.where(a_ok, s + W, 0), axis=0)
    rows = (n * A + a).to(tl.int64) * W
    f_rows = (m.to(tl.int64) * N + n) * B
    acc = tl.zeros((BLOCK_A, BLOCK_M), dtype=tl.float32)
    for u0 in range(lo, hi, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        j = u[None, :] - s[:, None]
        w_ok = a_ok[:, None] & (j >= 0) & (j < W)
        wt = tl.load(w_ptr + rows[:, None] + j, mask=w_ok, other=0.0).to(tl.float32)
        f_ok = (u[:, None] < B) & m_ok[None, :]
        ft = tl.load(f_ptr + f_rows[None, :] + u[:, None], mask=f_ok, other=0.0).to(tl.float32)
        acc += tl.dot(wt, ft, input_precision="ieee")
    out = out_ptr + (m[None, :].to(tl.int64) * N + n) * A + a[:, None]
    tl.store(out, acc, mask=a_ok[:, None] & m_ok[None, :])


@triton.jit
def _backward_f_kernel(
    g_ptr, w_ptr, s_ptr, alo_ptr, ahi_ptr, out_ptr, M, N, A, B, W, NBLK,
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr,
):  # fmt: skip
    n, k, mb = _program_3d(N, NBLK)
    b = k * BLOCK_B + tl.arange(0, BLOCK_B)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    a_lo = tl.load(alo_ptr + n * NBLK + k)
    a_hi = tl.load(ahi_ptr + n * NBLK + k)
    acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=tl.float32)
    for a0 in range(a_lo, a_hi, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        a_ok = a < a_hi
        s = tl.load(s_ptr + n * A + a, mask=a_ok, other=0)
        j = b[:, None] - s[None, :]
        w_ok = a_ok[None, :] & (j >= 0) & (j < W)
        rows = (n * A + a).to(tl.int64) * W
        wt = tl.load(w_ptr + rows[None, :] + j, mask=w_ok, other=0.0).to(tl.float32)
        g_off = (m[None, :].to(tl.int64) * N + n) * A + a[:, None]
        gt = tl.load(g_ptr + g_off, mask=a_ok[:, None] & m_ok[None, :], other=0.0)
        acc += tl.dot(wt, gt.to(tl.float32), input_precision="ieee")
    out = out_ptr + (m[None, :].to(tl.int64) * N + n) * B + b[:, None]
    tl.store(out, acc, mask=(b[:, None] < B) & m_ok[None, :])


@triton.jit
def _backward_w_kernel(
    g_ptr, f_ptr, s_ptr, out_ptr, M, N, A, B, W,
    BLOCK_A: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    n, ab, jb = _program_3d(N, tl.cdiv(A, BLOCK_A))
    a = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    j = jb * BLOCK_W + tl.arange(0, BLOCK_W)
    a_ok = a < A
    j_ok = j < W
    s = tl.load(s_ptr + n * A + a, mask=a_ok, other=0)
    acc = tl.zeros((BLOCK_A, BLOCK_W), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < M
        g_off = (m[None, :].to(tl.int64) * N + n) * A + a[:, None]
        gt = tl.load(g_ptr + g_off, mask=a_ok[:, None] & m_ok[None, :], other=0.0)
        f_off = (m[None, :, None].to(tl.int64) * N + n) * B + s[:, None, None] + j[None, None, :]
        f_ok = a_ok[:, None, None] & m_ok[None, :, None] & j_ok[None, None, :]
        ft = tl.load(f_ptr + f_off, mask=f_ok, other=0.0).to(tl.float32)
        acc += tl.sum(gt.to(tl.float32)[:, :, None] * ft, axis=1)
    out = out_ptr + (n * A + a[:, None]).to(tl.int64) * W + j[None, :]
    tl.store(out, acc, mask=a_ok[:, None] & j_ok[None, :])


def forward(f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out (M, N, A) float32 from contiguous f (M, N, B), starts (N, A), weights (N, A, W)."""
    M, N, B = f.shape
    _, A, W = weights.shape
    out = torch.empty(M, N, A, dtype=torch.float32, device=f.device)
    BLOCK_A, BLOCK_U, BLOCK_M = 32, 64, block_m(M)
    grid = (N * triton.cdiv(A, BLOCK_A) * triton.cdiv(M, BLOCK_M),)
    with on_device(out):
        _forward_kernel[grid](
            f, weights, starts, out, M, N, A, B, W,
            BLOCK_A=BLOCK_A, BLOCK_M=BLOCK_M, BLOCK_U=BLOCK_U,
        )  # fmt: skip
    return out


def coarse_ranges(
    starts: torch.Tensor, W: int, B: int, block: int, sorted_starts: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (function, fine block): the coarse points [lo, hi) whose windows can reach it.

    With starts sorted along each row, those are contiguous; otherwise all A are scanned.
    """
    N, A = starts.shape
    if not sorted_starts:
        lo = torch.zeros(N, triton.cdiv(B, block), dtype=torch.int32, device=starts.device)
        return lo, torch.full_like(lo, A)
    return window_block_ranges(starts, starts + W, B, block)


def backward_f(
    g: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor, B: int, sorted_starts: bool
) -> torch.Tensor:
    """grad_f (M, N, B) float32 from contiguous g (M, N, A): the transposed band."""
    M, N, A = g.shape
    W = weights.shape[-1]
    BLOCK_B, BLOCK_A, BLOCK_M = 64, 32, block_m(M)
    lo, hi = coarse_ranges(starts, W, B, BLOCK_B, sorted_starts)
    out = torch.empty(M, N, B, dtype=torch.float32, device=g.device)
    grid = (N * lo.shape[1] * triton.cdiv(M, BLOCK_M),)
    with on_device(out):
        _backward_f_kernel[grid](
            g, weights, starts, lo, hi, out, M, N, A, B, W, lo.shape[1],
            BLOCK_B=BLOCK_B, BLOCK_M=BLOCK_M, BLOCK_A=BLOCK_A,
        )  # fmt: skip
    return out


def backward_w(g: torch.Tensor, f: torch.Tensor, starts: torch.Tensor, W: int) -> torch.Tensor:
    """grad_w (N, A, W) float32 from contiguous g (M, N, A) and f (M, N, B)."""
    M, N, B = f.shape
    A = g.shape[-1]
    out = torch.empty(N, A, W, dtype=torch.float32, device=f.device)
    BLOCK_A, BLOCK_W, BLOCK_M = 16, 64, 4
    grid = (N * triton.cdiv(A, BLOCK_A) * triton.cdiv(W, BLOCK_W),)
    with on_device(out):
        _backward_w_kernel[grid](
            g, f, starts, out, M, N, A, B, W, BLOCK_A=BLOCK_A, BLOCK_W=BLOCK_W, BLOCK_M=BLOCK_M
        )
    return out
