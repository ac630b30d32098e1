"""A lean HTTP/1.1 transport: plain ``http://``, kept-alive sockets, whole bodies.

httpx (its client layer, then httpcore over h11) spends 1.4-1.7 ms of CPU on a 64-row
inference request on a 2-core host, as much as a light model's maths on the server, so a
Python client beside the server takes a core from it. :class:`H1Transport` sends the same
requests over a pool of plain sockets and parses the answer in a few byte operations.
:class:`~._client.Client` calls :meth:`H1Transport.exchange` directly with a head it built
as httpx would (its client CPU per 64-row ``infer_many`` request fell from 2.6 to 1.2 ms);
as an ``httpx.BaseTransport`` it also sits under the client's ``httpx.Client``, where
everything above the socket stays httpx's.

What it speaks (RFC 9112, client side):

* the request: httpx's head as it stands (``Host``, ``Content-Length`` or
  ``Transfer-Encoding: chunked``, which it then frames); a small body goes out in one send;
* the response: ``HTTP/1.x`` status line and fields; interim 1xx answers skipped; a body
  framed by ``Transfer-Encoding: chunked`` (trailers dropped), ``Content-Length``, or the
  connection's end; none for ``HEAD``, 1xx, 204 and 304;
* connections: kept alive unless either side says ``Connection: close`` or the answer is
  HTTP/1.0 or ends with the connection; an idle one is dropped after ``keepalive_expiry``
  seconds, or when the server has closed it (checked before reuse, as httpcore does);
  ``max_connections`` open at once (waiting up to the pool timeout),
  ``max_keepalive_connections`` kept idle.

What it does not: TLS, proxies, HTTP/2, streaming an answer as it arrives (the whole body is
read before the response is returned). :class:`~._client.Client` uses it only for a plain
``http://`` URL with no proxy (argument or environment) and ``http2=False``; anything else
goes through httpx's own transport, as does any client given ``transport=``.
:class:`~._async_client.AsyncClient` has its asyncio twin (``_h1_async``), which reads
answers with the same :func:`read_answer`: the reading is written once, without I/O, as
generators that yield when they need more bytes than the buffer holds.

Failures map to httpx's exceptions the way httpcore's do: ``ConnectError`` /
``ConnectTimeout`` before the request is on the wire, ``WriteError`` / ``WriteTimeout``
while sending, ``ReadError`` / ``ReadTimeout`` while waiting, ``RemoteProtocolError`` for a
malformed answer or a connection closed before a complete one, ``PoolTimeout`` when no
connection frees up in time.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import httpx

__all__ = ["H1Transport", "Reply", "frame_body", "read_answer"]

T = TypeVar("T")

MAX_HEAD = 64 * 1024
"""The most bytes a response's status line and fields may take."""
JOIN_BELOW = 256 * 1024
"""Bodies up to this size are joined with the head and sent in one call."""
_RECV = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
"""httpx's own default limits."""


class _Closed(Exception):
    """The server closed the connection (EOF) where more of the answer was due."""


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes or an EOF waiting (or is broken), without blocking.

    ``poll`` where there is one: ``select`` cannot watch descriptors above 1023, which a
    process with many files open hands out.
    """
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return True


class _Connection:
    """One kept-alive socket and the bytes read past the last answer."""

    __slots__ = ("buf", "closing", "idle_since", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.idle_since = 0.0
        self.closing = False

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a socket the kernel already dropped
            self.sock.close()

    def usable(self) -> bool:
        """Whether an idle connection can carry another request: not closed.

        A server that closed its end makes the socket readable (EOF); so does one that sent
        bytes nobody asked for. Either way the connection is not reused.
        """
        if self.buf:
            return False
        return not _readable(self.sock)

    def fill(self) -> bool:
        """Read what has come into :attr:`buf`; False at the connection's end."""
        data = self.sock.recv(_RECV)
        self.buf += data
        return bool(data)


# -- the answer, read from a buffer (no I/O) ------------------------------------------------
#
# Each reader takes bytes from the front of a connection's buffer. When it needs more than
# the buffer holds it yields; whoever drives it (a socket's recv here, an asyncio protocol's
# next data in ``_h1_async``) adds what came to the buffer and sends back whether anything
# did (False: the connection ended).

Steps = Generator[None, bool, T]


def _more() -> Steps[None]:
    if not (yield):
        raise _Closed


