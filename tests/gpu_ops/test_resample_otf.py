"""gpu_ops.OnTheFlyResampler: every kernel against the torch kernels, the dense reference and
finite differences.

The Triton kernels run interpreted on CPU tensors without a GPU (``TRITON_INTERPRET=1``, set
by conftest); the compiled C kernels run wherever a C compiler is found.
"""

from __future__ import annotations

import pytest
import torch

from gpu_ops import BandedResampler, OnTheFlyResampler, responses
from tests.common_utils import needs_triton
from tests.gpu_ops.resample_cases import (
    PARAMS,
    RESPONSES,
    assert_close,
    coarse,
    dense_ref,
    grid,
    seed,
)

# boxcar: derivatives are 0 almost everywhere
SMOOTH = ["gaussian", "lorentzian", "triangle", "epanechnikov", "laplacian", "exponential", "alpha"]


def _problem(seed: int, B: int = 300) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    return grid(B, gen), coarse(2, 40, gen), gen


def _close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 2e-5) -> None:
    assert_close(out, ref, rtol)


def _dense_grads(
    name: str, x: torch.Tensor, c: torch.Tensor, f: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, grad_f, grad_c, grad_param) by autograd through the dense float64 T = r(c - x).

    The cut is fixed at the windows of the starting parameter, as the kernels count it.
    """
    ((_pname, value),) = PARAMS[name].items()
    shape = OnTheFlyResampler(x, c, name, dtype=torch.float64, **PARAMS[name]).shape
    lo, hi = shape.window(value)  # offsets of the moved coarse points c + shift * p
    c_ = c.clone().requires_grad_()
    p_ = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    f_ = f.double().clone().requires_grad_()
    d = c_[..., None] + shape.shift * p_ - x
    u = d / p_
    causal = (u >= 0).double()
    r = {
        "gaussian": lambda: torch.exp(-0.5 * u * u),
        "lorentzian": lambda: 1 / (1 + u * u),
        "triangle": lambda: (1 - d.abs() / p_).clamp(min=0),
        "boxcar": lambda: (d.abs() <= p_).double(),
        "epanechnikov": lambda: (1 - u * u).clamp(min=0),
        "laplacian": lambda: torch.exp(-u.abs()),
        "exponential": lambda: torch.exp(-u) * causal,
        "alpha": lambda: u * torch.exp(1 - u) * causal,
    }[name]()
    T = r * ((d.detach() >= lo) & (d.detach() <= hi))
    out = torch.einsum("nab,mnb->mna", T, f_)
    # boxcar builds no graph through c and p: their gradients are zeros.
    grads = torch.autograd.grad(out, (f_, c_, p_), g.double(), materialize_grads=True)
    return out.detach(), *grads


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_match_autograd_of_the_dense_reference(name: str, dtype: torch.dtype) -> None:
    """The CPU kernels (C for float32 where built, torch for float64) against autograd."""
    x, c, gen = _problem(seed(name))
    f = torch.randn(3, 2, 300, generator=gen, dtype=dtype)
    g = torch.randn(3, 2, 40, generator=gen, dtype=torch.float64)
    op = OnTheFlyResampler(x, c, name, dtype=dtype, trainable=True, **PARAMS[name])
    fr = f.clone().requires_grad_()
    out = op(fr)
    (out * g.to(dtype)).sum().backward()
    ref, ref_f, ref_c, ref_p = _dense_grads(name, x, c, f, g)
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    _close(out, ref, rtol)
    assert fr.grad is not None
    assert op.c.grad is not None
    assert op.param.grad is not None
    _close(fr.grad, ref_f, rtol)
    _close(op.c.grad, ref_c, 10 * rtol)
    _close(op.param.grad, ref_p, 10 * rtol)


@pytest.mark.parametrize("name", SMOOTH)
def test_gradcheck_c_and_parameter(name: str) -> None:
    gen = torch.Generator().manual_seed(4)
    x, c = grid(60, gen), coarse(2, 5, gen)
    op = OnTheFlyResampler(x, c, name, dtype=torch.float64, **PARAMS[name])
    inputs = (
        torch.randn(2, 2, 60, generator=gen, dtype=torch.float64, requires_grad=True),
        op.c.detach().clone().requires_grad_(),
        op.param.detach().clone().requires_grad_(),
    )
    op_fn = torch.ops.bitserve.on_the_fly_forward
    assert torch.autograd.gradcheck(lambda f, c, p: op_fn(f, op.x, c, p, name, op.support), inputs)


def test_modes_agree_and_work_under_inference_mode() -> None:
    gen = torch.Generator().manual_seed(5)
    x, c = grid(200, gen), coarse(2, 30, gen)
    f = torch.randn(4, 2, 200, generator=gen)
    stored = BandedResampler.from_response(x, c, "gaussian", sigma=2.0)
    otf = OnTheFlyResampler.from_response(x, c, "gaussian", sigma=2.0)
    with torch.inference_mode():
        a, b = stored(f), otf(f)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored.to_dense(), otf.to_dense(), rtol=1e-6, atol=1e-6)
    assert otf.nbytes < stored.nbytes
    assert otf.band_width == stored.band_width
    f16 = f.to(torch.bfloat16)
    assert otf(f16).dtype == torch.bfloat16


@pytest.mark.parametrize("cast", ["to", "half"])
def test_geometry_stays_precise_under_dtype_casts(cast: str) -> None:
    gen = torch.Generator().manual_seed(14)
    x, c = grid(400, gen), coarse(2, 25, gen)
    op = OnTheFlyResampler(x, c, "gaussian", sigma=0.3)
    f = torch.randn(2, 400, generator=gen).to(torch.bfloat16)
    before = op(f)
    cast_op = op.to(torch.bfloat16) if cast == "to" else op.half()
    assert cast_op.x.dtype == torch.float64
    assert cast_op.c.dtype == torch.float64  # c - x is formed in float64
    assert isinstance(cast_op.c, torch.nn.Parameter)
    torch.testing.assert_close(cast_op(f), before, rtol=0, atol=0)
    stored = BandedResampler.from_response(x, c, "gaussian", sigma=0.3).half()
    assert stored.weights.dtype == torch.float16  # stored weights do follow the cast


def test_constructor_errors() -> None:
    x = torch.linspace(0, 1, 50, dtype=torch.float64)
    c = torch.rand(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="exactly one parameter: sigma"):
        OnTheFlyResampler(x, c, "gaussian", gamma=1.0)
    with pytest.raises(ValueError, match="unknown response"):
        OnTheFlyResampler(x, c, "sinc", sigma=1.0)
    with pytest.raises(ValueError, match="compact support"):
        OnTheFlyResampler(x, c, "boxcar", 3.0, half_width=0.1)
    with pytest.raises(ValueError, match="x must be sorted"):
        OnTheFlyResampler(x.flip(0), c, "gaussian", sigma=0.1)
    with pytest.raises(TypeError, match="OnTheFlyResampler"):
        BandedResampler.from_response(x, c, "gaussian", sigma=0.1, on_the_fly=True)


@needs_triton
@pytest.mark.parametrize(
    ("name", "M"),
    # M = 70: two blocks of inputs, so every axis of the flat launch grid has several.
    [(name, M) for name in sorted(PARAMS) for M in (1, 3, 20)] + [("gaussian", 70)],
)
def test_triton_kernels_match_the_torch_kernels(name: str, M: int) -> None:
    from gpu_ops._triton import resample_otf as ko

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, c, gen = _problem(seed(name, M))
    op = OnTheFlyResampler(x, c, name, dtype=torch.float64, trainable=True, **PARAMS[name])
    f = torch.randn(M, 2, 300, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(M, 2, 40, generator=gen, dtype=torch.float64)
    ref = op(f)
    (ref * g).sum().backward()  # the torch kernels in float64: the reference
    p = float(op.param.detach())
    moved = (op.c + op.shape.shift * op.param).detach()  # a causal response's centring
    resp = responses.KernelResponse(name, op.param.detach())
    geo = ko.prepare(x.to(device), moved.float().to(device), resp, op.support)
    f32 = f.detach().float().to(device).contiguous()
    g32 = g.float().to(device).contiguous()
    _close(ko.forward(f32, geo).cpu(), ref.detach())
    assert f.grad is not None
    assert op.c.grad is not None
    assert op.param.grad is not None
    _close(ko.grad_f(g32, geo, 300).cpu(), f.grad)
    gc, gp = ko.grad_c_param(f32, g32, geo)
    _close(gc.cpu(), op.c.grad)
    # The centring shift moves c with the parameter: its share of the parameter's gradient.
    gp = gp + op.shape.shift * gc.double().sum()
    _close(gp.cpu(), op.param.grad, rtol=1e-4)
    if name == "boxcar":
        assert not bool(gc.any())
        return
    # Finite differences of the float64 forward in the parameter: independent of both paths.
    h = 1e-6 * p

    def loss(value: float) -> float:
        shifted = OnTheFlyResampler(x, c, name, dtype=torch.float64, **{op.spec.param: value})
        with torch.no_grad():
            return float((shifted(f.detach()) * g).sum())

    fd = (loss(p + h) - loss(p - h)) / (2 * h)
    assert abs(float(gp) - fd) <= 1e-3 * max(1.0, abs(fd))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_cuda_module_gradients(name: str) -> None:
    x, c, gen = _problem(21, B=5000)
    kw = PARAMS[name]
    f = torch.randn(5, 2, 5000, generator=gen, dtype=torch.float64)
    g = torch.randn(5, 2, 40, generator=gen, dtype=torch.float64)
    ref_op = OnTheFlyResampler(x, c, name, dtype=torch.float64, trainable=True, **kw)
    fr = f.clone().requires_grad_()
    (ref_op(fr) * g).sum().backward()
    op = OnTheFlyResampler(x, c, name, device="cuda", trainable=True, **kw)
    fc = f.float().cuda().requires_grad_()
    out = op(fc)
    (out * g.float().cuda()).sum().backward()
    _close(out.cpu(), ref_op(f).detach())
    assert fc.grad is not None
    assert fr.grad is not None
    assert op.c.grad is not None
    assert ref_op.c.grad is not None
    assert op.param.grad is not None
    assert ref_op.param.grad is not None
    _close(fc.grad.cpu(), fr.grad)
    _close(op.c.grad.cpu(), ref_op.c.grad, rtol=1e-4)
    _close(op.param.grad.cpu(), ref_op.param.grad, rtol=1e-4)


def test_dense_reference_agrees_with_named_responses() -> None:
    """The helper above and resample_cases.RESPONSES describe the same responses."""
    x, c, gen = _problem(3)
    f = torch.randn(2, 2, 300, generator=gen, dtype=torch.float64)
    g = torch.ones(2, 2, 40, dtype=torch.float64)
    for name, (_, r) in RESPONSES.items():
        _close(_dense_grads(name, x, c, f, g)[0], dense_ref(x, c, r, f), 1e-12)
