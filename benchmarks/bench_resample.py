"""Banded response operator against what its users run today (issues 3 and 15).

Run as ``python -m benchmarks.bench_resample [--smoke] [--device cuda]``. N functions on B fine
points, A coarse points each, a Gaussian response cut so that W is about 1500 fine points at
full size, M input sets. The baselines are the users' own code from the seed question:

- ``torch.einsum("nab,nb->na", T, f)`` with the dense T (N, A, B), called once per input set
  (for M sets: their loop of M calls);
- ``T.to_sparse()`` + ``torch.bmm``, the sparse attempt the seed describes, at M=1 and batched;
- ``torch.einsum("nab,mnb->mna", T, f)``, the batched dense form a user could switch to.

fwd+bwd is the gradient w.r.t. f (on the fly: also w.r.t. c and sigma). Every row is timed
in this process, in this run; ratios are against the rows above them of the same M.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks._common import markdown_table, median_time, parse_args, report
from gpu_ops import BandedResampler, OnTheFlyResampler

Fn = Callable[[torch.Tensor], torch.Tensor]

INTRO = """\
Baselines, the users' own code: `torch.einsum("nab,nb->na", T, f)` with the dense T,
called once per input set (for M sets, their loop of M calls, timed as such), and
`T.to_sparse()` + `torch.bmm` per set (M = 1 only: a loop of it takes minutes here); for
M > 1 also the batched `torch.einsum("nab,mnb->mna", T, f)`. Medians of a few runs in one
process (the dense and sparse baselines: 2, they take seconds each); every ratio is against
the users' einsum row of the same M in the same run. fwd+bwd is the gradient w.r.t. f (on
the fly: also w.r.t. c and sigma)."""


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _fwd_bwd(fn: Fn, f: torch.Tensor, params: Sequence[torch.Tensor] = ()) -> Callable[[], None]:
    fr = f.detach().clone().requires_grad_()

    def run() -> None:
        fn(fr).sum().backward()  # type: ignore[no-untyped-call]
        fr.grad = None
        for p in params:
            p.grad = None

    return run


def _loop(fn: Fn) -> Fn:
    """The users' loop: one call per input set."""
    return lambda f: torch.stack([fn(f[m]) for m in range(f.shape[0])])


@dataclass(frozen=True)
class _Row:
    M: int
    method: str
    fwd: float  # seconds
    fwd_bwd: float
    nbytes: int  # what the method keeps resident for the operator


def _time(fn: Fn, f: torch.Tensor, device: str, repeat: int, params: Sequence[torch.Tensor] = ()
          ) -> tuple[float, float]:  # fmt: skip
    t_f = median_time(lambda: fn(f), device=device, repeat=repeat, warmup=1)
    t_fb = median_time(_fwd_bwd(fn, f, params), device=device, repeat=repeat, warmup=1)
    return t_f, t_fb


