"""How evenly do N worker processes on one port share keep-alive connections?

``python -m benchmarks.workers_spread [--trials 20] [--workers 2] [--connections 8]``

The two ways to put uvicorn workers on one port, with the mechanism ``bitserve serve
--workers`` uses (``spawn``ed processes, each running ``uvicorn.Server.run(sockets=...)``):

* ``shared``: the parent binds and listens once; every worker accepts on that socket (what
  bitserve does, and uvicorn's own ``--workers``);
* ``reuseport``: every worker binds its own socket with ``SO_REUSEPORT``; the kernel hashes
  each new connection to one of them.

A closed-loop client (asyncio, raw HTTP/1.1) opens ``--connections`` keep-alive connections
at once, sends requests back to back on each for a second, and records which worker (pid)
served each connection. A trial's split is the number of connections per worker (busiest
first); its share is the busiest worker's fraction of the requests. The app burns ~0.3 ms of
CPU per request, like a small inference. Not part of ``make bench`` (nothing to compare with
later); run it when the way workers share the port changes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

_REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"


def _app() -> Any:
    pid = str(os.getpid()).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0003:
            pass
        headers = [(b"x-pid", pid), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def _worker(sock: socket.socket | None, port: int) -> None:
    import uvicorn

    if sock is None:  # reuseport: a socket of its own
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(_app(), http="httptools", log_level="error", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


async def _connection(port: int, seconds: float) -> tuple[str, int]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    pid, count = "", 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        writer.write(_REQUEST)
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
            elif name.lower() == b"x-pid":
                pid = value.strip().decode()
        await reader.readexactly(length)
        count += 1
    writer.close()
    return pid, count


async def _trial(port: int, connections: int, seconds: float) -> list[tuple[str, int]]:
    return list(await asyncio.gather(*(_connection(port, seconds) for _ in range(connections))))


def measure(mode: str, trials: int, workers: int, connections: int) -> dict[str, Any]:
    """Run ``trials`` trials against ``workers`` workers sharing a port the ``mode`` way."""
    ctx = multiprocessing.get_context("spawn")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if mode == "reuseport":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))  # reuseport: bound, not listening, only to hold the port
    port = sock.getsockname()[1]
    if mode == "shared":
        sock.listen(2048)
    procs = [
        ctx.Process(target=_worker, args=(sock if mode == "shared" else None, port))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        _wait_listening(port)
        splits: Counter[tuple[int, ...]] = Counter()
        shares, rates = [], []
        for _ in range(trials):
            t0 = time.perf_counter()
            results = asyncio.run(_trial(port, connections, 1.0))
            elapsed = time.perf_counter() - t0
            by_pid: Counter[str] = Counter(pid for pid, _ in results)
            reqs: Counter[str] = Counter()
            for pid, n in results:
                reqs[pid] += n
            pids = [str(p.pid) for p in procs]
            splits[tuple(sorted((by_pid[p] for p in pids), reverse=True))] += 1
            shares.append(max(reqs.values()) / sum(reqs.values()))
            rates.append(sum(reqs.values()) / elapsed)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
        sock.close()
    return {"splits": splits, "share": statistics.median(shares), "rate": statistics.median(rates)}


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(_REQUEST)
                if s.recv(100).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("workers did not start")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--connections", type=int, default=8)
    args = p.parse_args(argv)
    print(f"{args.workers} workers, {args.connections} keep-alive connections, "
          f"{args.trials} trials of 1 s each; {os.cpu_count()} CPUs\n")  # fmt: skip
    print("| mode | connections per worker (busiest first): trials | median busiest share "
          "of requests | median req/s |")  # fmt: skip
    print("|---|---|---|---|")
    for mode in ("shared", "reuseport"):
        r = measure(mode, args.trials, args.workers, args.connections)
        splits = ", ".join(f"{'/'.join(map(str, s))}: {n}" for s, n in sorted(r["splits"].items()))
        print(f"| {mode} | {splits} | {r['share']:.2f} | {r['rate']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
