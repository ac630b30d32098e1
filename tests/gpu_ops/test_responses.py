"""The named responses' shapes, sigma conventions and options against their closed forms.

Closed forms are Elephant's kernels (``elephant.kernels``), written out here: unit area,
``sigma`` the standard deviation, causal kernels centred on their median.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from gpu_ops import BandedResampler, OnTheFlyResampler, responses

SQ2 = math.sqrt(2.0)


def _pdf(name: str, s: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Elephant's kernel ``name`` of standard deviation s at times t (not centred)."""

    def pdf(t: torch.Tensor) -> torch.Tensor:
        if name == "gaussian":
            return torch.exp(-0.5 * (t / s) ** 2) / (s * math.sqrt(2 * math.pi))
        if name == "boxcar":
            tau = math.sqrt(3) * s
            return (t.abs() < tau).double() / (2 * tau)
        if name == "triangle":
            tau = math.sqrt(6) * s
            return (1 - t.abs() / tau).clamp(min=0) / tau
        if name == "epanechnikov":
            tau = math.sqrt(5) * s
            return 0.75 / tau * (1 - (t / tau) ** 2).clamp(min=0)
        if name == "laplacian":
            tau = s / SQ2
            return torch.exp(-t.abs() / tau) / (2 * tau)
        if name == "exponential":
            return (t >= 0) * torch.exp(-t.clamp(min=0) / s) / s
        assert name == "alpha"
        tau = s / SQ2
        return (t >= 0) * t.clamp(min=0) / tau**2 * torch.exp(-t.clamp(min=0) / tau)

    return pdf


SHARED = ["gaussian", "boxcar", "triangle", "epanechnikov", "laplacian", "exponential", "alpha"]
MEDIAN = {"exponential": math.log(2.0), "alpha": responses.ALPHA_MEDIAN / SQ2}  # in sigmas


def _weights(name: str, s: float, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, r(d)): the operator's row for one coarse point at 0 over a fine grid of offsets."""
    x = torch.linspace(-12 * s, 12 * s, 24000, dtype=torch.float64)  # no point on a cut
    c = torch.zeros(1, 1, dtype=torch.float64)
    op = BandedResampler.from_response(x, c, name, sigma=s, dtype=torch.float64, **kw)  # type: ignore[arg-type]
    T = op.to_dense()[0, 0]
    return -x, T


