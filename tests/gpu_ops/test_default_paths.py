"""The default call is the fast call (issue 35): what a plain script gets (grad mode on,
default arguments) from both resamplers, against the float64 dense reference; gradients when
asked; no band past ``max_band_bytes``; ties at the cut and the alpha kernel against Elephant.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gpu_ops import BandedResampler, OnTheFlyResampler, packbits
from gpu_ops.resample import MAX_BAND_BYTES
from tests.gpu_ops.resample_cases import assert_close

SQ2 = math.sqrt(2.0)


def _lattice(B: int, A: int, step: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """x (B,) in seconds at 10 kHz, c (3, A) every ``step`` fine points, random bits."""
    x = torch.arange(B, dtype=torch.float64) / 1e4
    c = (torch.arange(A, dtype=torch.float64) * step / 1e4).expand(3, A).contiguous()
    bits = torch.rand(2, 3, B, generator=gen) < 0.02
    return x, c, bits


def _dense(x: torch.Tensor, c: torch.Tensor, sigma: float, bits: torch.Tensor) -> torch.Tensor:
    """The float64 dense reference: a normalised Gaussian cut at 4 sigma, T (N, A, B) @ bits
    (an offset of exactly 4 sigma counts: the grids put some there)."""
    d = c[..., None] - x
    T = torch.exp(-0.5 * (d / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    T = T * (d.abs() <= 4 * sigma * (1 + 1e-9))
    return torch.einsum("nab,mnb->mna", T, bits.double())


@pytest.mark.parametrize("kind", ["on_the_fly", "stored"])
def test_the_default_call_takes_the_inference_path_and_matches_the_reference(kind: str) -> None:
    gen = torch.Generator().manual_seed(35)
    x, c, bits = _lattice(3000, 30, 100, gen)
    sigma = 0.004
    op: BandedResampler | OnTheFlyResampler
    if kind == "on_the_fly":
        op = OnTheFlyResampler(x, c, "gaussian", sigma=sigma, normalize=True)
        assert not any(p.requires_grad for p in op.parameters())  # frozen unless asked
    else:
        op = BandedResampler.from_response(x, c, "gaussian", sigma=sigma, normalize=True)
        assert isinstance(op, BandedResampler)
    packed = packbits(bits, dim=-1)
    assert torch.is_grad_enabled()
    plan = op.plan_bits(packed)
    with torch.inference_mode():
        assert op.plan_bits(packed) == plan
    assert plan.path == "event"  # sparse bits: not the band
    out = op.forward_bits(packed)
    assert not out.requires_grad
    assert_close(out, _dense(x, c, sigma, bits), 1e-5)


def test_gradients_when_asked() -> None:
    """trainable=True, or requires_grad_() later: the band path with autograd, gradcheck of
    the module itself (its c and width) in float64."""
    gen = torch.Generator().manual_seed(36)
    x = torch.sort(torch.rand(60, generator=gen, dtype=torch.float64) * 10).values
    c = torch.rand(2, 5, generator=gen, dtype=torch.float64) * 10
    bits = torch.rand(2, 2, 60, generator=gen) < 0.4
    packed = packbits(bits, dim=-1)
    for op in (
        OnTheFlyResampler(x, c, "laplacian", dtype=torch.float64, sigma=1.5, trainable=True),
        OnTheFlyResampler(x, c, "laplacian", dtype=torch.float64, sigma=1.5).requires_grad_(),
    ):
        assert op.c.requires_grad
        assert op.param.requires_grad
        assert op.plan_bits(packed).path == "band"
        op.forward_bits(packed).square().sum().backward()
        assert op.c.grad is not None
        assert op.param.grad is not None

        def fn(cc: torch.Tensor, p: torch.Tensor, op: OnTheFlyResampler = op) -> torch.Tensor:
            state = {"c": cc, "tau": p}
            return torch.func.functional_call(op, state, (bits.double(),))

        inputs = (
            op.c.detach().clone().requires_grad_(),
            op.param.detach().clone().requires_grad_(),
        )
        assert torch.autograd.gradcheck(fn, inputs)
    frozen = OnTheFlyResampler(x, c, "laplacian", dtype=torch.float64, sigma=1.5)
    f = bits.double().requires_grad_()
    frozen(f).sum().backward()  # gradients still reach f
    assert f.grad is not None
    assert frozen.c.grad is None


def test_no_band_past_the_limit_at_a_wide_kernel() -> None:
    """The issue's case: 20 trains, 500 coarse x 50,000 fine points, sigma 200 ms cut at
    5 sigma: a band of 20 x 500 x 20,001 float32 (800 MB) is not built."""
    x = torch.arange(50_000, dtype=torch.float64) / 1e4
    c = (torch.arange(500, dtype=torch.float64) * 0.01).expand(20, 500).contiguous()
    op = BandedResampler.from_response(x, c, "gaussian", 5.0, sigma=0.2, normalize=True)
    assert isinstance(op, OnTheFlyResampler)
    tensors = [*op.parameters(), *op.buffers()]
    assert max(t.numel() * t.element_size() for t in tensors) < 1 << 20  # c: 80 kB
    assert op.nbytes < 1 << 20 < MAX_BAND_BYTES  # x and c: 480 kB
    assert not any(t.requires_grad for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_past_the_limit_the_same_outputs(dtype: torch.dtype) -> None:
    """Every option goes to the on-the-fly module: its outputs are the band's."""
    gen = torch.Generator().manual_seed(37)
    x = torch.sort(torch.rand(400, generator=gen, dtype=torch.float64)).values
    c = torch.rand(3, 20, generator=gen, dtype=torch.float64)
    f = torch.rand(2, 3, 400, generator=gen, dtype=dtype)
    kw: dict[str, Any] = {"normalize": True, "border": "correct", "scale": 2.0, "center": "peak"}
    band = BandedResampler.from_response(x, c, "alpha", 4.0, sigma=0.05, dtype=dtype, **kw)
    otf = BandedResampler.from_response(
        x, c, "alpha", 4.0, max_band_bytes=100, dtype=dtype, **kw, sigma=0.05
    )
    assert isinstance(band, BandedResampler)
    assert isinstance(otf, OnTheFlyResampler)
    assert otf.param.dtype == dtype
    assert_close(otf(f), band(f).double(), 1e-5 if dtype == torch.float32 else 1e-12)
    with pytest.warns(UserWarning, match="max_band_bytes"):  # a callable: its band, warned
        BandedResampler.from_response(
            x, c, lambda d: (d.abs() < 0.1).double(), 0.1, max_band_bytes=100
        )


