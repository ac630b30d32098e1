"""bitserve's uvicorn protocol in process, over a recording transport: one write per response
(the head held for its body), HEAD and 100-continue, pipelined requests in order, JSON 400s
for malformed HTTP, the head-size bound and the head timeout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from service.rest.http_protocol import BitserveHttpProtocol, protocol_class

pytestmark = pytest.mark.anyio


class Transport(asyncio.Transport):
    """Records every write; what a socket would have sent, one entry per system call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

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


def connect(**limits: Any) -> tuple[BitserveHttpProtocol, Transport]:
    cls = protocol_class(
        head_timeout_s=limits.get("head_timeout_s", 10.0),
        max_header_bytes=limits.get("max_header_bytes", 1024),
        max_connections=limits.get("max_connections", 0),
    )
    config = Config(app, http=cls, lifespan="off", log_level="warning")
    config.load()
    protocol = cls(config=config, server_state=ServerState(), app_state={})
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
    assert transport.closed


async def test_a_head_past_the_limit_is_431_in_one_piece_or_many() -> None:
    for pieces in (1, 40):
        protocol, transport = connect(max_header_bytes=1024)
        head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nX-Pad: " + b"a" * 2000
        head += b"\r\n\r\nbody"
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            if transport.closed:
                break
            protocol.data_received(head[i : i + step])
        (response,) = transport.writes
        assert response.startswith(b"HTTP/1.1 431 "), pieces
        assert b"max_header_bytes" in response
        assert transport.closed


async def test_a_head_too_slow_is_408() -> None:
    protocol, transport = connect(head_timeout_s=0.05)
    protocol.data_received(b"GET / HTTP/1.1\r\nHo")
    await asyncio.sleep(0.2)
    (response,) = transport.writes
    assert response.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within 0.05 s" in response
    assert transport.closed
    # A complete head in time is served, and its timer does not fire later.
    protocol, transport = connect(head_timeout_s=0.05)
    protocol.data_received(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.2)
    assert len(transport.writes) == 1
    assert b'"/ok"' in transport.writes[0]
    assert not transport.closed
