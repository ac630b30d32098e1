"""The request head on a bitserve HTTP connection (``service.rest.http_protocol``): its parse
(the parser's head callbacks), its bounds (bytes as sent, header lines, one ``Host`` and one
``Authorization``) and its clocks (the head-read timeout, the keep-alive timeout). The
module docstring of ``http_protocol`` says what each limit promises.
"""

from __future__ import annotations

import asyncio
from typing import Any

from service.errors import HeaderLimit, InvalidInput, RequestTimeout, ServiceError
from service.rest.sockets import IdleConnections, unread_bytes

_SINGLE = {b"host": "Host", b"authorization": "Authorization"}
"""Request headers a request may have once (RFC 9112 for Host; for Authorization, one rule
on every route instead of the first on some and the last on others)."""


class HeadReader(asyncio.Protocol):
    """The head half of :class:`service.rest.http_protocol.HttpProtocol` (its base)."""

    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 << 10
    max_headers: int = 100
    idle: IdleConnections[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    active: Any
    lingering: bool
    keep_alive_s: float

    def _init_head(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect = False
        self._chunked = False
        self._head_bytes = 0
        self._partial_bytes = 0
        self._began_in_this_read = False
        self._head_begun = False
        self._waiting_for_head = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    def _fail(self, error: ServiceError) -> None:
        raise NotImplementedError  # the connection's: an error that ends it

    def _close(self, error: ServiceError | None = None) -> None:
        raise NotImplementedError  # the connection's

    def _count_partial(self, nbytes: int) -> None:
        """A read of ``nbytes`` was parsed."""
        if self._head_begun:
            # The parser keeps an unfinished header line to itself: its bytes are counted as
            # they come (from the read after the head began: the part of that read which
            # belonged to the previous request is not known).
            if not self._began_in_this_read:
                self._partial_bytes += nbytes
            if self._partial_bytes > self.max_head_bytes:
                self._fail(HeaderLimit(self._too_large()))

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect = self._chunked = False
        self._head_begun = True
        self.idle.remove(self)
        self._began_in_this_read = True
        self._head_bytes = self._partial_bytes = 0
        if self._waiting_for_head:
            self._start_clock()
        else:
            self._wait_for_head(clock=True)  # a pipelined head: its clock starts now

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # as sent: "name: value\r\n"
        headers = self._headers
        if len(headers) >= self.max_headers:
            raise HeaderLimit(f"too many request headers (limit {self.max_headers})")
        name = name.lower()
        if name in _SINGLE and any(k == name for k, _ in headers):
            raise InvalidInput(f"malformed HTTP request: more than one {_SINGLE[name]} header")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect = True
        elif name == b"transfer-encoding":
            self._chunked = True  # the parser refuses any coding but a final "chunked"
        headers.append((name, value))

    def _wait_for_head(self, *, clock: bool) -> None:
        """Wait for a head; ``clock``: start the head's clock now (else it starts at the
        head's first byte)."""
        self._waiting_for_head = True
        if clock:
            self._start_clock()

    def _start_clock(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_waiting(self) -> None:
        self._waiting_for_head = False
        self._head_begun = False
        self.idle.remove(self)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._waiting_for_head:
            return
        if self._head_begun:
            timeout = self.head_timeout_s
            self._fail(RequestTimeout(f"the request head did not arrive within {timeout:g} s"))
        else:
            self._close()

    def _idle_timed_out(self) -> None:
        self._idle_timer = None
        if self.active is not None or self._head_begun or self.lingering:
            return
        if unread_bytes(self.transport):
            # A request arrived as the timer fired (the loop runs due timers before it reads
            # the sockets): closing now would reset it. Its bytes are read next.
            self._idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_timed_out)
            return
        self._close()

    def _count_head(self, nbytes: int) -> None:
        self._head_bytes += nbytes
        if self._head_bytes > self.max_head_bytes:
            raise HeaderLimit(self._too_large())

    def _too_large(self) -> str:
        return f"request head of more than {self.max_head_bytes} bytes (max_header_bytes)"
