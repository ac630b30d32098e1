"""The HTTP protocol's limits (``service.rest.http_protocol``) in a real uvicorn server, in process.

A uvicorn server with our protocol class and the fake repository (``app_fakes``) runs in a
thread; raw sockets play the clients. Covered: the head-read timeout (silent close when no
byte of a head came, 408 for a partial head, the skipped rest of an early-answered body), the
head-size bound whatever the packets (431), malformed HTTP (400 naming the parser's reason),
pipelining, the connection cap (evicting only connections idle with nothing received; 503 with
Retry-After when none is), and ``Expect: 100-continue`` answered
before the body.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from harness.probes import read_until_closed
from service.rest.server import uvicorn_config
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

HEAD_TIMEOUT_S = 0.5
MAX_HEAD = 4096
# Long enough never to fire in these tests: a test that waits for it would hang instead.
WAIT_S = 10.0


@contextlib.contextmanager
def serving(
    *,
    max_connections: int = 0,
    head_timeout_s: float = HEAD_TIMEOUT_S,
    keep_alive_s: int = 5,
    graceful_s: int = 5,
    stopped: list[uvicorn.Server] | None = None,
) -> Iterator[int]:
    """A uvicorn server configured as ``bitserve serve`` configures it (``uvicorn_config``),
    over the fake repository, on a free loopback port (yielded); the server object is
    appended to ``stopped`` if given."""
    settings = Settings(
        access_log=False,
        log_level="warning",
        max_header_bytes=MAX_HEAD,
        max_connections=max_connections or 1000,
        head_timeout_s=head_timeout_s,
        timeout_keep_alive_s=keep_alive_s,
        graceful_shutdown_s=graceful_s,
    )
    app = in_process_app(settings, FakeRepository())
    config = uvicorn_config(settings, app, None)  # type: ignore[arg-type]  # no logging set-up
    server = uvicorn.Server(config)
    if stopped is not None:
        stopped.append(server)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        assert time.monotonic() < deadline, "uvicorn did not start in time"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with serving() as p:
        yield p


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return s


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (status, lower-cased headers, body) from a keep-alive connection."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        part = s.recv(65536)
        assert part, f"closed before a response head: {buf!r}"
        buf += part
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        part = s.recv(65536)
        assert part, "closed inside a response body"
        rest += part
    assert len(rest) == n, "more bytes than one response"
    return status, headers, rest


def parse_all(raw: bytes) -> list[tuple[int, bytes]]:
    """Every (status, body) in ``raw``, several responses one after the other."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"truncated response {raw[:200]!r}"
        status = int(head.split(b" ", 2)[1])
        m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        n = int(m.group(1)) if m else 0
        out.append((status, rest[:n]))
        raw = rest[n:]
    return out


def error_of(body: bytes) -> str:
    doc = json.loads(body)
    assert set(doc) == {"error"}
    assert isinstance(doc["error"], str)
    assert doc["error"]
    return str(doc["error"])


ECHO_INPUT = {"name": "x", "datatype": "UINT8", "shape": [1, 4], "data": [1, 2, 3, 4]}
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"


def echo_request(extra: str = "", body: bytes = b"{}") -> bytes:
    head = f"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
    return (head + extra + "\r\n").encode() + body


# --- the head-read timeout ----------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(port: int) -> None:
    with connect(port) as s:
        assert read_until_closed(s) == b""


def test_a_trickled_head_gets_408_and_is_closed(port: int) -> None:
    with connect(port) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Slow: ")
        s.settimeout(0.1)
        answer = b""
        for _ in range(int(WAIT_S / 0.1)):  # one byte per 0.1 s, until the server closes
            try:
                s.sendall(b"a")
                part = s.recv(4096)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not part:
                break
            answer += part
        else:
            pytest.fail("the trickled head was never cut off")
    status, body = parse_all(answer)[0]
    assert status == 408
    assert "did not arrive within 0.5 s" in error_of(body)


def test_an_idle_keep_alive_connection_is_closed_without_an_answer() -> None:
    with serving(keep_alive_s=1) as port, connect(port) as s:
        s.sendall(LIVE)
        assert read_response(s)[0] == 200
        assert read_until_closed(s) == b""  # uvicorn's keep-alive timeout, silently


