"""The client's own HTTP/1.1 transport (``_h1``) against httpx's (httpcore over h11).

The reference is httpx's transport on the same bytes: a scripted socket server sends random
answers (every body framing, interim 1xx, no-body statuses, HEAD, ``Connection: close``,
HTTP/1.0, gzip, odd field spacing, several answers on one kept-alive connection) and both
transports must read the same status, fields and body. The client's direct path must send
what httpx would send. Failures on real sockets map to the same exceptions and retries.
"""

from __future__ import annotations

import gzip
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from bitserve_client import Client, ConnectError, Retry, TimeoutException, TransportError
from bitserve_client._h1 import H1Transport

from .fake_v2 import FakeV2, reference_bits
from .wire import WireServer

# -- a scripted server ------------------------------------------------------------------------


class Scripted:
    """A loopback server that answers each request with the next scripted bytes.

    Each script entry is ``(answer bytes, then)``: ``then`` is ``"keep"`` (wait for the next
    request on this connection), ``"close"`` (close after the answer) or ``"drop"`` (close
    without answering). Requests are recorded as (head bytes, body bytes).
    """

    def __init__(self) -> None:
        self.script: list[tuple[bytes, str]] = []
        self.requests: list[tuple[bytes, bytes]] = []
        self.ended: list[bool] = []
        """Per connection, in order of accepting: whether the client closed it."""
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.ended.append(False)
            index = len(self.ended) - 1
            threading.Thread(target=self._connection, args=(conn, index), daemon=True).start()

    @property
    def accepted(self) -> int:
        """The connections accepted so far."""
        return len(self.ended)

    def wait_ended(self, index: int, timeout_s: float = 5.0) -> bool:
        """Whether connection ``index`` is closed by its client within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ended[index] and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.ended[index]

    def _connection(self, conn: socket.socket, index: int) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        self.ended[index] = True
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                body, buf = self._read_body(conn, head, buf)
                self.requests.append((head, body))
                answer, then = self.script.pop(0)
                if then != "drop":
                    conn.sendall(answer)
                if then != "keep":
                    return

    @staticmethod
    def _read_body(conn: socket.socket, head: bytes, buf: bytes) -> tuple[bytes, bytes]:
        fields = {k.strip().lower(): v.strip() for k, _, v in
                  (line.partition(b":") for line in head.split(b"\r\n")[1:])}  # fmt: skip
        if fields.get(b"transfer-encoding") == b"chunked":
            out = b""
            while True:
                while b"\r\n" not in buf:
                    buf += conn.recv(65536)
                size_line, _, buf = buf.partition(b"\r\n")
                size = int(size_line, 16)
                while len(buf) < size + 2:
                    buf += conn.recv(65536)
                out, buf = out + buf[:size], buf[size + 2 :]
                if size == 0:
                    return out, buf
        n = int(fields.get(b"content-length", b"0"))
        while len(buf) < n:
            buf += conn.recv(65536)
        return buf[:n], buf[n:]

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self._sock.close()


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    server = Scripted()
    yield server
    server.close()


# -- random answers ---------------------------------------------------------------------------


def random_answer(rng: random.Random, method: str) -> tuple[bytes, str]:
    """Random answer bytes and whether the connection ends after them."""
    status = rng.choice([200, 200, 200, 201, 204, 304, 404, 500, 503])
    version = rng.choice([b"HTTP/1.1"] * 5 + [b"HTTP/1.0"])
    body = rng.randbytes(rng.choice([0, 1, 17, 1000, 70_000, 300_000]))
    fields = [(b"X-Test-%d" % k, b"v%d" % rng.randrange(1000)) for k in range(rng.randrange(4))]
    fields.append((b"Content-Type", b"application/octet-stream"))
    if rng.random() < 0.2:
        body = gzip.compress(body)
        fields.append((b"Content-Encoding", b"gzip"))
    no_body = method == "HEAD" or status in (204, 304)
    framing = rng.choice(["length", "chunked", "close"])
    then = "keep"
    if framing == "length":
        fields.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "chunked" and version == b"HTTP/1.1":
        fields.append((b"Transfer-Encoding", b"chunked"))
    else:
        framing, then = "close", "close"
    if rng.random() < 0.15:
        fields.append((b"Connection", b"close"))
        then = "close"
    if version == b"HTTP/1.0":
        then = "close"
    if no_body and framing == "close":  # framed by its length: the connection is kept
        fields.append((b"Content-Length", b"0"))
        if version == b"HTTP/1.1" and (b"Connection", b"close") not in fields:
            then = "keep"  # closing it after all would race the next request (a reset)
    head = b"%s %d Reason Phrase\r\n" % (version, status)
    if rng.random() < 0.15:
        head = b"HTTP/1.1 100 Continue\r\n\r\n" + head
    spacing = rng.choice([b": ", b":", b":  ", b": \t"])
    head += b"".join(k + spacing + v + rng.choice([b"", b" "]) + b"\r\n" for k, v in fields)
    if no_body:
        return head + b"\r\n", then
    if framing == "chunked":
        chunks, rest = [], body
        while rest:
            n = rng.randint(1, 50_000)
            ext = rng.choice([b"", b";name=value"])
            chunks.append(b"%x%s\r\n%s\r\n" % (min(n, len(rest)), ext, rest[:n]))
            rest = rest[n:]
        trailer = rng.choice([b"", b"X-Trailer: t\r\n"])
        return head + b"\r\n" + b"".join(chunks) + b"0\r\n" + trailer + b"\r\n", then
    return head + b"\r\n" + body, then


def fetch(client: httpx.Client, method: str) -> tuple[int, list[tuple[str, str]], bytes]:
    r = client.request(method, "/x")
    return r.status_code, r.headers.multi_items(), r.content


@pytest.mark.parametrize("seed", [*range(6), None])
def test_random_answers_read_as_httpx_reads_them(scripted: Scripted, seed: int | None) -> None:
    """Six fixed seeds, and a fresh one each run (printed, to replay a failure)."""
    seed = random.randrange(2**32) if seed is None else seed
    print(f"seed {seed}")
    rng = random.Random(seed)
    with (
        httpx.Client(base_url=scripted.url, transport=H1Transport()) as lean,
        httpx.Client(base_url=scripted.url, transport=httpx.HTTPTransport()) as reference,
    ):
        for _ in range(25):
            method = rng.choice(["GET", "POST", "HEAD"])
            answer = random_answer(rng, method)
            scripted.script += [answer, answer]
            got, want = fetch(lean, method), fetch(reference, method)
            assert got == want, f"seed {seed}"
    # kept-alive connections were reused by both: far fewer connections than requests
    assert scripted.accepted < 50


def test_bodies_go_out_as_httpx_sends_them(scripted: Scripted) -> None:
    rng = np.random.default_rng(1)
    with (
        httpx.Client(base_url=scripted.url, transport=H1Transport()) as lean,
        httpx.Client(base_url=scripted.url, transport=httpx.HTTPTransport()) as reference,
    ):
        for n in (0, 5, 300_000, 700_000):  # one send, then piecewise above JOIN_BELOW
            arr = rng.integers(0, 255, n, dtype=np.uint8)
            floats = rng.random(n // 4 + 1).astype(np.float32)
            length = 4 + arr.nbytes + floats.nbytes
            for client in (lean, reference):
                # h11 counts a memoryview's items; the lean transport counts bytes of any view
                view = memoryview(floats) if client is lean else memoryview(floats).cast("B")
                pieces = [b"head", memoryview(arr), view]
                scripted.script.append((b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", "keep"))
                client.post("/p", content=pieces, headers={"Content-Length": str(length)})
                scripted.script.append((b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", "keep"))
                client.post("/p", content=iter([b"a", b"", b"bc"]))  # no length: chunked
            (h1, b1), (_, b2), (h3, b3), (_, b4) = scripted.requests[-4:]
            assert b1 == b3 == b"head" + arr.tobytes() + floats.tobytes()
            assert b2 == b4 == b"abc"
            assert h1.split(b"\r\n")[0] == h3.split(b"\r\n")[0] == b"POST /p HTTP/1.1"


# -- the client's direct path -----------------------------------------------------------------


def fields_of(request: httpx.Request) -> list[tuple[str, str]]:
    """A request's fields, names lower-cased, sorted; httpx's ``Connection: keep-alive`` aside."""
    return sorted((k.lower(), v) for k, v in request.headers.multi_items() if k != "connection")


@pytest.mark.parametrize("prefix", ["", "/route/a"])
def test_client_sends_what_httpx_sends(prefix: str) -> None:
    """The same calls through the direct path and through httpx: same request lines, same
    fields (httpx's ``Connection: keep-alive`` aside), same bodies."""
    fake = FakeV2()
    server = WireServer(fake)
    url = server.url("http://x" + prefix, strip_prefix=True)
    rng = np.random.default_rng(2)
    bits = rng.random((8, 3, 13)) < 0.5
    extra = {"X-Trace": "abc", "user-agent": "mine/1"}  # overrides the client's, any case
    seen: list[list[tuple[httpx.Request, bytes]]] = []
    try:
        for transport in (None, httpx.HTTPTransport()):
            with Client(url, token="t0k", headers={"X-Team": "chem"}, transport=transport) as c:
                assert (c._lean is not None) == (transport is None)
                start = len(fake.requests)
                c.model_metadata("bits", headers=extra)
                c.infer("bits", bits, headers=extra, deadline=0.25)
                c.load_model("bits", headers={"X-Load": "1"})
                assert c.is_ready()
                seen.append([(r, r.content) for r in fake.requests[start:]])
    finally:
        server.close()
    lean, reference = seen
    assert all(path.startswith(prefix + "/v2") for path in server.paths)
    assert len(lean) == len(reference) >= 4
    for (r1, b1), (r2, b2) in zip(lean, reference, strict=True):
        assert (r1.method, r1.url.raw_path) == (r2.method, r2.url.raw_path)
        assert fields_of(r1) == fields_of(r2)
        assert b1 == b2
    assert lean[0][0].headers["user-agent"] == "mine/1"
    assert lean[0][0].headers["authorization"] == "Bearer t0k"


def test_client_results_match_reference_on_the_wire() -> None:
    fake = FakeV2()
    server = WireServer(fake)
    try:
        with Client(server.url("http://x"), compression="gzip") as c:
            assert c._lean is not None
            for seed in range(3):
                bits = np.random.default_rng(seed).random((7, 3, 13)) < 0.5
                result = c.infer("bits", bits)
                ref = reference_bits(bits)
                np.testing.assert_array_equal(result["count"], ref["count"])
                np.testing.assert_array_equal(result["first"], ref["first"])
    finally:
        server.close()


def test_bad_header_values_are_refused_before_sending() -> None:
    with Client("http://127.0.0.1:9") as c, pytest.raises(Exception, match="CR, LF or NUL"):
        c.model_metadata("bits", headers={"X-Bad": "a\r\nInjected: 1"})


# -- connections and failures -----------------------------------------------------------------


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def client_on(server: Scripted, **kwargs: Any) -> tuple[Client, list[float]]:
    sleeps: list[float] = []
    kwargs.setdefault("retries", Retry(retries=2, backoff=0.01))
    client = Client(server.url, **kwargs)
    client._sleep = sleeps.append
    return client, sleeps


def assert_one_connection_carries_three(client: Client, scripted: Scripted) -> None:
    scripted.script += [(OK, "keep")] * 3
    for _ in range(3):
        client.server_metadata()
    assert scripted.accepted == 1


def test_connections_are_reused_and_a_closed_one_is_not(scripted: Scripted) -> None:
    client, sleeps = client_on(scripted)
    with client:
        assert_one_connection_carries_three(client, scripted)
        scripted.script += [(OK, "close"), (OK, "keep")]  # the server closes after answering
        client.server_metadata()
        time.sleep(0.05)
        client.server_metadata()  # found closed before reuse: a new connection, no retry
        assert (scripted.accepted, sleeps) == (2, [])


def test_idle_connections_expire(scripted: Scripted) -> None:
    client, _ = client_on(scripted, limits=httpx.Limits(keepalive_expiry=0.05))
    with client:
        scripted.script += [(OK, "keep")] * 2
        client.server_metadata()
        time.sleep(0.15)
        client.server_metadata()
        assert scripted.accepted == 2


@pytest.mark.parametrize(
    "answer",
    [
        (b"", "drop"),  # closed with no answer
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", "close"),  # cut short
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "close"),  # malformed status
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "close"),  # malformed field
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "close"),
    ],
)
def test_broken_answers_are_retried_then_raised(
    scripted: Scripted, answer: tuple[bytes, str]
) -> None:
    client, sleeps = client_on(scripted)
    with client:
        scripted.script += [answer, (OK, "keep")]
        assert client.server_metadata() == {}
        assert len(sleeps) == 1
        scripted.script += [answer] * 3
        with pytest.raises(TransportError) as info:
            client.server_metadata()
        assert isinstance(info.value.__cause__, httpx.RemoteProtocolError)
        assert len(sleeps) == 3


