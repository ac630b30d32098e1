"""Shared set-up of the client tests: clients (sync and async) on a FakeV2, and test data.

Each behaviour runs for both clients through the ``make`` fixture, whose harness hides the
difference between ``client.x(...)`` and ``await client.x(...)``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from bitserve_client import AsyncClient, Client, Retry

from .fake_v2 import FakeV2, async_handler
from .wire import WireServer


def jittery() -> float:
    """A random service time, so that concurrent requests finish out of order."""
    return random.uniform(0.0, 0.004)


def rows(n: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """``n`` random items for model ``bits``: bool [n, 3, 13]."""
    return np.random.default_rng(seed).random((n, 3, 13)) < 0.5


class Harness:
    """One client (sync or async) on a FakeV2, with recorded backoff sleeps.

    Args:
        kind: ``"sync"`` or ``"async"`` (over ``httpx.MockTransport``), or ``"wire"`` and
            ``"async-wire"``: the sync or async client on its default transport, the fake on
            a real socket (:mod:`.wire`); the async one's calls all run on one event loop.
        fake: the server.
        jitter: for the async client, a random delay per request on the event loop (the
            other clients' FakeV2 sleeps in its ``delay`` instead).
        **kwargs: client arguments; ``retries`` defaults to 3 with a 0.01 s backoff.
    """

    def __init__(self, kind: str, fake: FakeV2, jitter: bool = False, **kwargs: Any) -> None:
        self.kind, self.fake = kind, fake
        self.sleeps: list[float] = []
        kwargs.setdefault("retries", Retry(retries=3, backoff=0.01))
        kwargs.setdefault("url", "http://fake:1")
        self.wire: WireServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: Client | AsyncClient
        if kind in ("wire", "async-wire"):
            self.wire = WireServer(fake)
            kwargs["url"] = self.wire.url(kwargs["url"])
        if kind == "wire":
            on_wire = Client(**kwargs)
            assert on_wire._lean is not None, "the default transport was not the lean one"
            on_wire._sleep = self.sleeps.append
            self.client = on_wire
            return

        async def sleep(s: float) -> None:
            self.sleeps.append(s)

        if kind == "async-wire":
            async_on_wire = AsyncClient(**kwargs)  # (may refuse its arguments: no loop yet)
            assert async_on_wire._lean is not None, "the default transport was not the lean one"
            async_on_wire._sleep = sleep
            self.client = async_on_wire
            self.loop = asyncio.new_event_loop()
            return
        if kind == "sync":
            mocked = Client(transport=httpx.MockTransport(fake.handler), **kwargs)
            mocked._sleep = self.sleeps.append
            self.client = mocked
            return

        async def handler(request: httpx.Request) -> httpx.Response:
            if jitter:
                await asyncio.sleep(jittery())
            return await async_handler(fake, request)

        async_mocked = AsyncClient(transport=httpx.MockTransport(handler), **kwargs)
        async_mocked._sleep = sleep
        self.client = async_mocked

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.method(*args, **kwargs)``, awaited for the async client."""
        fn = getattr(self.client, method)
        if isinstance(self.client, Client):
            return fn(*args, **kwargs)

        async def run() -> Any:
            return await fn(*args, **kwargs)

        return self._run(run())

    def _run(self, coro: Any) -> Any:
        """Run ``coro`` to its end: on the harness's own loop (``async-wire``), else in a
        fresh one."""
        if self.loop is not None:
            return self.loop.run_until_complete(coro)
        return asyncio.run(coro)

    def collect(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Everything an iterator method yields, as a list."""
        fn = getattr(self.client, method)
        if isinstance(self.client, Client):
            return list(fn(*args, **kwargs))

        async def run() -> list[Any]:
            it: AsyncIterator[Any] = fn(*args, **kwargs)
            return [x async for x in it]

        collected: list[Any] = self._run(run())
        return collected

    def infers(self) -> int:
        """How many inference requests the server has seen."""
        return len([r for r in self.fake.requests if r.url.path.endswith("/infer")])

    def settle(self, quiet_s: float = 0.25, timeout_s: float = 10.0) -> None:
        """On the wire, wait until the server has answered every request it has read and
        read no new one for ``quiet_s``: a call that failed may have left requests on their
        way (the async client cancels the rest of a failed ``infer_many``, closing their
        connections, but what it had sent still reaches the server)."""
        if self.wire is None:
            return
        deadline = time.monotonic() + timeout_s
        seen, since = len(self.fake.requests), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = len(self.fake.requests)
            if now != seen or self.fake.in_flight:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def close(self) -> None:
        if isinstance(self.client, Client):
            self.client.close()
        else:
            self._run(self.client.aclose())
        if self.loop is not None:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            self.loop = None  # a call after closing runs in a fresh loop (and is refused)
        if self.wire is not None:
            self.wire.close()


@pytest.fixture(params=["sync", "async", "wire", "async-wire"])
def kind(request: pytest.FixtureRequest) -> str:
    """Each test using it runs for the sync and the async client over httpx.MockTransport,
    and for each client on its own transport against the fake on a real socket.

    A test marked ``mock_transport`` scripts what only a MockTransport can do (an httpx
    exception raised inside the transport, the recorded ``timeout`` extension, host names
    that resolve nowhere): its wire run is skipped; ``test_h1.py`` covers those behaviours of
    the client's own transport on real sockets.
    """
    if "wire" in request.param and request.node.get_closest_marker("mock_transport"):
        pytest.skip("scripts httpx.MockTransport itself; test_h1*.py cover the wire")
    return str(request.param)


@pytest.fixture
def make(kind: str) -> Iterator[Callable[..., Harness]]:
    """``make(fake=None, **client_kwargs)`` -> a :class:`Harness`, closed after the test."""
    made: list[Harness] = []

    def factory(fake: FakeV2 | None = None, **kwargs: Any) -> Harness:
        h = Harness(kind, fake or FakeV2(), **kwargs)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()
