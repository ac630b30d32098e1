"""The server-wide budget of request bytes in flight (``max_inflight_bytes``), in process.

The app is driven as raw ASGI, so each test sees exactly when the body is read: a declared
body past the budget is 503 before any ``receive``; a chunked one when it would pass; a
compressed one when its inflated copy would; what a request holds is given back after its
answer whatever the answer; and two uploads at once share the one budget.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from service.errors import Overloaded
from service.models.handle import Result
from service.models.signature import Bound
from service.protocol import decompress
from service.rest.app import BitserveApp
from service.rest.infer_route import InferRoute
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeHandle, FakeRepository

pytestmark = pytest.mark.anyio

BUDGET = 1 << 20


@pytest.fixture
async def app() -> AsyncIterator[BitserveApp]:
    settings = Settings(access_log=False, max_inflight_bytes=BUDGET, max_body_bytes=8 << 20)
    app = in_process_app(settings, FakeRepository())
    async with app.router.lifespan_context(app):
        yield app


def route_of(app: BitserveApp) -> InferRoute:
    assert app.gateway is not None
    return app.gateway.infer


def echo_body(rows: int) -> bytes:
    """A valid JSON request for ``echo``: ``rows`` x 4 UINT8."""
    data = np.arange(rows * 4, dtype=np.uint8).reshape(rows, 4) % 7
    doc = {
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [rows, 4], "data": data.tolist()}]
    }
    return json.dumps(doc).encode()


class Exchange:
    """One request driven as ASGI: the chunks it will receive, what it received and sent."""

    def __init__(
        self, chunks: list[bytes], headers: dict[str, str], *, stall: asyncio.Event | None = None
    ) -> None:
        self.chunks = list(chunks)
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        self.stall = stall  # before the last chunk, wait for this
        self.received = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        self.received += 1
        if len(self.chunks) == 1 and self.stall is not None:
            await self.stall.wait()
        body = self.chunks.pop(0) if self.chunks else b""
        return {"type": "http.request", "body": body, "more_body": bool(self.chunks)}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def run(self, app: BitserveApp, model: str = "echo") -> None:
        scope = {
            "type": "http",
            "method": "POST",
            "path": f"/v2/models/{model}/infer",
            "raw_path": f"/v2/models/{model}/infer".encode(),
            "query_string": b"",
            "headers": self.headers,
        }
        await app(scope, self.receive, self.send)  # type: ignore[arg-type]

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def error(self) -> str:
        return str(json.loads(self.sent[1]["body"])["error"])

    def header(self, name: bytes) -> bytes | None:
        return dict(self.sent[0]["headers"]).get(name)


async def test_a_declared_body_past_the_budget_is_503_before_it_is_read(
    app: BitserveApp,
) -> None:
    ex = Exchange([b"x" * 10], {"Content-Length": str(BUDGET + 1)})
    await ex.run(app)
    assert ex.status == 503
    assert ex.received == 0
    assert "max_inflight_bytes" in ex.error
    assert ex.header(b"retry-after") == b"1"
    assert route_of(app).inflight_bytes == 0


async def test_the_budget_is_held_through_the_computation_and_given_back(
    app: BitserveApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    route = route_of(app)
    seen: list[int] = []
    compute = FakeHandle.compute

    def watching(self: FakeHandle, bound: Bound) -> Result:
        seen.append(route.inflight_bytes)
        return compute(self, bound)

    monkeypatch.setattr(FakeHandle, "compute", watching)
    good = echo_body(3)
    cases = [
        (Exchange([good], {"Content-Length": str(len(good))}), "echo", 200),
        (Exchange([good], {"Content-Length": str(len(good))}), "boom", 500),
        (Exchange([good[:10], good[10:]], {}), "echo", 200),  # chunked
    ]
    for ex, model, status in cases:
        seen.clear()
        await ex.run(app, model)
        assert ex.status == status, ex.sent
        assert seen == [len(good)]
        assert route.inflight_bytes == 0
    bad = Exchange([b"{not json"], {"Content-Length": "9"})
    await bad.run(app)
    assert bad.status == 400
    assert route.inflight_bytes == 0


async def test_a_chunked_body_is_refused_when_it_would_pass_the_budget(app: BitserveApp) -> None:
    chunks = [b"x" * (256 << 10)] * 8  # 2 MiB in all, no Content-Length
    ex = Exchange(chunks, {})
    await ex.run(app)
    assert ex.status == 503
    assert "max_inflight_bytes" in ex.error
    assert ex.received == 5  # four fill the 1 MiB; the fifth is refused, never kept
    assert route_of(app).inflight_bytes == 0


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_the_inflated_copy_of_a_compressed_body_counts(
    app: BitserveApp, encoding: str
) -> None:
    big = echo_body(150_000)  # about 2 MiB of JSON: more than the budget once inflated
    assert len(big) > BUDGET
    packed = gzip.compress(big) if encoding == "gzip" else zlib.compress(big)
    assert len(packed) < BUDGET // 8
    ex = Exchange([packed], {"Content-Length": str(len(packed)), "Content-Encoding": encoding})
    await ex.run(app)
    assert ex.status == 503
    assert "max_inflight_bytes" in ex.error
    assert route_of(app).inflight_bytes == 0
    small = echo_body(100)
    packed = gzip.compress(small) if encoding == "gzip" else zlib.compress(small)
    ok = Exchange([packed], {"Content-Length": str(len(packed)), "Content-Encoding": encoding})
    await ok.run(app)
    assert ok.status == 200, ok.sent
    assert route_of(app).inflight_bytes == 0


async def test_concurrent_uploads_share_the_budget(app: BitserveApp) -> None:
    body = b"x" * (600 << 10)
    stall = asyncio.Event()
    first = Exchange([body[:1000], body[1000:]], {"Content-Length": str(len(body))}, stall=stall)
    task = asyncio.create_task(first.run(app))
    while first.received < 2:  # the first upload is half-way through its body
        await asyncio.sleep(0.001)
    assert route_of(app).inflight_bytes == len(body)
    second = Exchange([body], {"Content-Length": str(len(body))})
    await second.run(app)
    assert second.status == 503
    assert second.received == 0
    stall.set()
    await task
    assert first.status == 400  # the bytes are no V2 request; what matters: it was read
    third = Exchange([body], {"Content-Length": str(len(body))})
    await third.run(app)
    assert third.status == 400
    assert route_of(app).inflight_bytes == 0


def test_decompress_reserves_each_step_as_it_goes() -> None:
    data = np.random.default_rng(0).integers(0, 4, 5 << 20, dtype=np.uint8).tobytes()
    packed = gzip.compress(data, compresslevel=1)
    calls: list[int] = []
    out = decompress(packed, "gzip", limit=64 << 20, reserve=calls.append)
    assert out == data
    assert calls[-1] == len(data)
    assert calls == sorted(calls)
    assert max(np.diff([0, *calls])) <= 1 << 20  # one step at most between two calls

    def refuse(n: int) -> None:
        if n > 2 << 20:
            raise Overloaded("budget")

    with pytest.raises(Overloaded):
        decompress(packed, "gzip", limit=64 << 20, reserve=refuse)


async def test_shed_requests_are_logged_as_a_count_not_one_line_each(
    app: BitserveApp, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="service"):
        for _ in range(50):
            ex = Exchange([b"x"], {"Content-Length": str(BUDGET + 1)})
            await ex.run(app)
            assert ex.status == 503
    lines = [r.getMessage() for r in caplog.records if "503 (shed)" in r.getMessage()]
    assert len(lines) == 1, lines  # the first; the next line comes 10 s later with the count
    assert "max_inflight_bytes" in lines[0]
    assert lines[0].endswith("(1 time(s) since the last such line)")


def test_tally_counts_between_lines(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.observability.request_ids as obs

    now = [100.0]
    monkeypatch.setattr(obs.time, "monotonic", lambda: now[0])
    tally = obs.Tally(logging.getLogger("service.test"), logging.WARNING, "event %s", every_s=10)
    with caplog.at_level(logging.WARNING, logger="service.test"):
        for i in range(5):
            tally(i)
            now[0] += 3
    assert [r.getMessage() for r in caplog.records] == [
        "event 0 (1 time(s) since the last such line)",
        "event 4 (4 time(s) since the last such line)",  # 12 s after the first line
    ]
