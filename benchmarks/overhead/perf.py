"""Driving servers for the overhead benchmark: processes, perf_analyzer, CPU accounting.

perf_analyzer is Triton's C++ load generator, so the load costs the measured cores little.
It is found as ``$PERF_ANALYZER``, then ``perf_analyzer`` on ``PATH``, then the workplace's
installer script ``../shared/tools/perf-analyzer.sh`` beside the project.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from harness.loadgen import tree_cpu_seconds
from harness.server import STARTUP_S, bitserve_command, free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Running:
    """A server process under test."""

    label: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def bitserve(repository: Path, *flags: str) -> list[str]:
    """``bitserve serve`` on ``repository`` (the port is appended by :func:`start`)."""
    cmd = bitserve_command()
    # HTTP only here: gRPC off (several servers run at once; 8001 may be anyone's)
    return [*cmd, "serve", "--model-repository", str(repository), "--grpc-port", "0", *flags]


def module(name: str) -> list[str]:
    """A ``python -m`` server module that takes ``--port``."""
    return [sys.executable, "-m", name]


@contextlib.contextmanager
def start(
    servers: Sequence[tuple[str, list[str]]], *, timeout_s: float = STARTUP_S
) -> Iterator[list[Running]]:
    """Start every server on a free port, wait until each is ready, stop them all afterwards.

    Args:
        servers: ``(label, command)``; ``--port N`` is appended to each command.
    """
    logs = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("PYTHONPATH", str(ROOT))
    running: list[Running] = []
    try:
        for i, (label, cmd) in enumerate(servers):
            port = free_port()
            log = logs / f"server-{i}.log"
            with log.open("wb") as fh:
                proc = subprocess.Popen(
                    [*cmd, "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT, env=env,
                    cwd=ROOT,
                )  # fmt: skip
            running.append(Running(label, proc, port, log))
        deadline = time.monotonic() + timeout_s
        for r in running:
            while True:
                if r.process.poll() is not None:
                    raise RuntimeError(f"{r.label} exited:\n{r.log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(r.url + "/v2/health/ready", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{r.label} not ready:\n{r.log.read_text()[-3000:]}")
                time.sleep(0.2)
        yield running
    finally:
        for r in running:
            if r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
        for r in running:
            try:
                r.process.wait(30)
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait()


@dataclass
class Load:
    """One perf_analyzer measurement."""

    rps: float
    p50_us: float
    p99_us: float
    cpu_us_per_request: float
    stable: bool = True
    """perf_analyzer reached its stability criterion (on a machine busy with other work it
    may not: the last of three windows is taken then)."""


def measure(
    command: list[str] | None,
    server: Running,
    model: str,
    concurrency: int,
    *,
    interval_ms: int = 4000,
    smoke: bool = False,
) -> Load:
    """Drive ``model`` on ``server`` at a concurrency with perf_analyzer.

    The server's CPU time (its process tree: user + system) is read around the whole
    perf_analyzer run, whose load is the same from its first request to its last, and divided
    by the requests it served in that time (throughput x duration). Without perf_analyzer
    (``command`` None: a smoke run where it is not installed), a small Python load of the
    same requests stands in.
    """
    if command is None:
        return asyncio.run(_python_load(server, model, concurrency, 4 * concurrency))
    try:
        return _perf_analyzer(command, server, model, concurrency, interval_ms, smoke, True)
    except _Unstable:
        return _perf_analyzer(command, server, model, concurrency, interval_ms, smoke, False)


class _Unstable(RuntimeError):
    """perf_analyzer found no stable measurement."""


def _perf_analyzer(
    command: list[str],
    server: Running,
    model: str,
    concurrency: int,
    interval_ms: int,
    smoke: bool,
    stable: bool,
) -> Load:
    """One perf_analyzer run (``stable`` False: take the last of three windows)."""
    steady = stable and not smoke
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pa.csv"
        args = [
            *command,
            "-m", model, "-u", f"127.0.0.1:{server.port}", "-i", "http",
            "--concurrency-range", str(concurrency),
            "--measurement-interval", str(500 if smoke else interval_ms),
            "--stability-percentage", "50" if steady else "1000",  # 1000: any window will do
            "--max-trials", "6" if steady else "3",
            "-f", str(out),
        ]  # fmt: skip
        cpu0 = tree_cpu_seconds(server.process.pid)
        t0 = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        cpu = tree_cpu_seconds(server.process.pid) - cpu0
        if done.returncode != 0 or not out.exists():
            said = done.stdout[-3000:] + done.stderr[-2000:]
            if steady and "stable measurement" in said:
                raise _Unstable(said)
            raise RuntimeError(f"perf_analyzer failed on {server.label}:\n{said}")
        row = next(csv.DictReader(io.StringIO(out.read_text())))
    rps = float(row["Inferences/Second"])
    # perf_analyzer's own start (metadata calls) is a fraction of a second of its run.
    served = rps * wall
    return Load(
        rps=rps,
        p50_us=float(row["p50 latency"]),
        p99_us=float(row["p99 latency"]),
        cpu_us_per_request=cpu / served * 1e6 if served else float("nan"),
        stable=steady or smoke,
    )


async def _python_load(server: Running, model: str, concurrency: int, requests: int) -> Load:
    """``requests`` V2 binary requests of one item of zeros, ``concurrency`` at a time."""
    meta = httpx.get(f"{server.url}/v2/models/{model}", timeout=10).json()
    (inp,) = meta["inputs"]
    shape = [1, *inp["shape"][1:]]
    nbytes = int(np.prod(shape)) * np.dtype(inp["datatype"].lower().replace("fp", "float")).itemsize
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": inp["name"],
                    "datatype": inp["datatype"],
                    "shape": shape,
                    "parameters": {"binary_data_size": nbytes},
                }
            ]
        }
    ).encode()
    body = head + bytes(nbytes)
    headers = {"Inference-Header-Content-Length": str(len(head))}
    latencies: list[float] = []
    left = requests

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            r = await client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    cpu0 = tree_cpu_seconds(server.process.pid)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu = tree_cpu_seconds(server.process.pid) - cpu0
    us = np.array(latencies) * 1e6
    return Load(
        rps=len(latencies) / wall,
        p50_us=float(np.percentile(us, 50)),
        p99_us=float(np.percentile(us, 99)),
        cpu_us_per_request=cpu / len(latencies) * 1e6,
    )
