"""``bitserve-client``: health, metadata, one inference and a load test from the shell.

    bitserve-client [--url URL] [--token T] [--timeout S] health [--model M]
    bitserve-client metadata MODEL [--config]
    bitserve-client infer MODEL --input NAME=file.npy [...] [--output out.npz]
    bitserve-client bench MODEL [--concurrency C] [--requests N] [--duration S] [--batch-size B]

The URL and token default to ``$BITSERVE_URL`` (else ``http://127.0.0.1:8000``) and
``$BITSERVE_TOKEN``. Exit status: 0 on success, 1 when the server says no (not ready, an
error answer), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from ._bulk import _progress
from ._client import Client
from ._exceptions import BitserveError
from ._spec import BYTES, DATATYPES, ModelSpec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bitserve-client", description="Talk to a bitserve (or any V2) server."
    )
    p.add_argument("--url", default=os.environ.get("BITSERVE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--token", default=os.environ.get("BITSERVE_TOKEN"))
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout in seconds")
    p.add_argument("--retries", type=int, default=3, help="retries on connect errors and 503")
    sub = p.add_subparsers(dest="command", required=True)

    h = sub.add_parser("health", help="is the server (or a model) live and ready")
    h.add_argument("--model", help="also check this model's readiness")

    m = sub.add_parser("metadata", help="print a model's V2 metadata as JSON")
    m.add_argument("model")
    m.add_argument("--config", action="store_true", help="print its config as well")

    i = sub.add_parser("infer", help="run one inference on arrays from .npy files")
    i.add_argument("model")
    i.add_argument(
        "--input", action="append", required=True, metavar="NAME=FILE.npy", help="repeatable"
    )
    i.add_argument("--output", metavar="OUT.npz", help="save the outputs here (else print)")
    i.add_argument("--json", action="store_true", help="JSON tensors instead of binary")

    b = sub.add_parser("bench", help="load test with random valid inputs")
    b.add_argument("model")
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--requests", type=int, help="stop after N requests (default 200)")
    b.add_argument("--duration", type=float, help="stop after S seconds")
    b.add_argument("--batch-size", type=int, default=1, help="items per request")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-progress", action="store_true")
    return p


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


def _bench(client: Client, args: argparse.Namespace) -> int:
    spec = client.model_spec(args.model)
    inputs = random_inputs(spec, args.batch_size, args.seed)
    limit = args.requests if args.requests is not None else (None if args.duration else 200)
    deadline = None if args.duration is None else time.perf_counter() + args.duration
    stats = BenchStats()
    lock = threading.Lock()
    issued = 0
    bar = _progress(not args.no_progress, limit, f"bench {args.model}", unit="req")

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


def _infer(client: Client, args: argparse.Namespace) -> int:
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"bitserve-client: --input wants NAME=FILE.npy, got {item!r}")
        inputs[name] = np.load(path, allow_pickle=False)
    result = client.infer(args.model, inputs, binary=not args.json)
    if args.output:
        arrays: dict[str, Any] = dict(result.items())
        np.savez(args.output, **arrays)
        print(f"wrote {', '.join(result)} to {args.output}")
        return 0
    print(f"model {result.model_name} version {result.model_version}")
    for name, arr in result.items():
        print(f"{name}: {arr.dtype} {list(arr.shape)}")
        print(np.array2string(arr, threshold=20, edgeitems=3, precision=5))
    return 0


def _run(client: Client, args: argparse.Namespace) -> int:
    if args.command == "health":
        checks = {"live": client.is_live(), "ready": client.is_ready()}
        if args.model:
            checks[f"model {args.model} ready"] = client.is_ready(args.model)
        for what, ok in checks.items():
            print(f"{what}: {'yes' if ok else 'no'}")
        return 0 if all(checks.values()) else 1
    if args.command == "metadata":
        doc: dict[str, Any] = {"metadata": client.model_metadata(args.model)}
        if args.config:
            doc["config"] = client.model_config(args.model)
        print(json.dumps(doc if args.config else doc["metadata"], indent=2))
        return 0
    if args.command == "infer":
        return _infer(client, args)
    return _bench(client, args)


def main(argv: Sequence[str] | None = None, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run the CLI; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        transport: an httpx transport for the client (tests).
    """
    args = _parser().parse_args(argv)
    try:
        with Client(
            args.url,
            token=args.token,
            timeout=args.timeout,
            retries=args.retries,
            transport=transport,
        ) as client:
            return _run(client, args)
    except BitserveError as exc:
        print(f"bitserve-client: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # unreadable .npy files and the like
        print(f"bitserve-client: {exc}", file=sys.stderr)
        return 1
