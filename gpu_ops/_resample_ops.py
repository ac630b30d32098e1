"""The banded operator as torch operators, with per-device kernels and autograd.

Defined in the ``bitserve`` library (:mod:`gpu_ops._library`) under ``torch.ops.bitserve``,
so the torch dispatcher picks the kernel by device, autograd is the registered formula (no Python
``autograd.Function`` around the op), and the ops work under ``torch.compile`` (no graph
break) and ``torch.export`` (an exported program records them by name):

==============================  =========================================================
op                              computes
==============================  =========================================================
``banded_forward``              out (M, N, A) = the stored band applied to f (M, N, B)
``banded_backward_f``           the transposed band applied to grad (M, N, A)
``banded_backward_w``           the weight gradient (N, A, W)
``on_the_fly_forward``          out (M, N, A), the weights of a named response (or a
                                table) computed from (x, c, parameter) inside the kernel
``on_the_fly_backward_f``       its transposed band
``on_the_fly_backward_c_param`` the gradients w.r.t. c (N, A) and the parameter (0-d)
==============================  =========================================================

===========  ==============================================================================
device       kernel
===========  ==============================================================================
CPU          the compiled C kernels (:mod:`gpu_ops._resample_c`); torch where none built
CUDA         Triton kernels (:mod:`gpu_ops._triton`), registered when Triton is installed
any other    chunked torch (:mod:`gpu_ops._resample_torch`): also CUDA without Triton
fake / meta  shapes and dtypes only, for compile and export
===========  ==============================================================================

float64 operands (gradcheck) take the torch kernels on every device; for the on-the-fly ops
that is f or the parameter (c is float64 in every on-the-fly module: its offsets to x are
formed in float64 by every kernel). The ops trust their
arguments (shapes, dtypes, start ranges): :mod:`gpu_ops.resample` checks them.

The on-the-fly ops take ``(param, response, support)`` as
:class:`gpu_ops.responses.KernelResponse` reads them: a name with its 0-d parameter, or
``"tabulated"`` with the table ``(2, K)`` (breakpoints, then values) as ``param`` and no
support. A table gets no gradient (it has no width; its values are data): asking for one
raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gpu_ops import _resample_c, _resample_torch, responses
from gpu_ops._lazy_triton import triton_kernels
from gpu_ops._library import Op

# Triton is optional (without it CUDA tensors take the torch kernels) and imported at the
# first CUDA call (gpu_ops._lazy_triton).
if TYPE_CHECKING:
    from gpu_ops._triton import resample as _triton_band
    from gpu_ops._triton import resample_otf as _triton_otf
else:
    _triton_band = triton_kernels("resample")
    _triton_otf = triton_kernels("resample_otf")


def _wide(*ts: Tensor) -> bool:
    return any(t.dtype == torch.float64 for t in ts)


def _f32(t: Tensor) -> Tensor:
    return t.float().contiguous()


# --- stored band --------------------------------------------------------------------------------


banded_forward = Op(
    "banded_forward(Tensor f, Tensor starts, Tensor weights, bool sorted_starts) -> Tensor"
)


@banded_forward.register_kernel(None)
def _torch_banded_forward(
    f: Tensor, starts: Tensor, weights: Tensor, sorted_starts: bool
) -> Tensor:
    """out (M, N, A) in f's dtype: ``sum_j weights[n, a, j] * f[m, n, starts[n, a] + j]``.

    Args:
        f: (M, N, B) float.
        starts: (N, A) int32, in ``[0, B - W]``.
        weights: (N, A, W) float.
        sorted_starts: starts are non-decreasing along each row (the backward then uses the
            banded transpose); the forward ignores it.

    This body is the kernel for devices without their own (chunked torch).
    """
    return _resample_torch.forward(f, starts, weights).to(f.dtype)


@banded_forward.register_kernel("cpu")
def _(f: Tensor, starts: Tensor, weights: Tensor, sorted_starts: bool) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None or _wide(f, weights):
        return _torch_banded_forward(f, starts, weights, sorted_starts)
    s, w = starts.contiguous(), weights.contiguous()
    return _resample_c.forward(lib, _f32(f), s, w).to(f.dtype)


@banded_forward.register_fake
def _(f: Tensor, starts: Tensor, weights: Tensor, sorted_starts: bool) -> Tensor:
    return f.new_empty((f.shape[0], *starts.shape))


banded_backward_f = Op(
    "banded_backward_f(Tensor grad, Tensor starts, Tensor weights, SymInt num_fine, "
    "bool sorted_starts) -> Tensor"
)


@banded_backward_f.register_kernel(None)
def _torch_banded_backward_f(
    grad: Tensor, starts: Tensor, weights: Tensor, num_fine: int, sorted_starts: bool
) -> Tensor:
    """grad_f (M, N, B) in grad's dtype from grad (M, N, A): the transposed band."""
    return _resample_torch.backward_f(grad, starts, weights, num_fine).to(grad.dtype)


