"""Elephant's ``instantaneous_rate`` beside ``forward_bits``: the workload both get and each
side's rates (the bench extra: elephant, neo, quantities), for the parity test and the
benchmark (``benchmarks/bench_elephant.py``)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_ops import BandedResampler, OnTheFlyResampler
from gpu_ops.responses import ALPHA_MEDIAN

FS = 10_000.0  # fine points per second
STEP = 0.01  # the coarse step: 10 ms
CUTOFF = 5.0  # Elephant's default cutoff, in sigmas

# Our response -> Elephant's kernel class (every kernel both sides have).
KERNELS = {
    "gaussian": "GaussianKernel",
    "boxcar": "RectangularKernel",
    "triangle": "TriangularKernel",
    "epanechnikov": "EpanechnikovLikeKernel",
    "laplacian": "LaplacianKernel",
    "exponential": "ExponentialKernel",
    "alpha": "AlphaKernel",
}
COMPACT = ("boxcar", "triangle", "epanechnikov")  # cut at their own ends


@dataclass
class Workload:
    """Spike trains on the fine grid: bits (N, B) and the spike times Elephant gets."""

    name: str
    bits: np.ndarray[Any, Any]  # (N, B) bool
    duration: float

    @property
    def packed(self) -> torch.Tensor:
        return torch.from_numpy(np.packbits(self.bits, axis=-1))[None]

    def spiketrains(self) -> list[Any]:
        import neo
        import quantities as pq

        # Each spike in the middle of its fine bin: np.histogram puts it in that bin whatever
        # the rounding, and Elephant convolves bins at their left edge, i.e. at x[b] as we do.
        return [
            neo.SpikeTrain(times / FS * pq.s, t_start=0 * pq.s, t_stop=self.duration * pq.s)
            for times in (np.flatnonzero(row) + 0.5 for row in self.bits)
        ]


def workloads(N: int, duration: float, seed: int = 0) -> list[Workload]:
    rng = np.random.default_rng(seed)
    B = round(duration * FS)
    rates = np.linspace(5.0, 50.0, N)
    spikes = np.zeros((N, B), dtype=bool)
    for n, rate in enumerate(rates):
        times = rng.uniform(0.0, duration, rng.poisson(rate * duration))
        spikes[n, np.floor(times * FS).astype(np.int64)] = True
    demo = rng.random((N, B)) < 0.1
    return [Workload("spikes 5-50 Hz", spikes, duration), Workload("demo 10%", demo, duration)]


def centred(name: str, sigma: float) -> bool:
    """Whether the two sides compare median-centred (Elephant's ``center_kernel=True``).

    Elephant's ``AlphaKernel.icdf`` solves for its quantile starting from the fraction itself
    taken as the time (``fsolve`` from x0 = 0.5 s): for sigma of some ms (and at 30 ms) it
    stops away from the root (0.5 s, 0.109 s), so its median-centred alpha rates are shifted
    by that. The alpha kernel compares uncentred there (``center="none"``,
    ``center_kernel=False``), which needs no median; centred where Elephant finds the median.
    """
    if name != "alpha":
        return True
    import quantities as pq
    from elephant.kernels import AlphaKernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fsolve's note that it is not making progress
        median = float(AlphaKernel(sigma=sigma * pq.s).icdf(0.5).rescale(pq.s).magnitude)
    return abs(median - ALPHA_MEDIAN * sigma / math.sqrt(2)) <= 1e-9 * sigma


def operator(
    w: Workload, name: str, sigma: float, *, banded: bool = False
) -> OnTheFlyResampler | BandedResampler:
    """The user's call beside Elephant's: ``OnTheFlyResampler(x, c, name, 5.0, sigma=sigma,
    normalize=True)`` (with ``banded``, ``BandedResampler.from_response`` of the same
    arguments), x and c in seconds; default arguments otherwise (frozen, grad mode as the
    caller's). Elephant's kernel array includes its ends, +-cutoff sigma exactly: our windows
    count such a tie too (:func:`gpu_ops.responses.inclusive`)."""
    N, B = w.bits.shape
    A = round(w.duration / STEP)
    x = torch.arange(B, dtype=torch.float64) / FS
    c = (torch.arange(A, dtype=torch.float64) * STEP).expand(N, A).contiguous()
    support = None if name in COMPACT else CUTOFF
    center = "median" if centred(name, sigma) else "none"
    build = BandedResampler.from_response if banded else OnTheFlyResampler
    return build(x, c, name, support, sigma=sigma, normalize=True, center=center)


def elephant_rate(w: Workload, name: str, sigma: float, period: float) -> np.ndarray[Any, Any]:
    """Elephant's rates (N, samples) in Hz at ``period`` seconds."""
    import quantities as pq
    from elephant import kernels
    from elephant.statistics import instantaneous_rate

    kernel = getattr(kernels, KERNELS[name])(sigma=sigma * pq.s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its notes on adjusted cutoffs and on quantities
        rate = instantaneous_rate(
            w.spiketrains(), period * pq.s, kernel=kernel, cutoff=CUTOFF,
            center_kernel=centred(name, sigma),
        )  # fmt: skip
    return np.asarray(rate.magnitude).T
