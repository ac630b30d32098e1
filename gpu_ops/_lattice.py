"""The on-the-fly event path on a lattice: the response tabulated once, not evaluated per event.

When the fine grid is evenly spaced, ``x[b] = x0 + b dx``, and each row's sorted coarse points
are too, a whole number ``step`` of fine points apart, ``c[n, a] = c0[n] + a step dx`` (a
recording sampled at 10 kHz and rates every 10 ms: step = 100), the offset

    c[n, a] - x[b] = c0[n] - x0 + (a step - b) dx

depends on ``a step - b`` alone. With ``b = q step + s`` (``0 <= s < step``) it is a function
of the phase ``s`` and of ``j = a - q``, so the response is evaluated once per geometry into

    tables[t, s, j - jmin] = r(c0 - x0 + (j step - s) dx)      (float64, stored in float32)

(one table per distinct ``c0 - x0``; ``tid[n]`` picks row n's), and each event adds one
contiguous run of its phase's row to the outputs whose windows hold it: a vector add per
event instead of a response evaluated per (event, coarse point). The windows stay the
ones every other path uses (``[first, last)`` from the exact offsets), so the lattice changes
what is summed only by the rounding of the offsets: within ``TOLERANCE`` fine steps of the
exact ones, far below the float32 rounding of the offsets the other kernels evaluate at.

:func:`find` recognises a lattice (or returns None: the event path then evaluates the
response per event); :func:`forward` is the plain-torch kernel of the op
``events_lattice_forward`` (the compiled C kernel is the fast one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpu_ops import _resample_torch, responses

TOLERANCE = 1e-8  # the largest distance from the lattice, in fine steps
MAX_TABLE_ITEMS = 1 << 22  # 16 MB of float32 tables at most (else no lattice)
ROW_MULTIPLE = 16  # each row of the tables is padded with zeros to a multiple of 16 floats


@dataclass(frozen=True)
class Lattice:
    """The response on the lattice of one geometry.

    Attributes:
        tables: (T, step, Jp) float32, ``tables[t, s, j - jmin]`` (see the module
            docstring) for the J coarse distances j the windows reach, then zeros up to a
            multiple of ``ROW_MULTIPLE``.
        tid: (N,) int64, each row's table.
        jmin: the first coarse distance j the tables hold.
        walk: each event reaches the coarse points of its windows, walked along as the events
            advance. False ("baked"): the windows are the lattice's own (no offset at a tie
            of the cut tipped by a rounding), the tables are zero outside them, and each
            event reaches the tables' whole run of J coarse points.
    """

    tables: torch.Tensor
    tid: torch.Tensor
    jmin: int
    walk: bool


def _spacing(x: torch.Tensor) -> float | None:
    """dx if x (B,) float64 is evenly spaced within ``TOLERANCE`` fine steps, else None."""
    B = x.numel()
    if B < 2:
        return None
    x0 = float(x[0])
    dx = (float(x[-1]) - x0) / (B - 1)
    if not dx > 0:
        return None
    ideal = x0 + torch.arange(B, dtype=torch.float64, device=x.device) * dx
    return dx if float((x - ideal).abs().max()) <= TOLERANCE * dx else None


def _reach(offsets: torch.Tensor, dx: float, lo: float, hi: float) -> tuple[torch.Tensor, ...]:
    """Per table, the lattice distances ``m = a step - b`` whose offset ``offset + m dx`` is
    in ``[lo, hi]``: ``(m_lo, m_hi)`` (T,) int64, as the tables evaluate the offsets."""
    found = []
    for bound, side in ((lo, "lo"), (hi, "hi")):
        m0 = torch.floor((bound - offsets) / dx)
        cand = m0[:, None] + torch.arange(-2, 3, dtype=torch.float64, device=offsets.device)
        d = offsets[:, None] + cand * dx
        if side == "lo":  # the least m with d >= lo
            found.append(torch.where(d >= lo, cand, math.inf).min(1).values)
        else:  # the largest m with d <= hi
            found.append(torch.where(d <= hi, cand, -math.inf).max(1).values)
    return found[0].long(), found[1].long()


def find(
    x: torch.Tensor, c: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
    resp: responses.KernelResponse, window: tuple[float, float],
) -> Lattice | None:  # fmt: skip
    """The lattice of x and c with the response tabulated on it, or None where there is none.

    Args:
        x: (B,) float64 fine grid.
        c: (N, A) float64, the kernels' coarse points, sorted along each row.
        first, last: (N, A) int64, the windows ``[first, last)`` of c: the offsets
            ``window[0] <= c - x <= window[1]``.
        resp: the response (named at its parameter, or a table).
        window: ``(lo, hi)``, the response's cut in x's units.

    Returns:
        None unless x is evenly spaced, every row of c is evenly spaced by the same whole
        number of fine steps (one coarse point: any), and the tables take at most
        ``MAX_TABLE_ITEMS`` floats.
    """
    dx = _spacing(x)
    N, A = c.shape
    B = x.numel()
    if dx is None or N == 0 or A == 0:
        return None
    step = 1
    if A > 1:
        step = round(float(c[0, 1] - c[0, 0]) / dx)
        if step < 1:
            return None
    a = torch.arange(A, dtype=torch.float64, device=c.device)
    if float((c - c[:, :1] - a * (step * dx)).abs().max()) > TOLERANCE * dx:
        return None
    offsets, tid = torch.unique(c[:, 0] - float(x[0]), return_inverse=True)
    m_lo, m_hi = _reach(offsets, dx, *window)
    # The lattice's own windows, b in [a step - m_hi, a step - m_lo], against the exact ones.
    ia = torch.arange(A, device=c.device) * step
    first_l = (ia - m_hi[tid][:, None]).clamp(0, B)
    last_l = (ia - m_lo[tid][:, None] + 1).clamp(0, B)
    empty, empty_l = last <= first, last_l <= first_l
    same = torch.where(empty | empty_l, empty == empty_l, (first == first_l) & (last == last_l))
    baked = bool(same.all()) and bool((m_hi >= m_lo).all())
    if baked:  # every j = a - b // step with m = j step - s in [m_lo, m_hi], s in [0, step)
        jmin = -(-int(m_lo.min()) // step)  # ceil(m_lo / step)
        jmax = (int(m_hi.max()) + step - 1) // step
    else:  # the coarse distances of every (a, b) in a window
        held = last > first
        if not bool(held.any()):
            return None
        ja = torch.arange(A, device=c.device).expand(N, A)
        jmin = int((ja - torch.div(last - 1, step, rounding_mode="floor"))[held].min())
        jmax = int((ja - torch.div(first, step, rounding_mode="floor"))[held].max())
    J = jmax - jmin + 1
    if J < 1 or offsets.numel() * step * (J + ROW_MULTIPLE) > MAX_TABLE_ITEMS:
        return None
    s = torch.arange(step, device=c.device)
    j = torch.arange(jmin, jmin + J, device=c.device)
    m = j[None, :] * step - s[:, None]  # (step, J)
    # Where the lattice's offset and the exact one straddle a cut (a discontinuity there:
    # boxcar, a table's ends, a causal response's start), the exact one is in the window:
    # the value at the cut counts.
    d = (offsets[:, None, None] + m.to(torch.float64) * dx).clamp(*window)
    values = resp.evaluate(d)
    if baked:
        inside = (m >= m_lo[:, None, None]) & (m <= m_hi[:, None, None])
        values = torch.where(inside, values, 0.0)
    # Rows of whole 16-float vectors (the compiled kernel reads whole vectors of a baked run).
    pad = -J % ROW_MULTIPLE
    tables = torch.nn.functional.pad(values.to(torch.float32), (0, pad)).contiguous()
    return Lattice(tables, tid.to(torch.int64).contiguous(), jmin, not baked)


def forward(
    bits: torch.Tensor, first: torch.Tensor, last: torch.Tensor, tables: torch.Tensor,
    tid: torch.Tensor, jmin: int,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A) float32 of ``bits (M, N, B)`` (0/1, float32) with the tables' weights,
    as a band: each window's weights gathered from the tables, chunk by chunk."""
    B = bits.shape[-1]
    step, J = tables.shape[1:]
    win = _resample_torch.Windows.given(first, last, B)
    M, N, _ = bits.shape
    A = first.shape[1]
    out = torch.empty(M, N, A, dtype=torch.float32, device=bits.device)
    table = tables[tid]  # (N, step, J)
    rows = torch.arange(N, device=bits.device)[:, None, None]
    for sl in win.chunks(A):
        s = win.starts[:, sl]
        b = s[..., None] + torch.arange(win.W, device=bits.device)  # (N, k, W)
        inside = (b >= first[:, sl, None]) & (b < last[:, sl, None])
        a = torch.arange(A, device=bits.device)[sl][None, :, None]
        j = (a - torch.div(b, step, rounding_mode="floor") - jmin).clamp(0, J - 1)
        w = table[rows, b % step, j]
        out[:, :, sl] = _resample_torch.forward(bits, s, torch.where(inside, w, 0.0))
    return out
