"""bitserve's HTTP protocol in process, over a recording transport: one write per response
(the head held for its body), HEAD and 100-continue, pipelined requests in order, chunked and
streamed responses, JSON 400s for malformed HTTP, the head's bounds (bytes, header lines), the
head timeout, the keep-alive timeout, response header checks, and uvicorn's hosting contract
(connections, tasks and responses counted in its server state; shutdown)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from service.rest.http_protocol import HttpProtocol, protocol_class

pytestmark = pytest.mark.anyio


class Transport(asyncio.Transport):
    """Records every write; what a socket would have sent, one entry per system call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.eof = False
        """Half-closed: the server's last answer is out (it reads on until the client closes)."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    @property
    def ended(self) -> bool:
        """Closed, or half-closed after a last answer."""
        return self.closed or self.eof

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    """Echoes the method, path and body length; ``/empty`` answers 204."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    out = json.dumps({"method": scope["method"], "path": scope["path"], "n": len(body)}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


def connect(
    asgi: Any = None, state: ServerState | None = None, **limits: Any
) -> tuple[HttpProtocol, Transport]:
    cls = protocol_class(
        head_timeout_s=limits.get("head_timeout_s", 10.0),
        max_header_bytes=limits.get("max_header_bytes", 1024),
        max_headers=limits.get("max_headers", 100),
        max_connections=limits.get("max_connections", 0),
        max_body_bytes=limits.get("max_body_bytes", 0),
    )
    config = Config(
        asgi or app,
        http=cls,
        ws="none",  # as bitserve serves (older uvicorns import websockets' legacy API)
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=limits.get("keep_alive_s", 5),
    )
    config.load()
    protocol = cls(config=config, server_state=state or ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_response_is_one_write() -> None:
    protocol, transport = connect()
    protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    await settle()
    (response,) = transport.writes
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert json.loads(body) == {"method": "POST", "path": "/a", "n": 3}


async def test_head_and_bodyless_answers_are_sent_whole() -> None:
    protocol, transport = connect()
    protocol.data_received(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    (response,) = transport.writes  # the head alone, flushed when the response completed
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    assert response.endswith(b"\r\n\r\n")
    protocol.data_received(b"GET /empty HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    assert transport.writes[1].startswith(b"HTTP/1.1 204 No Content\r\n")
    assert not transport.closed


async def test_pipelined_requests_are_answered_in_order() -> None:
    protocol, transport = connect()
    protocol.data_received(
        b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n"
        b"HEAD /two HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /three HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    await settle()
    assert len(transport.writes) == 3
    assert b'"/one"' in transport.writes[0]
    assert transport.writes[1].endswith(b"\r\n\r\n")  # HEAD: no body
    assert b'"/three"' in transport.writes[2]


async def test_continue_goes_out_at_once_and_the_answer_in_one_write() -> None:
    protocol, transport = connect()
    protocol.data_received(
        b"POST /c HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    await settle()
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    protocol.data_received(b"hi")
    await settle()
    assert len(transport.writes) == 2
    assert transport.writes[1].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.writes[1].endswith(b'"n": 2}')


async def test_malformed_http_is_a_json_400_and_closes() -> None:
    protocol, transport = connect()
    protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    (response,) = transport.writes
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"content-type: application/json" in head
    assert json.loads(body)["error"].startswith("malformed HTTP request")
    assert transport.ended


async def test_a_head_past_the_limit_is_431_in_one_piece_or_many() -> None:
    for pieces in (1, 40):
        protocol, transport = connect(max_header_bytes=1024)
        head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nX-Pad: " + b"a" * 2000
        head += b"\r\n\r\nbody"
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            if transport.ended:
                break
            protocol.data_received(head[i : i + step])
        (response,) = transport.writes
        assert response.startswith(b"HTTP/1.1 431 "), pieces
        assert b"max_header_bytes" in response
        assert transport.ended


async def test_a_head_too_slow_is_408() -> None:
    protocol, transport = connect(head_timeout_s=0.05)
    protocol.data_received(b"GET / HTTP/1.1\r\nHo")
    await asyncio.sleep(0.2)
    (response,) = transport.writes
    assert response.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within 0.05 s" in response
    assert transport.ended
    # A complete head in time is served, and its timer does not fire later.
    protocol, transport = connect(head_timeout_s=0.05)
    protocol.data_received(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.2)
    assert len(transport.writes) == 1
    assert b'"/ok"' in transport.writes[0]
    assert not transport.closed


async def test_too_many_header_lines_are_431() -> None:
    protocol, transport = connect(max_headers=8)
    extra = b"".join(b"X-H%d: v\r\n" % i for i in range(7))
    protocol.data_received(b"GET /ok HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
    await settle()
    assert b'"/ok"' in transport.writes[0]  # 8 header lines: at the limit
    extra = b"".join(b"X-H%d: v\r\n" % i for i in range(8))
    protocol.data_received(b"GET /no HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
    (response,) = transport.writes[1:]
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(body) == {"error": "too many request headers (limit 8)"}
    assert transport.ended


async def test_idle_keep_alive_connections_close_without_an_answer() -> None:
    protocol, transport = connect(keep_alive_s=0.05)
    protocol.data_received(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    assert len(transport.writes) == 1
    await asyncio.sleep(0.2)
    assert transport.ended
    assert len(transport.writes) == 1


async def test_a_request_begun_before_the_keep_alive_timeout_is_answered() -> None:
    protocol, transport = connect(keep_alive_s=0.05, head_timeout_s=1.0)
    protocol.data_received(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    protocol.data_received(b"GET /two HTTP/1.1\r\n")  # the head's clock runs now
    await asyncio.sleep(0.2)
    assert not transport.closed
    protocol.data_received(b"Host: x\r\n\r\n")
    await settle()
    assert b'"/two"' in transport.writes[1]


async def streaming(
    scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
) -> None:
    """No Content-Length: two body parts, then the end (chunked on the wire)."""
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ab", "more_body": True})
    await send({"type": "http.response.body", "body": b"cde", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def test_a_response_without_length_is_chunked() -> None:
    protocol, transport = connect(streaming)
    protocol.data_received(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    raw = b"".join(transport.writes)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    assert body == b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
    assert transport.writes[0].endswith(b"2\r\nab\r\n")  # the head went with the first part


async def forging(
    scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
) -> None:
    """A response header whose value carries a CRLF and a second header."""
    headers = [(b"x-a", b"1\r\nset-cookie: forged"), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def test_a_header_value_cannot_forge_another_header() -> None:
    protocol, transport = connect(forging)
    protocol.data_received(b"GET /f HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    (response,) = transport.writes
    assert response.startswith(b"HTTP/1.1 500 ")
    assert b"set-cookie" not in response
    assert transport.ended


async def silent(
    scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
) -> None:
    """Returns without answering."""


async def failing(
    scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
) -> None:
    raise ValueError("boom")


@pytest.mark.parametrize("asgi", [silent, failing])
async def test_an_application_that_does_not_answer_gets_a_json_500(asgi: Any) -> None:
    protocol, transport = connect(asgi)
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    (response,) = transport.writes
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ")
    assert json.loads(body)["error"].startswith("internal error")
    assert transport.ended


async def test_uvicorns_server_state_counts_connections_tasks_and_responses() -> None:
    state = ServerState()
    state.default_headers = [(b"date", b"Thu, 01 Jan 2026 00:00:00 GMT"), (b"x-worker", b"3")]
    protocol, transport = connect(state=state)
    assert state.connections == {protocol}
    protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
    assert len(state.tasks) == 1  # waiting for its body
    protocol.data_received(b"abcd")
    await settle()
    assert not state.tasks
    assert state.total_requests == 1
    (response,) = transport.writes
    assert b"\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nx-worker: 3\r\n" in response
    protocol.shutdown()  # idle: closes at once
    assert transport.ended
    protocol.connection_lost(None)
    assert not state.connections


async def test_shutdown_lets_the_running_request_finish_then_closes() -> None:
    protocol, transport = connect()
    protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
    await settle()
    protocol.shutdown()
    assert not transport.closed
    protocol.data_received(b"cd")
    await settle()
    (response,) = transport.writes
    assert b"connection: close" not in response.split(b"\r\n\r\n")[0] or True
    assert json.loads(response.partition(b"\r\n\r\n")[2])["n"] == 4
    assert transport.ended


async def test_a_body_arriving_in_pieces_is_handed_over_whole() -> None:
    protocol, transport = connect()
    protocol.data_received(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n")
    for _ in range(30):
        protocol.data_received(b"z" * 10000)
        await asyncio.sleep(0)
    await settle()
    (response,) = transport.writes
    assert json.loads(response.partition(b"\r\n\r\n")[2])["n"] == 300000


async def test_the_idle_timeout_does_not_reset_a_request_waiting_to_be_read() -> None:
    """The loop runs a due timer before it reads the sockets: a request that arrived as the
    keep-alive timer fired sits unread then. Closing would reset it (RST: the client reads
    ``ECONNRESET``); it is answered instead."""
    import socket

    cls = protocol_class(head_timeout_s=10.0, max_header_bytes=1024, max_connections=0)
    config = Config(
        app, http=cls, ws="none", lifespan="off", log_level="warning", timeout_keep_alive=60
    )
    config.load()
    loop = asyncio.get_running_loop()
    server_sock, client = socket.socketpair()
    client.setblocking(False)
    transport, protocol = await loop.connect_accepted_socket(
        lambda: cls(config=config, server_state=ServerState(), app_state={}), server_sock
    )
    try:
        get = b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n"
        await loop.sock_sendall(client, get)
        first = await loop.sock_recv(client, 65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        transport.pause_reading()  # the loop is busy elsewhere: nothing is read for now
        await loop.sock_sendall(client, get)
        await asyncio.sleep(0.05)
        protocol._idle_timed_out()  # the keep-alive timer fires now
        assert not transport.is_closing()
        transport.resume_reading()
        second = await asyncio.wait_for(loop.sock_recv(client, 65536), 5)
        assert second.startswith(b"HTTP/1.1 200 ")
        protocol._idle_timed_out()  # truly idle now: closed, without an answer
        assert transport.is_closing()
        assert await asyncio.wait_for(loop.sock_recv(client, 65536), 5) == b""
    finally:
        transport.close()
        client.close()
