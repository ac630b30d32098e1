"""One HTTP/1.1 request on a bitserve connection (``service.rest.http_protocol``), and the
contract between the connection and the ways a request is answered.

The contract: a :class:`Connection` (what the HTTP protocol offers a request) and a
:class:`Request` (what it asks of one), and a :class:`Lane` the protocol is given to take
some requests aside as their heads are parsed (``service.rest.express_lane``). Everything
else is an :class:`Exchange`.

:class:`Exchange` is the request's ``receive`` and ``send``: it hands the body to the
application as it arrives, writes ``100 Continue`` when the body is first asked for, and
frames the response. A response goes out in one write: its head is held until the first body
bytes (or the end of the response) and sent with them. Response header names and values are
checked (no CR, LF or other control characters: a header must not be able to forge another).
A connection lost before the response is complete tells the request's handler
(:func:`service.rest.disconnect.client_gone`): a request still queued for its batch is
dropped, never computed.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import httptools

from service.errors import ServiceError
from service.rest.disconnect import client_gone
from service.rest.errors import error_bytes

log = logging.getLogger("service.rest.http_protocol")

Message = MutableMapping[str, Any]
App = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
               Awaitable[None]]  # fmt: skip

# Header lines as they go out: a token name, ": ", a value without control characters (tab
# allowed), CRLF. Checked once over the whole block, with its count of CRLFs (a value holding
# one would add a line that matches too).
_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9a-z]+: [^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Bodies up to this size are joined to their head (one copy, one write); larger ones go out
# with it as two buffers of one writelines call.
_JOIN_BYTES = 64 << 10


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
Head = tuple[bytes, str, bytes, list[tuple[bytes, bytes]]]
"""A request's head as parsed: method, HTTP version, target and headers (names lowercased)."""


def header_lines(headers: Any) -> bytes:
    """``name: value`` lines (CRLF each) of ``(name, value)`` byte pairs."""
    return b"".join([b"%b: %b\r\n" % (k, v) for k, v in headers])


def frame_head(status: int, defaults: bytes, lines: bytes) -> bytes:
    """A response head: the status line, the server's header lines (``defaults``), the
    response's own ``lines`` and the blank line. Every answer of the connection is framed
    here (an :class:`Exchange`'s, the express lane's)."""
    return b"".join((STATUS_LINES.get(status) or _status_line(status), defaults, lines, b"\r\n"))