def _head(buf: bytearray) -> Steps[tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]]:
    """(status, reason, http version, fields) of the next answer, its head consumed."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buf) > MAX_HEAD:
            raise httpx.RemoteProtocolError("response head larger than 64 KiB")
        yield from _more()
    if end > MAX_HEAD:
        raise httpx.RemoteProtocolError("response head larger than 64 KiB")
    lines = bytes(buf[:end]).split(b"\r\n")
    del buf[: end + 4]
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:80]!r}")
    fields: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise httpx.RemoteProtocolError(f"malformed response field {line[:80]!r}")
        fields.append((name, value.strip(b" \t")))
    return int(code), reason, version, fields


def _exact(buf: bytearray, n: int) -> Steps[bytes]:
    while len(buf) < n:
        yield from _more()
    data = bytes(buf[:n])
    del buf[:n]
    return data


def _line(buf: bytearray) -> Steps[bytes]:
    while True:
        end = buf.find(b"\r\n")
        if end >= 0:
            line = bytes(buf[:end])
            del buf[: end + 2]
            return line
        if len(buf) > MAX_HEAD:
            raise httpx.RemoteProtocolError("chunk size line too long")
        yield from _more()


def _chunked(buf: bytearray) -> Steps[bytes]:
    parts: list[bytes] = []
    while True:
        size_field = (yield from _line(buf)).split(b";", 1)[0].strip()
        try:
            if not size_field or not all(c in b"0123456789abcdefABCDEF" for c in size_field):
                raise ValueError
            size = int(size_field, 16)
        except ValueError:
            bad = size_field[:40]
            raise httpx.RemoteProtocolError(f"malformed chunk size {bad!r}") from None
        if size == 0:
            while (yield from _line(buf)):  # trailer fields, up to the empty line
                pass
            return b"".join(parts)
        parts.append((yield from _exact(buf, size)))
        if (yield from _exact(buf, 2)) != b"\r\n":
            raise httpx.RemoteProtocolError("chunk not followed by CRLF")


def _to_end(buf: bytearray) -> Steps[bytes]:
    while (yield):
        pass
    data = bytes(buf)
    buf.clear()
    return data


def read_answer(buf: bytearray, method: str) -> Steps[tuple[Reply, bool]]:
    """The next final answer (interim 1xx skipped) and whether its connection must close
    after it: HTTP/1.0, 101, ``Connection: close``, or a body that ran to the end."""
    while True:
        status, reason, version, fields = yield from _head(buf)
        if status >= 200 or status == 101:
            break
    closing = version != b"HTTP/1.1" or status == 101 or _wants_close(fields)
    body = b""
    if not (method == "HEAD" or status < 200 or status in _NO_BODY_STATUS):
        body, to_end = yield from _body(buf, fields)
        closing = closing or to_end
    return Reply(status, reason, version, fields, body), closing


def _body(buf: bytearray, fields: list[tuple[bytes, bytes]]) -> Steps[tuple[bytes, bool]]:
    """The answer's body, framing removed (RFC 9112 section 6.3), and whether it ran to
    the connection's end."""
    encodings = _field(fields, b"transfer-encoding")
    if encodings:
        if b",".join(encodings).lower().split(b",")[-1].strip() != b"chunked":
            return (yield from _to_end(buf)), True
        return (yield from _chunked(buf)), False
    lengths = _field(fields, b"content-length")
    if lengths:
        values = {v.strip() for length in lengths for v in length.split(b",")}
        if len(values) != 1 or not next(iter(values)).isdigit():
            raise httpx.RemoteProtocolError(f"malformed Content-Length {lengths!r}")
        return (yield from _exact(buf, int(next(iter(values))))), False
    return (yield from _to_end(buf)), True


def _field(fields: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for k, v in fields if k.lower() == name]


@dataclass(slots=True)
class Reply:
    """A whole HTTP answer as :meth:`H1Transport.exchange` returns it.

    Attributes:
        status_code: the status.
        reason_phrase: the reason phrase, as sent.
        http_version: ``b"HTTP/1.1"`` or ``b"HTTP/1.0"``.
        fields: the header fields as sent (names not lower-cased), in order.
        body: the body as sent (any ``Content-Encoding`` still applied), framing removed.
    """

    status_code: int
    reason_phrase: bytes
    http_version: bytes
    fields: list[tuple[bytes, bytes]]
    body: bytes


