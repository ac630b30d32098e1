"""Closed-loop load generator: C concurrent clients, every answer checked against float64.

Runs in its own process (never inside a server): ``python -m harness.loadgen --url ...
--format packed --concurrency 8 --seconds 10 --pool-file pool.npz --server-pid PID`` prints one
JSON :class:`LevelResult`. The end-to-end tests import :func:`run_level` directly.

Each of the C clients sends the next pool item as soon as its previous answer came back
(closed loop), so throughput is what the server sustains at that concurrency. Server CPU is
read from the server's process tree (psutil) before and after the timed phase.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from harness import wire
from harness.workload import Pool, check


def tree_cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (0 if None)."""
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its live descendants, in bytes."""
    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def is_error_body(content: bytes) -> bool:
    """``content`` is ``{"error": "<non-empty text>"}``, the body of every non-200."""
    try:
        doc = json.loads(content)
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), str) and bool(doc["error"])


SUCCESS = ("200", "OK")
"""The statuses of an answer: HTTP's 200, gRPC's OK (other gRPC codes by name)."""


@dataclass
class LevelResult:
    """What one concurrency level measured."""

    fmt: str
    concurrency: int
    ok: int = 0
    """Requests answered 200 with a correct answer during the timed phase."""
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    """Every answer by status ("200", "503", ..., gRPC's "OK", "UNAVAILABLE", ...,
    "transport" for connection errors)."""
    wrong: int = 0
    """200 answers that did not match the float64 reference."""
    first_problem: str | None = None
    rps: float = 0.0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    request_bytes: int = 0
    response_bytes: float = 0.0
    server_cpu_s_per_req: float = float("nan")
    retry_after_missing: int = 0
    """503 answers without a Retry-After header."""
    malformed_errors: int = 0
    """Non-200 answers whose body is not ``{"error": "<message>"}``."""
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    """Latency of every 200 in the timed phase (not in the JSON output)."""

    @property
    def errors(self) -> int:
        """Answers that were not 200 (gRPC: OK), plus wrong 200s."""
        return sum(n for s, n in self.statuses.items() if s not in SUCCESS) + self.wrong

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("latencies_ms")
        return d


async def run_level(
    url: str,
    fmt: wire.Format,
    pool: Pool,
    concurrency: int,
    *,
    seconds: float | None = None,
    requests: int | None = None,
    warmup_requests: int = 0,
    server_pid: int | None = None,
    timeout_s: float = 120.0,
    headers: dict[str, str] | None = None,
    parameters: dict[str, Any] | None = None,
    backoff_503_s: float = 0.0,
) -> LevelResult:
    """Drive ``url`` with ``concurrency`` closed-loop clients and check every answer.

    Args:
        url: the infer URL; for the ``grpc`` format the server's ``host:port``, with one
            channel (one HTTP/2 connection) per client, as each HTTP client has its own
            connection.
        fmt: the wire format (see :mod:`harness.wire`).
        pool: the items cycled through, with their references.
        concurrency: number of clients, each with at most one request in flight.
        seconds: timed phase length; or
        requests: a fixed number of requests in the timed phase.
        warmup_requests: untimed requests sent first (checked all the same).
        server_pid: the server's pid, for its CPU seconds per request.
        timeout_s: per-request timeout.
        headers: extra headers on every request (e.g. authorization).
        parameters: V2 request parameters on every request (e.g. ``{"timeout": us}``).
        backoff_503_s: a client answered 503 waits this long before its next request.
    """
    if (seconds is None) == (requests is None):
        raise ValueError("give exactly one of seconds and requests")
    bodies = [wire.encode(fmt, item, parameters) for item in pool.items]
    res = LevelResult(fmt=fmt, concurrency=concurrency, request_bytes=len(bodies[0].content))
    statuses: Counter[str] = Counter()
    resp_bytes: list[int] = []
    # An idle connection is dropped by the client before the server's keep-alive timeout (5 s
    # by default) can close it: reusing one the server is closing at that moment fails with a
    # reset (httpx's own expiry is 5 s too, which made the two race).
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(timeout_s)
    counter = 0
    deadline = float("inf")
    timed = False
    remaining = warmup_requests

    def take() -> int | None:
        nonlocal counter, remaining
        if time.perf_counter() >= deadline:
            return None
        if remaining <= 0 and not timed:
            return None
        remaining -= 1
        counter += 1
        return counter

    grpc_calls: list[Any] = []  # one per client, on its own channel

    async def post(client: httpx.AsyncClient, body: wire.Body) -> _Answer | None:
        try:
            r = await client.post(url, content=body.content, headers={**body.headers})
        except httpx.HTTPError as e:
            statuses["transport"] += 1
            res.first_problem = res.first_problem or f"transport: {e!r}"
            return None
        if r.status_code != 200:
            if r.status_code == 503 and "retry-after" not in r.headers:
                res.retry_after_missing += 1
            if not is_error_body(r.content):
                res.malformed_errors += 1
        answer = _Answer(str(r.status_code), r.headers, r.content, r.num_bytes_downloaded)
        answer.text = r.text[:300]
        return answer

    async def call(body: wire.Body, who: int) -> _Answer:
        import grpc

        try:
            content = await grpc_calls[who](body.content, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            answer = _Answer(e.code().name, {}, b"", 0)
            answer.text = str(e.details())[:300]
            return answer
        return _Answer("OK", {}, content, len(content))

    async def one(client: httpx.AsyncClient, i: int, record: bool, who: int) -> None:
        k = i % len(bodies)
        body = bodies[k]
        t0 = time.perf_counter()
        r = await call(body, who) if grpc_calls else await post(client, body)
        if r is None:
            return
        dt = time.perf_counter() - t0
        statuses[r.status] += 1
        if r.status not in SUCCESS:
            res.first_problem = res.first_problem or f"{r.status}: {r.text}"
            if r.status in ("503", "UNAVAILABLE") and backoff_503_s > 0:
                await asyncio.sleep(backoff_503_s)
            return
        try:
            answer = wire.decode(fmt, r.headers, r.content)
            problem = check(answer[0].astype(np.float64), pool.expected[k])
        except (ValueError, KeyError, TypeError) as e:
            problem = f"undecodable answer: {e!r}"
        if problem is not None:
            res.wrong += 1
            res.first_problem = res.first_problem or f"wrong answer: {problem}"
            return
        if record:
            res.latencies_ms.append(dt * 1e3)
            # Bytes on the wire (compressed when the server gzips the answer).
            resp_bytes.append(r.nbytes)

    async def worker(client: httpx.AsyncClient, record: bool, who: int) -> None:
        while (i := take()) is not None:
            await one(client, i, record, who)

    metadata = tuple((k.lower(), v) for k, v in (headers or {}).items())
    channels: list[Any] = []
    if fmt == "grpc":
        import grpc

        # A separate channel per client (grpcio shares one connection between channels with
        # the same arguments unless told not to).
        for k in range(concurrency):
            options = [
                ("grpc.max_receive_message_length", -1),
                ("grpc.use_local_subchannel_pool", 1),
                ("bitserve.client", k),
            ]
            channels.append(grpc.aio.insecure_channel(url, options=options))
        grpc_calls.extend(c.unary_unary(wire.GRPC_METHOD) for c in channels)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        if warmup_requests:
            await asyncio.gather(*(worker(client, False, k) for k in range(concurrency)))
        statuses.clear()
        timed = True
        if requests is not None:
            remaining = requests
            timed = False
        cpu0 = tree_cpu_seconds(server_pid)
        t0 = time.perf_counter()
        if seconds is not None:
            deadline = t0 + seconds
        await asyncio.gather(*(worker(client, True, k) for k in range(concurrency)))
        res.seconds = time.perf_counter() - t0
        cpu1 = tree_cpu_seconds(server_pid)
    for c in channels:
        await c.close()

    res.statuses = dict(statuses)
    res.ok = len(res.latencies_ms)
    res.rps = res.ok / res.seconds if res.seconds > 0 else 0.0
    if res.latencies_ms:
        res.p50_ms = float(np.percentile(res.latencies_ms, 50))
        res.p99_ms = float(np.percentile(res.latencies_ms, 99))
        res.response_bytes = float(np.mean(resp_bytes))
    if server_pid is not None and res.ok:
        res.server_cpu_s_per_req = (cpu1 - cpu0) / res.ok
    return res


@dataclass
class _Answer:
    """One answer, whichever the transport: its status, headers, body and bytes received."""

    status: str
    headers: Mapping[str, str]
    content: bytes
    nbytes: int
    text: str = ""


def save_pool(pool: Pool, path: Path) -> None:
    """Write ``pool`` to an ``.npz`` file (the runner builds it once for every level)."""
    np.savez(path, items=pool.items, packed=pool.packed, expected=pool.expected)


def load_pool(path: Path) -> Pool:
    """Read a pool written by :func:`save_pool`."""
    with np.load(path) as z:
        return Pool(items=z["items"], packed=z["packed"], expected=z["expected"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--format", required=True, choices=wire.FORMATS)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--seconds", type=float)
    p.add_argument("--requests", type=int)
    p.add_argument("--warmup", type=int, default=0, help="untimed requests first")
    p.add_argument("--pool-file", type=Path, required=True)
    p.add_argument("--server-pid", type=int)
    args = p.parse_args(argv)
    pool = load_pool(args.pool_file)
    res = asyncio.run(
        run_level(
            args.url,
            args.format,
            pool,
            args.concurrency,
            seconds=args.seconds,
            requests=args.requests,
            warmup_requests=args.warmup,
            server_pid=args.server_pid,
        )
    )
    print(json.dumps(res.to_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
