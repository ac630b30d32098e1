"""bitserve's HTTP/1.1 connection: httptools' parser (llhttp, C) under our own rules.

uvicorn hosts it as a protocol class (``uvicorn.Config(http=protocol_class(...))``, the
documented way to give uvicorn a protocol), and bitserve uses only what that contract and
uvicorn's public attributes give: uvicorn calls the class with ``config``, ``server_state``,
``app_state`` and ``_loop`` for each connection; a connection is in
``server_state.connections`` while open and stops on ``shutdown()``; its requests' tasks are
in ``server_state.tasks`` (uvicorn waits for them, then cancels them, on a graceful shutdown);
``server_state.total_requests`` counts the responses; ``server_state.default_headers`` are
the headers every response carries. Nothing here subclasses uvicorn or reads its private
state; CI runs the tests at both ends of the uvicorn range that ``pyproject.toml`` pins.
There is no WebSocket: an upgrade request is answered as plain HTTP and its connection closed.

What a connection owns beyond parsing (``docs/http.md`` says it for users):

- **A head-read timeout**: a head must arrive whole within ``head_timeout_s`` of the
  connection's opening, or of its first byte after an answer; else a 408 if part of one came
  (silence otherwise). The same clock bounds the skipped rest of a body answered early.
- **Bounds on the head**: more than ``max_head_bytes`` (target and header lines as sent,
  counted as they arrive) or ``max_headers`` lines is a 431.
- **A keep-alive timeout**: idle ``Config.timeout_keep_alive`` seconds after an answer, the
  connection closes without a word (an unsolicited 408 could be read as an answer).
- **A connection cap**: beyond ``max_connections``, a new connection evicts the one idle
  longest with nothing received (never answered and open over ``_FRESH_GRACE_S``, else
  answered before) with a 503 and Retry-After (a request on its way reads it as its answer);
  one whose socket holds unread bytes, or with a head, a request or a body under way, is
  never evicted. With none idle, the newcomer gets the 503.
- **JSON errors**: malformed HTTP is a 400 naming the parser's reason; so are two ``Host``
  or two ``Authorization`` headers; a chunk declared larger than ``max_body_bytes`` is a 413
  as its size line arrives (:mod:`service.rest.chunks`).
- **One write per response** (:class:`~service.rest.http_cycle.Exchange`).
- **Pipelining**: answers go in request order; reading pauses while a request waits its
  turn, or holds 64 KiB of body its application has not taken. An error that ends the
  connection (400, 408, 413, 431) is answered after every request received whole before it,
  then the connection closes; a request whose body the error cut is dropped.
- **A lingering close**: after its last answer a connection is half-closed and what the
  client still sends is dropped, until it closes or ``_LINGER_S`` passes (a close with
  unread bytes sends a reset, which can destroy the answer before the client reads it).

The limits are class attributes, set once per server by :func:`protocol_class`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

import httptools

from service.errors import (
    InvalidInput,
    Overloaded,
    ServiceError,
)
from service.rest.chunks import ChunkWatch
from service.rest.errors import error_bytes
from service.rest.http_cycle import (
    App,
    Cancellable,
    Exchange,
    Head,
    Lane,
    Request,
    request_scope,
)
from service.rest.http_head import HeadReader
from service.rest.sockets import IdleConnections
from service.text import safe_text

log = logging.getLogger(__name__)

_HIGH_WATER = 64 << 10
"""Body bytes held for an application that has not taken them, above which reading pauses."""
_LINGER_S = 2.0
"""The longest a connection closed after an answer reads what its client still sends."""
_REFUSALS_LINGERING = 16
"""Connections refused at the cap that may linger at once (beyond the cap); more are
answered and closed at once."""
_FRESH_GRACE_S = 1.0
"""A connection accepted this recently, with nothing received yet, is not evicted: its
request may be on the way."""


class HttpProtocol(HeadReader):
    """One HTTP/1.1 connection (see the module docstring); uvicorn makes one per connection.

    Args:
        config: the uvicorn ``Config`` (its app, ``root_path``, ``timeout_keep_alive``).
        server_state: the uvicorn server's shared state (see the module docstring).
        app_state: the lifespan's state, copied into each request's scope.
    """

    max_connections: int = 0  # 0: no cap
    max_body_bytes: int = 0  # 0: chunk sizes are not checked
    idle: IdleConnections[HttpProtocol] = IdleConnections(log)  # protocol_class makes one
    given_lane: Lane | None = None  # protocol_class's

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app: App = config.loaded_app
        self.lane: Lane | None = None if config.root_path else self.given_lane
        """The lane that looks at each head first (``service.rest.express_lane``), unless a
        ``root_path`` moves the paths it knows."""
        self.loop = _loop or asyncio.get_event_loop()
        self.state = server_state
        self.app_state = app_state
        self.root_path: str = config.root_path
        self.keep_alive_s: float = config.timeout_keep_alive
        self.asgi = {"version": config.asgi_version, "spec_version": "2.3"}
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            # Answer a request even when the client sent more after a "Connection: close".
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.active: Request | None = None
        """The request being answered."""
        self.queued: deque[Request] = deque()
        """Pipelined requests waiting for ``active``'s response, oldest first."""
        self.parsing: Request | None = None
        """The newest request, whose body the parser is reading."""
        self.reading = False
        """Inside ``data_received``: the parser is at work."""
        self.stopping = False
        self.fatal: ServiceError | None = None
        """An error that ends the connection, answered after the requests ahead of it."""
        self.lingering = False
        """Answered for the last time: half-closed, dropping what the client still sends."""
        self.opened_at = 0.0
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._default_src: object = None
        self._default_block = b""
        self._chunks: ChunkWatch | None = None
        self._init_head()
        self._linger_timer: asyncio.TimerHandle | None = None

    # --- the transport's callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream's: uvloop's or asyncio's
        self.state.connections.add(self)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        self.opened_at = now = self.loop.time()
        cap = self.max_connections
        if cap and len(self.state.connections) > cap:
            idle = self.idle.evictable(opened_before=now - _FRESH_GRACE_S)
            if idle is None:
                self.idle.refused(cap)
                error = Overloaded(f"too many connections (max_connections {cap}); retry later")
                if len(self.state.connections) > cap + _REFUSALS_LINGERING:
                    # Refusals linger too (their 503 must not be lost to a reset), but only
                    # this many at once: past them the 503 is written and the socket closed
                    # at once, so that a flood of connections cannot hold more sockets than
                    # the cap and this allowance.
                    self.transport.write(error_bytes(error))
                    self.transport.close()
                    return
                self._close(error)
                return
            self.idle.evicted(cap)
            # Nothing received, but a request may be on its way: it reads this 503 as its
            # answer (it was not served), never a close without a byte.
            idle._close(Overloaded(f"closed to admit another connection (max_connections {cap})"))
        self.idle.add(self, served=False)
        self._wait_for_head(clock=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        self._stop_waiting()
        self._cancel_idle()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        for exchange in (self.active, *self.queued, self.parsing):
            if exchange is not None and not exchange.complete:
                exchange.lost()
        self.queued.clear()
        self.resume_writing()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing() or self.fatal is not None or self.lingering:
            return  # refused, failed, answered for the last time: what else comes is dropped
        self._cancel_idle()
        self._began_in_this_read = False
        self.reading = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            log.debug("upgrade request answered as plain HTTP")  # its connection then closes
            return
        except httptools.HttpParserError as e:
            cause = e.__context__
            if isinstance(cause, ServiceError):  # raised by a callback of ours
                self._fail(cause)
                return
            reason = cause if isinstance(cause, httptools.HttpParserError) else e
            text = safe_text(str(reason) or type(reason).__name__, 200)
            log.info("malformed HTTP request: %s", text)
            self._fail(InvalidInput(f"malformed HTTP request: {text}"))
            return
        finally:
            self.reading = False
        refusal = (
            None if self._chunks is None else self._chunks.too_large(data, self.max_body_bytes)
        )
        if refusal is not None:
            self._fail(refusal)
            return
        parsing = self.parsing
        if parsing is not None and parsing.more_body:
            parsing.body_incomplete()
        if self._head_begun:  # a head unfinished at the end of this read
            self._count_partial(len(data))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def drain(self) -> None:
        """Wait until the transport takes writes again (or the connection is lost)."""
        if self._drained is None:
            self._drained = self.loop.create_future()
        await asyncio.shield(self._drained)

    # --- the parser's callbacks (the head's: ``HeadReader``) ------------------------------

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        parser = self.parser
        method = parser.get_method()
        version = parser.get_http_version()
        keep_alive = version != "1.0" and parser.should_keep_alive() and not parser.should_upgrade()
        request: Request | None = None
        url, headers = self._url, self._headers
        if self.lane is not None and not self._expect:
            request = self.lane.begin(self, (method, version, url, headers), keep_alive)
        if request is None:
            scope = request_scope(self, method, version, url, headers)
            request = Exchange(self, scope, keep_alive=keep_alive, expect_continue=self._expect)
        self.parsing = request
        if self._chunked and self.max_body_bytes:
            self._chunks = ChunkWatch()
        if self.active is None:
            self._start(request)
        else:
            self.queued.append(request)  # answered in order
            self._pause_reading()

    def take_over(self, request: Request, head: Head, chunks: list[bytes]) -> None:
        """A lane's request handed to the general way (``http_cycle.Connection``)."""
        method, version, url, headers = head
        scope = request_scope(self, method, version, url, headers)
        exchange = Exchange(self, scope, keep_alive=request.keep_alive, expect_continue=False)
        exchange.chunks = chunks
        exchange.more_body = request.more_body
        if self.parsing is request:
            self.parsing = exchange
        if self.active is request:
            self.active = exchange
            exchange.start()
        else:
            self.queued = deque(exchange if r is request else r for r in self.queued)

    def respond(self, request: Request, data: bytes) -> None:
        """Write a lane's whole answer and end its turn (``http_cycle.Connection``)."""
        self.transport.write(data)
        self.response_done(request)

    def track(self, work: Cancellable) -> None:
        self.state.tasks.add(work)
        if isinstance(work, asyncio.Future):
            work.add_done_callback(self.state.tasks.discard)

    def untrack(self, work: Cancellable) -> None:
        self.state.tasks.discard(work)

    def on_body(self, body: bytes) -> None:
        if self._chunks is not None:
            self._chunks.body(len(body))
        exchange = self.parsing
        if exchange is None or exchange.complete or self.transport.is_closing():
            return  # the rest of a body answered early (or refused) is skipped
        if exchange.add_body(body) > _HIGH_WATER:
            self._pause_reading()

    def on_message_complete(self) -> None:
        self._chunks = None
        exchange = self.parsing
        if exchange is not None:
            exchange.body_done()

    def on_chunk_header(self) -> None:
        if self._chunks is not None:
            self._chunks.header()

    def on_chunk_complete(self) -> None:
        if self._chunks is not None:
            self._chunks.complete()

    # --- requests -------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self.active = request
        request.start()

    def body_taken(self, exchange: Request) -> None:
        """``exchange``'s application took its body bytes: reading may resume."""
        if self._reading_paused and exchange is self.parsing and not self.queued:
            self._reading_paused = False
            self.transport.resume_reading()

    def response_done(self, exchange: Request) -> None:
        """``exchange``'s response is complete (called by the exchange)."""
        self.state.total_requests += 1
        if exchange is self.parsing and not exchange.more_body:
            self.parsing = None
        if self.stopping:
            self.transport.close()  # the server is going: its loop may end before a linger
        elif not exchange.keep_alive:
            self._linger()
        if self.transport.is_closing() or self.lingering:
            self.active = None
            return
        if self.queued:
            self._start(self.queued.popleft())
            if not self.queued and self._reading_paused:
                self._reading_paused = False
                self.transport.resume_reading()
            return
        self.active = None
        if self.fatal is not None:
            self._close(self.fatal)  # every request ahead of it is answered
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._waiting_for_head:
            return  # a pipelined head has begun: its clock runs
        if self.parsing is not None:
            # The body of a request answered early is still arriving, to be skipped: that
            # takes the head's clock from now.
            self._wait_for_head(clock=True)
        else:
            # Idle. The next head's clock starts at its first byte; the keep-alive timeout
            # covers the silence before it.
            self.idle.add(self, served=True)
            self._wait_for_head(clock=False)
            self._idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_timed_out)

    def shutdown(self) -> None:
        """Stop after the request being answered (uvicorn calls this on a graceful shutdown)."""
        self.stopping = True
        if self.active is None and not self.lingering:
            self._close()

    def default_headers(self) -> bytes:
        """The header lines every response carries (uvicorn renews its list every second)."""
        src = self.state.default_headers
        if src is not self._default_src:
            self._default_src = src
            self._default_block = b"".join(b"%b: %b\r\n" % (k, v) for k, v in src)
        return self._default_block

    # --- closing --------------------------------------------------------------------------

    def _close(self, error: ServiceError | None = None) -> None:
        """Close the connection: silently, or after answering ``error`` (then lingering)."""
        self._stop_waiting()
        self._cancel_idle()
        if self.transport.is_closing() or self.lingering:
            return
        if error is None:
            self.transport.close()
            return
        self.transport.write(error_bytes(error))
        self._linger()

    def _fail(self, error: ServiceError) -> None:
        """An error that ends the connection (400, 408, 413, 431): answered after the
        requests received whole before it, in order; a request whose body it cut is dropped
        (``error`` is its answer)."""
        self._stop_waiting()
        self._cancel_idle()
        if self.fatal is not None or self.lingering or self.transport.is_closing():
            return
        self.fatal = error
        cut, self.parsing, self._chunks = self.parsing, None, None
        if cut is not None and cut.more_body and not cut.complete:
            if cut is self.active:
                if isinstance(cut, Exchange) and cut.started and cut.head is None:
                    self.transport.close()  # part of its answer is out: cut, never followed
                    return
                self.active = None
            else:
                self.queued = deque(r for r in self.queued if r is not cut)
            cut.lost()
        if self.active is None:
            self._close(error)

    def _linger(self) -> None:
        """Half-close after the last answer (see the module docstring)."""
        transport = self.transport
        if transport.is_closing() or self.lingering:
            return
        self._stop_waiting()
        self._cancel_idle()
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        self.lingering = True
        transport.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        self._linger_timer = self.loop.call_later(_LINGER_S, transport.close)

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.transport.is_closing():
            self._reading_paused = True
            self.transport.pause_reading()


def _address(value: object) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


def protocol_class(
    *,
    head_timeout_s: float,
    max_header_bytes: int,
    max_connections: int,
    max_headers: int = 100,
    max_body_bytes: int = 0,
    lane: Lane | None = None,
) -> type[HttpProtocol]:
    """A protocol class for one server, with its limits (uvicorn's ``Config(http=...)``) and
    the lane that looks at each request head first (``service.rest.express_lane``)."""
    return type(
        "HttpProtocol",
        (HttpProtocol,),
        {
            "head_timeout_s": head_timeout_s,
            "max_head_bytes": max_header_bytes,
            "max_headers": max_headers,
            "max_connections": max_connections,
            "max_body_bytes": max_body_bytes,
            "idle": IdleConnections(log),
            "given_lane": lane,
        },
    )