class _Idle(Protocol):
    idle_since: float

    def close(self) -> None: ...


C = TypeVar("C", bound=_Idle)


class IdlePool(Generic[C]):
    """Idle kept-alive connections by ``(host, port)``, newest reused first: at most
    ``limits.max_keepalive_connections`` in all, each for ``keepalive_expiry`` seconds.
    Shared by the sync and async transports (a lock: the sync one's threads)."""

    def __init__(self, limits: httpx.Limits) -> None:
        self.keep = limits.max_keepalive_connections
        self.expiry = limits.keepalive_expiry
        self.closed = False
        self._idle: dict[tuple[str, int], list[C]] = {}
        self.total = 0
        self._lock = threading.Lock()

    def take(self, key: tuple[str, int], usable: Callable[[C], bool]) -> C | None:
        """The newest idle connection to ``key`` that has not expired and is
        ``usable(conn)``; the stale ones met on the way are closed."""
        now = time.monotonic()
        expiry = self.expiry
        stale: list[C] = []
        found = None
        with self._lock:
            idle = self._idle.get(key)
            while idle:
                conn = idle.pop()
                self.total -= 1
                if (expiry is None or now - conn.idle_since <= expiry) and usable(conn):
                    found = conn
                    break
                stale.append(conn)
        for conn in stale:
            conn.close()
        return found

    def put(self, key: tuple[str, int], conn: C) -> None:
        """Keep ``conn`` idle for reuse, or close it (the pool full or closed)."""
        conn.idle_since = time.monotonic()
        with self._lock:
            if not self.closed and (self.keep is None or self.total < self.keep):
                self._idle.setdefault(key, []).append(conn)
                self.total += 1
                return
        conn.close()

    def close(self) -> None:
        """Close every idle connection; later ones are closed as they are put back."""
        with self._lock:
            self.closed = True
            conns = [c for v in self._idle.values() for c in v]
            self._idle.clear()
            self.total = 0
        for conn in conns:
            conn.close()


