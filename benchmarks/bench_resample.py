"""Banded response operator vs dense einsum / matmul / sparse bmm (issue 3).

Run as ``python -m benchmarks.bench_resample [--smoke]``. N functions on B fine points, A
coarse points each, Gaussian response cut so W is about 1500 at full size; M input sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from benchmarks._common import copy_bandwidth, markdown_table, median_time, parse_args, report
from gpu_ops import BandedResampler, OnTheFlyResampler


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], f: torch.Tensor) -> Callable[[], None]:
    fr = f.detach().clone().requires_grad_()

    def run() -> None:
        fn(fr).sum().backward()
        fr.grad = None

    return run


def _ratio(base: float | None, t: float) -> float | str:
    return base / t if base else ""


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    if args.smoke:
        N, A, B, Ms = 2, 20, 2000, (1, 16)
    else:
        N, A, B, Ms = 20, 500, 50000, (1, 16, 64)
    sections = []
    for device in args.device:
        gen = torch.Generator().manual_seed(0)
        x = torch.linspace(0.0, 1.0, B, dtype=torch.float64)
        c = torch.rand(N, A, generator=gen, dtype=torch.float64)
        sigma = 1500 / (B - 1) / 8  # cut at 4 sigma: W ~ 1500 fine points at full size
        ops = {
            "ours f32": BandedResampler.from_response(x, c, "gaussian", sigma=sigma, device=device),
            "ours bf16": BandedResampler.from_response(
                x, c, "gaussian", sigma=sigma, dtype=torch.bfloat16, device=device
            ),
            "ours on-the-fly": OnTheFlyResampler.from_response(
                x, c, "gaussian", sigma=sigma, device=device
            ),
        }
        T = ops["ours f32"].to_dense()  # (N, A, B) float32, the users' current operator
        Ts = T.to_sparse()
        bw = copy_bandwidth(device)
        W = ops["ours f32"].band_width
        rows: list[list[object]] = []
        # (M, variant) -> (fwd s, fwd+bwd s), for the targets table
        seen: dict[tuple[int, str], tuple[float, float]] = {}
        slow = 1 if args.smoke else 2
        for M in Ms:
            f = torch.randn(M, N, B, device=device)
            methods: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
                "dense einsum": (lambda f, T=T: torch.einsum("nab,mnb->mna", T, f), _bytes(T)),
                "dense matmul": (lambda f, T=T: torch.matmul(T, f.permute(1, 2, 0)), _bytes(T)),
                "T.to_sparse() + bmm": (
                    lambda f, Ts=Ts: torch.bmm(Ts, f.permute(1, 2, 0).contiguous()),
                    _bytes(Ts.indices(), Ts.values()),
                ),
            }
            for name, op in ops.items():
                methods[name] = (op, op.nbytes)
            for name, (fn, nbytes) in methods.items():
                dense = not name.startswith("ours")
                if "sparse" in name and M > 1 and device == "cpu" and not args.smoke:
                    # Seconds per call here on CPU at M >= 16; measured at M = 1 only.
                    rows.append([device, M, name, "not run (slow)", "", "", "", "", nbytes])
                    continue
                rep, warm = (slow, 1) if dense else (1 if args.smoke else 5, 1)
                t_f = median_time(lambda fn=fn, f=f: fn(f), device=device, repeat=rep, warmup=warm)
                t_fb = median_time(_fwd_bwd(fn, f), device=device, repeat=rep, warmup=warm)
                seen[M, name] = (t_f, t_fb)
                e_f, e_fb = seen[M, "dense einsum"]
                mm_fb = seen.get((M, "dense matmul"), (0.0, 0.0))[1]
                rows.append(
                    [
                        device, M, name, t_f * 1e3, e_f / t_f, t_fb * 1e3, e_fb / t_fb,
                        _ratio(mm_fb, t_fb), nbytes,
                    ]
                )  # fmt: skip
            for variant in ("ours f32", "ours bf16"):
                floor = (ops[variant].nbytes + _bytes(f)) / bw
                seen[M, "floor " + variant] = (floor, floor)
                label = f"floor: ({variant[5:]} operator + f bytes) / copy bw"
                rows.append([device, M, label, floor * 1e3, "", "", "", "", ""])
        headers = [
            "device", "M", "method", "fwd ms", "fwd x einsum", "fwd+bwd ms", "fwd+bwd x einsum",
            "fwd+bwd x matmul", "operator bytes",
        ]  # fmt: skip
        sections.append(
            f"N={N}, A={A}, B={B}, W={W}; copy bandwidth {bw / 1e9:.2f} GB/s on {device}.\n\n"
            + markdown_table(headers, rows)
            + "\n\nTargets (issue 3), per variant:\n\n"
            + _targets(seen, ops, T, Ms[1])
        )
    note = (
        "Medians of a few runs (dense baselines: 2). Speed-ups are against the dense einsum / "
        "dense matmul of the same M in the same run. The floor counts operator and input "
        "bytes once at the measured copy bandwidth (a copy reads and writes, so a read-only "
        "kernel may beat it). fwd+bwd is the gradient w.r.t. f (on-the-fly: also c and sigma)."
    )
    report(
        "resample",
        "Banded response operator (gpu_ops.resample)",
        note + "\n\n" + "\n\n".join(sections),
        smoke=args.smoke,
        devices=args.device,
    )


def _targets(
    seen: dict[tuple[int, str], tuple[float, float]],
    ops: dict[str, BandedResampler | OnTheFlyResampler],
    T: torch.Tensor,
    m_big: int,
) -> str:
    """A table saying which variant meets which of the issue's targets, from measured times."""
    rows: list[list[object]] = []
    e_f, e_fb = seen[1, "dense einsum"]
    mm_fb = seen[m_big, "dense matmul"][1]
    for v in ("ours f32", "ours bf16", "ours on-the-fly"):
        t_f, t_fb = seen[1, v]
        floor = seen[1, "floor " + (v if v != "ours on-the-fly" else "ours bf16")][0]
        big_fb = seen[m_big, v][1]
        checks = [
            ("M=1 fwd >= 50x einsum", e_f / t_f, 50.0, True),
            ("M=1 fwd within 3x of its floor", t_f / floor, 3.0, False),
            ("M=1 fwd+bwd >= 30x einsum", e_fb / t_fb, 30.0, True),
            (f"M={m_big} fwd+bwd >= 5x dense matmul", mm_fb / big_fb, 5.0, True),
            ("operator bytes <= dense T / 30", _bytes(T) / ops[v].nbytes, 30.0, True),
        ]
        for what, value, goal, higher in checks:
            ok = value >= goal if higher else value <= goal
            rows.append([v, what, f"{value:.3g}", "yes" if ok else "no"])
    return markdown_table(["variant", "target", "measured", "met"], rows)


if __name__ == "__main__":
    main()
