# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels of the on-the-fly banded operator: weights computed in registers.

No weight is ever stored: each program evaluates ``r(c[a] - x[b])`` of a named response (or
a table: bisection for each offset's segment, then linear interpolation) for the (coarse x
fine) tile it is about to use, from ``x (B,)`` (loaded per tile), ``c`` (one per coarse point)
and the response parameter. The windows ``[first, last)`` come from one
``searchsorted`` per call (exactly the torch path's windows). Coarse points are sorted per
row once per call so a block of consecutive coarse points has a short union window, and the
transposed band (grad f) is banded; results are put back in the caller's order.

Backward: ``grad_f`` is the transposed band with recomputed weights; ``grad_c`` and the
parameter gradient use ``dr/dd`` and ``dr/dparam`` evaluated analytically per response. Each
program owns a block of coarse points and reduces over all M inputs itself, so every
``grad_c`` is written once; the parameter gradient is written as per-coarse-point partials
and summed with torch. No atomics anywhere: results are deterministic.

Offsets ``c - x`` are formed in float64 (c and x may be large while the response is narrow)
and the response is evaluated in float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_ops import responses
from gpu_ops._triton import on_device
from gpu_ops._triton._grid import _program_3d
from gpu_ops._triton._launch import block_m, window_block_ranges


@triton.jit
def _response(d, p, RESP: tl.constexpr):
    """(r, dr/dd, dr/dp) of the named response at offsets d (float32 tiles).

    RESP is ``NamedResponse.code`` (gpu_ops.responses); the formulas are the ones there.
    """
    if RESP == 0:  # gaussian: exp(-u^2 / 2), u = d / p
        u = d / p
        r = tl.exp(-0.5 * u * u)
        return r, -u / p * r, u * u / p * r
    elif RESP == 1:  # boxcar: piecewise constant, zero derivatives almost everywhere
        r = tl.where(tl.abs(d) <= p, 1.0, 0.0)
        return r, 0.0 * d, 0.0 * d
    elif RESP == 2:  # triangle: max(0, 1 - |d| / p)
        t = 1.0 - tl.abs(d) / p
        sgn = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        on = t > 0
        return (
            tl.where(on, t, 0.0),
            tl.where(on, -sgn / p, 0.0),
            tl.where(on, tl.abs(d) / (p * p), 0.0),
        )
    elif RESP == 3:  # lorentzian: 1 / (1 + u^2)
        u = d / p
        q = 1.0 / (1.0 + u * u)
        return q, -2.0 * u * q * q / p, 2.0 * u * u * q * q / p
    elif RESP == 4:  # laplacian: exp(-|u|)
        au = tl.abs(d) / p
        r = tl.exp(-au)
        sgn = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        return r, -sgn / p * r, au / p * r
    elif RESP == 5:  # exponential (causal): exp(-u) for u >= 0
        u = d / p
        r = tl.where(u >= 0, tl.exp(-tl.maximum(u, 0.0)), 0.0)
        return r, -r / p, u / p * r
    elif RESP == 6:  # alpha (causal): u exp(1 - u) for u >= 0
        u = d / p
        e = tl.where(u >= 0, tl.exp(1.0 - tl.maximum(u, 0.0)), 0.0)
        return u * e, (1.0 - u) * e / p, -u * (1.0 - u) * e / p
    else:  # epanechnikov: max(0, 1 - u^2)
        u = d / p
        on = tl.abs(u) < 1.0
        return (
            tl.where(on, 1.0 - u * u, 0.0),
            tl.where(on, -2.0 * u / p, 0.0),
            tl.where(on, 2.0 * u * u / p, 0.0),
        )


@triton.jit
def _table(d, t_ptr, K, STEPS: tl.constexpr):
    """(r, dr/dd) of the table at ``t_ptr`` (K breakpoints, then K values, float32) at
    offsets d: the segment by STEPS >= log2(K - 1) bisection steps, linear inside it (clamped
    to it past either end: the windows decide what is inside), as the C kernels do."""
    lo = tl.zeros_like(d).to(tl.int32)  # tx[lo] <= d, or lo = 0
    hi = lo + (K - 1)  # d < tx[hi], or hi = K - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = tl.load(t_ptr + mid) <= d
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    i = tl.minimum(lo, K - 2)
    x0 = tl.load(t_ptr + i)
    x1 = tl.load(t_ptr + i + 1)
    y0 = tl.load(t_ptr + K + i)
    y1 = tl.load(t_ptr + K + i + 1)
    slope = (y1 - y0) / (x1 - x0)
    t = tl.minimum(tl.maximum((d - x0) / (x1 - x0), 0.0), 1.0)
    return y0 + (y1 - y0) * t, slope


@triton.jit
def _evaluate(d, p, t_ptr, K, RESP: tl.constexpr, STEPS: tl.constexpr):
    """(r, dr/dd, dr/dp) at offsets d: the named response ``RESP`` at parameter p, or for
    ``RESP == 8`` (gpu_ops.responses.TABLE_CODE) the table at ``t_ptr`` (no parameter)."""
    if RESP == 8:
        r, dr_dd = _table(d, t_ptr, K, STEPS)
        return r, dr_dd, 0.0 * d
    else:
        return _response(d, p, RESP)


@triton.jit
def _forward_kernel(
    f_ptr, x_ptr, c_ptr, fi_ptr, la_ptr, out_ptr, p, t_ptr, K, M, N, A, B,
    RESP: tl.constexpr, STEPS: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_U: tl.constexpr,
):  # fmt: skip
    n, ab, mb = _program_3d(N, tl.cdiv(A, BLOCK_A))
    a = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    a_ok = a < A
    m_ok = m < M
    fi = tl.load(fi_ptr + n * A + a, mask=a_ok, other=B)
    la = tl.load(la_ptr + n * A + a, mask=a_ok, other=0)
    cv = tl.load(c_ptr + n * A + a, mask=a_ok, other=0.0).to(tl.float64)
    lo = tl.min(fi, axis=0)
    hi = tl.max(la, axis=0)
    f_rows = (m.to(tl.int64) * N + n) * B
    acc = tl.zeros((BLOCK_A, BLOCK_M), dtype=tl.float32)
    for u0 in range(lo, hi, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        u_ok = u < B
        xv = tl.load(x_ptr + u, mask=u_ok, other=0.0).to(tl.float64)
        d = (cv[:, None] - xv[None, :]).to(tl.float32)
        r, _, _ = _evaluate(d, p, t_ptr, K, RESP, STEPS)
        inside = (u[None, :] >= fi[:, None]) & (u[None, :] < la[:, None])
        wt = tl.where(inside, r, 0.0)
        f_ok = u_ok[:, None] & m_ok[None, :]
        ft = tl.load(f_ptr + f_rows[None, :] + u[:, None], mask=f_ok, other=0.0).to(tl.float32)
        acc += tl.dot(wt, ft, input_precision="ieee")
    out = out_ptr + (m[None, :].to(tl.int64) * N + n) * A + a[:, None]
    tl.store(out, acc, mask=a_ok[:, None] & m_ok[None, :])


@triton.jit
def _grad_cp_kernel(
    f_ptr, g_ptr, x_ptr, c_ptr, fi_ptr, la_ptr, gc_ptr, gp_ptr, p, t_ptr, K, M, N, A, B,
    RESP: tl.constexpr, STEPS: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_U: tl.constexpr,
):  # fmt: skip
    n, ab, _ = _program_3d(N, tl.cdiv(A, BLOCK_A))
    a = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    a_ok = a < A
    fi = tl.load(fi_ptr + n * A + a, mask=a_ok, other=B)
    la = tl.load(la_ptr + n * A + a, mask=a_ok, other=0)
    cv = tl.load(c_ptr + n * A + a, mask=a_ok, other=0.0).to(tl.float64)
    lo = tl.min(fi, axis=0)
    hi = tl.max(la, axis=0)
    gc = tl.zeros((BLOCK_A,), dtype=tl.float32)
    gp = tl.zeros((BLOCK_A,), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < M
        f_rows = (m.to(tl.int64) * N + n) * B
        acc_c = tl.zeros((BLOCK_A, BLOCK_M), dtype=tl.float32)
        acc_p = tl.zeros((BLOCK_A, BLOCK_M), dtype=tl.float32)
        for u0 in range(lo, hi, BLOCK_U):
            u = u0 + tl.arange(0, BLOCK_U)
            u_ok = u < B
            xv = tl.load(x_ptr + u, mask=u_ok, other=0.0).to(tl.float64)
            d = (cv[:, None] - xv[None, :]).to(tl.float32)
            _, dr_dd, dr_dp = _evaluate(d, p, t_ptr, K, RESP, STEPS)
            inside = (u[None, :] >= fi[:, None]) & (u[None, :] < la[:, None])
            f_ok = u_ok[:, None] & m_ok[None, :]
            ft = tl.load(f_ptr + f_rows[None, :] + u[:, None], mask=f_ok, other=0.0)
            ft = ft.to(tl.float32)
            acc_c += tl.dot(tl.where(inside, dr_dd, 0.0), ft, input_precision="ieee")
            acc_p += tl.dot(tl.where(inside, dr_dp, 0.0), ft, input_precision="ieee")
        g_off = (m[None, :].to(tl.int64) * N + n) * A + a[:, None]
        gt = tl.load(g_ptr + g_off, mask=a_ok[:, None] & m_ok[None, :], other=0.0)
        gt = gt.to(tl.float32)
        gc += tl.sum(acc_c * gt, axis=1)
        gp += tl.sum(acc_p * gt, axis=1)
    tl.store(gc_ptr + n * A + a, gc, mask=a_ok)
    tl.store(gp_ptr + n * A + a, gp, mask=a_ok)


@triton.jit
def _grad_f_kernel(
    g_ptr, x_ptr, c_ptr, fi_ptr, la_ptr, alo_ptr, ahi_ptr, out_ptr, p, t_ptr, K, M, N, A, B,
    NBLK, RESP: tl.constexpr, STEPS: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr,
):  # fmt: skip
    n, k, mb = _program_3d(N, NBLK)
    b = k * BLOCK_B + tl.arange(0, BLOCK_B)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    b_ok = b < B
    m_ok = m < M
    xv = tl.load(x_ptr + b, mask=b_ok, other=0.0).to(tl.float64)
    a_lo = tl.load(alo_ptr + n * NBLK + k)
    a_hi = tl.load(ahi_ptr + n * NBLK + k)
    acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=tl.float32)
    for a0 in range(a_lo, a_hi, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        a_ok = a < a_hi
        fi = tl.load(fi_ptr + n * A + a, mask=a_ok, other=B)
        la = tl.load(la_ptr + n * A + a, mask=a_ok, other=0)
        cv = tl.load(c_ptr + n * A + a, mask=a_ok, other=0.0).to(tl.float64)
        d = (cv[None, :] - xv[:, None]).to(tl.float32)
        r, _, _ = _evaluate(d, p, t_ptr, K, RESP, STEPS)
        inside = (b[:, None] >= fi[None, :]) & (b[:, None] < la[None, :])
        wt = tl.where(inside, r, 0.0)
        g_off = (m[None, :].to(tl.int64) * N + n) * A + a[:, None]
        gt = tl.load(g_ptr + g_off, mask=a_ok[:, None] & m_ok[None, :], other=0.0)
        acc += tl.dot(wt, gt.to(tl.float32), input_precision="ieee")
    out = out_ptr + (m[None, :].to(tl.int64) * N + n) * B + b[:, None]
    tl.store(out, acc, mask=b_ok[:, None] & m_ok[None, :])


class Table(NamedTuple):
    """A response as the kernels take it: ``param``, ``code``, and for a table its
    contiguous float32 ``(2, K)`` tensor (else any float32 tensor: not read), K and the
    bisection steps (a constexpr)."""

    param: float
    code: int
    table: torch.Tensor
    K: int
    steps: int


def table_args(resp: responses.KernelResponse, device: torch.device) -> Table:
    """The kernels' arguments for ``resp`` (see :class:`Table`)."""
    if not resp.tabulated:
        return Table(resp.value, resp.code, torch.zeros(2, device=device), 0, 0)
    table = resp.param.detach().to(device=device, dtype=torch.float32).contiguous()
    K = table.shape[1]
    return Table(0.0, resp.code, table, K, max(1, math.ceil(math.log2(K - 1))) if K > 2 else 0)


class Geometry(NamedTuple):
    """Per-call geometry: coarse points sorted per row and their windows in that order."""

    x: torch.Tensor  # (B,) float64
    c: torch.Tensor  # (N, A) sorted along each row, c's dtype
    first: torch.Tensor  # (N, A) int32, window [first, last) in fine points
    last: torch.Tensor  # (N, A) int32
    order: torch.Tensor  # (N, A) int64: sorted position -> caller's position
    inverse: torch.Tensor  # (N, A) int64: caller's position -> sorted position
    resp: Table


def prepare(
    x: torch.Tensor, c: torch.Tensor, resp: responses.KernelResponse, support: float | None
) -> Geometry:
    """Sort c per row and find each window ``lo <= c - x <= hi`` with one searchsorted.

    Args:
        x: (B,) float64 fine grid.
        c: (N, A) coarse points.
        resp: the response (a named one at its parameter, or a table).
        support: its cut (None: the default; a table's are its ends).
    """
    lo, hi = resp.window(support)
    c_sorted, order = torch.sort(c.detach(), dim=1, stable=True)
    c64 = c_sorted.to(x.dtype).contiguous()
    first64, last64 = responses.bounds(x, c64, lo, hi, resp.tie_ends)
    first, last = first64.to(torch.int32), last64.to(torch.int32)
    return Geometry(
        x, c_sorted.contiguous(), first, last, order, torch.argsort(order, dim=1),
        table_args(resp, x.device),
    )  # fmt: skip


def forward(f: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """out (M, N, A) float32 in the caller's coarse order from contiguous f (M, N, B)."""
    M, N, B = f.shape
    A = geo.c.shape[1]
    out = torch.empty(M, N, A, dtype=torch.float32, device=f.device)
    BLOCK_A, BLOCK_U, BLOCK_M = 32, 64, block_m(M)
    grid = (N * triton.cdiv(A, BLOCK_A) * triton.cdiv(M, BLOCK_M),)
    with on_device(out):
        t = geo.resp
        _forward_kernel[grid](
            f, geo.x, geo.c, geo.first, geo.last, out, t.param, t.table, t.K, M, N, A, B,
            RESP=t.code, STEPS=t.steps, BLOCK_A=BLOCK_A, BLOCK_M=BLOCK_M, BLOCK_U=BLOCK_U,
        )  # fmt: skip
    return out.gather(-1, geo.inverse.expand(M, N, A))


def grad_c_param(
    f: torch.Tensor, g: torch.Tensor, geo: Geometry
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_c (N, A) in the caller's order, grad_param 0-d), float32, for g (M, N, A)."""
    M, N, B = f.shape
    A = geo.c.shape[1]
    g_sorted = g.gather(-1, geo.order.expand(M, N, A)).contiguous()
    gc = torch.empty(N, A, dtype=torch.float32, device=f.device)
    gp = torch.empty(N, A, dtype=torch.float32, device=f.device)
    BLOCK_A, BLOCK_U, BLOCK_M = 32, 64, block_m(M)
    grid = (N * triton.cdiv(A, BLOCK_A),)
    with on_device(gc):
        t = geo.resp
        _grad_cp_kernel[grid](
            f, g_sorted, geo.x, geo.c, geo.first, geo.last, gc, gp, t.param, t.table, t.K,
            M, N, A, B,
            RESP=t.code, STEPS=t.steps, BLOCK_A=BLOCK_A, BLOCK_M=BLOCK_M, BLOCK_U=BLOCK_U,
        )  # fmt: skip
    return gc.gather(1, geo.inverse), gp.double().sum().float()


def grad_f(g: torch.Tensor, geo: Geometry, B: int) -> torch.Tensor:
    """grad_f (M, N, B) float32 for g (M, N, A): the transposed band, weights recomputed."""
    M, N, A = g.shape
    g_sorted = g.gather(-1, geo.order.expand(M, N, A)).contiguous()
    BLOCK_B, BLOCK_A, BLOCK_M = 64, 32, block_m(M)
    # Sorted c: first and last are non-decreasing, so the windows reaching a fine block are
    # one contiguous range [lo, hi).
    lo, hi = window_block_ranges(geo.first, geo.last, B, BLOCK_B)
    nblk = lo.shape[1]
    out = torch.empty(M, N, B, dtype=torch.float32, device=g.device)
    grid = (N * nblk * triton.cdiv(M, BLOCK_M),)
    with on_device(out):
        t = geo.resp
        _grad_f_kernel[grid](
            g_sorted, geo.x, geo.c, geo.first, geo.last, lo, hi, out,
            t.param, t.table, t.K, M, N, A, B, nblk,
            RESP=t.code, STEPS=t.steps, BLOCK_B=BLOCK_B, BLOCK_M=BLOCK_M, BLOCK_A=BLOCK_A,
        )  # fmt: skip
    return out
