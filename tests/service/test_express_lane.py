"""The infer route's express lane (``service.rest.express_lane``) against the general way, byte
for byte, on fresh random requests: both ways run the data plane's core and the same response
builders, so this holds by construction; these tests keep it so.

Two connections of bitserve's HTTP protocol share one application: one with the express lane
(as ``bitserve serve`` runs), one without it (every request the general way: the gateway, the
infer route, the data plane). Each request is sent to both, one at a time, and the raw
responses must be the same bytes. Covered: binary and JSON inputs and outputs, batch sizes,
request ids sent and made, the request's own ``id``, requested outputs, pipelining, a body
in pieces, bodies the lane hands to the general way (bad input, unknown models, a full
queue, compression, ``Expect``, large bodies), large bodies a full queue sheds on the lane,
errors after the batcher took the request (a failed batch), the bearer token, the
concurrency limit and the body timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.fake_transport import FakeClient, Response, host_config
from service.rest.express_lane import ExpressRequest
from service.rest.http_cycle import Head, Request
from service.rest.http_protocol import HttpProtocol, protocol_class
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

pytestmark = pytest.mark.anyio
_ID = re.compile(rb'(x-request-id: [^\r]*|"id":"[^"]*")')


class Server:
    """One application; connections to it with and without the express lane."""

    def __init__(self, app: Any) -> None:
        self.app = app
        cls = protocol_class(
            head_timeout_s=10.0, max_header_bytes=65536, max_connections=0, lane=app.express
        )
        self.config, self.state = host_config(app, cls)
        self.cls = cls
        self.handed_over = 0

    def connect(self, express: bool) -> tuple[HttpProtocol, FakeClient]:
        conn: HttpProtocol = self.cls(self.config, self.state, {})
        if not express:
            conn.lane = None
        else:
            take_over = conn.take_over

            def counted(request: Request, head: Head, chunks: list[bytes]) -> None:
                self.handed_over += 1
                take_over(request, head, chunks)

            conn.take_over = counted  # type: ignore[method-assign]
        return conn, FakeClient().attach(conn)

    async def ask(self, chunks: list[bytes], *, express: bool, answers: int = 1) -> list[Response]:
        """Send ``chunks`` (one read each, a loop turn apart) on a fresh connection; the
        ``answers`` responses."""
        _, client = self.connect(express)
        for chunk in chunks:
            client.send(chunk)
            await asyncio.sleep(0)
        for _ in range(2000):
            if len(client.responses) >= answers:
                break
            await asyncio.sleep(0.001)
        assert len(client.responses) == answers, f"{len(client.responses)} of {answers} answers"
        return client.responses

    async def both(self, chunks: list[bytes], answers: int = 1) -> list[bytes]:
        """The raw responses of the general way and of the express lane: they must be equal."""
        general = [bytes(r.raw) for r in await self.ask(chunks, express=False, answers=answers)]
        express = [bytes(r.raw) for r in await self.ask(chunks, express=True, answers=answers)]
        assert express == general
        return express


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[Server]:
    async with app.router.lifespan_context(app):
        yield Server(app)


def request(
    model: str,
    header: dict[str, Any],
    data: bytes = b"",
    *,
    extra: str = "",
    binary: bool = True,
    path: str | None = None,
) -> bytes:
    """A V2 infer request: its JSON header, then ``data`` (binary, with
    Inference-Header-Content-Length) when ``binary``."""
    head = json.dumps(header).encode()
    body = head + data
    lines = [
        f"POST {path or f'/v2/models/{model}/infer'} HTTP/1.1",
        "Host: t",
        f"Content-Length: {len(body)}",
    ]
    if binary:
        lines.append(f"Inference-Header-Content-Length: {len(head)}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode() + body


def echo(
    rows: np.ndarray[Any, Any], *, rid: str | None = "r-1", binary_out: bool = True, **more: Any
) -> tuple[dict[str, Any], bytes]:
    """The echo model's request header and data for ``rows`` (UINT8, (b, 4))."""
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": "x",
                "datatype": "UINT8",
                "shape": list(rows.shape),
                "parameters": {"binary_data_size": rows.nbytes},
            }
        ],
        "outputs": [
            {"name": "y", "parameters": {"binary_data": binary_out}},
            {"name": "n", "parameters": {"binary_data": binary_out}},
        ],
        **more,
    }
    if rid is not None:
        header["id"] = rid
    return header, rows.tobytes()