def test_a_tie_at_the_cut_counts_in_float32_and_float64() -> None:
    """An event exactly at the cut (5 sigma, a whole number of fine steps) counts as in
    Elephant's kernel array, whichever way the rounding of c - x or of the cut falls."""
    x = torch.arange(50_000, dtype=torch.float64) / 1e4
    c = (torch.arange(500, dtype=torch.float64) * 0.01)[None]
    f = torch.zeros(1, 50_000)
    f[0, [19_500, 30_500]] = 1.0  # 500 fine steps = 5 sigma before 2.0 s and after 3.0 s
    for dtype in (torch.float32, torch.float64):
        op = OnTheFlyResampler(x, c, "laplacian", 5.0, sigma=0.01, dtype=dtype)
        out = op(f.to(dtype))[0]
        tail = math.exp(-5 * SQ2)  # the laplacian at 5 sigma
        torch.testing.assert_close(float(out[200]), tail, rtol=1e-6, atol=0)
        torch.testing.assert_close(float(out[300]), tail, rtol=1e-6, atol=0)


def test_alpha_weights_are_elephants_alpha_kernel() -> None:
    """Ours (normalised, centred on the median, cut at 5 sigma around it) against
    ``elephant.kernels.AlphaKernel`` at Elephant's own median, at the offsets Elephant's
    instantaneous_rate evaluates (the kernel array, ends included)."""
    pytest.importorskip("elephant")
    import quantities as pq
    from elephant.kernels import AlphaKernel

    sigma, dt = 0.05, 1e-4
    kernel = AlphaKernel(sigma=sigma * pq.s)
    median = float(kernel.icdf(0.5).rescale(pq.s).magnitude)
    assert median == pytest.approx(1.6783469900166608 * sigma / SQ2, rel=1e-9)
    half = round(5 * sigma / dt)
    lags = torch.arange(-half, half + 1, dtype=torch.float64)  # (c - x) / dt
    ref = kernel((lags.numpy() * dt + median) * pq.s).rescale(pq.Hz).magnitude
    x = torch.arange(-2 * half, 2 * half + 1, dtype=torch.float64) * dt
    c = torch.zeros(1, 1, dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        op = OnTheFlyResampler(x, c, "alpha", sigma=sigma, normalize=True, dtype=dtype)
        row = op.to_dense()[0, 0].double()  # T[b] = r(0 - x[b])
        ours = row.flip(0)[half : 3 * half + 1]  # at lags -half..half
        peak = float(abs(ref).max())
        err = float((ours - torch.from_numpy(ref)).abs().max()) / peak
        assert err <= (1e-12 if dtype == torch.float64 else 1e-6)
        assert float(row.flip(0)[: half - 1].abs().max()) == 0.0  # nothing past the cut
        assert float(row.flip(0)[3 * half + 2 :].abs().max()) == 0.0


@pytest.mark.parametrize("sigma", [0.05, 0.2])
def test_alpha_rates_match_elephants_instantaneous_rate(sigma: float) -> None:
    """Median-centred alpha rates (center_kernel=True) where Elephant's icdf finds the median
    (at sigma <= 5 ms and at 30 ms it does not: see benchmarks/results/elephant.md)."""
    pytest.importorskip("elephant")
    from harness.elephant import Workload, centred, elephant_rate, operator, workloads

    assert centred("alpha", sigma)
    assert not centred("alpha", 0.005)  # Elephant's icdf returns 0.5 s there
    w = workloads(3, 1.0, seed=2)[0]
    bits = w.bits.copy()
    k = round(5 * sigma * 1e4)
    bits[0, [4000 - min(k, 4000), 6000 + min(k, 3999)]] = True  # ties at the cut
    w = Workload(w.name, bits, w.duration)
    ref = elephant_rate(w, "alpha", sigma, 1e-4)[:, ::100]
    ours = operator(w, "alpha", sigma).forward_bits(w.packed)[0].double().numpy()  # default call
    assert float(abs(ours - ref).max()) <= 1e-5 * float(abs(ref).max())
