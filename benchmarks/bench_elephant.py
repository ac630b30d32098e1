"""forward_bits against Elephant's instantaneous_rate: parity and speed (issue 20).

Run as ``python -m benchmarks.bench_elephant [--smoke]`` (needs the ``bench`` extra:
elephant). The neuroscience workload: 20 Poisson spike trains at 5-50 Hz, 5 s at 10 kHz
(B = 50,000 fine points), firing rates every 10 ms (A = 500 coarse points). Both sides get
the same spikes on the fine grid; one thread each.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks._common import markdown_table, parse_args, report
from gpu_ops import OnTheFlyResampler

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

INTRO = f"""\
Elephant's `elephant.statistics.instantaneous_rate` bins the spikes at its sampling period
and convolves the bins with the kernel by FFT (`scipy.signal.fftconvolve`), so its cost does
not depend on sigma but on the number of samples, and its accuracy on the sampling period:
at 10 ms every spike is moved to its 10 ms bin. `forward_bits` (an `OnTheFlyResampler`,
`normalize=True`, rates in Hz) reads the packed spike bits (0.1 ms resolution) and writes the
rates at the 10 ms coarse points only, by the path its cost model picks per input (`event`:
each spike adds its kernel to the coarse points in reach; `band`: every fine point of every
window; `prefix`: prefix sums, for the piecewise polynomial kernels). Elephant at a 0.1 ms
sampling period is the same computation as ours (spikes at their fine points), so "matching
accuracy" compares with it. Kernels cut at {CUTOFF:g} sigma (Elephant's default `cutoff`),
centred on their median (Elephant's `center_kernel=True`). One thread each
(`torch.set_num_threads(1)`; scipy's FFT is single-threaded); medians of repeated calls,
wall time."""


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


# Elephant's AlphaKernel.icdf solves for its quantile starting from the fraction itself taken
# as seconds (fsolve from x0 = 0.5 s): for sigma of some ms it stops there and returns 0.5 s,
# so its median-centred alpha rates are shifted by ~0.5 s. The alpha rows compare the kernels
# uncentred (center="none", Elephant's center_kernel=False), which does not need the median.
UNCENTRED = ("alpha",)


def operator(w: Workload, name: str, sigma: float) -> OnTheFlyResampler:
    N, B = w.bits.shape
    A = round(w.duration / STEP)
    x = torch.arange(B, dtype=torch.float64) / FS
    c = (torch.arange(A, dtype=torch.float64) * STEP).expand(N, A).contiguous()
    support = None if name in COMPACT else CUTOFF
    center = "none" if name in UNCENTRED else "median"
    return OnTheFlyResampler(x, c, name, support, sigma=sigma, normalize=True, center=center)


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
            center_kernel=name not in UNCENTRED,
        )  # fmt: skip
    return np.asarray(rate.magnitude).T


def parity(w: Workload, sigmas: Sequence[float]) -> str:
    rows = []
    for name in KERNELS:
        for sigma in sigmas:
            ref = elephant_rate(w, name, sigma, 1 / FS)[:, :: round(STEP * FS)]
            with torch.inference_mode():
                ours = operator(w, name, sigma).forward_bits(w.packed)[0].double().numpy()
            err = float(np.abs(ours - ref).max() / np.abs(ref).max())
            label = f"{name} (uncentred)" if name in UNCENTRED else name
            rows.append([label, f"{sigma * 1e3:g}", f"{np.abs(ref).max():.4g}", f"{err:.2e}",
                         "yes" if err <= 1e-5 else "no"])  # fmt: skip
    headers = ["kernel", "sigma ms", "peak Hz", "largest error / peak (float32)", "<= 1e-5"]
    return markdown_table(headers, rows)


def _median(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(ws: Sequence[Workload], sigmas: Sequence[float], repeat: int) -> tuple[str, bool]:
    rows, met = [], True
    for w in ws:
        for sigma in sigmas:
            op = operator(w, "gaussian", sigma)
            packed = w.packed
            with torch.inference_mode():
                ours = _median(lambda: op.forward_bits(packed), repeat)  # noqa: B023
                path = op.plan_bits(packed).path
            coarse = _median(lambda: elephant_rate(w, "gaussian", sigma, STEP), repeat)  # noqa: B023
            fine = _median(lambda: elephant_rate(w, "gaussian", sigma, 1 / FS), max(3, repeat // 3))  # noqa: B023
            ok = coarse / ours >= 5 and fine / ours >= 20
            met &= ok
            rows.append([
                w.name, f"{sigma * 1e3:g}", f"{coarse * 1e3:.2f}", f"{fine * 1e3:.1f}",
                f"{ours * 1e3:.3f}", path, f"{coarse / ours:.1f}", f"{fine / ours:.0f}",
                "yes" if ok else "no",
            ])  # fmt: skip
    headers = [
        "spikes", "sigma ms", "Elephant 10 ms: ms", "Elephant 0.1 ms: ms", "forward_bits ms",
        "path", "x Elephant 10 ms", "x Elephant 0.1 ms", ">= 5x and >= 20x",
    ]  # fmt: skip
    return markdown_table(headers, rows), met


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        N, duration = (3, 0.5) if args.smoke else (20, 5.0)
        ws = workloads(N, duration)
        sigmas = (0.01,) if args.smoke else (0.001, 0.01, 0.05, 0.2)
        parity_table = parity(ws[0], (0.01,) if args.smoke else (0.01, 0.05))
        speed_table, met = speed(ws, sigmas, 3 if args.smoke else 15)
    finally:
        torch.set_num_threads(threads)
    spikes = int(ws[0].bits.sum())
    body = (
        f"{INTRO}\n\n### Parity (spikes 5-50 Hz, {N} trains, {duration:g} s: {spikes} spikes)\n\n"
        "Largest difference from Elephant at a 0.1 ms sampling period (its rates taken at our "
        "10 ms coarse points), as a fraction of the largest rate. The alpha kernel is compared "
        "uncentred: Elephant 1.2's `AlphaKernel.icdf(0.5)` returns 0.5 s for sigma of a few ms "
        "(its solver starts from 0.5 s and stops there), so its median-centred alpha rates are "
        "off by about 0.5 s; ours centre on the true median, 1.678 tau.\n\n"
        f"{parity_table}\n\n### Speed (Gaussian kernel)\n\n{speed_table}\n\n"
        f"Speed targets (>= 5x Elephant at 10 ms and >= 20x at 0.1 ms, every row): "
        f"{'met' if met else 'NOT met'}."
    )
    report("elephant", "forward_bits against Elephant's instantaneous_rate", body,
           smoke=args.smoke, devices=["cpu"])  # fmt: skip


if __name__ == "__main__":
    main()
