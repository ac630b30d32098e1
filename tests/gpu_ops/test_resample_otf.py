"""On-the-fly Triton kernels (weights computed in registers) against the torch on-the-fly path.

Without a GPU they run interpreted on CPU tensors (``TRITON_INTERPRET=1``, set by conftest).
"""

from __future__ import annotations

import pytest
import torch

from gpu_ops import BandedResampler
from tests.common_utils import needs_triton

PARAMS = {
    "gaussian": {"sigma": 1.5},
    "boxcar": {"half_width": 2.5},
    "triangle": {"half_width": 3.0},
    "lorentzian": {"gamma": 0.7},
}


def _problem(seed: int, B: int = 300) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.sort(torch.rand(B, generator=gen, dtype=torch.float64) * 100).values  # uneven
    c = torch.rand(2, 40, generator=gen, dtype=torch.float64) * 120 - 10  # unsorted, clipped
    return x, c, gen


def _close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 2e-5) -> None:
    scale = float(ref.abs().max().clamp(min=1e-12))
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=rtol * scale)


@needs_triton
@pytest.mark.parametrize(
    ("name", "M"),
    # M = 70: two blocks of inputs, so every axis of the flat launch grid has several.
    [(name, M) for name in sorted(PARAMS) for M in (1, 3, 20)] + [("gaussian", 70)],
)
def test_triton_on_the_fly_matches_torch_path(name: str, M: int) -> None:
    from gpu_ops._triton import resample_otf as ko

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, c, gen = _problem(hash((name, M)) % 2**31)
    op = BandedResampler.from_response(x, c, name, on_the_fly=True, dtype=torch.float64,
                                       **PARAMS[name])  # fmt: skip
    f = torch.randn(M, 2, 300, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(M, 2, 40, generator=gen, dtype=torch.float64)
    (op(f) * g).sum().backward()  # the torch on-the-fly path in float64: the reference
    ref = op(f).detach()
    assert op._otf is not None
    spec, support = op._otf
    p_param = getattr(op, spec.param)
    p = float(p_param.detach())
    geo = ko.prepare(x.to(device), op.c.detach().float().to(device), name, p,
                     spec.half_width(p, support))  # fmt: skip
    f32 = f.detach().float().to(device).contiguous()
    g32 = g.float().to(device).contiguous()
    _close(ko.forward(f32, geo).cpu(), ref)
    _close(ko.grad_f(g32, geo, 300).cpu(), f.grad)  # type: ignore[arg-type]
    gc, gp = ko.grad_c_param(f32, g32, geo)
    assert op.c.grad is not None
    assert p_param.grad is not None
    _close(gc.cpu(), op.c.grad)
    _close(gp.cpu(), p_param.grad, rtol=1e-4)
    if name == "boxcar":
        assert not bool(gc.any())
        return
    # Finite differences of the float64 forward in the parameter: independent of both paths.
    h = 1e-6 * p

    def loss(value: float) -> float:
        kw = {spec.param: value}
        shifted = BandedResampler.from_response(
            x, c, name, on_the_fly=True, dtype=torch.float64, **kw
        )
        with torch.no_grad():
            return float((shifted(f.detach()) * g).sum())

    fd = (loss(p + h) - loss(p - h)) / (2 * h)
    assert abs(float(gp) - fd) <= 1e-3 * max(1.0, abs(fd))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_cuda_on_the_fly_module_gradients(name: str) -> None:
    x, c, gen = _problem(21, B=5000)
    kw = PARAMS[name]
    f = torch.randn(5, 2, 5000, generator=gen, dtype=torch.float64)
    g = torch.randn(5, 2, 40, generator=gen, dtype=torch.float64)
    ref_op = BandedResampler.from_response(x, c, name, on_the_fly=True, dtype=torch.float64, **kw)
    fr = f.clone().requires_grad_()
    (ref_op(fr) * g).sum().backward()
    op = BandedResampler.from_response(x, c, name, on_the_fly=True, device="cuda", **kw)
    fc = f.float().cuda().requires_grad_()
    out = op(fc)
    (out * g.float().cuda()).sum().backward()
    _close(out.cpu(), ref_op(f).detach())
    assert fc.grad is not None
    assert fr.grad is not None
    assert op.c.grad is not None
    assert ref_op.c.grad is not None
    _close(fc.grad.cpu(), fr.grad)
    _close(op.c.grad.cpu(), ref_op.c.grad, rtol=1e-4)
    p, p_ref = getattr(op, next(iter(kw))), getattr(ref_op, next(iter(kw)))
    _close(p.grad.cpu(), p_ref.grad, rtol=1e-4)