@banded_backward_f.register_kernel("cpu")
def _(grad: Tensor, starts: Tensor, weights: Tensor, num_fine: int, sorted_starts: bool) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None or _wide(grad, weights):
        return _torch_banded_backward_f(grad, starts, weights, num_fine, sorted_starts)
    s, w = starts.contiguous(), weights.contiguous()
    return _resample_c.backward_f(lib, _f32(grad), s, w, num_fine, sorted_starts).to(grad.dtype)


@banded_backward_f.register_fake
def _(grad: Tensor, starts: Tensor, weights: Tensor, num_fine: int, sorted_starts: bool) -> Tensor:
    return grad.new_empty((*grad.shape[:2], num_fine))


banded_backward_w = Op(
    "banded_backward_w(Tensor grad, Tensor f, Tensor starts, SymInt width) -> Tensor"
)


@banded_backward_w.register_kernel(None)
def _torch_banded_backward_w(grad: Tensor, f: Tensor, starts: Tensor, width: int) -> Tensor:
    """grad_w (N, A, W), float32 (float64 for float64 operands), from grad and f."""
    return _resample_torch.backward_w(grad, f, starts, width)


@banded_backward_w.register_kernel("cpu")
def _(grad: Tensor, f: Tensor, starts: Tensor, width: int) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None or _wide(grad, f):
        return _torch_banded_backward_w(grad, f, starts, width)
    return _resample_c.backward_w(lib, _f32(grad), _f32(f), starts.contiguous(), width)


@banded_backward_w.register_fake
def _(grad: Tensor, f: Tensor, starts: Tensor, width: int) -> Tensor:
    dtype = torch.float64 if _wide(grad, f) else torch.float32
    return grad.new_empty((*starts.shape, width), dtype=dtype)


def _banded_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    f, starts, weights, sorted_starts = inputs
    # f (M, N, B) is only needed for the weight gradient: for a fixed operator, saving it
    # would hold the whole input batch until the backward.
    ctx.save_for_backward(f if ctx.needs_input_grad[2] else None, starts, weights)
    ctx.num_fine = f.shape[-1]
    ctx.sorted_starts = sorted_starts


def _banded_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    f, starts, weights = ctx.saved_tensors
    grad_f = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_f = banded_backward_f(grad, starts, weights, ctx.num_fine, ctx.sorted_starts)
    if ctx.needs_input_grad[2]:
        grad_w = banded_backward_w(grad, f, starts, weights.shape[-1]).to(weights.dtype)
    return grad_f, None, grad_w, None


banded_forward.register_autograd(_banded_backward, setup_context=_banded_setup)


# --- on the fly ---------------------------------------------------------------------------------


on_the_fly_forward = Op(
    "on_the_fly_forward(Tensor f, Tensor x, Tensor c, Tensor param, str response, "
    "float? support) -> Tensor"
)


