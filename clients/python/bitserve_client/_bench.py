"""``bitserve-client bench``: a load test with random valid inputs, and its statistics."""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._client import Client
from ._exceptions import BitserveError
from ._progress import progress
from ._spec import BYTES, DATATYPES, ModelSpec


def random_inputs(
    spec: ModelSpec, batch_size: int, seed: int = 0
) -> dict[str, np.ndarray[Any, Any]]:
    """Random valid inputs for ``batch_size`` items (variable dims get size 1).

    Packed inputs are generated as bits and packed once here, so a benchmark measures the
    server and the transport, not repeated packing.
    """
    rng = np.random.default_rng(seed)
    lead = (batch_size,) if spec.batched else ()
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for name, t in spec.inputs.items():
        if t.packing is not None:
            shape = lead + tuple(max(d, 1) for d in t.packing.logical_shape)
            bits = rng.random(shape) < 0.5
            arrays[name] = np.packbits(bits, axis=-1, bitorder=t.packing.bitorder)
            continue
        shape = lead + tuple(max(d, 1) for d in t.shape)
        dtype = DATATYPES.get(t.datatype)
        if dtype is None:
            what = "BYTES" if t.datatype == BYTES else repr(t.datatype)
            raise BitserveError(f"input {name!r}: cannot generate {what} data")
        if dtype.kind == "f":
            arrays[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            arrays[name] = rng.random(shape) < 0.5
        else:
            arrays[name] = rng.integers(0, 2, size=shape).astype(dtype)
    return arrays


@dataclass
class BenchStats:
    """Latencies (seconds) of successful requests and a count of errors by type."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    first_error: str | None = None

    def summary(self, wall_s: float, batch_size: int) -> str:
        ok = len(self.latencies)
        lines = [
            f"requests: {ok} ok, {sum(self.errors.values())} failed in {wall_s:.2f} s",
            f"throughput: {ok / wall_s:.1f} req/s, {ok * batch_size / wall_s:.1f} items/s",
        ]
        if ok:
            ms = np.percentile(np.asarray(self.latencies) * 1e3, [50, 90, 99, 100])
            lines.append("latency ms: p50 {:.2f}  p90 {:.2f}  p99 {:.2f}  max {:.2f}".format(*ms))
        for kind, n in self.errors.most_common():
            lines.append(f"errors: {n} x {kind}")
        if self.first_error:
            lines.append(f"first error: {self.first_error}")
        return "\n".join(lines)


def run_bench(client: Client, args: argparse.Namespace) -> int:
    """Run ``bench`` as parsed from the command line; 0 when every request succeeded."""
    spec = client.model_spec(args.model)
    inputs = random_inputs(spec, args.batch_size, args.seed)
    limit = args.requests if args.requests is not None else (None if args.duration else 200)
    deadline = None if args.duration is None else time.perf_counter() + args.duration
    stats = BenchStats()
    lock = threading.Lock()
    issued = 0
    bar = progress(not args.no_progress, limit, f"bench {args.model}", unit="req")

    def worker() -> None:
        nonlocal issued
        while True:
            with lock:
                if (limit is not None and issued >= limit) or (
                    deadline is not None and time.perf_counter() >= deadline
                ):
                    return
                issued += 1
            start = time.perf_counter()
            try:
                client.infer(args.model, inputs)
            except BitserveError as exc:
                with lock:
                    stats.errors[type(exc).__name__] += 1
                    stats.first_error = stats.first_error or str(exc)
            else:
                with lock:
                    stats.latencies.append(time.perf_counter() - start)
            with lock:
                bar.update(1)

    client.infer(args.model, inputs)  # warm-up: connection, caches, server-side lazy work
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            for f in [pool.submit(worker) for _ in range(args.concurrency)]:
                f.result()
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    print(
        f"model {args.model}  batch {args.batch_size}  concurrency {args.concurrency}  "
        f"url {client.url}"
    )
    print(stats.summary(wall, args.batch_size))
    return 0 if not stats.errors else 1
