"""The async client's own HTTP/1.1 transport (``_h1_async``) against httpx's async one.

As ``test_h1.py`` does for the sync transport: the scripted server's random answers must read
as httpx's ``AsyncHTTPTransport`` (httpcore over h11 and anyio) reads them, the client's
direct path must send what httpx sends, and failures map to the same exceptions and retries.
Then what only the async one has: a cancelled call closes its connection, and a connection
from another event loop is not reused.
"""

from __future__ import annotations

import asyncio
import gc
import random
import socket
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import pytest
from bitserve_client import AsyncClient, ConnectError, Retry, TimeoutException, TransportError
from bitserve_client._h1_async import AsyncH1Transport

from .fake_v2 import FakeV2, reference_bits
from .test_h1 import OK, Scripted, fields_of, random_answer, scripted
from .wire import WireServer

__all__ = ["scripted"]  # the fixture, shared with test_h1.py


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(fn())  # type: ignore[arg-type]


async def fetch(client: httpx.AsyncClient, method: str) -> tuple[int, list[tuple[str, str]], bytes]:
    r = await client.request(method, "/x")
    return r.status_code, r.headers.multi_items(), r.content


@pytest.mark.parametrize("seed", [*range(4), None])
def test_random_answers_read_as_httpx_reads_them(scripted: Scripted, seed: int | None) -> None:
    """Four fixed seeds, and a fresh one each run (printed, to replay a failure)."""
    seed = random.randrange(2**32) if seed is None else seed
    print(f"seed {seed}")
    rng = random.Random(seed)

    async def main() -> None:
        async with (
            httpx.AsyncClient(base_url=scripted.url, transport=AsyncH1Transport()) as lean,
            httpx.AsyncClient(base_url=scripted.url, transport=httpx.AsyncHTTPTransport()) as ref,
        ):
            for _ in range(25):
                method = rng.choice(["GET", "POST", "HEAD"])
                answer = random_answer(rng, method)
                scripted.script += [answer, answer]
                got, want = await fetch(lean, method), await fetch(ref, method)
                assert got == want, f"seed {seed}"

    run(main)
    assert scripted.accepted < 50  # kept-alive connections were reused


