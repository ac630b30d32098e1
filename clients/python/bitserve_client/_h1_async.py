"""The lean HTTP/1.1 transport for asyncio: :class:`AsyncH1Transport`.

What :class:`~._h1.H1Transport` is to :class:`~._client.Client`, this is to
:class:`~._async_client.AsyncClient`: the same requests (a head the client built as httpx
would, the body's pieces), the same reading of the answer (:func:`~._h1.read_answer`, here on
the bytes an asyncio protocol collects), the same pool rules (``max_connections`` open,
``max_keepalive_connections`` kept idle for ``keepalive_expiry`` seconds, a connection the
server closed or sent unasked bytes on never reused) and the same exceptions, as httpcore
raises them. httpx's async stack (its client, httpcore, anyio's streams, h11) spends more CPU
a request than the light model it calls; this is a protocol object and a few byte operations.

Beyond the sync transport:

* **Cancellation.** A task cancelled during an exchange (``asyncio.wait_for``, a
  ``TaskGroup`` failing, a web request whose client left) closes that connection at once: the
  server sees its client leave and drops the request if it is still queued (bitserve counts
  it as cancelled and never computes it). The connection is never reused.
* **Event loops.** A connection belongs to the loop that opened it. An idle one from another
  loop (a client used across ``asyncio.run`` calls) is not reused: it is closed on its own
  loop if that still runs, else shut down. As with ``httpx.AsyncClient``, one client per
  event loop is the intended use.

What it does not do: TLS, proxies, HTTP/2, streaming an answer as it arrives. The client uses
it only where the sync client uses :class:`~._h1.H1Transport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import AsyncIterable

import httpx

from ._h1 import (
    _LIMITS,
    JOIN_BELOW,
    IdlePool,
    Reply,
    _Closed,
    frame_body,
    httpx_head,
    httpx_response,
    read_answer,
)

__all__ = ["AsyncH1Transport"]


class _Connection(asyncio.Protocol):
    """One kept-alive connection: the bytes received past the last answer, and its state."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.ended = False
        """The server closed its end (or the connection was lost)."""
        self.closing = False
        """Not to be reused (either side asked to close, or the answer ran to the end)."""
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- the transport's callbacks ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream's transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool | None:
        self.ended = True
        self._wake()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- ours ------------------------------------------------------------------------------

    def usable(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether an idle connection can carry another request on ``loop``."""
        if self.loop is not loop or self.ended or self.buf:
            return False
        return self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        """Close the connection (on its own loop; shut down if that loop has ended)."""
        transport = self.transport
        if transport is None:
            return
        if not self.loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self.loop:
                transport.close()
            else:
                self.loop.call_soon_threadsafe(transport.close)
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    async def send(self, parts: list[bytes | memoryview], timeout: float | None) -> None:
        """Write the request; waits (up to ``timeout``) while the transport is full."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.ended:
            raise httpx.WriteError("the connection was closed before the request was sent")
        if sum(len(p) for p in parts) <= JOIN_BELOW:
            transport.write(b"".join(parts))
        else:
            for part in parts:  # each sent at once as far as the socket takes it
                transport.write(part)
        if self._paused:
            self._drained = self.loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._drained
            except TimeoutError as exc:
                raise httpx.WriteTimeout("timed out sending the request") from exc
            if self.ended:
                raise httpx.WriteError("the connection was lost while sending the request")

    async def fill(self, timeout: float | None) -> bool:
        """Wait (up to ``timeout``) for more bytes in :attr:`buf`; False at the end."""
        have = len(self.buf)
        while len(self.buf) == have:
            if self.ended:
                return False
            self._waiter = self.loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._waiter
            finally:
                self._waiter = None
        return True


class AsyncH1Transport(httpx.AsyncBaseTransport):
    """An :class:`httpx.AsyncBaseTransport` for plain HTTP/1.1 over kept-alive connections.

    :meth:`exchange` is the whole of it, on bytes; :meth:`handle_async_request` puts httpx's
    request and response types around it.

    Args:
        limits: connections open at once, idle connections kept, and how long one is kept.
    """

    def __init__(self, limits: httpx.Limits = _LIMITS) -> None:
        self._max = limits.max_connections
        self._open = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        self._pool: IdlePool[_Connection] = IdlePool(limits)

    @property
    def is_closed(self) -> bool:
        return self._pool.closed

    # -- the pool ----------------------------------------------------------------------

    async def _acquire(self, timeout: float | None) -> None:
        """A connection slot: at once if fewer than ``max_connections`` are in use, else
        the next one freed, in order of asking."""
        if self._max is None or (self._open < self._max and not self._queue):
            self._open += 1
            return
        slot = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        try:
            async with asyncio.timeout(timeout):
                await slot
        except BaseException as exc:
            with contextlib.suppress(ValueError):
                self._queue.remove(slot)
            if slot.done() and not slot.cancelled():
                self._release()  # handed over as the wait ended: passed on
            if isinstance(exc, TimeoutError):
                message = "no connection became free within the pool timeout"
                raise httpx.PoolTimeout(message) from exc
            raise

    def _release(self) -> None:
        """Free a slot: to the longest-waiting task if any waits (its count kept)."""
        while self._queue:
            slot = self._queue.popleft()
            if not slot.done() and not slot.get_loop().is_closed():
                slot.set_result(None)
                return
        self._open -= 1

    async def aclose(self) -> None:
        self._pool.close()

    # -- one exchange ------------------------------------------------------------------

    async def exchange(
        self,
        host: str,
        port: int,
        head: bytes,
        body: list[bytes | memoryview],
        timeouts: dict[str, float | None],
        method: str = "POST",
        close: bool = False,
    ) -> Reply:
        """Send one request and read its whole answer (the arguments and exceptions of
        :meth:`~._h1.H1Transport.exchange`); cancelled, it closes the connection."""
        if self._pool.closed:
            raise RuntimeError("the transport is closed")
        key = (host, port)
        await self._acquire(timeouts.get("pool"))
        try:
            loop = asyncio.get_running_loop()
            conn = self._pool.take(key, lambda c: c.usable(loop))
            conn = conn or await _connect(host, port, timeouts.get("connect"))
            try:
                reply = await _send_and_read(conn, head, body, timeouts, method)
            except BaseException:
                conn.close()
                raise
            if conn.closing or close:
                conn.close()
            else:
                self._pool.put(key, conn)
            return reply
        finally:
            self._release()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's entry: the request's head and body as they stand, through :meth:`exchange`."""
        head, chunked, close = httpx_head(request)
        stream = request.stream
        pieces = [p async for p in stream] if isinstance(stream, AsyncIterable) else stream
        body = frame_body(pieces, chunked)
        timeouts = request.extensions.get("timeout", {})
        port = request.url.port or 80
        reply = await self.exchange(request.url.host, port, head, body, timeouts, request.method,
                                    close)  # fmt: skip
        return httpx_response(reply, request)


async def _connect(host: str, port: int, timeout: float | None) -> _Connection:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(lambda: _Connection(loop), host, port)
    except TimeoutError as exc:
        raise httpx.ConnectTimeout("timed out connecting") from exc
    except OSError as exc:
        raise httpx.ConnectError(str(exc)) from exc
    return conn


async def _send_and_read(
    conn: _Connection,
    head: bytes,
    body: list[bytes | memoryview],
    timeouts: dict[str, float | None],
    method: str,
) -> Reply:
    """One request out on ``conn`` and its answer in; ``conn.closing`` set if it cannot be
    reused."""
    await conn.send([head, *body], timeouts.get("write"))
    read_timeout = timeouts.get("read")
    steps = read_answer(conn.buf, method)
    try:
        try:
            next(steps)
            while True:
                steps.send(await conn.fill(read_timeout))
        except StopIteration as done:
            answer: tuple[Reply, bool] = done.value
    except TimeoutError as exc:
        raise httpx.ReadTimeout("timed out reading the response") from exc
    except _Closed:
        raise httpx.RemoteProtocolError(
            "Server disconnected without sending a complete response."
        ) from None
    reply, closing = answer
    conn.closing = conn.closing or closing
    return reply