_METHODS = {m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH")}


def frame_answer(
    defaults: bytes, status: int, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool
) -> tuple[bytes, bool]:
    """A whole answer with its ``Content-Length`` as bytes, framed as an :class:`Exchange`
    frames it; and whether the connection stays open after it (not when ``keep_alive`` is
    False, which adds ``Connection: close``, nor when ``headers`` close it)."""
    closes = False
    lines = b""
    for k, v in headers:
        lines += b"%b: %b\r\n" % (k, v)  # as header_lines
        if k == b"connection" and b"close" in v.lower():
            closes = True
    if not (keep_alive or closes):
        lines += b"connection: close\r\n"
    status_line = STATUS_LINES.get(status) or _status_line(status)
    return b"".join((status_line, defaults, lines, b"\r\n", body)), keep_alive and not closes


def request_scope(
    conn: Connection,
    method: bytes,
    version: str,
    url: bytes,
    headers: list[tuple[bytes, bytes]],
) -> Message:
    """The ASGI scope of a request with this head on ``conn``."""
    if url[:1] == b"/" and b"?" not in url and b"#" not in url:
        raw_path, query = url, b""
    else:
        parsed = httptools.parse_url(url)
        raw_path, query = parsed.path, parsed.query or b""
    path = raw_path.decode("ascii")
    if "%" in path:
        path = urllib.parse.unquote(path)
    root_path = conn.root_path
    return {
        "type": "http",
        "asgi": conn.asgi,
        "http_version": version,
        "server": conn.server,
        "client": conn.client,
        "scheme": conn.scheme,
        "method": _METHODS.get(method) or method.decode("ascii"),
        "root_path": root_path,
        "path": root_path + path,
        "raw_path": root_path.encode("ascii") + raw_path,
        "query_string": query,
        "headers": headers,
        "state": conn.app_state.copy(),
    }


class Request(Protocol):
    """A request on a connection, as the connection sees it: an :class:`Exchange`, or a
    lane's request (``service.rest.express_lane``)."""

    complete: bool
    """Its response has been written whole (or nothing more will be)."""
    more_body: bool
    """Its body has not been received whole yet."""
    keep_alive: bool

    def add_body(self, data: bytes) -> int:
        """Body bytes received; returns the bytes now held for the application."""

    def body_done(self) -> None:
        """The whole body has been received."""

    def body_incomplete(self) -> None:
        """A read of the connection ended before the body did."""

    def start(self) -> None:
        """Its turn has come: the requests before it on the connection are answered."""

    def lost(self) -> None:
        """The client went away."""


class Cancellable(Protocol):
    """Work the server waits for on a graceful shutdown, then cancels (uvicorn's tasks)."""

    def cancel(self, msg: Any = None) -> bool: ...


class Connection(Protocol):
    """What an HTTP connection (``service.rest.http_protocol.HttpProtocol``) offers the
    requests on it."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    state: Any
    """uvicorn's server state (its tasks, connections, default headers, request count)."""
    app: App
    app_state: dict[str, Any]
    asgi: dict[str, str]
    server: tuple[str, int] | None
    client: tuple[str, int] | None
    scheme: str
    root_path: str
    reading: bool
    """Inside a read: the parser is at work (a request started now has its head's read)."""
    write_paused: bool

    def default_headers(self) -> bytes:
        """The header lines every response carries."""

    def respond(self, request: Request, data: bytes) -> None:
        """Write ``request``'s whole answer (head and body) and end its turn."""

    def response_done(self, request: Request) -> None:
        """``request``'s response is complete: the next one's turn."""

    def take_over(self, request: Request, head: Head, chunks: list[bytes]) -> None:
        """Hand ``request`` to the general way: an :class:`Exchange` with its ``head`` and
        its body so far (``chunks``) takes its place (and starts if its turn has come)."""

    def track(self, work: Cancellable) -> None:
        """Have the server's graceful shutdown wait for ``work`` (then cancel it); a task
        is let go when it is done, other work by :meth:`untrack`."""

    def untrack(self, work: Cancellable) -> None:
        """``work`` is over."""

    def body_taken(self, request: Request) -> None:
        """``request``'s application took its body bytes: reading may resume."""

    async def drain(self) -> None:
        """Wait until the transport takes writes again."""


class Lane(Protocol):
    """A way to answer some requests without an ASGI exchange, given to the HTTP protocol
    (``protocol_class(lane=...)``): it looks at each parsed head first."""

    def begin(self, conn: Connection, head: Head, keep_alive: bool) -> Request | None:
        """The lane's request for this head, or None: an :class:`Exchange` answers it."""


class Exchange:
    """One request and its response (the ASGI ``receive`` and ``send`` of ``scope``).

    Args:
        conn: the connection it came on.
        scope: its ASGI scope.
        keep_alive: the connection may serve another request after this one.
        expect_continue: the client sent ``Expect: 100-continue``.
    """

    __slots__ = (
        "body_given",
        "chunked",
        "chunks",
        "complete",
        "conn",
        "disconnected",
        "expect_continue",
        "head",
        "head_only",
        "keep_alive",
        "more_body",
        "remaining",
        "scope",
        "started",
        "waiter",
    )

    def __init__(
        self, conn: Connection, scope: Message, *, keep_alive: bool, expect_continue: bool
    ) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.chunks: list[bytes] = []
        """Body bytes received and not yet handed to the application."""
        self.more_body = True
        """The request's body has not been received whole yet."""
        self.body_given = False
        """The last body message has been handed to the application."""
        self.disconnected = False
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.complete = False
        self.head: bytes | None = None
        """The response head, held for the first body bytes."""
        self.head_only = scope["method"] == "HEAD"
        self.chunked = False
        self.remaining = 0
        """Body bytes the response's Content-Length still promises."""

    # --- the connection's side ------------------------------------------------------------

    def wake(self) -> None:
        """Wake a ``receive`` waiting for body bytes, the end of the response or the client."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def add_body(self, data: bytes) -> int:
        """Body bytes received; returns the bytes now held for the application."""
        self.chunks.append(data)
        self.wake()
        return sum(map(len, self.chunks)) if len(self.chunks) > 1 else len(data)

    def body_done(self) -> None:
        """The whole body has been received."""
        self.more_body = False
        self.wake()

    def lost(self) -> None:
        """The client went away: a ``receive`` waiting wakes to ``http.disconnect``, and the
        request's handler is told (:func:`service.rest.disconnect.client_gone`: a request
        still queued for its batch is dropped)."""
        self.disconnected = True
        self.wake()
        client_gone(self.scope)

    def body_incomplete(self) -> None:
        """Nothing to do: the application's body reader keeps its own time."""

    def start(self) -> None:
        """Run the application on this request in a task of its own."""
        conn = self.conn
        task = conn.loop.create_task(self.run(conn.app))
        conn.track(task)

    async def run(self, app: App) -> None:
        """Run the application on this request; a failure it leaves unanswered is a JSON 500."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:  # the task ends here either way: nothing awaits it
            log.error("exception in the ASGI application", exc_info=exc)
            self._abort("internal error")
        else:
            if not self.complete and not self.disconnected:
                log.error("the ASGI application returned without completing its response")
                self._abort("internal error: the response was not completed")

    def _abort(self, message: str) -> None:
        """A 500 if the response has not started, else cut the connection (the client sees a
        truncated response, never a wrong one); nothing once the response is complete (the
        connection may be serving the next request), nor once the request was dropped (its
        client gone, or an error on its connection answered in its place)."""
        if self.complete or self.disconnected:
            return
        transport = self.conn.transport
        if not self.started and not transport.is_closing():
            self.started = self.complete = True
            transport.write(error_bytes(ServiceError(message)))
        transport.close()
        self.complete = True

    # --- ASGI -----------------------------------------------------------------------------

    async def receive(self) -> Message:
        """The next body message, or ``http.disconnect`` once the client has gone (or the
        response is complete)."""
        if self.expect_continue:
            self.expect_continue = False
            if not self.started and not self.conn.transport.is_closing():
                self.conn.transport.write(_CONTINUE)
        while not (self.disconnected or self.complete):
            if self.chunks or (not self.more_body and not self.body_given):
                chunks = self.chunks
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self.chunks = []
                self.body_given = not self.more_body
                self.conn.body_taken(self)
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            self.conn.body_taken(self)  # wants more: reading may resume
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        """Frame and write the response; raises RuntimeError on an ASGI protocol violation."""
        conn = self.conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            self.head = self._head(message["status"], message.get("headers", ()))
            self.started = True
            self.expect_continue = False
            return
        if self.complete:
            raise RuntimeError(f"{kind!r} sent after the response was complete")
        if kind != "http.response.body":
            raise RuntimeError(f"expected 'http.response.body', got {kind!r}")
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self.head_only:
            body = b""
        elif self.chunked:
            body = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                body += b"0\r\n\r\n"
        else:
            self.remaining -= len(body)
            if self.remaining < 0:
                raise RuntimeError("response body longer than its Content-Length")
        head = self.head
        if head is not None:
            self.head = None
            if len(body) <= _JOIN_BYTES:
                conn.transport.write(head + body)
            else:
                conn.transport.writelines([head, body])
        elif body:
            conn.transport.write(body)
        if not more:
            if self.remaining and not self.head_only:
                raise RuntimeError("response body shorter than its Content-Length")
            self.complete = True
            self.wake()
            conn.response_done(self)

    def _head(self, status: int, headers: Any) -> bytes:
        defaults = self.conn.default_headers()
        length: int | None = None
        close = False
        own = []
        for name, value in headers:
            name = name.lower()
            if name == b"content-length":
                if length is None:
                    if not value.isdigit():
                        raise RuntimeError(f"malformed response Content-Length {value!r}")
                    length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = value.lower() == b"chunked" and length is None
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                close = True
            own.append((name, value))
        lines = header_lines(own)
        count = len(self.conn.state.default_headers) + len(own)  # for the check below
        if not self.keep_alive and not close:
            lines += b"connection: close\r\n"
            count += 1
        if length is not None:
            self.remaining = length
            self.chunked = False
        elif not self.chunked and not self.head_only and status not in (204, 304):
            self.chunked = True
            lines += b"transfer-encoding: chunked\r\n"
            count += 1
        block = defaults + lines
        if block.count(b"\r\n") != count or _HEADER_LINES.fullmatch(block) is None:
            raise RuntimeError("invalid response header name or value")
        return frame_head(status, defaults, lines)
