"""The banded operator's kernels in plain torch: every device, and float64 (gradcheck).

They run wherever no compiled kernel does (CUDA without Triton, other devices, the CPU
without a C compiler) and for float64 operands everywhere. Work goes in chunks of coarse
points, so nothing of size (M, N, A, W) is ever whole: a chunk gathers its windows of f
(``unfold`` views, no copy of f) into a block of about 2M items.

Stored band: :func:`forward`, :func:`backward_f` (the transposed band, by ``index_add_``),
:func:`backward_w`. On the fly (a named response or a table, see
:class:`gpu_ops.responses.KernelResponse`): the weights
of each chunk are evaluated, used and dropped; the gradients with respect to the coarse
points and the response parameter apply the same stored-band kernels to bands of the
analytic derivatives ``dr/dd`` and ``dr/dp``.
"""

from __future__ import annotations

import torch

from gpu_ops import responses


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    """float64 when any operand is float64 (gradcheck), else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _chunk(M: int, N: int, W: int, budget: int = 1 << 21) -> int:
    """Coarse points per chunk so that a gathered (M, N, chunk, W) block has ~budget items."""
    return max(1, budget // max(1, M * N * W))


def forward(f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out (M, N, A) in float32 (float64 for float64 operands), chunk by chunk, plain torch."""
    M, N, _ = f.shape
    _, A, W = weights.shape
    ct = _compute_dtype(f, weights)
    out = torch.empty(M, N, A, dtype=ct, device=f.device)
    windows = f.unfold(-1, W, 1)  # (M, N, B - W + 1, W), a view: nothing is copied
    rows = torch.arange(N, device=f.device)[:, None]
    step = _chunk(M, N, W)
    for a0 in range(0, A, step):
        win = windows[:, rows, starts[:, a0 : a0 + step].long()]  # (M, N, k, W)
        w = weights[:, a0 : a0 + step].to(ct)
        out[:, :, a0 : a0 + step] = (win.to(ct) * w).sum(-1)
    return out


def backward_f(
    g: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor, B: int
) -> torch.Tensor:
    """grad_f (M, N, B) float32/64: each chunk's windows are added with index_add_."""
    M, N, A = g.shape
    W = weights.shape[-1]
    ct = _compute_dtype(g, weights)
    out = torch.zeros(M, N * B, dtype=ct, device=g.device)
    base = (torch.arange(N, device=g.device) * B)[:, None, None]
    cols = torch.arange(W, device=g.device)
    step = _chunk(M, N, W)
    for a0 in range(0, A, step):
        w = weights[:, a0 : a0 + step].to(ct)  # (N, k, W)
        contrib = g[:, :, a0 : a0 + step, None].to(ct) * w  # (M, N, k, W)
        idx = base + starts[:, a0 : a0 + step, None].long() + cols  # (N, k, W)
        out.index_add_(1, idx.reshape(-1), contrib.reshape(M, -1))
    return out.view(M, N, B)


def backward_w(g: torch.Tensor, f: torch.Tensor, starts: torch.Tensor, W: int) -> torch.Tensor:
    """grad_w (N, A, W) float32/64, chunk by chunk."""
    M, N, _ = f.shape
    A = g.shape[-1]
    ct = _compute_dtype(g, f)
    out = torch.empty(N, A, W, dtype=ct, device=f.device)
    windows = f.unfold(-1, W, 1)
    rows = torch.arange(N, device=f.device)[:, None]
    step = _chunk(M, N, W)
    for a0 in range(0, A, step):
        win = windows[:, rows, starts[:, a0 : a0 + step].long()].to(ct)  # (M, N, k, W)
        gk = g[:, :, a0 : a0 + step].to(ct)
        out[:, a0 : a0 + step] = torch.einsum("mnk,mnkw->nkw", gk, win)
    return out


# --- on the fly ------------------------------------------------------------------------------

# Coarse points per chunk so that a chunk's (N, k, W) weights stay a few MB.
_OTF_CHUNK_ITEMS = 1 << 20