@on_the_fly_forward.register_kernel(None)
def _torch_otf_forward(
    f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None
) -> Tensor:
    """out (M, N, A) in f's dtype, ``sum_b r(c[n, a] - x[b]) f[m, n, b]`` over the windows.

    Args:
        f: (M, N, B) float.
        x: (B,) float64, sorted.
        c: (N, A) float32 or float64 (float64: computed in float64), any order.
        param: 0-d, the response's parameter, c's dtype; a table (2, K) for "tabulated".
        response: a name from :data:`gpu_ops.responses.NAMED`, or "tabulated".
        support: the cut in units of the parameter (None: the response's default).
    """
    resp = responses.KernelResponse(response, param)
    return _resample_torch.otf_forward(f, x, c, resp, support).to(f.dtype)


def _c_windows(
    x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None
) -> _resample_c.Windows:
    return _resample_c.Windows(x, c, responses.KernelResponse(response, param), support)


@on_the_fly_forward.register_kernel("cpu")
def _(
    f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None
) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None or _wide(f, param):
        return _torch_otf_forward(f, x, c, param, response, support)
    win = _c_windows(x, c, param, response, support)
    return _resample_c.otf_forward(lib, _f32(f), win).to(f.dtype)


@on_the_fly_forward.register_fake
def _(
    f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None
) -> Tensor:
    return f.new_empty((*f.shape[:2], c.shape[1]))


on_the_fly_backward_f = Op(
    "on_the_fly_backward_f(Tensor grad, Tensor x, Tensor c, Tensor param, str response, "
    "float? support, SymInt num_fine) -> Tensor"
)


@on_the_fly_backward_f.register_kernel(None)
def _torch_otf_backward_f(
    grad: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    num_fine: int,
) -> Tensor:  # fmt: skip
    """grad_f (M, N, B) in grad's dtype: the transposed band, weights recomputed."""
    resp = responses.KernelResponse(response, param)
    out = _resample_torch.otf_backward_f(grad, x, c, resp, support, num_fine)
    return out.to(grad.dtype)


@on_the_fly_backward_f.register_kernel("cpu")
def _(
    grad: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    num_fine: int,
) -> Tensor:  # fmt: skip
    lib = _resample_c.kernels()
    if lib is None or _wide(grad, param):
        args = (grad, x, c, param, response, support, num_fine)
        return _torch_otf_backward_f(*args)
    win = _c_windows(x, c, param, response, support)
    return _resample_c.otf_backward_f(lib, _f32(grad), win, num_fine).to(grad.dtype)


@on_the_fly_backward_f.register_fake
def _(
    grad: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    num_fine: int,
) -> Tensor:  # fmt: skip
    return grad.new_empty((*grad.shape[:2], num_fine))


on_the_fly_backward_c_param = Op(
    "on_the_fly_backward_c_param(Tensor grad, Tensor f, Tensor x, Tensor c, Tensor param, "
    "str response, float? support) -> (Tensor, Tensor)"
)