@pytest.fixture
def fake_app() -> Any:
    return in_process_app(Settings(access_log=True, log_level="warning"), FakeRepository())


def _ids(raw: bytes) -> bytes:
    return _ID.sub(b"<id>", raw)


async def test_random_requests_get_the_same_bytes_both_ways(fake_app: Any) -> None:
    rng = np.random.default_rng()
    async with serving(fake_app) as server:
        for k in range(40):
            rows = rng.integers(0, 256, (int(rng.integers(1, 9)), 4), dtype=np.uint8)
            header, data = echo(rows, rid=f"id-{k}" if k % 2 else None, binary_out=k % 4 != 1)
            extra = f"X-Request-ID: req-{k}\r\n"
            if k % 5 == 0:
                header["outputs"] = [{"name": "n", "parameters": {"binary_data": True}}]
            if k % 7 == 0:
                header["parameters"] = {"timeout": 10_000_000}
            [response] = await server.both([request("echo", header, data, extra=extra)])
            assert response.startswith(b"HTTP/1.1 200 OK\r\n")
            assert f"x-request-id: req-{k}".encode() in response
        assert server.handed_over <= 1  # the fake's batcher starts at its first request
        # Made request ids (none sent): the same answers but for the ids.
        header, data = echo(rng.integers(0, 256, (2, 4), dtype=np.uint8), rid=None)
        general = await server.ask([request("echo", header, data)], express=False)
        express = await server.ask([request("echo", header, data)], express=True)
        assert _ids(bytes(express[0].raw)) == _ids(bytes(general[0].raw))
        assert express[0].header(b"x-request-id") != general[0].header(b"x-request-id")


async def test_json_inputs_pipelining_and_a_body_in_pieces(fake_app: Any) -> None:
    rng = np.random.default_rng()
    async with serving(fake_app) as server:
        rows = rng.integers(0, 256, (3, 4), dtype=np.uint8)
        header = {
            "id": "j",
            "inputs": [{"name": "x", "datatype": "UINT8", "shape": [3, 4], "data": rows.tolist()}],
        }
        plain = request("echo", header, binary=False, extra="X-Request-ID: j\r\n")
        [raw] = await server.both([plain])
        assert b'"data":' in raw  # JSON outputs
        two = [
            request("echo", *echo(rng.integers(0, 256, (b, 4), dtype=np.uint8)), extra=e)
            for b, e in ((1, "X-Request-ID: a\r\n"), (4, "X-Request-ID: b\r\n"))
        ]
        await server.both([b"".join(two)], answers=2)
        one = two[1]
        await server.both([one[:50], one[50:-3], one[-3:]])  # the head, then the body, split