async def stream(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def test_bodies_go_out_as_httpx_sends_them(scripted: Scripted) -> None:
    rng = np.random.default_rng(1)

    async def main() -> None:
        async with (
            httpx.AsyncClient(base_url=scripted.url, transport=AsyncH1Transport()) as lean,
            httpx.AsyncClient(base_url=scripted.url, transport=httpx.AsyncHTTPTransport()) as ref,
        ):
            for n in (0, 5, 300_000, 700_000):  # one write, then piecewise above JOIN_BELOW
                arr = rng.integers(0, 255, n, dtype=np.uint8)
                floats = rng.random(n // 4 + 1).astype(np.float32)
                length = 4 + arr.nbytes + floats.nbytes
                for client in (lean, ref):
                    pieces = [b"head", arr.tobytes(), floats.tobytes()]
                    scripted.script.append((OK, "keep"))
                    await client.post("/p", content=stream(pieces),
                                      headers={"Content-Length": str(length)})  # fmt: skip
                    scripted.script.append((OK, "keep"))
                    await client.post("/p", content=stream([b"a", b"", b"bc"]))  # chunked
                (h1, b1), (_, b2), (h3, b3), (_, b4) = scripted.requests[-4:]
                assert b1 == b3 == b"head" + arr.tobytes() + floats.tobytes()
                assert b2 == b4 == b"abc"
                assert h1.split(b"\r\n")[0] == h3.split(b"\r\n")[0] == b"POST /p HTTP/1.1"

    run(main)


# -- the client's direct path -----------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/route/a"])
def test_client_sends_what_httpx_sends(prefix: str) -> None:
    fake = FakeV2()
    server = WireServer(fake)
    url = server.url("http://x" + prefix, strip_prefix=True)
    bits = np.random.default_rng(2).random((8, 3, 13)) < 0.5
    extra = {"X-Trace": "abc", "user-agent": "mine/1"}
    seen: list[list[tuple[httpx.Request, bytes]]] = []

    async def main(transport: httpx.AsyncBaseTransport | None) -> None:
        async with AsyncClient(url, token="t0k", headers={"X-Team": "chem"},
                               transport=transport) as c:  # fmt: skip
            assert (c._lean is not None) == (transport is None)
            start = len(fake.requests)
            await c.model_metadata("bits", headers=extra)
            await c.infer("bits", bits, headers=extra, deadline=0.25)
            await c.load_model("bits", headers={"X-Load": "1"})
            assert await c.is_ready()
            seen.append([(r, r.content) for r in fake.requests[start:]])

    try:
        asyncio.run(main(None))
        asyncio.run(main(httpx.AsyncHTTPTransport()))
    finally:
        server.close()
    lean, reference = seen
    assert len(lean) == len(reference) >= 4
    for (r1, b1), (r2, b2) in zip(lean, reference, strict=True):
        assert (r1.method, r1.url.raw_path) == (r2.method, r2.url.raw_path)
        assert fields_of(r1) == fields_of(r2)
        assert b1 == b2
    assert lean[0][0].headers["authorization"] == "Bearer t0k"


def test_client_results_match_reference_on_the_wire() -> None:
    fake = FakeV2()
    server = WireServer(fake)

    async def main() -> None:
        async with AsyncClient(server.url("http://x"), compression="gzip") as c:
            assert c._lean is not None
            for seed in range(3):
                bits = np.random.default_rng(seed).random((7, 3, 13)) < 0.5
                result, ref = await c.infer("bits", bits), reference_bits(bits)
                np.testing.assert_array_equal(result["count"], ref["count"])
                np.testing.assert_array_equal(result["first"], ref["first"])
            many = np.random.default_rng(9).random((50, 3, 13)) < 0.5
            bulk = await c.infer_many("bits", many, batch_size=4)
            np.testing.assert_array_equal(bulk["count"], reference_bits(many)["count"])

    try:
        run(main)
    finally:
        server.close()


# -- connections and failures -----------------------------------------------------------------


def client_on(server: Scripted, **kwargs: Any) -> tuple[AsyncClient, list[float]]:
    sleeps: list[float] = []
    kwargs.setdefault("retries", Retry(retries=2, backoff=0.01))
    client = AsyncClient(server.url, **kwargs)

    async def sleep(s: float) -> None:
        sleeps.append(s)

    client._sleep = sleep
    return client, sleeps


def test_connections_are_reused_and_a_closed_one_is_not(scripted: Scripted) -> None:
    async def main() -> list[float]:
        client, sleeps = client_on(scripted)
        async with client:
            scripted.script += [(OK, "keep")] * 3
            for _ in range(3):
                await client.server_metadata()
            assert scripted.accepted == 1
            scripted.script += [(OK, "close"), (OK, "keep")]
            await client.server_metadata()
            await asyncio.sleep(0.05)
            await client.server_metadata()  # found closed before reuse: no retry
        return sleeps

    assert run(main) == []
    assert scripted.accepted == 2


def test_idle_connections_expire(scripted: Scripted) -> None:
    async def main() -> None:
        client, _ = client_on(scripted, limits=httpx.Limits(keepalive_expiry=0.05))
        async with client:
            scripted.script += [(OK, "keep")] * 2
            await client.server_metadata()
            await asyncio.sleep(0.15)
            await client.server_metadata()

    run(main)
    assert scripted.accepted == 2


@pytest.mark.parametrize(
    "answer",
    [
        (b"", "drop"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", "close"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "close"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "close"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "close"),
    ],
)
def test_broken_answers_are_retried_then_raised(
    scripted: Scripted, answer: tuple[bytes, str]
) -> None:
    async def main() -> None:
        client, sleeps = client_on(scripted)
        async with client:
            scripted.script += [answer, (OK, "keep")]
            assert await client.server_metadata() == {}
            assert len(sleeps) == 1
            scripted.script += [answer] * 3
            with pytest.raises(TransportError) as info:
                await client.server_metadata()
            assert isinstance(info.value.__cause__, httpx.RemoteProtocolError)
            assert len(sleeps) == 3

    run(main)


def test_refused_connection_is_a_connect_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]

    async def main() -> None:
        client = AsyncClient(f"http://127.0.0.1:{port}", retries=Retry(retries=2, backoff=0.01))
        async with client:
            with pytest.raises(ConnectError) as info:
                await client.server_metadata()
        assert isinstance(info.value.__cause__, httpx.ConnectError)

    run(main)


def test_read_timeout_is_raised_and_not_retried(scripted: Scripted) -> None:
    async def main() -> list[float]:
        client, sleeps = client_on(scripted, timeout=5.0)
        async with client:
            scripted.script.append((b"HTTP/1.1 200 OK\r\n", "keep"))  # then nothing more
            t0 = time.monotonic()
            with pytest.raises(TimeoutException) as info:
                await client.server_metadata(timeout=0.2)
            assert time.monotonic() - t0 < 3
        assert isinstance(info.value.__cause__, httpx.ReadTimeout)
        return sleeps

    assert run(main) == []


def test_pool_limit_waits_then_times_out(scripted: Scripted) -> None:
    async def main() -> None:
        transport = AsyncH1Transport(httpx.Limits(max_connections=1))
        scripted.script += [(b"HTTP/1.1 200 OK\r\n", "keep"), (OK, "keep")]
        async with httpx.AsyncClient(base_url=scripted.url, transport=transport) as c:
            held = asyncio.create_task(c.get("/", timeout=0.5))  # holds the only connection
            await asyncio.sleep(0.1)
            with pytest.raises(httpx.PoolTimeout):
                await c.get("/", timeout=httpx.Timeout(5.0, pool=0.1))
            waiting = asyncio.create_task(c.get("/", timeout=httpx.Timeout(5.0)))
            with pytest.raises(httpx.ReadTimeout):
                await held
            assert (await waiting).status_code == 200  # given the slot when it freed
            assert transport._open == 0
            assert not transport._queue

    run(main)


def test_a_cancelled_call_closes_its_connection(scripted: Scripted) -> None:
    """The server sees the client leave at once, and the connection is not reused."""

    async def main() -> None:
        client, _ = client_on(scripted)
        async with client:
            scripted.script += [(b"HTTP/1.1 200 OK\r\n", "keep"), (OK, "keep")]
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.server_metadata(), 0.2)
            assert client._lean is not None
            assert client._lean._open == 0
            assert client._lean._pool.total == 0
            assert await client.server_metadata() == {}

    run(main)
    assert scripted.accepted == 2
    assert scripted.wait_ended(0)  # the client closed the first connection


def test_a_connection_from_another_event_loop_is_not_reused(scripted: Scripted) -> None:
    """One client across two ``asyncio.run`` calls: the first loop's connection is shut
    down, not reused (its transport, left by a closed loop, is reclaimed by the collector,
    which warns of it: that warning is expected here)."""
    client, _ = client_on(scripted)
    scripted.script += [(OK, "keep")] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        assert run(client.server_metadata) == {}
        assert run(client.server_metadata) == {}  # a new loop: a new connection, no error
        run(client.aclose)
        gc.collect()
    assert scripted.accepted == 2
    assert scripted.wait_ended(0)  # shut down, so the server saw it end


def test_lean_transport_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)

    async def lean(url: str, **kwargs: Any) -> bool:
        async with AsyncClient(url, **kwargs) as c:
            assert isinstance(c._http._transport, AsyncH1Transport) is (c._lean is not None)
            return c._lean is not None

    assert asyncio.run(lean("http://h:1"))
    assert not asyncio.run(lean("https://h:1"))
    assert not asyncio.run(lean("http://h:1", proxy="http://p:3128"))
    assert not asyncio.run(lean("http://h:1", transport=httpx.AsyncHTTPTransport()))
    monkeypatch.setenv("HTTP_PROXY", "http://p:3128")
    assert not asyncio.run(lean("http://h:1"))


def test_closed_client_refuses(scripted: Scripted) -> None:
    client, _ = client_on(scripted)
    run(client.aclose)
    with pytest.raises(Exception, match="closed"):
        run(client.server_metadata)