@on_the_fly_backward_c_param.register_kernel(None)
def _torch_otf_backward_c_param(
    grad: Tensor, f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str,
    support: float | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(grad_c (N, A) in c's dtype, grad_param in param's dtype and shape) from grad and f
    (a table's: zeros)."""
    resp = responses.KernelResponse(response, param)
    gc, gp = _resample_torch.otf_backward_c_param(grad, f, x, c, resp, support)
    return gc.to(c.dtype), _param_grad(gp, param, response)


def _param_grad(gp: Tensor, param: Tensor, response: str) -> Tensor:
    """The parameter's gradient as the op returns it: a table's is zeros of its shape."""
    if response == responses.TABULATED:
        return torch.zeros_like(param)
    return gp.to(param.dtype)


@on_the_fly_backward_c_param.register_kernel("cpu")
def _(
    grad: Tensor, f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str,
    support: float | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    lib = _resample_c.kernels()
    if lib is None or _wide(grad, f, param):
        args = (grad, f, x, c, param, response, support)
        return _torch_otf_backward_c_param(*args)
    win = _c_windows(x, c, param, response, support)
    gc, gp = _resample_c.otf_backward_c_param(lib, _f32(f), _f32(grad), win)
    return gc.to(c.dtype), _param_grad(gp, param, response)


@on_the_fly_backward_c_param.register_fake
def _(
    grad: Tensor, f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str,
    support: float | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(c), torch.empty_like(param)


def _otf_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    f, x, c, param, response, support = inputs
    ctx.save_for_backward(f, x, c, param)
    ctx.response, ctx.support = response, support


def _otf_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    f, x, c, param = ctx.saved_tensors
    need_f, _, need_c, need_p = ctx.needs_input_grad[:4]
    if need_p and ctx.response == responses.TABULATED:
        raise ValueError("a tabulated response gets no gradient: its table is data, not a width")
    grad_f = grad_c = grad_p = None
    if need_f:
        args = (x, c, param, ctx.response, ctx.support, f.shape[-1])
        grad_f = on_the_fly_backward_f(grad, *args)
    if need_c or need_p:
        gc, gp = on_the_fly_backward_c_param(grad, f, x, c, param, ctx.response, ctx.support)
        grad_c = gc if need_c else None
        grad_p = gp if need_p else None
    return grad_f, None, grad_c, grad_p, None, None


on_the_fly_forward.register_autograd(_otf_backward, setup_context=_otf_setup)


# --- CUDA: Triton --------------------------------------------------------------------------------

if _triton_band is not None:
    _band = _triton_band

    @banded_forward.register_kernel("cuda")
    def _(f: Tensor, starts: Tensor, weights: Tensor, sorted_starts: bool) -> Tensor:
        if _wide(f, weights):
            return _torch_banded_forward(f, starts, weights, sorted_starts)
        return _band.forward(f.contiguous(), starts.contiguous(), weights.contiguous()).to(f.dtype)

    @banded_backward_f.register_kernel("cuda")
    def _(
        grad: Tensor, starts: Tensor, weights: Tensor, num_fine: int, sorted_starts: bool
    ) -> Tensor:
        if _wide(grad, weights):
            return _torch_banded_backward_f(grad, starts, weights, num_fine, sorted_starts)
        s, w = starts.contiguous(), weights.contiguous()
        return _band.backward_f(_f32(grad), s, w, num_fine, sorted_starts).to(grad.dtype)

    @banded_backward_w.register_kernel("cuda")
    def _(grad: Tensor, f: Tensor, starts: Tensor, width: int) -> Tensor:
        if _wide(grad, f):
            return _torch_banded_backward_w(grad, f, starts, width)
        return _band.backward_w(_f32(grad), _f32(f), starts.contiguous(), width)


if _triton_otf is not None:
    _otf = _triton_otf

    def _geometry(x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None) -> Any:
        return _otf.prepare(x, c, responses.KernelResponse(response, param), support)

    @on_the_fly_forward.register_kernel("cuda")
    def _(
        f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None
    ) -> Tensor:
        if _wide(f, param):
            return _torch_otf_forward(f, x, c, param, response, support)
        geo = _geometry(x, c, param, response, support)
        return _otf.forward(_f32(f), geo).to(f.dtype)

    @on_the_fly_backward_f.register_kernel("cuda")
    def _(
        grad: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str,
        support: float | None, num_fine: int,
    ) -> Tensor:  # fmt: skip
        if _wide(grad, param):
            args = (grad, x, c, param, response, support, num_fine)
            return _torch_otf_backward_f(*args)
        geo = _geometry(x, c, param, response, support)
        return _otf.grad_f(_f32(grad), geo, num_fine).to(grad.dtype)

    @on_the_fly_backward_c_param.register_kernel("cuda")
    def _(
        grad: Tensor, f: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str,
        support: float | None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        if _wide(grad, f, param):
            args = (grad, f, x, c, param, response, support)
            return _torch_otf_backward_c_param(*args)
        geo = _geometry(x, c, param, response, support)
        gc, gp = _otf.grad_c_param(_f32(f), _f32(grad), geo)
        return gc.to(c.dtype), _param_grad(gp, param, response)
