"""A light model at high rates: a 2048-bit fingerprint MLP through ``infer_many``.

The model (``benchmarks/overhead/mlp.py``: 2048 -> 256 -> 1, a ``torch.export`` program) is
served four ways, each started once and measured in interleaved rounds (medians reported):

- bitserve with its defaults (``--workers auto``), with ``--workers 1`` and ``2``, driven by
  the client a user would use: ``Client.infer_many`` on a bool array of the fingerprints
  (packed by the client, 256 bytes a row on the wire), 64 rows a request, its default
  concurrency (8 for this model: two of its 256-row batches); the defaults also with the
  client over httpx's transport (not its own), and at 4 requests in flight (the client's
  fixed default before it followed the model's batches), and through ``AsyncClient`` on its
  own transport and on httpx's (each row also gives the client's CPU a request);
- a hand-written FastAPI endpoint that takes the same rows as raw float32 bytes (8 KiB a row)
  and runs the same program (``benchmarks/overhead/fastapi_mlp.py``), driven by a thread pool
  of the same size posting 64-row bodies over ``httpx``.

Every score is checked against the program run here on the same rows.

    python -m benchmarks.bench_mlp            # writes benchmarks/results/mlp.md
    python -m benchmarks.bench_mlp --smoke    # short runs, prints only
    python -m benchmarks.bench_mlp --workers-per-gpu 1,2,4   # a GPU host: workers per GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bitserve_client._bulk import default_concurrency

from benchmarks._common import markdown_table, parse_args, quiet_host, report
from benchmarks.overhead import mlp, perf
from benchmarks.overhead.perf import Running

CONCURRENCY = default_concurrency(mlp.MAX_BATCH_SIZE, mlp.BATCH)
"""``infer_many``'s default for this model (8): requests in flight at once; the hand-written
endpoint's client keeps as many."""
FOUR_IN_FLIGHT = 4
DEFAULTS = "bitserve (defaults: --workers auto)"
WORKERS_1 = "bitserve --workers 1"
WORKERS_2 = "bitserve --workers 2"
FASTAPI = "hand-written FastAPI, float32 rows"
FOUR = "bitserve (defaults), infer_many at 4 in flight"
"""Not a server: the defaults' server driven by ``infer_many(concurrency=4)``, the client's
fixed default before it sized its load by the model's batches."""
HTTPX_CLIENT = "bitserve (defaults), client on httpx's transport"
"""Not a server: the defaults' server driven by the client over httpx's own transport
(``transport=httpx.HTTPTransport()``) instead of its lean default, in the same rounds."""
ASYNC_CLIENT = "bitserve (defaults), AsyncClient"
"""Not a server: the defaults' server driven by ``AsyncClient.infer_many`` (its own
transport), in the same rounds."""
ASYNC_HTTPX = "bitserve (defaults), AsyncClient on httpx's transport"
"""The same over httpx's async transport (``transport=httpx.AsyncHTTPTransport()``)."""


def reference(program: Path, bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The float32 program's scores on ``bits`` (rows x 2048 bool), computed here."""
    import torch

    model: Any = torch.export.load(str(program)).module()
    rows = torch.from_numpy(bits.astype(np.float32))
    with torch.inference_mode():  # in chunks the program's batch dimension allows
        out = [
            model(rows[i : i + mlp.MAX_BATCH_SIZE]) for i in range(0, len(rows), mlp.MAX_BATCH_SIZE)
        ]
    return np.asarray(torch.cat(out).numpy()).reshape(-1)


CLIENT_CPU: dict[str, list[float]] = {}
"""The client's CPU seconds a request (this process, every thread), per row of the table,
one a round (:func:`measure_rounds`)."""

Timed = tuple[float, np.ndarray[Any, Any], float]
"""A run's seconds, its scores, and the client's CPU seconds over it."""


def run_bitserve(
    server: Running,
    bits: np.ndarray[Any, Any],
    transport: httpx.BaseTransport | None = None,
    concurrency: int | None = None,
) -> Timed:
    """``infer_many`` over every row (``transport``: the client's; ``concurrency``: requests
    in flight; None for their defaults)."""
    from bitserve_client import Client

    with Client(server.url, timeout=60, transport=transport) as client:
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = client.infer_many(
            mlp.NAME, bits, batch_size=mlp.BATCH, concurrency=concurrency, progress=False
        )
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return seconds, np.asarray(result[mlp.OUTPUT]).reshape(-1), cpu


def run_async(
    server: Running, bits: np.ndarray[Any, Any], transport: httpx.AsyncBaseTransport | None = None
) -> Timed:
    """:func:`run_bitserve` through ``AsyncClient.infer_many`` (on one event loop)."""
    from bitserve_client import AsyncClient

    async def main() -> tuple[float, float, Any]:
        async with AsyncClient(server.url, timeout=60, transport=transport) as client:
            t0, cpu0 = time.perf_counter(), time.process_time()
            result = await client.infer_many(mlp.NAME, bits, batch_size=mlp.BATCH, progress=False)
            return time.perf_counter() - t0, time.process_time() - cpu0, result

    seconds, cpu, result = asyncio.run(main())
    return seconds, np.asarray(result[mlp.OUTPUT]).reshape(-1), cpu


def run_fastapi(server: Running, bits: np.ndarray[Any, Any]) -> Timed:
    """Every row posted as float32 bytes, 64 rows a request."""
    starts = range(0, len(bits), mlp.BATCH)
    scores: list[bytes] = [b""] * len(starts)
    with httpx.Client(base_url=server.url, timeout=60) as client:

        def one(k: int) -> None:
            rows = bits[starts[k] : starts[k] + mlp.BATCH].astype(np.float32)
            r = client.post("/predict", content=rows.tobytes())
            r.raise_for_status()
            scores[k] = r.content

        t0, cpu0 = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(len(starts))))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return seconds, np.frombuffer(b"".join(scores), np.float32), cpu


