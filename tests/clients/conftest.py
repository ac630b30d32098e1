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


def jittery() -> float:
    """A random service time, so that concurrent requests finish out of order."""
    return random.uniform(0.0, 0.004)


def rows(n: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """``n`` random items for model ``bits``: bool [n, 3, 13]."""
    return np.random.default_rng(seed).random((n, 3, 13)) < 0.5


class Harness:
    """One client (sync or async) on a FakeV2, with recorded backoff sleeps.

    Args:
        kind: ``"sync"`` or ``"async"``.
        fake: the server.
        jitter: for the async client, a random delay per request on the event loop (the
            sync client's FakeV2 sleeps in its ``delay`` instead).
        **kwargs: client arguments; ``retries`` defaults to 3 with a 0.01 s backoff.
    """

    def __init__(self, kind: str, fake: FakeV2, jitter: bool = False, **kwargs: Any) -> None:
        self.kind, self.fake = kind, fake
        self.sleeps: list[float] = []
        kwargs.setdefault("retries", Retry(retries=3, backoff=0.01))
        kwargs.setdefault("url", "http://fake:1")
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
        if self.kind == "sync":
            return fn(*args, **kwargs)

        async def run() -> Any:
            return await fn(*args, **kwargs)

        return asyncio.run(run())

    def collect(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Everything an iterator method yields, as a list."""
        fn = getattr(self.client, method)
        if self.kind == "sync":
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


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    """Each test using it runs for the sync and the async client."""
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