class Windows:
    """The windows of a response at coarse points c, for the current parameter value.

    Attributes:
        first, last: (N, A) int64, each window is ``[first, last)`` in fine points.
        starts: (N, A) int64, ``first`` moved into ``[0, B - W]``.
        W: the longest window.
        step: coarse points per chunk.
    """

    def __init__(
        self, x: torch.Tensor, c: torch.Tensor, resp: responses.KernelResponse,
        support: float | None,
    ) -> None:  # fmt: skip
        lo, hi = resp.window(support)
        first, last, W = responses.windows(x, c, lo, hi, resp.tie_ends)
        self._set(first, last, W, x.numel())

    def _set(self, first: torch.Tensor, last: torch.Tensor, W: int, B: int) -> None:
        self.first, self.last, self.W = first, last, W
        self.starts = responses.clipped_starts(first, W, B)
        self.step = max(1, _OTF_CHUNK_ITEMS // max(1, first.shape[0] * W))

    @classmethod
    def given(cls, first: torch.Tensor, last: torch.Tensor, B: int) -> Windows:
        """The windows ``[first, last)`` (N, A) int64 found elsewhere."""
        win = cls.__new__(cls)
        W = int((last - first).max()) if first.numel() else 1
        win._set(first, last, min(max(W, 1), B), B)
        return win

    def chunks(self, A: int) -> list[slice]:
        return [slice(a0, a0 + self.step) for a0 in range(0, A, self.step)]

    def offsets(
        self, x: torch.Tensor, c: torch.Tensor, sl: slice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(starts (N, k) int64, d (N, k, W), inside (N, k, W)) of the chunk ``sl``."""
        s = self.starts[:, sl]
        d, inside = responses.band_offsets(
            x, c[:, sl], self.first[:, sl], self.last[:, sl], s, self.W
        )
        return s, d, inside


def _masked(values: torch.Tensor, inside: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(inside, values, torch.zeros_like(values)).to(dtype)


def otf_forward(
    f: torch.Tensor, x: torch.Tensor, c: torch.Tensor, resp: responses.KernelResponse,
    support: float | None, win: Windows | None = None,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A), float32 (float64 for float64 f or c), for f (M, N, B).

    Args:
        f: (M, N, B) inputs.
        x: (B,) float64 fine grid.
        c: (N, A) coarse points.
        resp: the response (a named one at its parameter, or a table).
        support: the cut, in units of the parameter (None: the response's default).
        win: the windows, when already found (then ``support`` is not read).
    """
    ct = _compute_dtype(f, c)
    win = win or Windows(x, c, resp, support)
    M, N, _ = f.shape
    A = c.shape[1]
    out = torch.empty(M, N, A, dtype=ct, device=f.device)
    for sl in win.chunks(A):
        s, d, inside = win.offsets(x, c, sl)
        out[:, :, sl] = forward(f, s, _masked(resp.evaluate(d), inside, ct))
    return out


def otf_backward_f(
    g: torch.Tensor, x: torch.Tensor, c: torch.Tensor, resp: responses.KernelResponse,
    support: float | None, B: int,
) -> torch.Tensor:  # fmt: skip
    """grad_f (M, N, B) for g (M, N, A): the transposed band, weights recomputed per chunk."""
    ct = _compute_dtype(g, c)
    win = Windows(x, c, resp, support)
    M, N, A = g.shape
    out = torch.zeros(M, N, B, dtype=ct, device=g.device)
    for sl in win.chunks(A):
        s, d, inside = win.offsets(x, c, sl)
        w = _masked(resp.evaluate(d), inside, ct)
        out += backward_f(g[:, :, sl], s, w, B)
    return out


def otf_backward_c_param(
    g: torch.Tensor, f: torch.Tensor, x: torch.Tensor, c: torch.Tensor,
    resp: responses.KernelResponse, support: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(grad_c (N, A), grad_param 0-d) for g (M, N, A) and f (M, N, B).

    ``grad_c[n, a] = sum_m g[m, n, a] sum_j dr/dd(c[n, a] - x[j]) f[m, n, j]``, the
    parameter's likewise with ``dr/dp`` summed over every (n, a). The windows' edges move
    with the parameter too; that term is not counted (the weight there is the response at
    its cut, which the cut declares negligible). A table's grad_param is 0-d zero (a table
    gets no gradient; the op returns zeros of the table's shape).
    """
    ct = _compute_dtype(g, f, c)
    win = Windows(x, c, resp, support)
    A = c.shape[1]
    grad_c = torch.zeros(c.shape, dtype=ct, device=c.device)
    grad_p = torch.zeros((), dtype=torch.float64, device=c.device)
    for sl in win.chunks(A):
        s, d, inside = win.offsets(x, c, sl)
        dd, dp = resp.derivatives(d)
        # sum_m g[m, n, a] f[m, n, window]: gathered once for both derivatives.
        gf = backward_w(g[:, :, sl], f, s, win.W).to(ct)  # (N, k, W)
        grad_c[:, sl] = (gf * _masked(dd, inside, ct)).sum(-1)
        grad_p += (gf * _masked(dp, inside, ct)).sum(dtype=torch.float64)
    return grad_c, grad_p