def test_the_skipped_rest_of_an_early_answered_body_is_bounded_by_the_head_clock(
    port: int,
) -> None:
    # A 404 is answered from the headers; the declared gigabyte would be skipped forever if
    # every byte restarted uvicorn's keep-alive timer.
    with connect(port) as s:
        s.sendall(b"POST /v2/nowhere HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\n\r\nx")
        status, _, body = read_response(s)
        assert status == 404
        assert "no route POST /v2/nowhere" in error_of(body)
        s.settimeout(0.1)
        for _ in range(int(WAIT_S / 0.1)):
            try:
                s.sendall(b"x" * 100)
                if s.recv(4096) == b"":
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        else:
            pytest.fail("a body being skipped held its connection open")


# --- the head-size bound ------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /v2/" + b"a" * MAX_HEAD + b" HTTP/1.1\r\nHost: t\r\n\r\n",  # a long target
        b"GET /v2 HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * MAX_HEAD + b"\r\n\r\n",
        # Fewer lines than max_headers (100), more bytes than the bound.
        b"GET /v2 HTTP/1.1\r\n" + (b"X-Many: " + b"c" * 70 + b"\r\n") * (MAX_HEAD // 70),
    ],
    ids=["target", "one-header", "many-headers"],
)
def test_a_head_past_max_header_bytes_in_one_packet_is_431(port: int, request_bytes: bytes) -> None:
    with connect(port) as s:
        s.sendall(request_bytes)
        [(status, body)] = parse_all(read_until_closed(s))
    assert status == 431
    assert f"more than {MAX_HEAD} bytes" in error_of(body)


def test_an_unfinished_header_line_past_the_bound_is_431(port: int) -> None:
    with connect(port) as s:
        s.sendall(b"GET /v2 HTTP/1.1\r\nX-Endless: ")
        for _ in range(4 * MAX_HEAD // 512):
            try:
                s.sendall(b"d" * 512)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.005)  # separate reads: none holds the whole head
        [(status, _)] = parse_all(read_until_closed(s))
    assert status == 431


def test_pipelined_requests_larger_together_than_the_bound_are_all_answered(port: int) -> None:
    # Only each head is bounded: the bytes of a body in the same read are not head bytes.
    big = b"x" * (2 * MAX_HEAD)
    batch = echo_request(body=big) + echo_request(body=big) + LIVE
    batch += b"GET /v2 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    with connect(port) as s:
        s.sendall(batch)
        answers = parse_all(read_until_closed(s))
    assert [a[0] for a in answers] == [400, 400, 200, 200]  # the bodies are not V2 JSON
    assert all("JSON" in error_of(b) or "json" in error_of(b) for _, b in answers[:2])


