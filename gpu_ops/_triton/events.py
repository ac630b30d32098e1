# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels of the resamplers' bit-input paths (event scatter, prefix sums).

Both start from the row's events: :func:`compact` lists the set bits of each packed row in
increasing order (``events (R, E)`` int32, padded with B), one program per block of bytes,
each bit's slot from the per-byte popcounts' running sum (torch ``cumsum``).

- Event scatter: one program per (row, block of coarse points). Coarse points are sorted per
  row, so the block's windows together span one range of fine points, and the events inside
  it one range of the event list (found by ``searchsorted``); the program walks those events
  only, a tile of (coarse points x events) at a time, so its cost follows the events, not the
  window's width. Each output is written once: no atomics, deterministic.
- Prefix sums: running sums over each row's events of ``(x - mid)^j``, j <= 2, in float64
  (torch ``cumsum``); one program per (row, block of coarse points) takes, per polynomial
  piece, the difference of the sums at the piece's two ends (event indices by
  ``searchsorted``) and expands ``sum (c - x)^j`` from them.

Offsets ``c - x`` are formed in float64 and the responses (named, or a table) evaluated in
float32, as the on-the-fly kernels do (:func:`gpu_ops._triton.resample_otf._evaluate`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_ops import _events_torch, responses
from gpu_ops._triton import on_device
from gpu_ops._triton.resample_otf import _evaluate, table_args


@triton.jit
def _popcount8(v):
    v = v - ((v >> 1) & 0x55)
    v = (v & 0x33) + ((v >> 2) & 0x33)
    return (v + (v >> 4)) & 0x0F


@triton.jit
def _counts_kernel(p_ptr, out_ptr, nbytes, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for k0 in range(0, nbytes, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(p_ptr + r * nbytes + k, mask=k < nbytes, other=0).to(tl.int32)
        acc += _popcount8(v)
    tl.store(out_ptr + r, tl.sum(acc, axis=0).to(tl.int64))


def bit_counts(packed: torch.Tensor) -> torch.Tensor:
    """Set bits per row of contiguous ``packed (R, nbytes)`` uint8: int64 ``(R,)``."""
    R, nbytes = packed.shape
    out = torch.zeros(R, dtype=torch.int64, device=packed.device)
    if R and nbytes:
        with on_device(out):
            _counts_kernel[(R,)](packed, out, nbytes, BLOCK=1024)
    return out


@triton.jit
def _compact_kernel(p_ptr, off_ptr, ev_ptr, nbytes, E, B, BIG: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k_ok = k < nbytes
    v = tl.load(p_ptr + r * nbytes + k, mask=k_ok, other=0).to(tl.int32)
    start = tl.load(off_ptr + r * nbytes + k, mask=k_ok, other=0)  # events before byte k
    j = tl.arange(0, 8)
    shift = 7 - j if BIG else j
    bit = (v[:, None] >> shift[None, :]) & 1  # [BLOCK, 8], bit j of byte k is fine point 8k + j
    rank = tl.cumsum(bit, axis=1) - bit  # set bits before j in the byte
    pos = k[:, None] * 8 + j[None, :]
    keep = (bit != 0) & (pos < B) & k_ok[:, None]
    tl.store(ev_ptr + r * E + start[:, None] + rank, pos, mask=keep)


def compact(packed: torch.Tensor, B: int, big: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The events of each row of ``packed (R, nbytes)``: ``(events (R, E) int32, counts (R,))``.

    ``events[r, :counts[r]]`` are row r's set bits below B, increasing; the rest is B.
    """
    R, nbytes = packed.shape
    per_byte = _events_torch.bit_counts(packed[..., None]).to(torch.int32)  # (R, nbytes)
    if B % 8:  # bits past B in the last byte are not events
        last = packed[:, -1].to(torch.int32)
        keep = (0xFF << (8 - B % 8)) & 0xFF if big else (1 << (B % 8)) - 1
        per_byte[:, -1] = _events_torch.bit_counts((last & keep).to(torch.uint8)[:, None])
    ends = torch.cumsum(per_byte, dim=1, dtype=torch.int32)
    counts = ends[:, -1].to(torch.int64) if nbytes else per_byte.new_zeros(R, dtype=torch.int64)
    E = max(1, int(counts.max())) if R else 1
    events = torch.full((R, E), B, dtype=torch.int32, device=packed.device)
    if R and nbytes:
        BLOCK = 128
        with on_device(events):
            _compact_kernel[(R, triton.cdiv(nbytes, BLOCK))](
                packed, (ends - per_byte).contiguous(), events, nbytes, E, B,
                BIG=big, BLOCK=BLOCK,
            )  # fmt: skip
    return events, counts


def _event_ranges(
    events: torch.Tensor, first: torch.Tensor, last: torch.Tensor, N: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, coarse block): the events ``[lo, hi)`` inside the block's union window.

    ``first``/``last`` (N, A) are the windows' fine bounds, non-decreasing along each row.
    """
    R = events.shape[0]
    A = first.shape[1]
    a0 = torch.arange(0, A, block, device=first.device)
    a1 = (a0 + block).clamp(max=A) - 1
    lo_b = first[:, a0].repeat(R // N, 1).contiguous()  # (R, nblk)
    hi_b = last[:, a1].repeat(R // N, 1).contiguous()
    lo = torch.searchsorted(events, lo_b.to(torch.int32), side="left").to(torch.int32)
    hi = torch.searchsorted(events, hi_b.to(torch.int32), side="left").to(torch.int32)
    return lo.contiguous(), torch.maximum(lo, hi).contiguous()


@triton.jit
def _events_otf_kernel(
    ev_ptr, elo_ptr, ehi_ptr, x_ptr, c_ptr, fi_ptr, la_ptr, out_ptr, p, t_ptr, K, N, A, E, NBLK,
    RESP: tl.constexpr, STEPS: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    ab = tl.program_id(1)
    n = r % N
    a = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    a_ok = a < A
    fi = tl.load(fi_ptr + n * A + a, mask=a_ok, other=0)
    la = tl.load(la_ptr + n * A + a, mask=a_ok, other=0)
    cv = tl.load(c_ptr + n * A + a, mask=a_ok, other=0.0).to(tl.float64)
    e_lo = tl.load(elo_ptr + r * NBLK + ab)
    e_hi = tl.load(ehi_ptr + r * NBLK + ab)
    acc = tl.zeros((BLOCK_A,), dtype=tl.float32)
    for e0 in range(e_lo, e_hi, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_ok = e < e_hi
        pos = tl.load(ev_ptr + r.to(tl.int64) * E + e, mask=e_ok, other=0)
        xv = tl.load(x_ptr + pos, mask=e_ok, other=0.0).to(tl.float64)
        d = (cv[:, None] - xv[None, :]).to(tl.float32)
        w, _, _ = _evaluate(d, p, t_ptr, K, RESP, STEPS)
        inside = (pos[None, :] >= fi[:, None]) & (pos[None, :] < la[:, None]) & e_ok[None, :]
        acc += tl.sum(tl.where(inside, w, 0.0), axis=1)
    tl.store(out_ptr + r.to(tl.int64) * A + a, acc, mask=a_ok)


@triton.jit
def _events_band_kernel(
    ev_ptr, elo_ptr, ehi_ptr, s_ptr, w_ptr, out_ptr, N, A, W, E, NBLK,
    BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    ab = tl.program_id(1)
    n = r % N
    a = ab * BLOCK_A + tl.arange(0, BLOCK_A)
    a_ok = a < A
    s = tl.load(s_ptr + n * A + a, mask=a_ok, other=0)
    e_lo = tl.load(elo_ptr + r * NBLK + ab)
    e_hi = tl.load(ehi_ptr + r * NBLK + ab)
    rows = (n * A + a).to(tl.int64) * W
    acc = tl.zeros((BLOCK_A,), dtype=tl.float32)
    for e0 in range(e_lo, e_hi, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_ok = e < e_hi
        pos = tl.load(ev_ptr + r.to(tl.int64) * E + e, mask=e_ok, other=0)
        j = pos[None, :] - s[:, None]
        inside = (j >= 0) & (j < W) & e_ok[None, :] & a_ok[:, None]
        w = tl.load(w_ptr + rows[:, None] + j, mask=inside, other=0.0).to(tl.float32)
        acc += tl.sum(w, axis=1)
    tl.store(out_ptr + r.to(tl.int64) * A + a, acc, mask=a_ok)


_BLOCK_A, _BLOCK_E = 32, 32


def events_band(
    packed: torch.Tensor, big: bool, starts: torch.Tensor, weights: torch.Tensor, B: int
) -> torch.Tensor:
    """out (M, N, A) float32: the stored band on the events of ``packed (M, N, nbytes)``.

    ``starts (N, A)`` int32 non-decreasing per row, ``weights (N, A, W)`` contiguous.
    """
    M, N, nbytes = packed.shape
    _, A, W = weights.shape
    events, _ = compact(packed.reshape(M * N, nbytes), B, big)
    first = starts.to(torch.int64)
    lo, hi = _event_ranges(events, first, first + W, N, _BLOCK_A)
    out = torch.empty(M, N, A, dtype=torch.float32, device=packed.device)
    grid = (M * N, lo.shape[1])
    with on_device(out):
        _events_band_kernel[grid](
            events, lo, hi, starts, weights, out, N, A, W, events.shape[1], lo.shape[1],
            BLOCK_A=_BLOCK_A, BLOCK_E=_BLOCK_E,
        )  # fmt: skip
    return out


def events_otf(
    packed: torch.Tensor, big: bool, x: torch.Tensor, c: torch.Tensor, first: torch.Tensor,
    last: torch.Tensor, resp: responses.KernelResponse,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A) float32: the response ``resp`` (named, or a table) on the events of
    ``packed (M, N, nbytes)``, at c (N, A) float64 sorted along each row, windows
    ``[first, last)``."""
    M, N, nbytes = packed.shape
    A = c.shape[1]
    events, _ = compact(packed.reshape(M * N, nbytes), x.numel(), big)
    e_lo, e_hi = _event_ranges(events, first, last, N, _BLOCK_A)
    out = torch.empty(M, N, A, dtype=torch.float32, device=packed.device)
    grid = (M * N, e_lo.shape[1])
    t = table_args(resp, packed.device)
    with on_device(out):
        _events_otf_kernel[grid](
            events, e_lo, e_hi, x, c.contiguous(), first.contiguous(), last.contiguous(), out,
            t.param, t.table, t.K, N, A, events.shape[1], e_lo.shape[1],
            RESP=t.code, STEPS=t.steps, BLOCK_A=_BLOCK_A, BLOCK_E=_BLOCK_E,
        )  # fmt: skip
    return out


@triton.jit
def _prefix_kernel(
    s0_ptr, s1_ptr, s2_ptr, eb_ptr, c_ptr, coef_ptr, out_ptr, N, A, E1, R, P,
    BLOCK_A: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    a = tl.program_id(1) * BLOCK_A + tl.arange(0, BLOCK_A)
    a_ok = a < A
    n = r % N
    cr = tl.load(c_ptr + n * A + a, mask=a_ok, other=0.0)
    row = r.to(tl.int64) * E1
    acc = tl.zeros((BLOCK_A,), dtype=tl.float64)
    for k in range(P):
        hi = tl.load(eb_ptr + (k * R + r).to(tl.int64) * A + a, mask=a_ok, other=0)
        lo = tl.load(eb_ptr + ((k + 1) * R + r).to(tl.int64) * A + a, mask=a_ok, other=0)
        t0 = tl.load(s0_ptr + row + hi, mask=a_ok, other=0.0)
        t0 -= tl.load(s0_ptr + row + lo, mask=a_ok, other=0.0)
        t1 = tl.load(s1_ptr + row + hi, mask=a_ok, other=0.0)
        t1 -= tl.load(s1_ptr + row + lo, mask=a_ok, other=0.0)
        t2 = tl.load(s2_ptr + row + hi, mask=a_ok, other=0.0)
        t2 -= tl.load(s2_ptr + row + lo, mask=a_ok, other=0.0)
        q0 = tl.load(coef_ptr + k * 3)
        q1 = tl.load(coef_ptr + k * 3 + 1)
        q2 = tl.load(coef_ptr + k * 3 + 2)
        m1 = cr * t0 - t1  # sum (c - x)
        m2 = cr * cr * t0 - 2.0 * cr * t1 + t2  # sum (c - x)^2
        acc += q0 * t0 + q1 * m1 + q2 * m2
    tl.store(out_ptr + r.to(tl.int64) * A + a, acc.to(tl.float32), mask=a_ok)


def prefix(
    packed: torch.Tensor, big: bool, x: torch.Tensor, c: torch.Tensor, bounds: torch.Tensor,
    coef: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A) float32 of a piecewise polynomial response on the events of ``packed
    (M, N, nbytes)``: c (N, A) float64, the pieces' fine ``bounds (P + 1, N, A)`` and
    ``coef (P, 3)`` float64 (see :func:`gpu_ops._events_torch.piece_bounds`)."""
    M, N, nbytes = packed.shape
    A = c.shape[1]
    R = M * N
    events, _ = compact(packed.reshape(R, nbytes), x.numel(), big)
    mid = 0.5 * (x[0] + x[-1])
    ok = events < x.numel()
    xe = torch.where(ok, x[events.clamp(max=x.numel() - 1).long()] - mid, 0.0)  # (R, E)
    zero = xe.new_zeros(R, 1)
    sums = [
        torch.cat([zero, torch.cumsum(torch.where(ok, xe**j, 0.0), dim=1)], dim=1).contiguous()
        for j in range(3)
    ]
    c64 = c.detach().to(torch.float64).contiguous()
    P = coef.shape[0]
    # Fine bounds -> event bounds, per row: events before each bound.
    fine = bounds.repeat(1, M, 1).reshape(P + 1, R, A).to(torch.int32)
    eb = torch.stack([torch.searchsorted(events, fine[k].contiguous()) for k in range(P + 1)])
    out = torch.empty(M, N, A, dtype=torch.float32, device=packed.device)
    grid = (R, triton.cdiv(A, _BLOCK_A))
    with on_device(out):
        _prefix_kernel[grid](
            *sums, eb.contiguous(), (c64 - mid).contiguous(), coef.to(x.device).contiguous(), out,
            N, A, events.shape[1] + 1, R, P, BLOCK_A=_BLOCK_A,
        )  # fmt: skip
    return out
