"""Banded response operator vs dense einsum / matmul / sparse bmm (issue 3).

Run as ``python -m benchmarks.bench_resample [--smoke]``. N functions on B fine points, A
coarse points each, Gaussian response cut so W is about 1500 at full size; M input sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from benchmarks._common import copy_bandwidth, markdown_table, median_time, parse_args, report
from gpu_ops import BandedResampler


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], f: torch.Tensor) -> Callable[[], None]:
    fr = f.detach().clone().requires_grad_()

    def run() -> None:
        fn(fr).sum().backward()
        fr.grad = None

    return run


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
            "ours on-the-fly": BandedResampler.from_response(
                x, c, "gaussian", sigma=sigma, on_the_fly=True, device=device
            ),
        }
        T = ops["ours f32"].to_dense()  # (N, A, B) float32, the users' current operator
        Ts = T.to_sparse()
        bw = copy_bandwidth(device)
        W = ops["ours f32"].band_width
        rows = []
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
            floor = (ops["ours f32"].nbytes + _bytes(f)) / bw
            base: dict[str, float] = {}
            for name, (fn, nbytes) in methods.items():
                dense = not name.startswith("ours")
                if dense and M == 64 and "sparse" in name and not args.smoke:
                    rows.append([device, M, name, "skipped (too slow)", "", "", "", nbytes])
                    continue
                rep, warm = (slow, 1) if dense else (1 if args.smoke else 5, 1)
                t_f = median_time(lambda fn=fn, f=f: fn(f), device=device, repeat=rep, warmup=warm)
                t_fb = median_time(_fwd_bwd(fn, f), device=device, repeat=rep, warmup=warm)
                base.setdefault("f", t_f)
                base.setdefault("fb", t_fb)
                rows.append(
                    [
                        device, M, name, t_f * 1e3, base["f"] / t_f, t_fb * 1e3,
                        base["fb"] / t_fb, nbytes,
                    ]
                )  # fmt: skip
            rows.append([device, M, "floor (ours f32 bytes + f bytes) / copy bw", floor * 1e3])
            rows[-1] += ["", "", "", ""]
        headers = [
            "device", "M", "method", "fwd ms", "fwd speed-up vs einsum", "fwd+bwd ms",
            "fwd+bwd speed-up vs einsum", "operator bytes",
        ]  # fmt: skip
        sections.append(
            f"N={N}, A={A}, B={B}, W={W}; copy bandwidth {bw / 1e9:.2f} GB/s on {device}.\n\n"
            + markdown_table(headers, rows)
        )
    note = (
        "Medians of a few runs (dense baselines: 2). Speed-ups are against the dense einsum of "
        "the same M in the same run. The floor counts operator and input bytes once at the "
        "measured copy bandwidth (a copy reads and writes, so a read-only kernel may beat it)."
    )
    report(
        "resample",
        "Banded response operator (gpu_ops.resample)",
        note + "\n\n" + "\n\n".join(sections),
        smoke=args.smoke,
        devices=args.device,
    )


if __name__ == "__main__":
    main()