def httpx_head(request: httpx.Request) -> tuple[bytes, bool, bool]:
    """An httpx request's head as it stands, whether its body is chunked, and whether it
    asks to close the connection (the transports' ``handle_request``)."""
    if request.url.scheme != "http":
        raise httpx.UnsupportedProtocol(
            f"bitserve's HTTP/1.1 transport speaks plain http://, not {request.url.scheme}://"
        )
    raw_headers = request.headers.raw
    chunked = any(
        k.lower() == b"transfer-encoding" and b"chunked" in v.lower() for k, v in raw_headers
    )
    head = b"".join(
        [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
        + [b"%s: %s\r\n" % (k, v) for k, v in raw_headers]
        + [b"\r\n"]
    )
    return head, chunked, _wants_close(raw_headers)


def httpx_response(reply: Reply, request: httpx.Request) -> httpx.Response:
    """A whole answer as an ``httpx.Response`` to ``request``."""
    return httpx.Response(
        reply.status_code,
        headers=reply.fields,
        stream=httpx.ByteStream(reply.body),
        extensions={"http_version": reply.http_version, "reason_phrase": reply.reason_phrase},
        request=request,
    )


class H1Transport(httpx.BaseTransport):
    """An :class:`httpx.BaseTransport` for plain HTTP/1.1 over a pool of kept-alive sockets.

    :meth:`exchange` is the whole of it, on bytes; :meth:`handle_request` puts httpx's
    request and response types around it.

    Args:
        limits: connections open at once, idle connections kept, and how long one is kept.
    """

    def __init__(self, limits: httpx.Limits = _LIMITS) -> None:
        self._max = limits.max_connections
        self._slots = threading.BoundedSemaphore(self._max) if self._max is not None else None
        self._pool: IdlePool[_Connection] = IdlePool(limits)

    @property
    def is_closed(self) -> bool:
        return self._pool.closed

    def close(self) -> None:
        self._pool.close()

    # -- one exchange ------------------------------------------------------------------

    def exchange(
        self,
        host: str,
        port: int,
        head: bytes,
        body: list[bytes | memoryview],
        timeouts: dict[str, float | None],
        method: str = "POST",
        close: bool = False,
    ) -> Reply:
        """Send one request and read its whole answer.

        Args:
            host: the server's host name or address.
            port: its port.
            head: the request line and header fields, ending with the empty line; the
                fields must frame ``body`` (``Content-Length``, or chunk framing in it).
            body: the body's pieces as they go on the wire (may be empty).
            timeouts: seconds for ``connect``, ``write``, ``read`` and ``pool`` (a missing
                one or None: no limit), as in ``httpx.Timeout.as_dict()``.
            method: the request's method (a ``HEAD`` answer has no body).
            close: whether the request asked to close the connection (``Connection: close``).

        Raises:
            httpx.TransportError: the subclass httpcore would raise (module docstring).
        """
        if self._pool.closed:
            raise RuntimeError("the transport is closed")
        key = (host, port)
        if self._slots is not None and not self._slots.acquire(timeout=timeouts.get("pool")):
            raise httpx.PoolTimeout("no connection became free within the pool timeout")
        try:
            conn = self._pool.take(key, _Connection.usable)
            conn = conn or _connect(host, port, timeouts.get("connect"))
            try:
                reply = _send_and_read(conn, head, body, timeouts, method)
                conn.closing = conn.closing or close
            except BaseException:
                conn.close()
                raise
            if not conn.closing:  # read_answer marks HTTP/1.0, 101 and Connection: close
                self._pool.put(key, conn)
            else:
                conn.close()
            return reply
        finally:
            if self._slots is not None:
                self._slots.release()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's entry: the request's head and body as they stand, through :meth:`exchange`."""
        head, chunked, close = httpx_head(request)
        body = frame_body(request.stream, chunked)  # type: ignore[arg-type]  # a sync stream
        timeouts = request.extensions.get("timeout", {})
        port = request.url.port or 80
        reply = self.exchange(request.url.host, port, head, body, timeouts, request.method, close)
        return httpx_response(reply, request)


def _connect(host: str, port: int, timeout: float | None) -> _Connection:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "timed out connecting") from exc
    except OSError as exc:
        raise httpx.ConnectError(str(exc)) from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _Connection(sock)


def _send_and_read(
    conn: _Connection,
    head: bytes,
    body: list[bytes | memoryview],
    timeouts: dict[str, float | None],
    method: str,
) -> Reply:
    """One request out on ``conn`` and its answer in; ``conn.closing`` set if it cannot be
    reused (either side asked to close, or the answer ran to the connection's end)."""
    sock = conn.sock
    try:
        sock.settimeout(timeouts.get("write"))
        if sum(len(b) for b in body) <= JOIN_BELOW:
            sock.sendall(b"".join([head, *body]))
        else:
            sock.sendall(head)
            for part in body:
                sock.sendall(part)
    except TimeoutError as exc:
        raise httpx.WriteTimeout(str(exc) or "timed out sending the request") from exc
    except OSError as exc:
        raise httpx.WriteError(str(exc)) from exc
    try:
        sock.settimeout(timeouts.get("read"))
        steps = read_answer(conn.buf, method)
        try:
            next(steps)
            while True:
                steps.send(conn.fill())
        except StopIteration as done:
            answer: tuple[Reply, bool] = done.value
    except TimeoutError as exc:
        raise httpx.ReadTimeout(str(exc) or "timed out reading the response") from exc
    except _Closed:
        raise httpx.RemoteProtocolError(
            "Server disconnected without sending a complete response."
        ) from None
    except OSError as exc:
        raise httpx.ReadError(str(exc)) from exc
    reply, closing = answer
    conn.closing = conn.closing or closing
    return reply


def _wants_close(fields: Iterable[tuple[bytes, bytes]]) -> bool:
    return any(
        k.lower() == b"connection" and b"close" in v.lower().replace(b" ", b"").split(b",")
        for k, v in fields
    )


def frame_body(stream: Iterable[bytes | memoryview], chunked: bool) -> list[bytes | memoryview]:
    """The request body's pieces as they go on the wire (chunk-framed if asked).

    Bytes-like pieces other than ``bytes`` become byte memoryviews, so that ``len`` counts
    bytes (a view of a float array counts floats); empty pieces are dropped.
    """
    parts: list[bytes | memoryview] = []
    for piece in stream:
        part: bytes | memoryview = (
            piece if isinstance(piece, bytes) else memoryview(piece).cast("B")
        )
        if len(part):
            parts.append(part)
    if not chunked:
        return parts
    framed: list[bytes | memoryview] = []
    for part in parts:
        framed += [b"%x\r\n" % len(part), part, b"\r\n"]
    return [*framed, b"0\r\n\r\n"]