@pytest.mark.parametrize(
    ("case", "status"),
    [
        ("unknown model", 404),
        ("full queue", 503),
        ("bad shape", 400),
        ("bad header length", 400),
        ("failed batch", 500),
        ("compression accepted", 200),
        ("expect", 200),
        ("large body", 200),
        ("not the route", 404),
    ],
)
async def test_what_the_lane_hands_over_or_answers_is_answered_the_same(
    fake_app: Any, case: str, status: int
) -> None:
    rng = np.random.default_rng()
    rows = rng.integers(0, 256, (2, 4), dtype=np.uint8)
    header, data = echo(rows)
    model, extra, path = "echo", "X-Request-ID: e\r\n", None
    if case == "unknown model":
        model = "nope"
    elif case == "full queue":
        model = "busy"
    elif case == "bad shape":
        header["inputs"][0]["shape"] = [2, 3]
    elif case == "failed batch":
        model = "boom"
    elif case == "compression accepted":
        extra += "Accept-Encoding: gzip\r\n"
    elif case == "expect":
        extra += "Expect: 100-continue\r\n"
    elif case == "large body":
        rows = rng.integers(0, 256, (20_000, 4), dtype=np.uint8)
        header, data = echo(rows)
    elif case == "not the route":
        path = "/v2/models/echo/infer/"  # answered without redirects, as the route
        status = 200
    raw = request(model, header, data, extra=extra, path=path)
    if case == "bad header length":
        name = b"Inference-Header-Content-Length: "
        raw = raw.replace(name, name + b"9")
    async with serving(fake_app) as server:
        if model == "boom":
            await server.ask([request("echo", *echo(rows))], express=False)  # start batchers
        *_, response = await server.both([raw], answers=2 if case == "expect" else 1)
    assert response.startswith(b"HTTP/1.1 %d " % status), response[:200]


def _lane_requests(app: Any) -> list[ExpressRequest | None]:
    """What the express lane's ``begin`` returns from now on (None: the general way)."""
    lane, begun = app.express, []
    begin = lane.begin

    def spy(*args: Any) -> ExpressRequest | None:
        begun.append(begin(*args))
        return begun[-1]

    lane.begin = spy
    return begun


async def _wait_answers(client: Any, n: int) -> None:
    for _ in range(2000):
        if len(client.responses) >= n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{len(client.responses)} of {n} answers")


async def test_a_large_body_a_full_queue_refuses_is_shed_on_the_lane(fake_app: Any) -> None:
    """Over 64 KiB a body goes the general way, unless its model's queue is full: the lane
    then answers the 503 from the head alone, as the general way would, and skips the body;
    the connection serves the next request."""
    rng = np.random.default_rng()
    rows = rng.integers(0, 256, (20_000, 4), dtype=np.uint8)  # 80 kB
    raw = request("busy", *echo(rows), extra="X-Request-ID: s\r\n")
    head, body = raw.split(b"\r\n\r\n", 1)
    async with serving(fake_app) as server:
        (general,) = await server.both([raw])
        assert general.startswith(b"HTTP/1.1 503 ")
        assert b"retry-after: " in general.lower()
        begun = _lane_requests(fake_app)
        _conn, client = server.connect(express=True)
        client.send(head + b"\r\n\r\n")
        await _wait_answers(client, 1)  # before a byte of the body
        assert bytes(client.responses[0].raw) == general
        assert isinstance(begun[0], ExpressRequest)
        assert begun[0].plain.shed
        for i in range(0, len(body), 7000):
            client.send(body[i : i + 7000])
            await asyncio.sleep(0)
        small = rng.integers(0, 256, (2, 4), dtype=np.uint8)
        client.send(request("echo", *echo(small)))
        await _wait_answers(client, 2)
        assert client.responses[1].status == 200
        assert not begun[1].plain.shed  # type: ignore[union-attr]
        # The queue has room: a large body is the general way's.
        client.send(request("echo", *echo(rows)))
        await _wait_answers(client, 3)
        assert client.responses[2].status == 200
        assert begun[2] is None


async def test_a_shed_request_whose_queue_had_room_again_is_refused_and_counted(
    fake_app: Any,
) -> None:
    """The lane looked at a full queue, but the queue had room when the request started: it
    is refused all the same (503, counted as a failure of its model), never computed from a
    body the lane does not keep."""
    rows = np.random.default_rng().integers(0, 256, (20_000, 4), dtype=np.uint8)
    async with serving(fake_app) as server:
        dataplane = fake_app.express.dataplane
        dataplane.would_shed = lambda name, version=None: True
        before = dataplane.statistics("echo")["model_stats"][0]["inference_stats"]["fail"]
        (response,) = await server.ask([request("echo", *echo(rows))], express=True)
        assert response.status == 503
        assert response.header(b"retry-after") == b"1"
        assert b"overloaded" in bytes(response.body)
        after = dataplane.statistics("echo")["model_stats"][0]["inference_stats"]["fail"]
        assert after["count"] == before["count"] + 1


