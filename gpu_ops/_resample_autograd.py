"""Autograd and device dispatch of the stored-weights banded operator.

``banded_apply(f, starts, weights)`` picks the kernel by device: Triton on CUDA, the compiled
C kernels on the CPU, chunked torch code anywhere else (and where the C kernels cannot be
built). Kernels take contiguous float32 inputs of shape (M, N, B) and
return float32; the backward is a custom ``autograd.Function`` so nothing of size
(M, N, A, W) is ever saved or built.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_ops import _resample_cpu
from gpu_ops._triton import use_triton

try:  # Triton is optional: the CPU paths never need it.
    from gpu_ops._triton import resample as _triton_resample
except ImportError:  # pragma: no cover - depends on the environment
    _triton_resample = None  # type: ignore[assignment]


def kernel_forward(f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(M, N, A) float32 from contiguous f (M, N, B), starts (N, A) int32, weights (N, A, W).

    float64 operands (gradcheck) take the chunked torch path and stay float64.
    """
    if torch.float64 in (f.dtype, weights.dtype):
        return _resample_cpu.forward_torch(f, starts, weights)
    if use_triton(f, _triton_resample):
        return _triton_resample.forward(f, starts, weights)
    if f.device.type == "cpu":
        lib = _resample_cpu.kernels()
        f32 = f.float().contiguous()
        if lib is not None:
            return _resample_cpu.forward_c(lib, f32, starts, weights)
        return _resample_cpu.forward_torch(f32, starts, weights)
    # CUDA without Triton, other devices: chunked torch (it converts each chunk to float32),
    # never the reference, whose (M, N, A, W) gather would not fit for real sizes.
    return _resample_cpu.forward_torch(f, starts, weights)


def kernel_backward_f(
    g: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor, B: int, sorted_starts: bool
) -> torch.Tensor:
    """(M, N, B) float32: the transposed band applied to contiguous float32 g (M, N, A)."""
    if torch.float64 in (g.dtype, weights.dtype):
        return _resample_cpu.backward_f_torch(g, starts, weights, B)
    if use_triton(g, _triton_resample):
        return _triton_resample.backward_f(g, starts, weights, B, sorted_starts)
    if g.device.type == "cpu":
        lib = _resample_cpu.kernels()
        if lib is not None:
            return _resample_cpu.backward_f_c(lib, g, starts, weights, B, sorted_starts)
    return _resample_cpu.backward_f_torch(g, starts, weights, B)


def kernel_backward_w(
    g: torch.Tensor, f: torch.Tensor, starts: torch.Tensor, W: int
) -> torch.Tensor:
    """(N, A, W) float32 weight gradient from contiguous float32 g (M, N, A) and f (M, N, B)."""
    if torch.float64 in (g.dtype, f.dtype):
        return _resample_cpu.backward_w_torch(g, f, starts, W)
    if use_triton(g, _triton_resample):
        return _triton_resample.backward_w(g, f, starts, W)
    if g.device.type == "cpu":
        lib = _resample_cpu.kernels()
        if lib is not None:
            return _resample_cpu.backward_w_c(lib, g, f, starts, W)
    return _resample_cpu.backward_w_torch(g, f, starts, W)


class BandedFunction(torch.autograd.Function):
    """out (M, N, A) = band(starts, weights) applied to f (M, N, B); output dtype = f's."""

    @staticmethod
    def forward(
        ctx: Any, f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor, sorted_starts: bool
    ) -> torch.Tensor:
        f_c = f.contiguous()
        # f (M, N, B) is only needed for the weight gradient: for a fixed operator, saving
        # it would hold the whole input batch until backward.
        ctx.save_for_backward(f_c if ctx.needs_input_grad[2] else None, starts, weights)
        ctx.f_meta = (f.shape[-1], f.dtype)
        ctx.sorted_starts = sorted_starts
        return kernel_forward(f_c, starts, weights).to(f.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        f, starts, weights = ctx.saved_tensors
        B, f_dtype = ctx.f_meta
        wide = torch.float64 in (f_dtype, weights.dtype)
        g = (grad.double() if wide else grad.float()).contiguous()
        grad_f = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_f = kernel_backward_f(g, starts, weights, B, ctx.sorted_starts).to(f_dtype)
        if ctx.needs_input_grad[2]:
            W = weights.shape[-1]
            grad_w = kernel_backward_w(g, f.to(g.dtype).contiguous(), starts, W).to(weights.dtype)
        return grad_f, None, grad_w, None


def banded_apply(
    f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor, *, sorted_starts: bool = False
) -> torch.Tensor:
    """Apply a validated band to f (M, N, B); see :func:`gpu_ops.banded_resample`."""
    out: torch.Tensor = BandedFunction.apply(  # type: ignore[no-untyped-call]
        f, starts, weights, sorted_starts
    )
    return out
