"""Banded response operator against what its users run today (issues 3 and 15).

Run as ``python -m benchmarks.bench_resample [--smoke] [--device cuda]``. N functions on B fine
points, A coarse points each, a Gaussian response cut so that W is about 1500 fine points at
full size, M input sets. The baselines are the users' own code from the seed question:
``torch.einsum("nab,nb->na", T, f)`` with the dense T (N, A, B), one call per input set, and
``T.to_sparse()`` + ``torch.bmm``; for M > 1 their batched forms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks._common import markdown_table, parse_args, report, synchronize
from gpu_ops import BandedResampler, OnTheFlyResampler, packbits
from harness.memory import from_dense_peak

Fn = Callable[[torch.Tensor], torch.Tensor]

INTRO = """\
Baselines, the users' own code: `torch.einsum("nab,nb->na", T, f)` with the dense T (their
loop makes one such call per input set) and `T.to_sparse()` + `torch.bmm`, at M = 1; for
M > 1 their batched forms, `torch.einsum("nab,mnb->mna", T, f)` and the sparse `bmm` of all
M sets at once (M = 16 only: at M = 64 a call takes minutes here). "x loop" compares with the
users' loop of M single-set calls, counted as M times their M = 1 call. fwd+bwd is the
gradient w.r.t. f (on the fly: also w.r.t. c and sigma).

