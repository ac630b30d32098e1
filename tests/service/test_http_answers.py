"""Every request the HTTP server has is answered, in order, whatever follows it.

Pipelines of good requests (the general way and the express lane) followed by one that ends
the connection (a malformed head, 431, CL+TE, a lower-case method, two ``Host`` headers, a
chunk larger than the body limit): the requests ahead are answered first, in order, then the
error, then the connection closes, and nothing comes after. A hypothesis property runs random
interleavings, cut into random reads, against a plain model of the protocol. Also: a
pipelined head too slow (408) waits for the answer ahead of it; the header rules (two
``Host``, two ``Authorization``); ``Expect: 100-continue`` without a body; the connection
cap's choice against a socket with unread bytes; the shed and eviction tallies' last count.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import socket
import time
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from harness.fake_transport import FakeClient, Response, host_config
from harness.probes import read_until_closed
from service.observability.request_ids import Tally
from service.rest.http_protocol import HttpProtocol, protocol_class
from service.rest.sockets import IdleConnections
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository
from tests.service.test_http_limits import ECHO_INPUT, parse_all, serving
from tests.service.test_http_protocol import connect, settle

MAX_HEAD = 2048
MAX_BODY = 1 << 16


def good_get(rid: str) -> bytes:
    return f"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Request-ID: {rid}\r\n\r\n".encode()


def good_infer(rid: str) -> bytes:
    """An echo infer request the express lane takes (a plain Content-Length JSON body)."""
    body = json.dumps({"inputs": [ECHO_INPUT]}).encode()
    return (
        "POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\n"
        f"X-Request-ID: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


BAD: dict[str, tuple[bytes, int]] = {
    "no colon": (b"GET /v2 HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n", 400),
    "lower-case method": (b"get /v2 HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    "CL+TE": (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "two Host": (b"GET /v2 HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    "two Authorization": (
        b"GET /v2 HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer a\r\n"
        b"Authorization: Bearer b\r\n\r\n",
        400,
    ),
    "431": (b"GET /v2 HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * MAX_HEAD + b"\r\n\r\n", 431),
    "huge chunk": (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"ffffffffffffffff\r\nabc",
        413,
    ),
}


def request_id(response: Response) -> str | None:
    value = response.header(b"x-request-id")
    return None if value is None else value.decode()


async def run_pipeline(app: Any, reads: list[bytes], expected: int, closes: bool) -> FakeClient:
    """Send ``reads`` (one read of the socket each, a loop turn apart) on a fresh connection
    of a server with the express lane; returns its client once ``expected`` answers came
    (and, when ``closes``, the connection closed)."""
    cls = protocol_class(
        head_timeout_s=10.0,
        max_header_bytes=MAX_HEAD,
        max_connections=0,
        max_body_bytes=MAX_BODY,
        lane=app.express,
    )
    config, state = host_config(app, cls)
    conn: HttpProtocol = cls(config, state, {})
    assert conn.lane is not None
    client = FakeClient().attach(conn)
    for data in reads:
        client.send(data)
        await asyncio.sleep(0)
    for _ in range(3000):
        if len(client.responses) >= expected and (client.closed or not closes):
            break
        await asyncio.sleep(0.001)
    await settle()
    return client


def check_answers(client: FakeClient, goods: list[str], bad: str | None) -> None:
    """The plain model: each good request's answer, in order; then the error; nothing after
    it; the connection closed after an error, open without one."""
    statuses = [r.status for r in client.responses]
    assert [request_id(r) for r in client.responses[: len(goods)]] == goods, statuses
    assert statuses[: len(goods)] == [200] * len(goods), statuses
    if bad is None:
        assert len(client.responses) == len(goods)
        assert not client.closed
        return
    assert len(client.responses) == len(goods) + 1, statuses
    error = client.responses[-1]
    assert error.status == BAD[bad][1], bytes(error.raw)
    assert json.loads(bytes(error.body))["error"]
    assert error.header(b"connection") == b"close"
    assert client.closed


def answered(reads: list[bytes], expected: int, closes: bool) -> FakeClient:
    """:func:`run_pipeline` on a fresh application over the fake repository, in its
    lifespan, on a fresh event loop."""
    app = in_process_app(Settings(access_log=False, log_level="warning"), FakeRepository())

    async def go() -> FakeClient:
        async with app.router.lifespan_context(app):
            return await run_pipeline(app, reads, expected, closes)

    return asyncio.run(go())


@pytest.mark.parametrize("bad", sorted(BAD))
def test_the_requests_ahead_of_an_error_are_answered_first(bad: str) -> None:
    batch = good_get("first") + good_infer("second") + good_get("third") + BAD[bad][0]
    client = answered([batch], 4, closes=True)
    check_answers(client, ["first", "second", "third"], bad)


item = st.one_of(
    st.just(("get", None)),
    st.just(("infer", None)),
    st.sampled_from(sorted(BAD)).map(lambda b: ("bad", b)),
)


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(item, min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 4000), max_size=12),
    data=st.data(),
)
def test_random_pipelines_keep_their_answers_in_order(
    items: list[tuple[str, str | None]], cuts: list[int], data: st.DataObject
) -> None:
    goods: list[str] = []
    stream = b""
    bad = None
    for i, (kind, which) in enumerate(items):
        if kind == "bad":
            assert which is not None
            stream += BAD[which][0]
            bad = which
            break  # what follows an error is never read: the model stops here
        rid = f"{kind}-{i}"
        goods.append(rid)
        stream += good_get(rid) if kind == "get" else good_infer(rid)
    if bad is not None and data.draw(st.booleans(), label="bytes after the error"):
        stream += good_get("after")
    points = sorted({c % len(stream) for c in cuts} | {0, len(stream)})
    reads = [stream[a:b] for a, b in itertools.pairwise(points) if b > a]
    client = answered(reads, len(goods) + (bad is not None), bad is not None)
    check_answers(client, goods, bad)


# --- on a real server, over loopback --------------------------------------------------------


@pytest.mark.parametrize("bad", ["no colon", "lower-case method", "CL+TE", "two Host"])
def test_pipelined_error_behind_good_requests_on_a_socket(bad: str) -> None:
    batch = good_get("first") + good_infer("second") + BAD[bad][0]
    with serving() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(batch)
        raw = read_until_closed(s)
    assert re.findall(rb"(?i)x-request-id: (\S+)", raw)[:2] == [b"first", b"second"]
    assert [status for status, _ in parse_all(raw)] == [200, 200, BAD[bad][1]]


def test_expect_continue_without_a_body_keeps_the_connection() -> None:
    with serving() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for _ in range(2):
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n\r\n")
            raw = b""
            while not raw.endswith(b"}"):
                part = s.recv(65536)
                assert part, "closed"
                raw += part
            assert raw.startswith(b"HTTP/1.1 200 ")
            assert b"connection: close" not in raw.lower()


# --- in process: timers, the cap's choice, tallies ------------------------------------------


@pytest.mark.anyio
async def test_a_slow_pipelined_head_gets_its_408_after_the_answer_ahead() -> None:
    release = asyncio.Event()

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol, transport = connect(slow, head_timeout_s=0.05)
    protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHo")
    await asyncio.sleep(0.2)  # the second head's clock has run out
    assert transport.writes == []
    release.set()
    await settle()
    assert [w.split(b" ", 2)[1] for w in transport.writes] == [b"200", b"408"]
    assert transport.ended


@pytest.mark.anyio
async def test_a_chunk_larger_than_the_body_limit_is_413_as_its_size_arrives() -> None:
    protocol, transport = connect(max_body_bytes=1000)
    head = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(head + b"10\r\n0123456789abcdef\r\n3")  # 16 bytes: fine
    await settle()
    assert transport.writes == []
    protocol.data_received(b"e9\r\nxy")  # 16 + 0x3e9 (1001) bytes: past the limit
    await settle()
    (response,) = transport.writes
    assert response.startswith(b"HTTP/1.1 413 ")
    assert b"a chunk of 1001 bytes" in response
    assert transport.ended


class _Conn:
    def __init__(self, transport: Any, opened_at: float) -> None:
        self.transport = transport
        self.opened_at = opened_at


class _SocketTransport:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default


def test_the_cap_never_picks_a_connection_with_unread_bytes_or_a_young_one() -> None:
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        idle: IdleConnections[Any] = IdleConnections(logging.getLogger("test"))
        opened = [0.0, 1.0, 2.0, 9.0]
        conns = [_Conn(_SocketTransport(p[0]), t) for p, t in zip(pairs, opened, strict=True)]
        for conn in conns[:3]:
            idle.add(conn, served=False)
        idle.add(conns[3], served=True)
        pairs[0][1].sendall(b"GET / HTTP/1.1\r\n\r\n")  # arrived, not read yet
        time.sleep(0.05)
        assert idle.evictable(opened_before=5.0) is conns[1]  # oldest without unread bytes
        assert idle.evictable(opened_before=0.5) is conns[3]  # the fresh ones are too young
        pairs[3][1].sendall(b"G")
        time.sleep(0.05)
        assert idle.evictable(opened_before=0.5) is None  # then the newcomer gets 503
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@pytest.mark.anyio
async def test_a_tally_writes_its_last_count_without_another_occurrence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tally = Tally(logging.getLogger("service.test"), logging.WARNING, "evicted %s", every_s=0.05)
    with caplog.at_level(logging.WARNING, logger="service.test"):
        for i in range(5):
            tally(i)
        for _ in range(200):
            if len(caplog.records) == 2:
                break
            await asyncio.sleep(0.01)
    assert [r.getMessage() for r in caplog.records] == [
        "evicted 0 (1 time(s) since the last such line)",
        "evicted 4 (4 time(s) since the last such line)",
    ]