def _from_dense_peak(N: int, A: int, B: int, sigma: float) -> float:
    """Peak resident memory of ``from_dense`` above T, in units of T (a fresh process, CPU)."""
    code = f"""
import resource, torch
from gpu_ops import BandedResampler
x = torch.linspace(0, 1, {B}, dtype=torch.float64)
c = torch.rand({N}, {A}, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
starts, weights = BandedResampler.from_response(x, c, "gaussian", sigma={sigma!r}).band()
T = torch.zeros({N}, {A}, {B})
for n in range({N}):
    T[n].scatter_(-1, starts[n].long()[:, None] + torch.arange(weights.shape[-1]), weights[n])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
BandedResampler.from_dense(T)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / (T.numel() * T.element_size()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout)


def _section(device: str, smoke: bool) -> str:
    Ms: tuple[int, ...] = (1, 4) if smoke else (1, 16, 64)
    N, A, B = (2, 20, 2000) if smoke else (20, 500, 50000)
    gen = torch.Generator().manual_seed(0)
    x = torch.linspace(0.0, 1.0, B, dtype=torch.float64)
    c = torch.rand(N, A, generator=gen, dtype=torch.float64)
    sigma = 1500 / (B - 1) / 8  # cut at 4 sigma: W ~ 1500 fine points at full size
    f32 = BandedResampler.from_response(x, c, "gaussian", sigma=sigma, device=device)
    bf16 = BandedResampler.from_response(
        x, c, "gaussian", sigma=sigma, dtype=torch.bfloat16, device=device
    )
    otf = OnTheFlyResampler.from_response(x, c, "gaussian", sigma=sigma, device=device)
    T = f32.to_dense()  # (N, A, B) float32: the users' operator
    Ts = T.to_sparse()
    ours: dict[str, tuple[Fn, int, Sequence[torch.Tensor]]] = {
        "ours f32": (f32, f32.nbytes, ()),
        "ours bf16": (bf16, bf16.nbytes, ()),
        "ours on-the-fly": (otf, otf.nbytes, list(otf.parameters())),
    }
    users: dict[str, tuple[Fn, int]] = {
        'users: einsum("nab,nb->na") per set': (
            _loop(lambda f: torch.einsum("nab,nb->na", T, f)), _bytes(T)
        ),
        "users: T.to_sparse() + bmm per set": (
            _loop(lambda f: torch.bmm(Ts, f[..., None])[..., 0]), _bytes(Ts.indices(), Ts.values())
        ),
        'batched: einsum("nab,mnb->mna")': (
            lambda f: torch.einsum("nab,mnb->mna", T, f), _bytes(T)
        ),
    }  # fmt: skip
    rows: list[_Row] = []
    heavy = 1 if smoke else 2  # repeats of the dense and sparse baselines (seconds each)
    for M in Ms:
        f = torch.randn(M, N, B, generator=gen).to(device)
        for name, (fn, nbytes) in users.items():
            sparse_loop = "sparse" in name and M > 1 and not smoke
            if sparse_loop or (name.startswith("batched") and M == 1):
                continue  # the sparse loop: minutes at M=16; batched is the users' row at M=1
            rows.append(_Row(M, name, *_time(fn, f, device, heavy), nbytes))
        for name, (fn, nbytes, params) in ours.items():
            rows.append(_Row(M, name, *_time(fn, f, device, 3 if smoke else 7, params), nbytes))
    table = _table(rows)
    targets = _targets(rows, Ms, smoke, device, (N, A, B, sigma))
    return (
        f"### {device}: N={N}, A={A}, B={B}, W={f32.band_width}, "
        f"dense T {_bytes(T) / 2**30:.2f} GiB, {torch.get_num_threads()} threads\n\n"
        + table
        + "\n\nTargets (issue 15):\n\n"
        + targets
    )


def _table(rows: list[_Row]) -> str:
    out = []
    for r in rows:
        base = next(b for b in rows if b.M == r.M and b.method.startswith("users: einsum"))
        out.append([
            r.M, r.method, r.fwd * 1e3, base.fwd / r.fwd, r.fwd_bwd * 1e3,
            base.fwd_bwd / r.fwd_bwd, r.nbytes,
        ])  # fmt: skip
    headers = [
        "M", "method", "fwd ms", "fwd x users' einsum", "fwd+bwd ms",
        "fwd+bwd x users' einsum", "operator bytes",
    ]  # fmt: skip
    return markdown_table(headers, out)


def _targets(
    rows: list[_Row], Ms: Sequence[int], smoke: bool, device: str,
    size: tuple[int, int, int, float],
) -> str:  # fmt: skip
    def get(M: int, prefix: str) -> _Row:
        return next(r for r in rows if r.M == M and r.method.startswith(prefix))

    users, f32, bf16, otf = (
        get(1, p) for p in ("users: einsum", "ours f32", "ours bf16", "ours on-the-fly")
    )
    sparse = get(1, "users: T.to_sparse")
    checks = [
        ("f32, M=1: fwd >= 50x users' einsum", users.fwd / f32.fwd, 50.0, True),
        ("f32, M=1: fwd+bwd >= 50x users' einsum", users.fwd_bwd / f32.fwd_bwd, 50.0, True),
        ("bf16, M=1: fwd >= 50x users' einsum", users.fwd / bf16.fwd, 50.0, True),
        ("bf16, M=1: fwd+bwd >= 50x users' einsum", users.fwd_bwd / bf16.fwd_bwd, 50.0, True),
        ("f32, M=1: fwd x T.to_sparse() + bmm", sparse.fwd / f32.fwd, 1.0, True),
        ("bf16 fwd time / f32 fwd time, M=1 (<= 0.7)", bf16.fwd / f32.fwd, 0.7, False),
        ("on-the-fly, M=1: fwd >= 1.0x users' einsum", users.fwd / otf.fwd, 1.0, True),
        ("on-the-fly, M=1: fwd+bwd x users' einsum", users.fwd_bwd / otf.fwd_bwd, 1.0, True),
    ]
    for M in Ms[1:]:
        loop, batched = get(M, "users: einsum"), get(M, "batched: einsum")
        mine, fly = get(M, "ours f32"), get(M, "ours on-the-fly")
        checks += [
            (f"f32, M={M}: fwd >= 50x the users' loop", loop.fwd / mine.fwd, 50.0, True),
            (
                f"f32, M={M}: fwd+bwd >= 50x the users' loop",
                loop.fwd_bwd / mine.fwd_bwd,
                50.0,
                True,
            ),
            (f"on-the-fly, M={M}: fwd >= 1.0x batched einsum", batched.fwd / fly.fwd, 1.0, True),
        ]
    if device == "cpu":
        N, A, B, sigma = size
        peak = _from_dense_peak(N, A, B, sigma)
        checks.append(("from_dense: peak memory above T, in T (<= 0.2)", peak, 0.2, False))
    out = []
    for what, value, goal, higher in checks:
        ok = value >= goal if higher else value <= goal
        out.append([what, f"{value:.3g}", "yes" if ok else "no"])
    return markdown_table(["target", "measured", "met"], out)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    sections = [_section(device, args.smoke) for device in args.device]
    report(
        "resample",
        "Banded response operator (gpu_ops.resample) against the users' einsum",
        INTRO + "\n\n" + "\n\n".join(sections),
        smoke=args.smoke,
        devices=args.device,
    )


if __name__ == "__main__":
    main()
