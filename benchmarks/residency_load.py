"""The load of ``bench_residency``: its raw-socket HTTP/1.1 client, and the load tasks it runs
in a process of their own (Zipf traffic, the replay against the reference, random requests
to the tiny model)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.overhead import perf, tiny

CLIENTS = 8
ZIPF_S = 1.1
N, B, A = 16, 8192, 1024  # functions, fine bits, coarse points of each model


NAMES = {"demo": ("spikes", "resampled"), "tiny": (tiny.INPUT, tiny.OUTPUT)}
"""Input and output names of the models that are not ours (ours: ``bits``, ``out``)."""


def infer_bytes(model: str, packed: np.ndarray[Any, Any], rid: str) -> bytes:
    """One binary V2 request for ``model`` (HTTP/1.1, keep-alive)."""
    name, output = NAMES.get(model, ("bits", "out"))
    head = json.dumps(
        {
            "id": rid,
            "inputs": [{"name": name, "datatype": "UINT8", "shape": list(packed.shape),
                        "parameters": {"binary_data_size": packed.nbytes}}],
            "outputs": [{"name": output, "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    body = head + packed.tobytes()
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: b\r\nContent-Length: {len(body)}\r\n"
        f"Inference-Header-Content-Length: {len(head)}\r\n\r\n"
    ).encode() + body


class Conn:
    """One keep-alive HTTP/1.1 connection: a request's bytes in, ``(status, output bytes)``
    out (the body after its JSON header)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port, limit=1 << 20))

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = json_length = 0
        for line in head.split(b"\r\n"):
            key, _, value = line.partition(b":")
            if key.lower() == b"content-length":
                length = int(value)
            elif key.lower() == b"inference-header-content-length":
                json_length = int(value)
        body = await self.reader.readexactly(length)
        return status, body[json_length:] if status == 200 else body

    def close(self) -> None:
        self.writer.close()


# --- the load generator (its own process) -------------------------------------------------


async def zipf_load(port: int, names: list[str], seconds: float, seed: int) -> dict[str, Any]:
    """Zipf traffic from :data:`CLIENTS` connections: each request's model, seed, status,
    latency and the SHA-256 of its output bytes."""
    rng = np.random.default_rng(seed)
    ranked = list(rng.permutation(names))
    weights = 1.0 / np.arange(1, len(ranked) + 1) ** ZIPF_S
    p = weights / weights.sum()
    records: list[tuple[str, int, int, float, str]] = []
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        r = np.random.default_rng(seed * 100 + k)
        conn = await Conn.open(port)
        try:
            while time.perf_counter() < deadline:
                model = ranked[int(r.choice(len(ranked), p=p))]
                s = int(r.integers(0, 2**31))
                packed = np.random.default_rng(s).integers(0, 256, (1, N, B // 8), np.uint8)
                t0 = time.perf_counter()
                status, body = await conn.send(infer_bytes(model, packed, f"{k}-{s}"))
                ms = (time.perf_counter() - t0) * 1e3
                digest = hashlib.sha256(body).hexdigest() if status == 200 else ""
                records.append((model, s, status, ms, digest))
        finally:
            conn.close()

    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return {"records": records, "ranked": ranked, "p": p.tolist()}


async def replay(port: int, records: list[list[Any]]) -> int:
    """Send every recorded request to the reference server; the number whose output bytes
    differ (or failed)."""
    todo = list(records)
    bad = 0

    async def client() -> None:
        nonlocal bad
        conn = await Conn.open(port)
        try:
            while todo:
                model, s, _, _, digest = todo.pop()
                packed = np.random.default_rng(s).integers(0, 256, (1, N, B // 8), np.uint8)
                status, body = await conn.send(infer_bytes(model, packed, "ref"))
                if status != 200 or hashlib.sha256(body).hexdigest() != digest:
                    bad += 1
        finally:
            conn.close()

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return bad


async def rate(port: int, model: str, seconds: float, items: int, seed: int) -> float:
    """Requests per second of random ``items``-item requests to ``model`` (tiny) from
    :data:`CLIENTS` connections."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal count
        r = np.random.default_rng(seed * 1000 + k)
        conn = await Conn.open(port)
        try:
            while time.perf_counter() < deadline:
                packed = r.integers(0, 256, (items, 1, 1), np.uint8)
                status, _ = await conn.send(infer_bytes(model, packed, "r"))
                assert status == 200
                count += 1
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return count / (time.perf_counter() - t0)


def in_child(task: str, **kw: Any) -> Any:
    """Run a load task (``zipf``, ``replay``, ``rate``) in a separate Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"task": task, **kw}))
        subprocess.run([sys.executable, "-m", "benchmarks.bench_residency", "--child",
                        str(spec), str(out)], check=True, cwd=perf.ROOT)  # fmt: skip
        return json.loads(out.read_text())


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    task = spec.pop("task")
    fn = {"zipf": zipf_load, "replay": replay, "rate": rate}[task]
    Path(out_path).write_text(json.dumps(asyncio.run(fn(**spec))))  # type: ignore[operator]
