"""On-the-fly mode: the band of a named response is computed from (x, c, parameter), used and
dropped, so no weights are ever stored or saved for backward.

On CUDA (float32 compute) Triton kernels evaluate the response inside the kernel, tile by
tile, with analytic derivatives for c and the parameter (``gpu_ops/_triton/resample_otf.py``).
Elsewhere (CPU, float64) the band is built in chunks of coarse points and handed to the
stored-weight kernels; gradients with respect to c and the parameter come from recomputing
each chunk's weights under autograd in the backward and pulling the weight gradient through.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_ops import _resample_autograd as _ag
from gpu_ops import responses
from gpu_ops._triton import use_triton

try:  # Triton is optional: the CPU path never needs it.
    from gpu_ops._triton import resample_otf as _triton_otf
except ImportError:  # pragma: no cover - depends on the environment
    _triton_otf = None  # type: ignore[assignment]

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


def _triton_serves(f: torch.Tensor, compute_dtype: torch.dtype) -> bool:
    # The kernels compute in float32; float64 (gradcheck) takes the torch path.
    return use_triton(f, _triton_otf) and compute_dtype == torch.float32


def _triton_geometry(
    x: torch.Tensor, c: torch.Tensor, spec: responses.NamedResponse, param: torch.Tensor,
    support: float | None,
) -> _triton_otf.Geometry:  # fmt: skip
    value = float(param.detach())
    return _triton_otf.prepare(x, c, spec.name, value, spec.half_width(value, support))


def _triton_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    f, c, param = ctx.saved_tensors
    x, spec, support, _ = ctx.geometry
    geo = _triton_geometry(x, c, spec, param, support)
    g = grad.float().contiguous()
    need_f, need_c, need_p = ctx.needs_input_grad[:3]
    grad_f = grad_c = grad_p = None
    if need_f:
        grad_f = _triton_otf.grad_f(g, geo, f.shape[-1]).to(f.dtype)
    if need_c or need_p:
        gc, gp = _triton_otf.grad_c_param(f.float().contiguous(), g, geo)
        grad_c = gc.to(c.dtype) if need_c else None
        grad_p = gp.to(param.dtype) if need_p else None
    return grad_f, grad_c, grad_p, None, None, None, None


class OnTheFlyFunction(torch.autograd.Function):
    """out (M, N, A) for f (M, N, B), coarse points c (N, A) and a 0-d parameter tensor."""

    @staticmethod
    def forward(
        ctx: Any, f: torch.Tensor, c: torch.Tensor, param: torch.Tensor, x: torch.Tensor,
        spec: responses.NamedResponse, support: float | None, compute_dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        f_c = f.contiguous()
        ctx.save_for_backward(f_c, c, param)
        ctx.geometry = (x, spec, support, compute_dtype)
        if _triton_serves(f, compute_dtype):
            geo = _triton_geometry(x, c, spec, param, support)
            return _triton_otf.forward(f_c.float(), geo).to(f.dtype)
        first, last, starts, W = _band_geometry(x, c, spec, param, support)
        M, N, _ = f.shape
        A = c.shape[1]
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
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        f, c, param = ctx.saved_tensors
        x, spec, support, compute_dtype = ctx.geometry
        if _triton_serves(f, compute_dtype):
            return _triton_backward(ctx, grad)
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
                # A piecewise-constant response (boxcar) builds no graph: its gradients are 0.
                if (need_c or need_p) and w_k.requires_grad:
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
