"""uvicorn's httptools protocol with the limits a server facing untrusted clients needs.

uvicorn parses HTTP/1.1 with httptools (llhttp, C) on uvloop: several times cheaper per request
than h11. On top of it, :class:`BitserveHttpProtocol` adds what uvicorn leaves out:

- **A head-read timeout.** A request head (request line and headers) must arrive whole within
  ``head_timeout_s`` of the connection's opening or of the previous response; otherwise the
  connection is closed, with a 408 when part of a head had come. uvicorn's keep-alive timer
  is cancelled by any byte, so a client trickling a head one byte at a time would otherwise
  hold its connection forever. The same clock bounds the unread rest of a body that was
  answered early (a 404, a 503 from the headers): its bytes are skipped as they come, for
  ``head_timeout_s`` at most.
- **A bound on the head's size.** A head larger than ``max_header_bytes`` (request target
  and header lines, as sent) is answered 431 and the connection closed, whether it arrives in one
  read or many: the parser's callbacks count each part as it completes, and the bytes of a
  head not yet complete are counted as they arrive.
- **A connection cap.** Beyond ``max_connections`` open connections, a new one first evicts
  the connection that has been waiting longest for a request head among those never
  answered (a slow client), else among those answered before (an idle keep-alive client,
  or one whose early-answered body is being skipped); only when every connection is busy
  with a request is the new one answered 503 and closed.
- **JSON errors.** Malformed HTTP is answered ``{"error": ...}`` naming the parser's reason
  (uvicorn writes a fixed plain-text line).
- **Requests dropped when their client goes away.** A connection lost before its request's
  response is complete tells the request's handler (:func:`service.rest.disconnect.client_gone`):
  a request still queued for its batch is dropped, never computed.
- **One write per response.** uvicorn writes a response's head and its body separately: two
  system calls (and on loopback two wake-ups of the client) where one does. The head is held
  until the body's first write, or the end of the response (:class:`_HeldHead`).

A connection closed while it had sent no byte of a request head (idle keep-alive, or never
used) is closed without an answer, as uvicorn's keep-alive timeout does: an unsolicited 408
could be read as the answer to a request the client is sending at that moment.

The limits are class attributes, set once per server by :func:`protocol_class`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import HeaderLimit, InvalidInput, Overloaded, RequestTimeout, ServiceError
from service.observability import Tally
from service.rest.disconnect import client_gone
from service.rest.errors import error_bytes
from service.text import safe_text

log = logging.getLogger(__name__)


class _HeldHead:
    """A connection's transport for one request's response: holds the head (the first write,
    unless it is an interim ``100 Continue``) and sends it with the next write, or on
    :meth:`flush` and :meth:`close`. Everything else goes to the real transport."""

    __slots__ = ("_head", "_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._held = False

    def write(self, data: bytes) -> None:
        if not self._held and not data.startswith(b"HTTP/1.1 100 "):
            self._held = True
            self._head = data
            return
        if self._head is not None:
            data, self._head = self._head + data, None
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HeadTooLarge(Exception):
    """Raised in a parser callback to stop parsing a head past ``max_header_bytes``."""


class _Waiting:
    """One server's connections waiting for a request head, oldest first, in two classes:
    those that were never answered (slowloris holds only these) and those that were (a
    keep-alive client between requests). The first are evicted first; evictions are counted
    and logged at most every 10 s."""

    def __init__(self) -> None:
        self.fresh: OrderedDict[BitserveHttpProtocol, None] = OrderedDict()
        self.served: OrderedDict[BitserveHttpProtocol, None] = OrderedDict()
        self.evicted = Tally(
            log,
            logging.WARNING,
            "connection cap %d reached: closed connection(s) waiting for a head",
        )

    def add(self, conn: BitserveHttpProtocol, *, served: bool) -> None:
        """Add ``conn`` as the newest of its class."""
        self.remove(conn)
        (self.served if served else self.fresh)[conn] = None

    def remove(self, conn: BitserveHttpProtocol) -> None:
        self.fresh.pop(conn, None)
        self.served.pop(conn, None)

    def oldest(self) -> BitserveHttpProtocol | None:
        """The connection to evict first, if any."""
        for group in (self.fresh, self.served):
            if group:
                return next(iter(group))
        return None


class BitserveHttpProtocol(HttpToolsProtocol):
    """One HTTP/1.1 connection (see the module docstring for what is added to uvicorn's)."""

    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 << 10
    max_connections: int = 0  # 0: no cap

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_for_head = False
        """Between requests (evictable): no request head has completed since the last one."""
        self._head_begun = False
        """Part of a request head has been parsed, not all of it."""
        self._head_bytes = 0
        """Bytes of the current head's completed parts (request line, header lines)."""
        self._partial_bytes = 0
        """Bytes received for the current head after the read in which it began."""
        self._began_in_this_read = False
        self._message_done = True
        """The current request's body has been received whole."""
        self._served = False
        """A response has been sent on this connection."""
        self._responses: deque[_HeldHead] = deque()

    # --- connections waiting for a head (one registry per server) --------------------------

    def _registry(self) -> _Waiting:
        state = self.server_state
        registry: _Waiting | None = getattr(state, "bitserve_waiting", None)
        if registry is None:
            registry = _Waiting()
            state.bitserve_waiting = registry  # type: ignore[attr-defined]
        return registry

    def _wait_for_head(self, *, clock: bool) -> None:
        """Join the connections waiting for a head, as the newest; ``clock``: start the
        head's clock now (else it starts at the head's first byte)."""
        self._waiting_for_head = True
        self._registry().add(self, served=self._served)
        if clock:
            self._start_clock()

    def _start_clock(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_waiting(self) -> None:
        self._waiting_for_head = False
        self._head_begun = False
        self._registry().remove(self)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _close(self, error: ServiceError | None = None) -> None:
        """Close the connection, after answering ``error`` when one is given."""
        self._stop_waiting()
        if not self.transport.is_closing():
            if error is not None:
                self.transport.write(error_bytes(error))
            self.transport.close()

    def _close_waiting(self, message: str) -> None:
        """Close a connection waiting for a head: 408 if part of one came, else silently."""
        self._close(RequestTimeout(message) if self._head_begun else None)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head:
            self._close_waiting(f"the request head did not arrive within {self.head_timeout_s:g} s")

    def _count_head(self, nbytes: int) -> None:
        self._head_bytes += nbytes
        if self._head_bytes > self.max_head_bytes:
            raise _HeadTooLarge

    def _head_too_large(self) -> None:
        self._close(
            HeaderLimit(f"request head of more than {self.max_head_bytes} bytes (max_header_bytes)")
        )

    # --- uvicorn's protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.max_connections
        if cap and len(self.connections) > cap:
            registry = self._registry()
            oldest = registry.oldest()
            if oldest is not None:
                registry.evicted(cap)
                oldest._close_waiting("closed to admit another connection: request head too slow")
            else:
                self.transport.write(
                    error_bytes(Overloaded(f"too many connections (max_connections {cap})"))
                )
                self.transport.close()
                return
        self._wait_for_head(clock=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            client_gone(cast("dict[str, Any]", cycle.scope))  # uvicorn types it a TypedDict

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received, answering malformed HTTP in JSON with the parser's reason.
        if self.transport.is_closing():
            return  # refused (or closing): what else arrives is not parsed
        self._began_in_this_read = False
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No upgrade is served (no WebSocket routes): the request was answered as plain
            # HTTP. uvicorn would log two warnings per such request, which anyone could flood.
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                log.debug("upgrade request answered as plain HTTP")
            return
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _HeadTooLarge):
                self._head_too_large()
                return
            reason = e.__context__ if isinstance(e.__context__, httptools.HttpParserError) else e
            text = safe_text(str(reason) or type(reason).__name__, 200)
            log.info("malformed HTTP request: %s", text)
            self._close(InvalidInput(f"malformed HTTP request: {text}"))
            return
        if self._head_begun:
            # The parser keeps an unfinished header line to itself: its bytes are counted as
            # they come (from the read after the head began: the part of that read which
            # belonged to the previous request is not known).
            if not self._began_in_this_read:
                self._partial_bytes += len(data)
            if self._partial_bytes > self.max_head_bytes:
                self._head_too_large()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._message_done = False
        self._head_begun = True
        self._began_in_this_read = True
        self._head_bytes = self._partial_bytes = 0
        if self._waiting_for_head:
            self._start_clock()
        else:
            self._wait_for_head(clock=True)  # a pipelined head: its clock starts now

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # as sent: "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.transport is self.transport:
            held = _HeldHead(self.transport)
            self.cycle.transport = held  # type: ignore[assignment]
            self._responses.append(held)  # answered in order, pipelined or not

    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing():  # a refused head's body is not kept
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._message_done = True
        if not self.transport.is_closing():
            super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._responses:
            # A response without body bytes (to HEAD) has written only its head so far.
            self._responses.popleft().flush()
        super().on_response_complete()
        self._served = True
        if self.transport.is_closing() or self._waiting_for_head:
            return
        if self.cycle is not None and self.cycle.response_complete:
            # Idle, no pipelined request left. The next head's clock starts at its first byte
            # (uvicorn's keep-alive timeout covers the silence before it), unless the body of
            # a request answered early is still arriving, to be skipped: that takes the
            # head's clock from now (any byte resets the keep-alive timer).
            self._wait_for_head(clock=not self._message_done)

    def send_400_response(self, msg: str) -> None:
        self._close(InvalidInput(f"malformed HTTP request: {msg}"))


def max_connections(wanted: int) -> int:
    """``wanted``, lowered to leave file descriptors for files, pipes and the models' threads
    under the process's ``RLIMIT_NOFILE`` (a cap above it would fail in ``accept`` instead)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    fit = max(16, soft - 64)
    if fit < wanted:
        log.warning(
            "max_connections %d lowered to %d to fit the file-descriptor limit %d",
            wanted,
            fit,
            soft,
        )
    return min(wanted, fit)


def protocol_class(
    *, head_timeout_s: float, max_header_bytes: int, max_connections: int
) -> type[BitserveHttpProtocol]:
    """A protocol class for one server, with its limits (uvicorn's ``Config(http=...)``)."""
    return type(
        "BitserveHttpProtocol",
        (BitserveHttpProtocol,),
        {
            "head_timeout_s": head_timeout_s,
            "max_head_bytes": max_header_bytes,
            "max_connections": max_connections,
        },
    )