def test_refused_connection_is_a_connect_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    sleeps: list[float] = []
    with Client(f"http://127.0.0.1:{port}", retries=Retry(retries=2, backoff=0.01)) as c:
        c._sleep = sleeps.append
        with pytest.raises(ConnectError) as info:
            c.server_metadata()
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert len(sleeps) == 2


def test_read_timeout_is_raised_and_not_retried(scripted: Scripted) -> None:
    client, sleeps = client_on(scripted, timeout=5.0)
    with client:
        scripted.script.append((b"HTTP/1.1 200 OK\r\n", "keep"))  # then nothing more
        t0 = time.monotonic()
        with pytest.raises(TimeoutException) as info:
            client.server_metadata(timeout=0.2)  # the call's own timeout, not the client's
        assert time.monotonic() - t0 < 3
    assert isinstance(info.value.__cause__, httpx.ReadTimeout)
    assert sleeps == []


def test_pool_limit_waits_then_times_out(scripted: Scripted) -> None:
    transport = H1Transport(httpx.Limits(max_connections=1))
    scripted.script += [(b"HTTP/1.1 200 OK\r\n", "keep")]  # holds the only connection
    raised: list[BaseException] = []

    def hold(client: httpx.Client) -> None:
        try:
            client.get("/", timeout=0.5)
        except httpx.ReadTimeout as exc:
            raised.append(exc)

    with httpx.Client(base_url=scripted.url, transport=transport) as c:
        blocked = threading.Thread(target=hold, args=(c,), daemon=True)
        blocked.start()
        time.sleep(0.1)
        with pytest.raises(httpx.PoolTimeout):
            c.get("/", timeout=httpx.Timeout(5.0, pool=0.1))
        blocked.join()
    assert len(raised) == 1