async def test_the_token_and_the_concurrency_limit_apply_alike() -> None:
    settings = Settings(auth_token="s3cret", limit_concurrency=1, log_level="warning")
    app = in_process_app(settings, FakeRepository())
    header, data = echo(np.arange(8, dtype=np.uint8).reshape(2, 4))
    async with serving(app) as server:
        for auth, status in (("", 401), ("Authorization: Bearer nope\r\n", 401),
                             ("Authorization: Bearer s3cret\r\n", 200),
                             ("authorization: bearer s3cret\r\n", 200)):  # fmt: skip
            extra = "X-Request-ID: a\r\n" + auth
            [raw] = await server.both([request("echo", header, data, extra=extra)])
            assert raw.startswith(b"HTTP/1.1 %d " % status)
        # One request in flight already: the next is refused (503), both ways.
        app.gateway.active += 1
        good = "X-Request-ID: b\r\nAuthorization: Bearer s3cret\r\n"
        [raw] = await server.both([request("echo", header, data, extra=good)])
        assert raw.startswith(b"HTTP/1.1 503 ")
        assert b"connection: close" in raw


async def test_a_body_that_stops_coming_times_out_alike() -> None:
    settings = Settings(body_timeout_s=0.05, log_level="warning")
    app = in_process_app(settings, FakeRepository())
    header, data = echo(np.arange(8, dtype=np.uint8).reshape(2, 4))
    raw = request("echo", header, data, extra="X-Request-ID: t\r\n")
    async with serving(app) as server:
        await server.ask([request("echo", header, data)], express=False)  # start batchers
        [response] = await server.both([raw[:-4]])
    assert response.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in response


async def test_the_tiny_model_through_its_real_pipeline() -> None:
    """The benchmark's model, loaded from files, batched and computed: counts of ones."""
    from benchmarks.overhead import tiny

    rng = np.random.default_rng()
    with tempfile.TemporaryDirectory() as tmp:
        repo = tiny.write_repository(Path(tmp))
        app = in_process_app(Settings(model_repository=repo, grpc_port=0, log_level="warning"))
        async with serving(app) as server:
            for k in range(10):
                packed = rng.integers(0, 256, (int(rng.integers(1, 5)), 1, 1), dtype=np.uint8)
                [raw] = await server.both([_tiny_request(packed, f"t{k}")])
                n = int(raw.split(b"inference-header-content-length: ")[1].split(b"\r\n")[0])
                counts = np.frombuffer(raw.split(b"\r\n\r\n", 1)[1][n:], np.float32)
                expected = np.unpackbits(packed.reshape(-1)).reshape(-1, 8).sum(1)
                np.testing.assert_array_equal(counts, expected)
            assert server.handed_over == 0


def _tiny_request(packed: np.ndarray[Any, Any], rid: str, **parameters: Any) -> bytes:
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": "bits",
                "datatype": "UINT8",
                "shape": list(packed.shape),
                "parameters": {"binary_data_size": packed.nbytes},
            }
        ],
        "outputs": [{"name": "count", "parameters": {"binary_data": True}}],
    }
    if parameters:
        header["parameters"] = parameters
    return request("tiny", header, packed.tobytes(), extra=f"X-Request-ID: {rid}\r\n")


async def test_a_queued_request_whose_client_leaves_is_dropped() -> None:
    """As the general way drops it (issue 22): never computed, counted as cancelled, left out
    of the statistics, logged 499."""
    access = logging.getLogger("service.rest.gateway.access")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    access.addHandler(handler)
    level, access.level = access.level, logging.INFO
    try:
        await _client_leaves()
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert any(line.startswith("POST /v2/models/tiny/infer 499 ") for line in lines), lines


