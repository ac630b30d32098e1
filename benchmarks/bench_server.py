"""Server throughput and latency: the demo model over loopback, batching on vs off.

One ``bitserve serve`` process serves the demo workload twice: ``demo`` (max_batch_size 16,
max_queue_delay_us 1000: dynamic batching on) and ``demo_nobatch`` (max_batch_size 1, no
delay: every request is its own batch; the same wire shape, so the bytes sent are identical).
A closed-loop load generator (``harness.loadgen``, in this process, the server in its
own) drives each model at concurrency 1, 8 and 32 with bit-packed binary requests and checks
every answer against the float64 reference. The mean batch size comes from the server's
``/metrics`` (``bitserve_batch_size`` and ``bitserve_batch_requests`` histograms).

    python -m benchmarks.bench_server            # writes benchmarks/results/server.md
    python -m benchmarks.bench_server --smoke    # a few requests per level, prints only
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import markdown_table, parse_args, report
from harness.loadgen import run_level
from harness.probes import metric, write_repository
from harness.server import start_server
from harness.workload import Pool

CONCURRENCY = (1, 8, 32)
MODELS = (("on (max 16)", "demo"), ("off", "demo_nobatch"))


def batch_totals(url: str, model: str) -> tuple[float, float, float]:
    """(items, requests, batches) executed so far for ``model``, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    try:
        items = metric(text, "bitserve_batch_size_sum", model=model)
        requests = metric(text, "bitserve_batch_requests_sum", model=model)
        batches = metric(text, "bitserve_batch_size_count", model=model)
    except KeyError:
        return 0.0, 0.0, 0.0
    return items, requests, batches


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    seconds = None if args.smoke else 6.0
    pool = Pool.make(4 if args.smoke else 32)
    rows: list[list[Any]] = []
    rps: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        # demo_nobatch first: write_repository writes "demo" and renames it.
        write_repository(root, name="demo_nobatch", max_batch_size=1, max_queue_delay_us=0)
        write_repository(root, name="demo", max_batch_size=16, max_queue_delay_us=1000)
        with start_server(root, args=["--no-access-log", "--log-level", "warning"]) as server:
            # Interleaved (each concurrency: on, then off) so drift in a busy machine's load
            # hits both modes alike.
            for c in CONCURRENCY:
                for label, model in MODELS:
                    url = f"{server.url}/v2/models/{model}/infer"
                    before = batch_totals(server.url, model)
                    res = asyncio.run(
                        run_level(
                            url,
                            "packed",
                            pool,
                            c,
                            seconds=seconds,
                            requests=None if seconds else 2 * c,
                            warmup_requests=max(4, min(c, 8)),
                            server_pid=server.process.pid,
                        )
                    )
                    after = batch_totals(server.url, model)
                    items, reqs, batches = (a - b for a, b in zip(after, before, strict=True))
                    rps[(model, c)] = res.rps
                    rows.append(
                        [
                            label,
                            c,
                            res.rps,
                            res.p50_ms,
                            res.p99_ms,
                            res.request_bytes,
                            round(res.response_bytes),
                            items / batches if batches else float("nan"),
                            reqs / batches if batches else float("nan"),
                            res.server_cpu_s_per_req * 1e3,
                            res.errors,
                        ]
                    )
                    print(
                        f"{label} c={c}: {res.rps:.1f} req/s, p50 {res.p50_ms:.1f} ms", flush=True
                    )
    rows.sort(key=lambda r: ([m[0] for m in MODELS].index(r[0]), r[1]))
    table = markdown_table(
        [
            "batching",
            "concurrency",
            "requests/s",
            "p50 ms",
            "p99 ms",
            "request bytes",
            "response bytes",
            "mean batch (items)",
            "mean requests/batch",
            "server CPU ms/req",
            "errors",
        ],
        rows,
    )
    ratios = markdown_table(
        ["concurrency", "requests/s, batching on / off"],
        [[c, rps[("demo", c)] / rps[("demo_nobatch", c)]] for c in CONCURRENCY],
    )
    body = f"""
Demo workload (20 x 50000 bits packed big-endian = 125000 bytes in, 20 x 500 float32 out per
item, one item per request), over loopback to one `bitserve serve` process; binary V2 requests
(`Inference-Header-Content-Length`), closed-loop clients, every answer checked against a
float64 reference. {
        "Smoke run: 2 requests per client per level."
        if args.smoke
        else f"{seconds:.0f} s per level after a warm-up."
    } Devices: the server's default
(`auto`: CUDA when present, else CPU).

{table}

{ratios}
"""
    report(
        "server", "bitserve server: batching on vs off", body, smoke=args.smoke, devices=args.device
    )


if __name__ == "__main__":
    main()