# -- when the lean transport is used ---------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kwargs", "env", "lean"),
    [
        ("http://h:1", {}, {}, True),
        ("http://h:1/prefix", {}, {"HTTPS_PROXY": "http://p:3128"}, True),  # not for http://
        ("https://h:1", {}, {}, False),
        ("http://h:1", {"proxy": "http://p:3128"}, {}, False),
        ("http://h:1", {}, {"HTTP_PROXY": "http://p:3128"}, False),
        ("http://h:1", {}, {"all_proxy": "http://p:3128"}, False),
        ("http://h:1", {"transport": httpx.HTTPTransport()}, {}, False),
    ],
)
def test_lean_transport_only_where_it_applies(
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    kwargs: dict[str, Any],
    env: dict[str, str],
    lean: bool,
) -> None:
    for name in (
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with Client(url, **kwargs) as c:
        assert (c._lean is not None) is lean
        assert isinstance(c._http._transport, H1Transport) is lean


def test_http2_keeps_httpx() -> None:
    with Client("http://h:1") as c:  # (http2=True itself needs the [http2] extra installed)
        assert c._lean_transport_applies(None, http2=True) is False
        assert c._lean_transport_applies(None, http2=False) is True


def test_closed_client_refuses(scripted: Scripted) -> None:
    client, _ = client_on(scripted)
    client.close()
    with pytest.raises(Exception, match="closed"):
        client.server_metadata()


def test_reuse_check_works_above_descriptor_1023(scripted: Scripted) -> None:
    """``select`` cannot watch descriptors above 1023; the check before reuse must still see
    a live connection as live (else every request would open a new one)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("cannot open 1,100 descriptors here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [socket.socket() for _ in range(1100)]  # the client's socket gets a high number
    try:
        client, _ = client_on(scripted)
        with client:
            assert_one_connection_carries_three(client, scripted)
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
