"""The servers' Python alone: an in-process driver for profiling a request's path.

perf_analyzer measures a server through its sockets, on cores shared with the load generator
and (here) with other work, so small changes drown in its noise. This driver runs a server's
HTTP protocol on fake transports in one process and one event loop: ``connections`` keep-alive
clients each send their next request when their answer is complete (the next loop turn, as a
socket read would), until ``requests`` are answered. What it measures is the server's own
Python: the protocol, the application and (for bitserve) its data plane, batcher and pipeline,
with batches computed inline as a light model's are. No socket, no system call.

- ``bitserve``: the application of ``bitserve serve`` on the tiny model (access log on, as by
  default), hosted by bitserve's protocol (``service.rest.http_protocol``);
- ``fastapi``: the hand-written FastAPI V2 endpoint (``benchmarks.overhead.fastapi_v2``) on
  uvicorn's httptools protocol;
- ``floor``: the raw ASGI app (``benchmarks.overhead.asgi_v2``) on the same.

    python -m benchmarks.overhead.inprocess                 # µs and Python calls per request
    python -m benchmarks.overhead.inprocess --profile bitserve --sort tottime   # cProfile

Every answer is checked (status 200 and the count of ones).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import logging
import pstats
import statistics
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from benchmarks.overhead import tiny
from harness.fake_transport import FakeClient, Response, host_config
from service.cluster.supervisor import available_cores, plan_workers
from service.models.devices import set_torch_threads
from service.observability.request_ids import configure_logging

_HEAD = (
    b'{"inputs":[{"name":"bits","datatype":"UINT8","shape":[1,1,1],'
    b'"parameters":{"binary_data_size":1}}],'
    b'"outputs":[{"name":"count","parameters":{"binary_data":true}}]}'
)
REQUEST = (
    b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/octet-stream\r\n"
    b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%b\x0b"
    % (len(_HEAD), len(_HEAD) + 1, _HEAD)
)
"""One binary V2 request of one item (the byte 0b1011: three ones), as perf_analyzer sends."""


class _Driver:
    """``connections`` keep-alive clients, each sending its next request when its answer is
    complete (in the next loop turn, as a socket read would), until ``requests`` are sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, requests: int) -> None:
        self.loop = loop
        self.left = self.total = requests
        self.sent = 0
        self.done: asyncio.Future[None] = loop.create_future()

    def answered(self, client: FakeClient, response: Response) -> None:
        if response.status != 200 or struct.unpack("<f", response.body[-4:])[0] != 3.0:
            raise AssertionError(f"answer {response.status}: {bytes(response.body[:200])!r}")
        client.responses.clear()
        self.left -= 1
        if self.left <= 0:
            if not self.done.done():
                self.done.set_result(None)
        elif self.sent < self.total:
            self.sent += 1
            self.loop.call_soon(client.send, REQUEST)

    async def run(self, make: Callable[[], asyncio.Protocol], connections: int) -> None:
        for _ in range(connections):
            client = FakeClient(self.answered).attach(make())
            self.sent += 1
            self.loop.call_soon(client.send, REQUEST)
        await self.done


@contextlib.asynccontextmanager
async def _bitserve(tmp: Path) -> AsyncIterator[Callable[[], asyncio.Protocol]]:
    from service.rest.http_protocol import protocol_class
    from service.server import in_process_app
    from service.settings import Settings

    repo = tiny.write_repository(tmp / "tiny")
    settings = Settings(model_repository=repo, grpc_port=0)
    app = in_process_app(settings)
    cls = protocol_class(
        head_timeout_s=10.0, max_header_bytes=65536, max_connections=0, lane=app.express
    )
    config, state = host_config(app, cls)
    async with app.router.lifespan_context(app):
        yield lambda: cls(config, state, {})


@contextlib.asynccontextmanager
async def _uvicorn(module: str) -> AsyncIterator[Callable[[], asyncio.Protocol]]:
    import importlib

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    mod = importlib.import_module(module)
    app = mod.create_app() if hasattr(mod, "create_app") else mod.app
    config, state = host_config(app, "httptools")
    yield lambda: HttpToolsProtocol(config, state, {})


SERVERS = {
    "bitserve": lambda tmp: _bitserve(tmp),
    "fastapi": lambda tmp: _uvicorn("benchmarks.overhead.fastapi_v2"),
    "floor": lambda tmp: _uvicorn("benchmarks.overhead.asgi_v2"),
}


async def measure(
    name: str, *, requests: int, connections: int, profile: cProfile.Profile | None = None
) -> tuple[float, int]:
    """``(CPU µs per request, Python calls per request or 0)`` for one server."""
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory() as tmp:
        async with SERVERS[name](Path(tmp)) as make:
            await _Driver(loop, max(200, requests // 10)).run(make, connections)  # warm-up
            gc.collect()
            driver = _Driver(loop, requests)
            t0 = time.process_time()
            if profile is not None:
                profile.enable()
            await driver.run(make, connections)
            if profile is not None:
                profile.disable()
            cpu = time.process_time() - t0
    calls = 0
    if profile is not None:
        calls = sum(v[1] for v in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
    return cpu / requests * 1e6, calls // requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="bitserve,fastapi,floor")
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", default=None, help="a server to cProfile, printing its stats")
    p.add_argument("--sort", default="tottime")
    p.add_argument("--lines", type=int, default=40)
    p.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    # The server's logging, as ``bitserve serve`` sets it up; its lines (bitserve's access
    # log is on by default) go nowhere here.
    configure_logging("info")
    # Torch's threads as ``bitserve serve --workers 1`` sets them here (the FastAPI baseline
    # runs no torch); left at torch's default, an idle intra-op thread's spinning would be
    # counted as the server's CPU.
    plan = plan_workers(1, cores=available_cores(), gpus=0)
    set_torch_threads(plan.torch_threads, plan.interop_threads)
    for name in ("service", "gpu_ops", "uvicorn"):
        for handler in logging.getLogger(name).handlers:
            handler.setStream(io.StringIO())  # type: ignore[attr-defined]
    run: Any = asyncio.run
    if args.uvloop:
        import uvloop

        run = uvloop.run
    if args.profile:
        prof = cProfile.Profile()
        us, calls = run(
            measure(args.profile, requests=args.requests, connections=args.connections,
                    profile=prof)
        )  # fmt: skip
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(args.sort).print_stats(args.lines)
        print(out.getvalue())
        print(f"{args.profile}: {us:.0f} µs/req under cProfile, {calls} Python calls/req")
        return
    names = args.servers.split(",")
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):  # interleaved: drift on a shared machine hits every server
        for name in names:
            us, _ = run(measure(name, requests=args.requests, connections=args.connections))
            times[name].append(us)
    for name in names:
        prof = cProfile.Profile()
        _, calls = run(
            measure(name, requests=args.requests // 4, connections=args.connections,
                    profile=prof)
        )  # fmt: skip
        runs = ", ".join(f"{us:.0f}" for us in times[name])
        print(f"{name}: {statistics.median(times[name]):.0f} µs/req, least {min(times[name]):.0f} "
              f"(rounds: {runs}), "
              f"{calls} Python calls/req", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