async def _client_leaves() -> None:
    from benchmarks.overhead import tiny
    from harness.probes import metric

    with tempfile.TemporaryDirectory() as tmp:
        repo = tiny.write_repository(Path(tmp))
        app = in_process_app(Settings(model_repository=repo, grpc_port=0, log_level="warning"))
        async with serving(app) as server:
            packed = np.array([[[7]]], dtype=np.uint8)
            await server.both([_tiny_request(packed, "warm")])  # batches run inline by now
            stats = app.state.repository.get("tiny").stats
            computed = stats.snapshot().inference_count
            conn, client = server.connect(express=True)
            client.send(_tiny_request(packed, "left"))  # queued: its batch runs next turn
            assert isinstance(conn.active, ExpressRequest)
            client.hang_up()
            for _ in range(5):
                await asyncio.sleep(0.01)
            assert client.responses == []
            assert stats.snapshot().inference_count == computed
            text = app.state.metrics.render().decode()
            labels = {"model": "tiny", "version": "1"}
            assert metric(text, "bitserve_requests_cancelled_total", 0.0, **labels) == 1
            outcome = {"model": "tiny", "outcome": "Cancelled"}
            assert metric(text, "bitserve_requests_total", 0.0, **outcome) == 1
            assert stats.snapshot().fail_count == 0
            # A client that leaves while sending its body: dropped before its queue.
            conn, client = server.connect(express=True)
            client.send(_tiny_request(packed, "half")[:-1])
            assert isinstance(conn.active, ExpressRequest)
            client.hang_up()
            await asyncio.sleep(0.01)
            text = app.state.metrics.render().decode()
            assert metric(text, "bitserve_requests_cancelled_total", 0.0, **labels) == 2
            assert stats.snapshot().inference_count == computed
            assert client.responses == []
            assert server.handed_over == 0


def _stats(raw: bytes) -> dict[str, Any]:
    stats: dict[str, Any] = json.loads(raw.split(b"\r\n\r\n", 1)[1])["model_stats"][0]
    return stats


