"""uvicorn's httptools protocol with the limits a server facing untrusted clients needs.

uvicorn parses HTTP/1.1 with httptools (llhttp, C) on uvloop: several times cheaper per request
than h11. On top of it, :class:`BitserveHttpProtocol` adds what uvicorn leaves out:

- **A head-read timeout.** A request head (request line and headers) must arrive whole within
  ``head_timeout_s`` of its first byte, or of the connection's opening; otherwise the client
  gets a 408 and the connection is closed. uvicorn's keep-alive timer is cancelled by any byte,
  so a client trickling a head one byte at a time would otherwise hold its connection forever.
- **A bound on the head's size.** A head larger than ``max_header_bytes`` is answered 431 and
  the connection closed, whether it arrives in one read or many.
- **A connection cap.** Beyond ``max_connections`` open connections, a new one first evicts
  the connection that has been waiting longest for a request head (a slow client, or an idle
  keep-alive one); only when every connection is busy is the new one answered 503 and
  closed.
- **JSON errors.** Malformed HTTP is answered ``{"error": ...}`` (uvicorn writes plain text).
- **One write per response.** uvicorn writes a response's head and its body separately: two
  system calls (and on loopback two wake-ups of the client) where one does. The head is held
  until the body's first write, or the end of the response (:class:`_HeldHead`).

The limits are class attributes, set once per server by :func:`protocol_class`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.protocol.response import error_body

log = logging.getLogger(__name__)


def _error_bytes(status: int, message: str) -> bytes:
    body = error_body(message)
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
    )


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


class BitserveHttpProtocol(HttpToolsProtocol):
    """One HTTP/1.1 connection (see the module docstring for what is added to uvicorn's)."""

    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 << 10
    max_connections: int = 0  # 0: no cap

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._in_head = False
        self._responses: deque[_HeldHead] = deque()
        self._head_size = 0

    # --- connections waiting for a head, oldest first (one registry per server) -----------

    def _waiting(self) -> OrderedDict[BitserveHttpProtocol, None]:
        state = self.server_state
        waiting: OrderedDict[BitserveHttpProtocol, None] | None = getattr(
            state, "bitserve_waiting", None
        )
        if waiting is None:
            waiting = OrderedDict()
            state.bitserve_waiting = waiting  # type: ignore[attr-defined]
        return waiting

    def _start_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._idle()
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _idle(self) -> None:
        """Join the connections waiting for a request head, as the newest."""
        waiting = self._waiting()
        waiting.pop(self, None)
        waiting[self] = None

    def _end_head(self) -> None:
        self._in_head = False
        self._waiting().pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, message: str) -> None:
        self._end_head()
        if not self.transport.is_closing():
            self.transport.write(_error_bytes(status, message))
            self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head:
            self._refuse(408, f"the request head did not arrive within {self.head_timeout_s:g} s")

    # --- uvicorn's protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.max_connections
        if cap and len(self.connections) > cap:
            waiting = self._waiting()
            if waiting:
                oldest = next(iter(waiting))
                log.warning("connection cap %d reached: closing one waiting for its head", cap)
                oldest._refuse(408, "closed to admit another connection: request head too slow")
            else:
                self.transport.write(
                    _error_bytes(503, f"too many connections (max_connections {cap})")
                )
                self.transport.close()
                return
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # refused (or closing): what else arrives is not parsed
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes:
            self._refuse(
                431, f"request head of more than {self.max_head_bytes} bytes (max_header_bytes)"
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:
            self._start_head()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4  # as sent: "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        size, self._head_size = self._head_size, 0
        if size > self.max_head_bytes:  # a whole head in one read, past the bound
            self._refuse(
                431, f"request head of {size} bytes (max_header_bytes {self.max_head_bytes})"
            )
            return
        self._end_head()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.transport is self.transport:
            held = _HeldHead(self.transport)
            self.cycle.transport = held  # type: ignore[assignment]
            self._responses.append(held)  # answered in order, pipelined or not

    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing():  # a refused head's body is not kept
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self.transport.is_closing():
            super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._responses:
            # A response without body bytes (to HEAD) has written only its head so far.
            self._responses.popleft().flush()
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is not None and not self._in_head:
            self._idle()  # an idle keep-alive connection is evicted first, like a slow head

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"malformed HTTP request: {msg}")


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
