"""On-the-fly mode: the band of a named response is computed from (x, c, parameter) in chunks
of coarse points, used and dropped, so no weights are ever stored or saved for backward.

Gradients with respect to c and the response parameter come from recomputing each chunk's
weights under autograd in the backward and pulling the weight gradient through them.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_ops import _resample_autograd as _ag
from gpu_ops import responses

# Coarse points per chunk so a chunk's (N, k, W) weights stay a few MB.
_CHUNK_ITEMS = 1 << 20


def _band_geometry(
    x: torch.Tensor, c: torch.Tensor, spec: responses.NamedResponse, param: torch.Tensor,
    support: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    half = spec.half_width(float(param.detach()), support)
    first, last, W = responses.windows(x, c, -half, half)
    starts = responses.clipped_starts(first, W, x.numel())
    return first, last, starts, W


class OnTheFlyFunction(torch.autograd.Function):
    """out (M, N, A) for f (M, N, B), coarse points c (N, A) and a 0-d parameter tensor."""

    @staticmethod
    def forward(
        ctx: Any, f: torch.Tensor, c: torch.Tensor, param: torch.Tensor, x: torch.Tensor,
        spec: responses.NamedResponse, support: float | None, compute_dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        first, last, starts, W = _band_geometry(x, c, spec, param, support)
        M, N, _ = f.shape
        A = c.shape[1]
        f_c = f.contiguous()
        out = torch.empty(M, N, A, dtype=f.dtype, device=f.device)
        p = {spec.param: param.to(x.dtype)}
        step = max(1, _CHUNK_ITEMS // max(1, N * W))
        for a0 in range(0, A, step):
            sl = slice(a0, a0 + step)
            s_k = starts[:, sl].to(torch.int32).contiguous()
            w_k = responses.evaluate_band(
                x, c[:, sl], spec.bind(p), first[:, sl], last[:, sl],
                starts[:, sl], W,
            ).to(compute_dtype).contiguous()  # fmt: skip
            out[:, :, sl] = _ag.kernel_forward(f_c, s_k, w_k).to(f.dtype)
        ctx.save_for_backward(f_c, c, param)
        ctx.geometry = (x, spec, support, compute_dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        f, c, param = ctx.saved_tensors
        x, spec, support, compute_dtype = ctx.geometry
        first, last, starts, W = _band_geometry(x, c, spec, param, support)
        M, N, B = f.shape
        A = c.shape[1]
        wide = compute_dtype == torch.float64
        g = (grad.double() if wide else grad.float()).contiguous()
        f_k = f.to(g.dtype).contiguous()
        need_f, need_c, need_p = ctx.needs_input_grad[:3]
        grad_f = torch.zeros(M, N, B, dtype=g.dtype, device=f.device) if need_f else None
        grad_c = torch.zeros_like(c) if need_c else None
        grad_p = torch.zeros_like(param) if need_p else None
        step = max(1, _CHUNK_ITEMS // max(1, N * W))
        for a0 in range(0, A, step):
            sl = slice(a0, a0 + step)
            s_k = starts[:, sl].to(torch.int32).contiguous()
            g_k = g[:, :, sl].contiguous()
            with torch.enable_grad():
                c_k = c[:, sl].detach().requires_grad_(need_c)
                p_k = param.detach().requires_grad_(need_p)
                p = {spec.param: p_k.to(x.dtype)}
                w_k = responses.evaluate_band(
                    x, c_k, spec.bind(p), first[:, sl], last[:, sl],
                    starts[:, sl], W,
                ).to(compute_dtype)  # fmt: skip
                if need_c or need_p:
                    gw = _ag.kernel_backward_w(g_k, f_k, s_k, W).to(w_k.dtype)
                    wrt = [t for t, need in ((c_k, need_c), (p_k, need_p)) if need]
                    grads = torch.autograd.grad(w_k, wrt, gw, allow_unused=True)
                    it = iter(grads)
                    if need_c and grad_c is not None:
                        gc = next(it)
                        if gc is not None:
                            grad_c[:, sl] = gc
                    if need_p and grad_p is not None:
                        gp = next(it)
                        if gp is not None:
                            grad_p += gp
            if grad_f is not None:
                grad_f += _ag.kernel_backward_f(g_k, s_k, w_k.detach().contiguous(), B, False)
        if grad_f is not None:
            grad_f = grad_f.to(f.dtype)
        return grad_f, grad_c, grad_p, None, None, None, None