Timing: the methods of one M are timed in interleaved rounds (every method once per round),
so a change of load on the shared machine hits all of them alike; each row is the median of
its rounds (the dense and sparse baselines, seconds per call, take part in fewer rounds)."""


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class _Method:
    name: str
    fn: Fn
    nbytes: int  # what the method keeps resident for the operator
    heavy: bool = False  # seconds per call: fewer rounds
    params: Sequence[torch.Tensor] = ()
    fwd: float = 0.0  # median seconds
    fwd_bwd: float = 0.0


def _fwd(m: _Method, f: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        m.fn(f)

    return run


def _fwd_bwd(m: _Method, f: torch.Tensor) -> Callable[[], None]:
    fr = f.detach().clone().requires_grad_()

    def run() -> None:
        m.fn(fr).sum().backward()  # type: ignore[no-untyped-call]
        fr.grad = None
        for p in m.params:
            p.grad = None

    return run


def _measure(
    methods: list[_Method], f: torch.Tensor, device: str, rounds: int, heavy: int,
    clock: Callable[[], float] = time.perf_counter,
) -> None:  # fmt: skip
    """Median fwd and fwd+bwd times, every method once per round (heavy ones: ``heavy`` rounds).

    ``clock``: wall time by default; ``time.process_time`` gives the CPU time this process
    spent, which a shared machine's other load does not inflate (one thread only).
    """
    runs = [(m, _fwd(m, f), _fwd_bwd(m, f)) for m in methods]
    for _, fwd, fwd_bwd in runs:  # warm-up: first-call costs (allocations, kernel builds)
        fwd()
        fwd_bwd()
    times: dict[str, tuple[list[float], list[float]]] = {m.name: ([], []) for m in methods}
    for r in range(rounds):
        for m, fwd, fwd_bwd in runs:
            if m.heavy and r >= heavy:
                continue
            for fn, out in ((fwd, times[m.name][0]), (fwd_bwd, times[m.name][1])):
                synchronize(device)
                t0 = clock()
                fn()
                synchronize(device)
                out.append(clock() - t0)
    for m in methods:
        m.fwd, m.fwd_bwd = (statistics.median(t) for t in times[m.name])


def _section(device: str, smoke: bool) -> str:
    Ms: tuple[int, ...] = (1, 4) if smoke else (1, 16, 64)
    N, A, B = (2, 20, 2000) if smoke else (20, 500, 50000)
    rounds, heavy = (3, 1) if smoke else (15, 3)
    gen = torch.Generator().manual_seed(0)
    x = torch.linspace(0.0, 1.0, B, dtype=torch.float64)
    c = torch.rand(N, A, generator=gen, dtype=torch.float64)
    sigma = 1500 / (B - 1) / 8  # cut at 4 sigma: W ~ 1500 fine points at full size
    # The stored bands whatever their size (60 MB in float32 at full size): what is measured.
    kw: dict[str, Any] = {"sigma": sigma, "device": device, "max_band_bytes": None}
    f32 = BandedResampler.from_response(x, c, "gaussian", **kw)
    bf16 = BandedResampler.from_response(x, c, "gaussian", dtype=torch.bfloat16, **kw)
    otf = OnTheFlyResampler.from_response(x, c, "gaussian", sigma=sigma, device=device)
    T = f32.to_dense()  # (N, A, B) float32: the users' operator
    Ts = T.to_sparse()
    dense, sparse = _bytes(T), _bytes(Ts.indices(), Ts.values())
    rows: list[tuple[int, _Method]] = []
    for M in Ms:
        f = torch.randn(M, N, B, generator=gen).to(device)
        if M == 1:
            base = [
                _Method('users: einsum("nab,nb->na", T, f)',
                        lambda f: torch.einsum("nab,nb->na", T, f[0])[None], dense, True),
                _Method("users: T.to_sparse() + bmm",
                        lambda f: torch.bmm(Ts, f[0][..., None])[None, ..., 0], sparse, True),
            ]  # fmt: skip
        else:
            base = [
                _Method('batched: einsum("nab,mnb->mna", T, f)',
                        lambda f: torch.einsum("nab,mnb->mna", T, f), dense, True),
            ]  # fmt: skip
            if M <= 16 or smoke:
                base.append(_Method("batched: T.to_sparse() + bmm",
                                    lambda f: torch.bmm(Ts, f.permute(1, 2, 0)).permute(2, 0, 1),
                                    sparse, True))  # fmt: skip
        ours = [
            _Method("ours f32", f32, f32.nbytes),
            _Method("ours bf16", bf16, bf16.nbytes),
            _Method("ours on-the-fly", otf, otf.nbytes, params=list(otf.parameters())),
        ]
        _measure(base + ours, f, device, rounds, heavy)
        rows += [(M, m) for m in base + ours]
    threads = torch.get_num_threads()
    text = (
        f"### {device}: N={N}, A={A}, B={B}, W={f32.band_width}, "
        f"dense T {dense / 2**30:.2f} GiB, {threads} threads\n\n"
        + _table(rows)
        + "\n\nTargets (issue 15):\n\n"
        + _targets(rows, Ms, device, (N, A, B, sigma))
    )
    if device == "cpu":
        # The same M = 1 rows on one thread in CPU time (process_time): what the kernels cost,
        # without the time other processes take the cores away.
        one = [_Method(m.name, m.fn, m.nbytes, m.heavy, m.params) for k, m in rows if k == 1]
        torch.set_num_threads(1)
        try:
            _measure(one, torch.randn(1, N, B, generator=gen), device, rounds, heavy,
                     clock=time.process_time)  # fmt: skip
        finally:
            torch.set_num_threads(threads)
        text += (
            "\n\nM = 1 on one thread, CPU time of this process:\n\n"
            + _table([(1, m) for m in one])
            + "\n\n"
            + _targets([(1, m) for m in one], (1,), "", (N, A, B, sigma))
        )
    return text


def _users(rows: list[tuple[int, _Method]]) -> _Method:
    return next(m for M, m in rows if M == 1 and m.name.startswith("users: einsum"))


def _table(rows: list[tuple[int, _Method]]) -> str:
    users = _users(rows)
    out = []
    for M, m in rows:
        # The users' loop over M sets: M single-set calls.
        loop_f, loop_fb = M * users.fwd, M * users.fwd_bwd
        out.append([
            M, m.name, m.fwd * 1e3, loop_f / m.fwd, m.fwd_bwd * 1e3, loop_fb / m.fwd_bwd,
            m.nbytes,
        ])  # fmt: skip
    headers = [
        "M", "method", "fwd ms", "fwd x loop", "fwd+bwd ms", "fwd+bwd x loop",
        "operator bytes",
    ]  # fmt: skip
    return markdown_table(headers, out)


def _targets(
    rows: list[tuple[int, _Method]], Ms: Sequence[int], device: str,
    size: tuple[int, int, int, float],
) -> str:  # fmt: skip
    def get(M: int, prefix: str) -> _Method:
        return next(m for k, m in rows if k == M and m.name.startswith(prefix))

    users, sparse = _users(rows), get(1, "users: T.to_sparse")
    f32, bf16, otf = (get(1, p) for p in ("ours f32", "ours bf16", "ours on-the-fly"))
    checks = [
        ("f32, M=1: fwd >= 50x users' einsum", users.fwd / f32.fwd, 50.0, True),
        ("f32, M=1: fwd+bwd >= 50x users' einsum", users.fwd_bwd / f32.fwd_bwd, 50.0, True),
        ("bf16, M=1: fwd >= 50x users' einsum", users.fwd / bf16.fwd, 50.0, True),
        ("bf16, M=1: fwd+bwd >= 50x users' einsum", users.fwd_bwd / bf16.fwd_bwd, 50.0, True),
        ("f32, M=1: fwd x T.to_sparse() + bmm", sparse.fwd / f32.fwd, 1.0, True),
        ("f32, M=1: fwd+bwd x T.to_sparse() + bmm", sparse.fwd_bwd / f32.fwd_bwd, 1.0, True),
        ("bf16 fwd time / f32 fwd time, M=1 (<= 0.7)", bf16.fwd / f32.fwd, 0.7, False),
        ("on-the-fly, M=1: fwd >= 1.0x users' einsum", users.fwd / otf.fwd, 1.0, True),
        ("on-the-fly, M=1: fwd+bwd >= 1.0x users' einsum", users.fwd_bwd / otf.fwd_bwd, 1.0, True),
    ]
    for M in Ms[1:]:
        batched, mine, fly = (get(M, p) for p in ("batched: einsum", "ours f32", "ours on-the-fly"))
        checks += [
            (f"f32, M={M}: fwd x batched einsum", batched.fwd / mine.fwd, 1.0, True),
            (f"f32, M={M}: fwd+bwd x batched einsum", batched.fwd_bwd / mine.fwd_bwd, 1.0, True),
            (f"on-the-fly, M={M}: fwd >= 1.0x batched einsum", batched.fwd / fly.fwd, 1.0, True),
        ]
    if device == "cpu":
        N, A, B, sigma = size
        peak = from_dense_peak(N, A, B, sigma)
        checks.append(("from_dense: peak memory above T, in T (<= 0.2)", peak, 0.2, False))
    out = []
    for what, value, goal, higher in checks:
        ok = value >= goal if higher else value <= goal
        out.append([what, f"{value:.3g}", "yes" if ok else "no"])
    return markdown_table(["target", "measured", "met"], out)


DEMO_INTRO = """\
### The demo workload from packed bits (issue 20)

