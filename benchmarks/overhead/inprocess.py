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
import io
import logging
import pstats
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httptools

from benchmarks.overhead import tiny

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


class _Client(asyncio.Transport):
    """A fake transport: one keep-alive client that sends its next request when the answer
    to its last one is complete."""

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self.driver = driver
        self.protocol: asyncio.Protocol | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body = b""
        self.closed = False
        self.paused = False

    # the response parser's callbacks
    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        body, self.body = self.body, b""
        if status != 200 or struct.unpack("<f", body[-4:])[0] != 3.0:
            raise AssertionError(f"answer {status}: {body[:200]!r}")
        self.driver.answered(self)

    # the transport's side
    def write(self, data: Any) -> None:
        self.parser.feed_data(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def send(self) -> None:
        assert self.protocol is not None
        self.protocol.data_received(REQUEST)


class _Driver:
    def __init__(self, loop: asyncio.AbstractEventLoop, requests: int) -> None:
        self.loop = loop
        self.left = requests
        self.sent = 0
        self.done: asyncio.Future[None] = loop.create_future()

    def answered(self, client: _Client) -> None:
        self.left -= 1
        if self.left <= 0:
            if not self.done.done():
                self.done.set_result(None)
        elif self.sent < self.total:
            self.sent += 1
            self.loop.call_soon(client.send)

    async def run(self, make: Callable[[], asyncio.Protocol], connections: int) -> None:
        self.total = self.left
        for _ in range(connections):
            client = _Client(self)
            protocol = make()
            client.protocol = protocol
            protocol.connection_made(client)
            self.sent += 1
            self.loop.call_soon(client.send)
        await self.done


@contextlib.asynccontextmanager
async def _bitserve(tmp: Path) -> AsyncIterator[Callable[[], asyncio.Protocol]]:
    import uvicorn
    from uvicorn.server import ServerState

    from service.rest.app import create_app
    from service.rest.http_protocol import protocol_class
    from service.settings import Settings

    repo = tiny.write_repository(tmp / "tiny")
    settings = Settings(model_repository=repo, grpc_port=0)
    app = create_app(settings)
    cls = protocol_class(head_timeout_s=10.0, max_header_bytes=65536, max_connections=0)
    config = uvicorn.Config(app, http=cls, lifespan="off", proxy_headers=False)
    config.load()
    state = ServerState()
    async with app.router.lifespan_context(app):
        yield lambda: cls(config, state, {})


@contextlib.asynccontextmanager
async def _uvicorn(module: str) -> AsyncIterator[Callable[[], asyncio.Protocol]]:
    import importlib

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    mod = importlib.import_module(module)
    app = mod.create_app() if hasattr(mod, "create_app") else mod.app
    config = uvicorn.Config(app, http="httptools", lifespan="off", access_log=False)
    config.load()
    state = ServerState()
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
    p.add_argument("--profile", default=None, help="a server to cProfile, printing its stats")
    p.add_argument("--sort", default="tottime")
    p.add_argument("--lines", type=int, default=40)
    p.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # The access log is on, as bitserve's default: its lines go nowhere here.
    logging.getLogger("service.rest.gateway.access").addHandler(logging.NullHandler())
    logging.getLogger("service.rest.gateway.access").propagate = False
    logging.getLogger("service.rest.gateway.access").setLevel(logging.INFO)
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
    for name in args.servers.split(","):
        us, _ = run(measure(name, requests=args.requests, connections=args.connections))
        prof = cProfile.Profile()
        _, calls = run(
            measure(name, requests=args.requests // 4, connections=args.connections,
                    profile=prof)
        )  # fmt: skip
        print(f"{name}: {us:.0f} µs/req, {calls} Python calls/req", flush=True)


if __name__ == "__main__":
    main()