def gpu_sweep(root: Path, per_gpu: list[int]) -> list[tuple[str, list[str]]]:
    """bitserve on CUDA with ``k`` workers per GPU for each ``k`` (a GPU host's rule)."""
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        raise SystemExit("--workers-per-gpu needs a CUDA device")
    return [
        (f"bitserve --workers {k * gpus} ({k} per GPU)",
         perf.bitserve(root, "--workers", str(k * gpus), "--device", "cuda"))
        for k in per_gpu
    ]  # fmt: skip


def servers(root: Path, program: Path, *labels: str) -> list[tuple[str, list[str]]]:
    """The MLP's servers by label: bitserve's defaults, ``--workers 1``, ``--workers 2`` and
    the hand-written float32 endpoint (``program``) over the repository ``root``."""
    known = {
        DEFAULTS: perf.bitserve(root),
        WORKERS_1: perf.bitserve(root, "--workers", "1"),
        WORKERS_2: perf.bitserve(root, "--workers", "2"),
        FASTAPI: [*perf.module("benchmarks.overhead.fastapi_mlp"), "--program", str(program)],
    }
    return [(label, known[label]) for label in labels]


def measure_rounds(
    running: list[Running],
    bits: np.ndarray[Any, Any],
    expected: np.ndarray[Any, Any],
    rounds: int,
    httpx_client: bool = False,
) -> dict[str, list[float]]:
    """Rows/s of every server over all of ``bits``, in interleaved rounds after a warm-up;
    every score is checked against ``expected``. With ``httpx_client``, the defaults' server
    is also driven by the client over httpx's own transport (:data:`HTTPX_CLIENT`) and at 4
    requests in flight (:data:`FOUR`), and through ``AsyncClient`` on both transports
    (:data:`ASYNC_CLIENT`, :data:`ASYNC_HTTPX`). The client's CPU a request goes to
    :data:`CLIENT_CPU`."""
    Run = Callable[[], Timed]

    def runs(r: Running, rows: np.ndarray[Any, Any]) -> list[tuple[str, Run]]:
        if r.label == FASTAPI:
            return [(r.label, lambda: run_fastapi(r, rows))]
        own: list[tuple[str, Run]] = [(r.label, lambda: run_bitserve(r, rows))]
        if httpx_client and r.label == DEFAULTS:
            own.append((HTTPX_CLIENT, lambda: run_bitserve(r, rows, httpx.HTTPTransport())))
            own.append((FOUR, lambda: run_bitserve(r, rows, concurrency=FOUR_IN_FLIGHT)))
            own.append((ASYNC_CLIENT, lambda: run_async(r, rows)))
            own.append((ASYNC_HTTPX, lambda: run_async(r, rows, httpx.AsyncHTTPTransport())))
        return own

    results: dict[str, list[float]] = {}
    for r in running:  # warm-up: every worker's connections and allocator pools
        for _, run in runs(r, bits[: 4 * mlp.BATCH]):
            run()
    CLIENT_CPU.clear()
    requests = -(-len(bits) // mlp.BATCH)
    every = [one for r in running for one in runs(r, bits)]
    for k in range(rounds):
        for label, run in every[k % len(every) :] + every[: k % len(every)]:
            # Each round starts with the next one: no one is always first.
            seconds, got, cpu = run()
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
            results.setdefault(label, []).append(len(bits) / seconds)
            CLIENT_CPU.setdefault(label, []).append(cpu / requests)
            print(f"{label}: {len(bits) / seconds:,.0f} rows/s", flush=True)
    return results


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workers-per-gpu", default=None, help="e.g. 1,2,4: a GPU host's sweep")
    pre.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    known, rest = pre.parse_known_args()
    args = parse_args(__doc__.splitlines()[0], rest)
    sweep = [int(k) for k in known.workers_per_gpu.split(",")] if known.workers_per_gpu else []
    rounds, rows = (1, 20 * mlp.BATCH) if args.smoke else (known.rounds, 1000 * mlp.BATCH)
    _, host = quiet_host(wait_s=0 if args.smoke else 180)
    print(host, flush=True)
    rng = np.random.default_rng(0)
    bits = rng.random((rows, mlp.BITS)) < 0.5
    with tempfile.TemporaryDirectory(prefix="bench-mlp-") as tmp:
        program = mlp.write_repository(Path(tmp))
        expected = reference(program, bits)
        chosen = servers(Path(tmp), program, DEFAULTS, WORKERS_1, WORKERS_2, FASTAPI)
        if sweep:
            chosen = [chosen[0], *gpu_sweep(Path(tmp), sweep)]
        with perf.start(chosen) as running:
            results = measure_rounds(running, bits, expected, rounds, httpx_client=not sweep)

    def med(label: str) -> float:
        return statistics.median(results[label])

    def cpu_ms(label: str) -> object:
        xs = CLIENT_CPU.get(label)
        return statistics.median(xs) * 1e3 if xs else "-"

    table = markdown_table(
        ["server", "rows/s (median)", "client CPU ms/request", "rounds"],
        [[label, med(label), cpu_ms(label), ", ".join(f"{x:,.0f}" for x in results[label])]
         for label in results],
    )  # fmt: skip
    if sweep:
        targets = markdown_table(
            ["measure", "value", "target"],
            [[f"{label} / {DEFAULTS}", med(label) / med(DEFAULTS), "reported"]
             for label in results if label != DEFAULTS],
        )  # fmt: skip
    else:
        targets = markdown_table(
            ["measure", "value", "target"],
            [
                [f"{DEFAULTS} / {FASTAPI}", med(DEFAULTS) / med(FASTAPI), ">= 1.5"],
                [f"{WORKERS_1} / {FASTAPI}", med(WORKERS_1) / med(FASTAPI), "reported"],
                [f"{DEFAULTS} / {WORKERS_1}", med(DEFAULTS) / med(WORKERS_1), ">= 0.95"],
                [f"{HTTPX_CLIENT} / {FASTAPI}", med(HTTPX_CLIENT) / med(FASTAPI), "reported"],
                [f"{DEFAULTS} / {HTTPX_CLIENT}", med(DEFAULTS) / med(HTTPX_CLIENT), "reported"],
                [
                    f"{ASYNC_CLIENT} / {ASYNC_HTTPX}",
                    med(ASYNC_CLIENT) / med(ASYNC_HTTPX),
                    "reported",
                ],
                [f"{ASYNC_CLIENT} / {DEFAULTS}", med(ASYNC_CLIENT) / med(DEFAULTS), "reported"],
                [f"{FOUR} / {FASTAPI}", med(FOUR) / med(FASTAPI), "reported"],
                [f"{DEFAULTS} / {FOUR}", med(DEFAULTS) / med(FOUR), "reported"],
                [f"{WORKERS_2} / {WORKERS_1}", med(WORKERS_2) / med(WORKERS_1), "reported"],
            ],
        )
    body = f"""
Host: {host}.

A 2048-bit fingerprint MLP (2048 -> 256 -> 1, `torch.export`), {rows:,} random fingerprints,
{mlp.BATCH} rows a request, {CONCURRENCY} requests in flight; {rounds} interleaved round(s),
the client on the same {os.cpu_count()} cores as the server. bitserve gets the rows bit-packed
(256 bytes each) through `bitserve_client`'s `infer_many`; the hand-written endpoint gets them
as float32 (8,192 bytes each). Every score is checked against the program run in the
benchmark. "{HTTPX_CLIENT}" is not another server: the defaults' server driven by the same
client over httpx's transport (`transport=httpx.HTTPTransport()`) instead of its own, and
"{FOUR}" the same server at 4 requests in flight (`concurrency=4`, the client's default
before it sized its load by the model's batches: {CONCURRENCY} here, the hand-written
endpoint's client keeps as many). "{ASYNC_CLIENT}" drives the same server through
`AsyncClient.infer_many` on one event loop (its own transport), and "{ASYNC_HTTPX}" the same
over httpx's async transport. "client CPU ms/request" is this process's CPU time (every
thread) over a run, divided by its requests: what the client costs the cores it shares with
the server (the hand-written endpoint's client is a thread pool over httpx).

{table}

{targets}
"""
    report(
        "mlp_gpu" if sweep else "mlp",
        "A light model at high rates: the fingerprint MLP through infer_many",
        body,
        smoke=args.smoke,
        devices=args.device,
    )


if __name__ == "__main__":
    main()