The server's demo: bit-packed spike rows at 10% density, a stored Gaussian band of sigma =
125 fine points cut at 4 sigma (W = 1000), 500 sorted random coarse points per row. Before:
what the pipeline ran until issue 20, `unpackbits` into float32 then the band
(`op(unpackbits(packed, count=B))`); after: `op.forward_bits(packed)`, whose cost model picks
per input the band or the event scatter (its band path on the CPU reads the bits itself,
each row unpacked into a per-thread buffer). Both in this run, interleaved rounds, wall time
(CPU: also one thread in CPU time)."""


def _demo(device: str, smoke: bool, threads: int | None) -> list[list[object]]:
    N, A, B = (2, 50, 5000) if smoke else (20, 500, 50000)
    gen = torch.Generator().manual_seed(0)
    x = torch.arange(B, dtype=torch.float64)
    c = torch.sort(torch.rand(N, A, generator=gen, dtype=torch.float64) * B, dim=1).values
    op = BandedResampler.from_response(
        x, c, "gaussian", 4.0, sigma=125.0, device=device, max_band_bytes=None
    )
    rows: list[list[object]] = []
    for M in (1, 16):
        packed = packbits(torch.rand(M, N, B, generator=gen) < 0.1, dim=-1).to(device)

        def before(p: torch.Tensor = packed) -> torch.Tensor:
            f = torch.ops.bitserve.unpackbits(p, 2, B, "big", torch.float32)
            out: torch.Tensor = op(f)
            return out

        def after(p: torch.Tensor = packed) -> torch.Tensor:
            return op.forward_bits(p)

        clock = time.process_time if threads == 1 else time.perf_counter
        with torch.inference_mode():
            torch.testing.assert_close(after(), before(), rtol=1e-4, atol=1e-3)
            times: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(3 if smoke else 15):
                for name, fn in (("before", before), ("after", after)):
                    synchronize(device)
                    t0 = clock()
                    fn()
                    synchronize(device)
                    times[name].append(clock() - t0)
            path = op.plan_bits(packed).path
        b, a = (statistics.median(times[k]) for k in ("before", "after"))
        label = f"{device}, {'1 thread (CPU time)' if threads == 1 else 'all threads'}"
        rows.append([label, M, f"{b * 1e3:.2f}", f"{a * 1e3:.2f}", path, f"{b / a:.2f}"])
    return rows


def demo_section(devices: Sequence[str], smoke: bool) -> str:
    rows: list[list[object]] = []
    for device in devices:
        rows += _demo(device, smoke, None)
        if device == "cpu":
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                rows += _demo(device, smoke, 1)
            finally:
                torch.set_num_threads(threads)
    headers = ["device", "M", "before ms", "after ms", "path taken", "before / after"]
    return DEMO_INTRO + "\n\n" + markdown_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    report(
        "resample",
        "Banded response operator (gpu_ops.resample) against the users' einsum",
        INTRO
        + "\n\n"
        + "\n\n".join(_section(d, args.smoke) for d in args.device)
        + "\n\n"
        + demo_section(args.device, args.smoke),
        smoke=args.smoke,
        devices=args.device,
    )


if __name__ == "__main__":
    main()
