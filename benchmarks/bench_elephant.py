"""forward_bits against Elephant's instantaneous_rate: parity and speed (issue 20).

Run as ``python -m benchmarks.bench_elephant [--smoke]`` (needs the ``bench`` extra:
elephant). The neuroscience workload: 20 Poisson spike trains at 5-50 Hz, 5 s at 10 kHz
(B = 50,000 fine points), firing rates every 10 ms (A = 500 coarse points). Both sides get
the same spikes on the fine grid; one thread each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks._common import markdown_table, parse_args, report
from harness.elephant import (
    CUTOFF,
    FS,
    KERNELS,
    STEP,
    UNCENTRED,
    Workload,
    elephant_rate,
    operator,
    workloads,
)

INTRO = f"""\
Elephant's `elephant.statistics.instantaneous_rate` bins the spikes at its sampling period
and convolves the bins with the kernel by FFT (`scipy.signal.fftconvolve`), so its cost does
not depend on sigma but on the number of samples, and its accuracy on the sampling period:
at 10 ms every spike is moved to its 10 ms bin. `forward_bits` (an `OnTheFlyResampler`,
`normalize=True`, rates in Hz) reads the packed spike bits (0.1 ms resolution) and writes the
rates at the 10 ms coarse points only, by the path its cost model picks per input (`event`:
each spike adds its kernel to the coarse points in reach; `band`: every fine point of every
window; `prefix`: prefix sums, for the piecewise polynomial kernels). Here both grids are
even, the coarse step 100 fine steps: a lattice, on which the event path tabulates the
kernel once per operator (100 phases x the coarse points in reach) and each spike adds one
run of that table, summed per coarse step in vector registers ("event, lattice"; no kernel
value computed per spike). Elephant at a 0.1 ms
sampling period is the same computation as ours (spikes at their fine points), so "matching
accuracy" compares with it. Kernels cut at {CUTOFF:g} sigma (Elephant's default `cutoff`;
ours half a fine step further, so that a spike exactly {CUTOFF:g} sigma away counts on both
sides as it does in Elephant's kernel array), centred on their median (Elephant's
`center_kernel=True`). One thread each
(`torch.set_num_threads(1)`; scipy's FFT is single-threaded); medians of repeated calls in
CPU time of the process (one thread: what each side costs, whatever else the shared machine
runs)."""


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
    """Median CPU time of this process over ``repeat`` calls (after one untimed call): both
    sides run on one thread, so CPU time is their cost, whatever else the machine runs."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def speed(
    ws: Sequence[Workload], sigmas: Sequence[float], repeat: int
) -> tuple[str, dict[str, bool]]:
    rows: list[list[object]] = []
    met = {w.name: True for w in ws}
    for w in ws:
        for sigma in sigmas:
            op = operator(w, "gaussian", sigma)
            packed = w.packed
            with torch.inference_mode():
                ours = _median(lambda: op.forward_bits(packed), repeat)  # noqa: B023
                path = op.plan_bits(packed).path
                rates = op.forward_bits(packed)[0].double().numpy()
            if path == "event" and op.on_lattice:
                path = "event, lattice"
            coarse = _median(lambda: elephant_rate(w, "gaussian", sigma, STEP), repeat)  # noqa: B023
            fine = _median(lambda: elephant_rate(w, "gaussian", sigma, 1 / FS), max(3, repeat // 3))  # noqa: B023
            ref = elephant_rate(w, "gaussian", sigma, 1 / FS)[:, :: round(STEP * FS)]
            err = float(np.abs(rates - ref).max() / np.abs(ref).max())
            ok = coarse / ours >= 5 and fine / ours >= 20
            met[w.name] &= ok
            rows.append([
                w.name, f"{sigma * 1e3:g}", f"{coarse * 1e3:.2f}", f"{fine * 1e3:.1f}",
                f"{ours * 1e3:.3f}", path, f"{err:.1e}", f"{coarse / ours:.1f}",
                f"{fine / ours:.0f}", "yes" if ok else "no",
            ])  # fmt: skip
    headers = [
        "spikes", "sigma ms", "Elephant 10 ms: ms", "Elephant 0.1 ms: ms", "forward_bits ms",
        "path", "error / peak vs Elephant 0.1 ms", "x Elephant 10 ms", "x Elephant 0.1 ms",
        ">= 5x and >= 20x",
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
        "Speed targets (>= 5x Elephant at 10 ms and >= 20x at 0.1 ms at every sigma): "
        + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in met.items())
        + ". The exact sum costs events x coarse points in reach: the demo's 10% (100,000 "
        "ones in the 20 rows) has 36 times the spike trains' events, and at sigma = 200 ms "
        "each reaches 200 coarse points (20 M terms a call). Evaluating the kernel for each "
        "term took 13.7 ms there (1.1x Elephant at 10 ms, before the lattice); on the lattice "
        "a term is one float of a tabulated run added in a vector register. Elephant at 10 ms "
        "bins the spikes to 10 ms first (inexact), at 0.1 ms it pays a fine-grid FFT whatever "
        "the density. Errors are float32 sums against Elephant's float64 FFT at 0.1 ms."
    )
    report("elephant", "forward_bits against Elephant's instantaneous_rate", body,
           smoke=args.smoke, devices=["cpu"])  # fmt: skip


if __name__ == "__main__":
    main()
