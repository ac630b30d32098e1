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
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

__all__ = ["H1Transport", "Reply", "frame_body"]

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

    def usable(self, now: float, expiry: float | None) -> bool:
        """Whether an idle connection can carry another request: not expired, not closed.

        A server that closed its end makes the socket readable (EOF); so does one that sent
        bytes nobody asked for. Either way the connection is not reused.
        """
        if expiry is not None and now - self.idle_since > expiry:
            return False
        if self.buf:
            return False
        return not _readable(self.sock)

    # -- reading -----------------------------------------------------------------------

    def _fill(self) -> None:
        data = self.sock.recv(_RECV)
        if not data:
            raise _Closed
        self.buf += data

    def read_head(self) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
        """(status, reason, http version, fields) of the next answer, its head consumed."""
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buf) > MAX_HEAD:
                raise httpx.RemoteProtocolError("response head larger than 64 KiB")
            self._fill()
        if end > MAX_HEAD:
            raise httpx.RemoteProtocolError("response head larger than 64 KiB")
        lines = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[: end + 4]
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

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def read_line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > MAX_HEAD:
                raise httpx.RemoteProtocolError("chunk size line too long")
            self._fill()

    def read_chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size_field = self.read_line().split(b";", 1)[0].strip()
            try:
                if not size_field or not all(c in b"0123456789abcdefABCDEF" for c in size_field):
                    raise ValueError
                size = int(size_field, 16)
            except ValueError:
                bad = size_field[:40]
                raise httpx.RemoteProtocolError(f"malformed chunk size {bad!r}") from None
            if size == 0:
                while self.read_line():  # trailer fields, up to the empty line
                    pass
                return b"".join(parts)
            parts.append(self.read_exact(size))
            if self.read_exact(2) != b"\r\n":
                raise httpx.RemoteProtocolError("chunk not followed by CRLF")

    def read_to_end(self) -> bytes:
        while True:
            try:
                self._fill()
            except _Closed:
                data = bytes(self.buf)
                self.buf.clear()
                return data


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


class H1Transport(httpx.BaseTransport):
    """An :class:`httpx.BaseTransport` for plain HTTP/1.1 over a pool of kept-alive sockets.

    :meth:`exchange` is the whole of it, on bytes; :meth:`handle_request` puts httpx's
    request and response types around it.

    Args:
        limits: connections open at once, idle connections kept, and how long one is kept.
    """

    def __init__(self, limits: httpx.Limits = _LIMITS) -> None:
        self._max = limits.max_connections
        self._keep = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._slots = threading.BoundedSemaphore(self._max) if self._max is not None else None
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._idle_total = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def is_closed(self) -> bool:
        return self._closed

    # -- the pool ----------------------------------------------------------------------

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        now = time.monotonic()
        stale: list[_Connection] = []
        found = None
        with self._lock:
            idle = self._idle.get(key)
            while idle:
                conn = idle.pop()
                self._idle_total -= 1
                if conn.usable(now, self._expiry):
                    found = conn
                    break
                stale.append(conn)
        for conn in stale:
            conn.close()
        return found

    def _put_idle(self, key: tuple[str, int], conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            if not self._closed and (self._keep is None or self._idle_total < self._keep):
                self._idle.setdefault(key, []).append(conn)
                self._idle_total += 1
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for v in self._idle.values() for c in v]
            self._idle.clear()
            self._idle_total = 0
        for conn in conns:
            conn.close()

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
        if self._closed:
            raise RuntimeError("the transport is closed")
        key = (host, port)
        if self._slots is not None and not self._slots.acquire(timeout=timeouts.get("pool")):
            raise httpx.PoolTimeout("no connection became free within the pool timeout")
        try:
            conn = self._take_idle(key) or _connect(host, port, timeouts.get("connect"))
            try:
                reply = _send_and_read(conn, head, body, timeouts, method)
                conn.closing = conn.closing or close
            except BaseException:
                conn.close()
                raise
            if not conn.closing:  # _read_body marks HTTP/1.0, 101 and Connection: close
                self._put_idle(key, conn)
            else:
                conn.close()
            return reply
        finally:
            if self._slots is not None:
                self._slots.release()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's entry: the request's head and body as they stand, through :meth:`exchange`."""
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"H1Transport speaks plain http://, not {request.url.scheme}://"
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
        body = frame_body(request.stream, chunked)  # type: ignore[arg-type]  # a sync stream
        reply = self.exchange(
            request.url.host,
            request.url.port or 80,
            head,
            body,
            request.extensions.get("timeout", {}),
            request.method,
            _wants_close(raw_headers),
        )
        return httpx.Response(
            reply.status_code,
            headers=reply.fields,
            stream=httpx.ByteStream(reply.body),
            extensions={"http_version": reply.http_version, "reason_phrase": reply.reason_phrase},
            request=request,
        )


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
        while True:
            status, reason, version, fields = conn.read_head()
            if status >= 200 or status == 101:
                break
        content = _read_body(conn, method, status, version, fields)
    except TimeoutError as exc:
        raise httpx.ReadTimeout(str(exc) or "timed out reading the response") from exc
    except _Closed:
        raise httpx.RemoteProtocolError(
            "Server disconnected without sending a complete response."
        ) from None
    except OSError as exc:
        raise httpx.ReadError(str(exc)) from exc
    return Reply(status, reason, version, fields, content)


def _read_body(
    conn: _Connection, method: str, status: int, version: bytes, fields: list[tuple[bytes, bytes]]
) -> bytes:
    """The answer's body, framing removed (RFC 9112 section 6.3)."""
    if version != b"HTTP/1.1" or status == 101 or _wants_close(fields):
        conn.closing = True
    if method == "HEAD" or status < 200 or status in _NO_BODY_STATUS:
        return b""
    encodings = _field(fields, b"transfer-encoding")
    if encodings:
        if b",".join(encodings).lower().split(b",")[-1].strip() != b"chunked":
            conn.closing = True
            return conn.read_to_end()
        return conn.read_chunked()
    lengths = _field(fields, b"content-length")
    if lengths:
        values = {v.strip() for length in lengths for v in length.split(b",")}
        if len(values) != 1 or not next(iter(values)).isdigit():
            raise httpx.RemoteProtocolError(f"malformed Content-Length {lengths!r}")
        return conn.read_exact(int(next(iter(values))))
    conn.closing = True
    return conn.read_to_end()


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