@pytest.mark.parametrize("name", SHARED)
def test_normalized_shapes_are_elephants_kernels_centred_on_their_median(name: str) -> None:
    s = 0.7
    compact = name in ("boxcar", "triangle", "epanechnikov")  # cut at their own ends
    d, r = _weights(name, s, normalize=True, support=None if compact else 5.0)
    shift = MEDIAN.get(name, 0.0) * s
    expected = _pdf(name, s)(d + shift) * ((d >= -5 * s) & (d <= 5 * s))
    if name == "boxcar":  # the edges: ours counts |d| <= tau, Elephant's |d| < tau
        keep = (d.abs() - math.sqrt(3) * s).abs() > 1e-9
        r, expected = r[keep], expected[keep]
    torch.testing.assert_close(r, expected.double(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", SHARED)
def test_sigma_is_the_standard_deviation_and_the_area_is_one(name: str) -> None:
    s = 0.5
    compact = name in ("boxcar", "triangle", "epanechnikov")
    d, r = _weights(name, s, normalize=True, support=None if compact else 20.0)
    dx = float(d[0] - d[1])
    area = float(r.sum() * dx)
    mean = float((r * d).sum() * dx) / area
    var = float((r * (d - mean) ** 2).sum() * dx) / area
    assert area == pytest.approx(1.0, abs=2e-3)
    assert math.sqrt(var) == pytest.approx(s, rel=2e-3)
    # Centred on the median: half the mass before the coarse point.
    before = float(r[d < 0].sum() * dx) + 0.5 * float(r[d == 0].sum() * dx)
    assert before == pytest.approx(0.5, abs=2e-3)


def test_centre_options_of_a_causal_response() -> None:
    s = 1.0
    d, peak = _weights("alpha", s, center="peak")
    assert float(d[int(peak.argmax())]) == pytest.approx(0.0, abs=1e-3)  # the mode at 0
    d, none = _weights("exponential", s, center="none")
    assert float(none[d < 0].abs().max()) == 0.0  # strictly causal
    assert float(none.max()) == pytest.approx(1.0, abs=1e-3)  # unit peak, not normalised


def test_scale_and_unit_peak() -> None:
    _, r = _weights("laplacian", 0.3)
    _, r3 = _weights("laplacian", 0.3, scale=3.0)
    assert float(r.max()) == pytest.approx(1.0, abs=1e-3)
    torch.testing.assert_close(r3, 3 * r)


def test_sigma_conversions_and_errors() -> None:
    x = torch.linspace(0, 10, 101, dtype=torch.float64)
    c = torch.rand(2, 5, dtype=torch.float64) * 10
    op = OnTheFlyResampler(x, c, "boxcar", sigma=1.0)
    assert float(op.half_width.detach()) == pytest.approx(math.sqrt(3))
    assert float(OnTheFlyResampler(x, c, "alpha", sigma=1.0).tau.detach()) == pytest.approx(1 / SQ2)
    with pytest.raises(ValueError, match=r"lorentzian.*gamma"):
        OnTheFlyResampler(x, c, "lorentzian", sigma=1.0)
    with pytest.raises(ValueError, match="center must be one of"):
        OnTheFlyResampler(x, c, "alpha", sigma=1.0, center="mean")
    with pytest.raises(ValueError, match="border must be one of"):
        BandedResampler.from_response(x, c, "gaussian", sigma=1.0, border="reflect")
    with pytest.raises(ValueError, match="normalize and border need"):
        BandedResampler.from_response(x, c, torch.exp, 1.0, normalize=True)


@pytest.mark.parametrize("name", ["gaussian", "exponential", "epanechnikov"])
def test_border_correction_divides_by_the_mass_inside_the_recording(name: str) -> None:
    """A constant input gives a constant rate everywhere, edges included."""
    dx = 0.01
    x = torch.arange(1000, dtype=torch.float64) * dx  # the recording is [0, 10)
    c = torch.linspace(0, 10, 41, dtype=torch.float64)[None, :-1]
    f = torch.ones(1, 1000, dtype=torch.float64)
    kw: dict[str, object] = {"normalize": True, "sigma": 0.4, "dtype": torch.float64}
    plain = BandedResampler.from_response(x, c, name, **kw)(f) * dx  # type: ignore[arg-type]
    fixed = BandedResampler.from_response(x, c, name, border="correct", **kw)(f) * dx  # type: ignore[arg-type]
    assert float(plain.min()) < 0.8  # the edges lose mass without the correction
    torch.testing.assert_close(fixed, torch.ones_like(fixed), rtol=0, atol=0.03)
    otf = OnTheFlyResampler(x, c, name, border="correct", **kw)(f) * dx  # type: ignore[arg-type]
    torch.testing.assert_close(otf, fixed, rtol=1e-9, atol=1e-9)


def test_on_the_fly_options_survive_save_and_load(tmp_path: object) -> None:
    from pathlib import Path

    from gpu_ops.resample import load

    x = torch.linspace(0, 10, 301, dtype=torch.float64)
    c = torch.rand(2, 7, dtype=torch.float64) * 10
    op = OnTheFlyResampler(
        x, c, "alpha", 4.0, sigma=0.5, normalize=True, center="peak", border="correct", scale=2.0
    )
    path = Path(str(tmp_path)) / "op.safetensors"
    op.save(path)
    back = load(path)
    f = torch.rand(3, 2, 301)
    torch.testing.assert_close(back(f), op(f))


@pytest.mark.parametrize(
    "name", ["gaussian", "boxcar", "triangle", "epanechnikov", "laplacian", "exponential"]
)
def test_rates_match_elephants_instantaneous_rate(name: str) -> None:
    """Against Elephant itself (the bench extra): its rates at the 0.1 ms sampling period,
    read at our 10 ms coarse points (the alpha kernel: see benchmarks/bench_elephant.py)."""
    pytest.importorskip("elephant")
    from harness.elephant import elephant_rate, operator, workloads

    w = workloads(2, 0.4, seed=1)[0]
    ref = elephant_rate(w, name, 0.01, 1e-4)[:, ::100]
    with torch.inference_mode():
        ours = operator(w, name, 0.01).forward_bits(w.packed)[0].double().numpy()
    assert float(abs(ours - ref).max()) <= 1e-5 * float(abs(ref).max())