# --- malformed HTTP -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (b"GARBAGE\r\n\r\n", "Invalid method"),
        (b"GET /v2 HTTP/9.9\r\n\r\n", "Invalid HTTP version"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", "Invalid method"),  # TLS hello
        (b"GET /v2 HTTP/1.1\r\nBad Header: y\r\n\r\n", "Invalid header token"),
        (b"GET /v2 HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "Duplicate"),
        (b"GET /\xff HTTP/1.1\r\n\r\n", "Invalid char in url"),
        (b"POST /v2 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "PRI"),
    ],
)
def test_malformed_http_is_a_json_400_naming_the_reason(
    port: int, request_bytes: bytes, reason: str
) -> None:
    with connect(port) as s:
        s.sendall(request_bytes)
        raw = read_until_closed(s)
    [(status, body)] = parse_all(raw)
    assert status == 400
    assert b"content-type: application/json" in raw.lower()
    message = error_of(body)
    assert message.startswith("malformed HTTP request: "), message
    assert reason in message, message


def test_an_upgrade_request_is_answered_as_plain_http(port: int) -> None:
    # With a WebSocket library installed, uvicorn would answer a plain-text 403.
    head = (
        "GET /v2/health/live HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\n"
        "Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    )
    with connect(port) as s:
        s.sendall(head.encode())
        status, headers, body = read_response(s)
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"live": True}


def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    ids = [f"req-{i}" for i in range(6)]
    batch = b"".join(
        f"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Request-ID: {i}\r\n\r\n".encode()
        for i in ids[:-1]
    )
    batch += f"GET /v2 HTTP/1.1\r\nX-Request-ID: {ids[-1]}\r\nConnection: close\r\n\r\n".encode()
    with connect(port) as s:
        s.sendall(batch)
        raw = read_until_closed(s)
    assert re.findall(rb"(?i)x-request-id: (\S+)", raw) == [i.encode() for i in ids]
    assert [a[0] for a in parse_all(raw)] == [200] * 6


# --- the connection cap -------------------------------------------------------------------


def evicted(raw: bytes) -> bool:
    """``raw`` is the 503 of a connection closed at the cap to admit another."""
    [(status, body)] = parse_all(raw)
    return (
        status == 503
        and re.search(rb"(?im)^retry-after: 1\r$", raw) is not None
        and "closed to admit another connection (max_connections 3)" in error_of(body)
    )


def test_at_the_cap_only_connections_idle_with_nothing_received_are_evicted() -> None:
    with serving(max_connections=3, head_timeout_s=WAIT_S) as port:
        keep = connect(port)  # the oldest: a client that was answered, idle now
        keep.sendall(LIVE)
        assert read_response(keep)[0] == 200
        slow = connect(port)
        slow.sendall(b"GET /v2/health/live HTTP/1.1\r\n")  # part of a head: never evicted
        silent = connect(port)  # never sends a byte
        time.sleep(1.2)  # past the grace a new connection has for its first bytes
        new = connect(port)  # closes `silent`: never answered, nothing received
        new.sendall(LIVE)
        assert read_response(new)[0] == 200
        # A request on its way would read this 503 as its answer: never a close without one.
        assert evicted(read_until_closed(silent))
        # Now `keep` and `new` are idle after an answer: the one idle longest goes.
        last = connect(port)
        last.sendall(LIVE)
        assert read_response(last)[0] == 200
        assert evicted(read_until_closed(keep))
        slow.sendall(b"Host: t\r\n\r\n")  # the head under way was kept: it is answered
        assert read_response(slow)[0] == 200
        new.sendall(LIVE)
        assert read_response(new)[0] == 200
        for s in (keep, slow, silent, new, last):
            s.close()


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503() -> None:
    with serving(max_connections=2, head_timeout_s=WAIT_S) as port:
        # Two requests whose bodies have not come: busy, not waiting for a head.
        busy = [connect(port) for _ in range(2)]
        for s in busy:
            s.sendall(echo_request(body=b"{}")[:-2])
        time.sleep(0.1)
        with connect(port) as s:
            raw = read_until_closed(s)
        [(status, body)] = parse_all(raw)
        assert status == 503
        assert re.search(rb"(?im)^retry-after: 1\r$", raw)
        assert "max_connections 2" in error_of(body)
        for s in busy:
            s.sendall(b"{}")
            assert read_response(s)[0] == 400  # "{}" has no inputs: the request did run
            s.close()


def test_a_connection_with_a_pipelined_request_running_is_not_evicted() -> None:
    with serving(max_connections=2, head_timeout_s=WAIT_S) as port:
        body = json.dumps({"inputs": [ECHO_INPUT]}).encode()
        first = connect(port)
        # The live check is answered while the infer request behind it waits for its body.
        first.sendall(LIVE + echo_request(body=body)[:-10])
        assert read_response(first)[0] == 200
        time.sleep(0.1)
        others = [connect(port) for _ in range(3)]  # each evicts a waiting one, never `first`
        time.sleep(0.1)
        first.sendall(body[-10:])
        status, _, answer = read_response(first)
        assert status == 200, answer
        assert json.loads(answer)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
        for s in (first, *others):
            s.close()


def test_a_request_cut_by_the_end_of_the_graceful_shutdown_gets_a_json_503() -> None:
    servers: list[uvicorn.Server] = []
    with serving(graceful_s=1, stopped=servers) as port, connect(port) as s:
        s.sendall(echo_request(body=b"{}")[:-2])  # waits for a body that never comes
        time.sleep(0.2)
        servers[0].should_exit = True
        raw = read_until_closed(s)
    [(status, body)] = parse_all(raw)
    assert status == 503
    assert "shutting down" in error_of(body)


# --- Expect: 100-continue -----------------------------------------------------------------


@pytest.mark.parametrize(("model", "status"), [("nope", 404), ("busy", 503)])
def test_expect_100_continue_answered_from_the_headers_closes(
    port: int, model: str, status: int
) -> None:
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n"
        "Expect: 100-continue\r\n\r\n"
    )
    with connect(port) as s:
        s.sendall(head.encode())  # and never the body
        raw = read_until_closed(s)
    assert not raw.startswith(b"HTTP/1.1 100")
    [(got, body)] = parse_all(raw)
    assert got == status, body
    assert re.search(rb"(?im)^connection: close", raw)
    error_of(body)


def test_expect_100_continue_accepted_gets_continue_then_the_answer(port: int) -> None:
    body = json.dumps({"inputs": [ECHO_INPUT]}).encode()
    with connect(port) as s:
        s.sendall(echo_request("Expect: 100-continue\r\n", body)[: -len(body)])
        s.settimeout(WAIT_S)
        assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        status, headers, answer = read_response(s)
    assert status == 200, answer
    assert "close" not in headers.get("connection", "")
