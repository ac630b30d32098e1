"""One model, three formats: torch.export vs AOTInductor vs ONNX Runtime, served by bitserve.

The same 3-layer float32 MLP (2048 -> 256 -> 64 -> 1) over 2048-bit fingerprints (packed
big-endian, 256 bytes per row) is written as a ``torch.export`` program, an AOTInductor
package and an ONNX model (``harness.model_formats``), and served side by side by one
``bitserve serve`` process (``--workers 1``, CPU, dynamic batching up to 512 rows). A
closed-loop load generator in this process keeps 8 requests of 64 rows in flight per
format, rounds interleaved so a busy machine's drift hits all three alike; every answer is
checked against the float64 module. Beside it: the model call alone, in process (median of
repeated calls at 64 and 512 rows), which separates the format from the serving around it.

    python -m benchmarks.bench_formats            # writes benchmarks/results/formats.md
    python -m benchmarks.bench_formats --smoke    # a tiny MLP, a second per format, prints
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from benchmarks._common import markdown_table, median_time, parse_args, report
from harness.model_formats import FORMAT_FILES, fingerprint_mlp, reference, write_model
from harness.repo_utils import model_toml, tensor
from harness.server import start_server

FORMATS = ("torch_export", "aoti", "onnx")
LABELS = {"torch_export": "torch.export", "aoti": "AOTInductor", "onnx": "ONNX Runtime (CPU)"}
ROWS = 64
CONCURRENCY = 8
MAX_BATCH = ROWS * CONCURRENCY


def write_repository(root: Path, module: torch.nn.Module) -> None:
    """One model folder per format, the same module in each."""
    for fmt in FORMATS:
        folder = root / fmt
        write_model(folder / FORMAT_FILES[fmt], fmt, module, MAX_BATCH)
        (folder / "config.toml").write_text(
            model_toml(
                max_batch_size=MAX_BATCH,
                max_queue_delay_us=0,
                device="cpu",
                inputs=[tensor("fp", "BOOL", [2048], packing="bits")],
                model={"file": FORMAT_FILES[fmt]},
                outputs=[tensor("score", "FP32", [1])],
            )
        )


Item = tuple[bytes, np.ndarray]  # a request body of ROWS rows, and its float64 answers
HEADERS = {"Content-Type": "application/octet-stream"}


def body(packed: np.ndarray) -> bytes:
    """A V2 binary request of ``packed (rows, 256)`` uint8 (its header length is sent as
    ``Inference-Header-Content-Length``; see :func:`drive`)."""
    entry = {
        "name": "fp",
        "datatype": "UINT8",
        "shape": list(packed.shape),
        "parameters": {"binary_data_size": packed.nbytes},
    }
    head = json.dumps({"inputs": [entry], "parameters": {"binary_data_output": True}}).encode()
    return len(head).to_bytes(4, "little") + head + packed.tobytes()


async def drive(url: str, pool: list[Item], seconds: float) -> float:
    """Rows per second of ``CONCURRENCY`` closed-loop clients for ``seconds`` (after one
    untimed request each); every answer is checked against its float64 reference."""
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def send(k: int) -> None:
            framed, expected = pool[k % len(pool)]
            n = int.from_bytes(framed[:4], "little")
            headers = {**HEADERS, "Inference-Header-Content-Length": str(n)}
            r = await client.post(url, content=framed[4:], headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
            m = int(r.headers["inference-header-content-length"])
            got = np.frombuffer(r.content[m:], np.float32).reshape(expected.shape)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)

        async def loop(k: int, deadline: float) -> int:
            sent = 0
            while time.perf_counter() < deadline:
                await send(k + sent * CONCURRENCY)
                sent += 1
            return sent

        await asyncio.gather(*(send(k) for k in range(CONCURRENCY)))
        start = time.perf_counter()
        counts = await asyncio.gather(*(loop(k, start + seconds) for k in range(CONCURRENCY)))
        elapsed = time.perf_counter() - start
    return sum(counts) * ROWS / elapsed


def model_alone(root: Path, rows: int, smoke: bool) -> dict[str, float]:
    """Median seconds of one call of each format's runner at ``rows`` rows (float32 input)."""
    from service.backends import load_model_file

    x = (torch.rand(rows, 2048) < 0.1).float()
    out = {}
    for fmt in FORMATS:
        runner = load_model_file(root / fmt / FORMAT_FILES[fmt]).to(torch.device("cpu"))
        with torch.inference_mode():
            out[fmt] = median_time(lambda r=runner: r(x), repeat=3 if smoke else 30)
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    seconds, rounds = (1.0, 1) if args.smoke else (5.0, 3)
    hidden = (16,) if args.smoke else (256, 64)
    module = fingerprint_mlp(hidden=hidden)
    rng = np.random.default_rng(0)
    pool: list[Item] = []
    for _ in range(4 if args.smoke else 16):
        bits = rng.random((ROWS, 2048)) < 0.1
        pool.append((body(np.packbits(bits, axis=-1)), reference(module, bits)))
    rows_s: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-formats-") as tmp:
        root = Path(tmp) / "repo"
        t0 = time.perf_counter()
        write_repository(root, module)
        print(f"wrote the three formats in {time.perf_counter() - t0:.0f} s", flush=True)
        alone = {n: model_alone(root, n, args.smoke) for n in (ROWS, MAX_BATCH)}
        server_args = ["--workers", "1", "--no-access-log", "--log-level", "warning"]
        with start_server(root, args=server_args) as server:
            for r in range(rounds):
                for fmt in FORMATS:
                    url = f"{server.url}/v2/models/{fmt}/infer"
                    rows_s[fmt].append(asyncio.run(drive(url, pool, seconds)))
                    print(f"round {r}: {fmt}: {rows_s[fmt][-1]:,.0f} rows/s", flush=True)
    load_after = os.getloadavg()[0]
    best = {fmt: float(np.median(v)) for fmt, v in rows_s.items()}
    base = best["torch_export"]
    table = markdown_table(
        ["format", "rows/s (batch 64, c=8)", "vs torch.export",
         "model alone, 64 rows (ms)", "model alone, 512 rows (ms)"],
        [[LABELS[f], best[f], best[f] / base, alone[ROWS][f] * 1e3, alone[MAX_BATCH][f] * 1e3]
         for f in FORMATS],
    )  # fmt: skip
    speedup = alone[MAX_BATCH]["torch_export"] / alone[MAX_BATCH]["aoti"]
    layers = " -> ".join(map(str, (2048, *hidden, 1)))
    body_text = f"""
The fingerprint MLP ({layers}, float32) served three ways by one server: requests of {ROWS}
packed rows (256 bytes each), {CONCURRENCY} in flight, dynamic batching up to {MAX_BATCH}
rows; rows/s is the median of {rounds} interleaved rounds of {seconds:g} s. "Model alone"
times one call of each format's runner in process (no server), median of repeated calls.

{table}

AOTInductor against torch.export, model alone at {MAX_BATCH} rows: {speedup:.2f}x.

The host's 1-minute load average was {load_before:.1f} before and {load_after:.1f} after the
run (2 cores: above 2, other processes shared them and every number here is contended).
"""
    report("formats", "Model formats: torch.export, AOTInductor, ONNX Runtime", body_text,
           smoke=args.smoke, devices=["cpu"])  # fmt: skip


if __name__ == "__main__":
    main()
