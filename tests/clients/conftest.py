"""Shared set-up of the client tests: clients (sync and async) on a FakeV2, and test data.

Each behaviour runs for both clients through the ``make`` fixture, whose harness hides the
difference between ``client.x(...)`` and ``await client.x(...)``.
"""

from __future__ import annotations

import asyncio
import random
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
        kind: ``"sync"`` or ``"async"`` (over ``httpx.MockTransport``), or ``"wire"``: the
            sync client on its default transport, the fake on a real socket (:mod:`.wire`).
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
        if kind == "wire":
            self.wire = WireServer(fake)
            kwargs["url"] = self.wire.url(kwargs["url"])
            self.client = Client(**kwargs)
            assert self.client._lean is not None, "the default transport was not the lean one"
            self.client._sleep = self.sleeps.append
            return
        if kind == "sync":
            self.client: Client | AsyncClient = Client(
                transport=httpx.MockTransport(fake.handler), **kwargs
            )
            self.client._sleep = self.sleeps.append
            return

        async def handler(request: httpx.Request) -> httpx.Response:
            if jitter:
                await asyncio.sleep(jittery())
            return await async_handler(fake, request)

        async def sleep(s: float) -> None:
            self.sleeps.append(s)

        self.client = AsyncClient(transport=httpx.MockTransport(handler), **kwargs)
        self.client._sleep = sleep

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.method(*args, **kwargs)``, awaited for the async client."""
        fn = getattr(self.client, method)
        if self.kind != "async":
            return fn(*args, **kwargs)

        async def run() -> Any:
            return await fn(*args, **kwargs)

        return asyncio.run(run())

    def collect(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Everything an iterator method yields, as a list."""
        fn = getattr(self.client, method)
        if self.kind != "async":
            return list(fn(*args, **kwargs))

        async def run() -> list[Any]:
            it: AsyncIterator[Any] = fn(*args, **kwargs)
            return [x async for x in it]

        return asyncio.run(run())

    def infers(self) -> int:
        """How many inference requests the server has seen."""
        return len([r for r in self.fake.requests if r.url.path.endswith("/infer")])

    def close(self) -> None:
        if isinstance(self.client, Client):
            self.client.close()
        else:
            asyncio.run(self.client.aclose())
        if self.wire is not None:
            self.wire.close()


@pytest.fixture(params=["sync", "async", "wire"])
def kind(request: pytest.FixtureRequest) -> str:
    """Each test using it runs for the sync and the async client over httpx.MockTransport,
    and for the sync client on its own transport against the fake on a real socket.

    A test marked ``mock_transport`` scripts what only a MockTransport can do (an httpx
    exception raised inside the transport, the recorded ``timeout`` extension, host names
    that resolve nowhere): its wire run is skipped; ``test_h1.py`` covers those behaviours of
    the client's own transport on real sockets.
    """
    if request.param == "wire" and request.node.get_closest_marker("mock_transport"):
        pytest.skip("scripts httpx.MockTransport itself; test_h1.py covers the wire")
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