async def test_cache_hits_and_evicted_models_alike_on_both_lanes() -> None:
    """The response cache and the device memory budget are the plane's: the express lane
    answers a hit from the cache, and an evicted model's request waits for its load on
    either (issues 33, 34)."""
    from shutil import copytree

    from benchmarks.overhead import tiny

    rng = np.random.default_rng()
    with tempfile.TemporaryDirectory() as tmp:
        repo = tiny.write_repository(Path(tmp))
        copytree(repo / "tiny", repo / "tiny2")
        for name in ("tiny", "tiny2"):
            with (repo / name / "config.toml").open("a") as f:
                f.write("\n[response_cache]\nenable = true\n")
        settings = Settings(model_repository=repo, grpc_port=0, log_level="warning",
                            cache_config="local,size=1MiB")  # fmt: skip
        one = 0
        async with serving(in_process_app(settings)) as server:
            for k in range(6):
                packed = rng.integers(0, 256, (3, 1, 1), dtype=np.uint8)
                first = await server.both([_tiny_request(packed, f"t{k}")])  # a miss, then a hit
                again = await server.both([_tiny_request(packed, f"u{k}")])  # hits both ways
                assert _ids(first[0]) == _ids(again[0])
            stats = _stats(bytes((await server.ask([_GET_STATS], express=False))[0].raw))
            assert stats["execution_count"] == 6  # the model ran once per distinct request
            assert stats["inference_stats"]["cache_hit"]["count"] == 3 * 6
            assert stats["inference_stats"]["cache_miss"]["count"] == 6
            one = server.app.state.repository.accounting.bytes_of(
                server.app.state.repository.get("tiny")
            )
        assert server.handed_over == 0
        # One model fits: the other one's requests wait for its load, both ways.
        budget = Settings(model_repository=repo, grpc_port=0, log_level="warning",
                          device_memory_budget=str(one + one // 2))  # fmt: skip
        async with serving(in_process_app(budget)) as server:
            for k in range(4):
                packed = rng.integers(0, 256, (2, 1, 1), dtype=np.uint8)
                for model in ("tiny", "tiny2"):
                    body = _tiny_request(packed, f"e{k}").replace(b"/tiny/", f"/{model}/".encode())
                    [response] = await server.ask([body], express=True)
                    raw = bytes(response.raw)
                    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
                    n = int(response.header(b"inference-header-content-length"))
                    counts = np.frombuffer(raw.split(b"\r\n\r\n", 1)[1][n:], np.float32)
                    expected = np.unpackbits(packed.reshape(-1)).reshape(-1, 8).sum(1)
                    np.testing.assert_array_equal(counts, expected)
            # Each request found its model evicted by the other's: it waited for its load
            # through the data plane's core, on the express lane too (none handed over).
            assert server.handed_over == 0


_GET_STATS = b"GET /v2/models/tiny/stats HTTP/1.1\r\nHost: t\r\n\r\n"


async def test_the_answer_builder_frames_as_an_exchange_does() -> None:
    """``frame_answer`` (the express lane's bytes) against what an ASGI exchange writes for
    the same status, headers and body (the general way's bytes), on random answers."""
    from service.rest.http_cycle import frame_answer

    rng = np.random.default_rng()
    for k in range(60):
        status = int(rng.choice([200, 400, 404, 408, 413, 500, 503]))
        body = rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += [(b"x-%d" % i, b"v%d" % rng.integers(1000)) for i in range(rng.integers(0, 4))]
        if k % 5 == 0:
            headers.append((b"connection", b"close"))
        keep_alive = bool(k % 3)

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": status, "headers": headers})  # noqa: B023
            await send({"type": "http.response.body", "body": body})  # noqa: B023

        cls = protocol_class(head_timeout_s=10.0, max_header_bytes=65536, max_connections=0)
        config, state = host_config(app, cls)
        conn: HttpProtocol = cls(config, state, {})
        client = FakeClient().attach(conn)
        client.send(
            b"GET / HTTP/1.1\r\nHost: t\r\n"
            + (b"" if keep_alive else b"Connection: close\r\n")
            + b"\r\n"
        )
        for _ in range(100):
            if client.responses:
                break
            await asyncio.sleep(0)
        [response] = client.responses
        built, stays = frame_answer(conn.default_headers(), status, headers, body, keep_alive)
        assert bytes(response.raw) == built
        assert stays == (keep_alive and k % 5 != 0)


async def test_a_reload_while_the_body_arrives_is_the_planes_rule_on_the_lane(
    fake_app: Any,
) -> None:
    """The data plane's reload re-lookup holds on the express lane too (it once had to be
    copied there): the request goes to the version serving when its body is complete."""
    from tests.service.app_fakes import FakeHandle

    rows = np.random.default_rng().integers(0, 256, (2, 4), dtype=np.uint8)
    raw = request("echo", *echo(rows), extra="X-Request-ID: r\r\n")
    async with serving(fake_app) as server:
        repo = fake_app.state.repository
        old = repo.models["echo"]
        conn, client = server.connect(express=True)
        client.send(raw[:-5])
        await asyncio.sleep(0)
        assert isinstance(conn.active, ExpressRequest)
        repo.models["echo"] = new = FakeHandle("echo")
        client.send(raw[-5:])
        for _ in range(500):
            if client.responses:
                break
            await asyncio.sleep(0.001)
        [response] = client.responses
        assert bytes(response.raw).startswith(b"HTTP/1.1 200 OK\r\n")
        assert len(new.requests) == 1
        assert all(r.id != "r-1" for r in old.requests)
        assert server.handed_over == 0
