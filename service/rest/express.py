"""The infer route's express lane: a plain binary V2 request answered without an ASGI task.

Most inference requests are alike: ``POST /v2/models/{m}[/versions/{v}]/infer`` with a
``Content-Length`` body of a few KiB, a JSON header the model version has seen before and
binary outputs. The general path (``service.rest.gateway`` -> ``fastpath`` -> ``inference``
-> ``service.dataplane``) gives each one an ASGI scope, a task, a body reader with its own
timeout, a future for its batch and two ASGI messages for its answer, one layer at a time:
about as much Python as the whole of a hand-written endpoint. Here the HTTP connection
(``service.rest.http_protocol``) hands such a request to an :class:`ExpressRequest` as its
head is parsed; when its body is complete it is decoded (the model version's header cache),
checked and queued for its batch on the spot, and its batch's answer is framed and written
from the batcher's call back, in the turn of the loop that computed the batch. No task, no
coroutine, no future.

It is the same request on the same data plane: the same decoder, signature, batcher, metrics,
statistics, request ids, access log line, in-flight byte budget and concurrency limit, and
the same bytes on the wire (``tests/service/test_express.py`` compares the two paths on
random requests, byte for byte). Whatever is not plain goes the general way, decided from
the head (``Expect``, ``Content-Encoding``, chunked bodies, bodies over 64 KiB, a compressed
answer the client accepts, a wrong token, a ``root_path``, a target that is not exactly the
route) or later, before the request is queued: an error of any kind before the batcher takes
it (an unknown model, a full queue, a body that does not decode, the byte budget, the
concurrency limit), outputs in shared memory, or a client that leaves early. Such a request
is handed over whole (its head, and its body so far) to an ordinary exchange, whose task then
answers it as if it had gone that way from the start. After it is queued, the express lane
answers itself: the batch's outputs, or its error (a timeout, an unload, a failed batch)
framed as the general path frames it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from service.dataplane import THREAD_BYTES, build_response, enqueue, shared_outputs
from service.errors import (
    ModelNotReady,
    Overloaded,
    RequestTimeout,
    ServiceError,
    report,
    shown_message,
)
from service.observability import printable_path
from service.protocol import choose_encoding, encode_infer_response
from service.rest.errors import error_parts
from service.rest.fastpath import CLIENT_GONE, Held, InferRoute, match_infer
from service.rest.gateway import Gateway, access_lines
from service.rest.gateway import log as gateway_log
from service.rest.http_cycle import STATUS_LINES
from service.rest.inference import encodes_in_thread

if TYPE_CHECKING:
    from service.batcher import BatchInfo
    from service.handle import ModelHandle, Result
    from service.protocol import EncodedResponse, InferRequest
    from service.rest.http_protocol import HttpProtocol

log = logging.getLogger("service.rest.fastpath")  # its reports read as the infer route's

_ROUTES_KEPT = 1024
"""Request targets remembered as infer routes (or not): clients send a handful."""
_GENERAL = frozenset((b"expect", b"content-encoding", b"transfer-encoding"))
"""Request headers that send a request the general way."""
_OK = STATUS_LINES[200]


class ExpressLanes:
    """One server's express lane: which request targets it takes, and what it shares with
    the general infer route.

    Args:
        route: the general infer route (its limits, budget, token, REST inference).
        gateway: the gateway (request ids, the concurrency limit, the access log switch).
    """

    def __init__(self, route: InferRoute, gateway: Gateway) -> None:
        self.route = route
        self.gateway = gateway
        self.rest = route.rest
        self.dataplane = route.rest.dataplane
        self.largest = min(route.max_body_bytes, THREAD_BYTES)
        """The largest body taken (a larger one decodes in a worker thread)."""
        self._targets: dict[bytes, tuple[str, str | None, str] | None] = {}

    def _target(self, url: bytes) -> tuple[str, str | None, str] | None:
        """``(model, version, path as logged)`` when ``url`` is exactly the infer route."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        found = None
        if b"%" not in url and b"?" not in url and b"#" not in url and url.isascii():
            path = url.decode("ascii")
            route = match_infer("POST", path)
            if route is not None:
                found = (route[0], route[1], printable_path(path))
        if len(self._targets) < _ROUTES_KEPT:
            self._targets[url] = found
        return found

    def begin(
        self,
        conn: HttpProtocol,
        method: bytes,
        version: str,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> ExpressRequest | None:
        """The express request for a parsed head, or None: the general way."""
        if method != b"POST" or self.dataplane.tracing is not None:
            return None  # tracing on: a request may be traced (the general way's spans)
        target = self._target(url)
        if target is None:
            return None
        declared = header_length = sent_id = token = accept = None
        for k, v in headers:
            if k == b"content-length":
                declared = v
            elif k == b"inference-header-content-length":
                header_length = v
            elif k == b"x-request-id":
                sent_id = v
            elif k == b"authorization" and token is None:
                token = v  # the first, as every route reads it
            elif k == b"accept-encoding":
                accept = v
            elif k in _GENERAL:
                return None
        if declared is None or not (declared.isdigit() and declared.isascii()):
            return None
        size = int(declared)
        if size > self.largest:
            return None
        expected = self.route.token
        if expected is not None and not hmac.compare_digest(token or b"", b"Bearer " + expected):
            return None  # the general way answers it (or takes another spelling of it)
        compresses = self.rest.response_compression != "never"
        if accept is not None and compresses and choose_encoding(accept.decode("latin-1")):
            return None  # an answer that may be compressed
        return ExpressRequest(
            self,
            conn,
            target,
            (method, version, url, headers),
            size,
            None if header_length is None else header_length.decode("latin-1"),
            self.gateway.request_ids(sent_id),
            keep_alive,
        )


class _Answer:
    """The batcher's side of one express request (``service.batcher.Answer``)."""

    __slots__ = ("request",)

    def __init__(self, request: ExpressRequest) -> None:
        self.request = request

    def done(self) -> bool:
        return self.request.answered

    def set_result(self, result: tuple[Result, BatchInfo], /) -> None:
        self.request.computed(result)

    def set_exception(self, exception: BaseException, /) -> None:
        self.request.failed(exception)


class ExpressRequest:
    """One request on the express lane (see the module docstring); to its connection, what
    an exchange (``service.rest.http_cycle.Exchange``) is: it takes the body, starts when its
    turn comes, and is told when the client goes away."""

    __slots__ = (
        "answered",
        "body_timer",
        "chunks",
        "complete",
        "conn",
        "declared",
        "handle",
        "head",
        "header_length",
        "held",
        "keep_alive",
        "lane",
        "more_body",
        "outputs",
        "pending",
        "request",
        "request_id",
        "started",
        "t0",
        "t0_ns",
        "target",
        "waiting",
    )

    def __init__(
        self,
        lane: ExpressLanes,
        conn: HttpProtocol,
        target: tuple[str, str | None, str],
        head: tuple[bytes, str, bytes, list[tuple[bytes, bytes]]],
        declared: int,
        header_length: str | None,
        request_id: str,
        keep_alive: bool,
    ) -> None:
        self.lane = lane
        self.conn = conn
        self.target = target
        self.head = head
        """What the general way needs to take the request over: method, HTTP version,
        target and headers."""
        self.declared = declared
        self.header_length = header_length
        self.request_id = request_id
        self.keep_alive = keep_alive
        self.t0 = time.perf_counter()
        self.t0_ns = 0
        self.chunks: list[bytes] = []
        self.more_body = True
        self.started = False
        self.complete = False
        """The response has been written (or the request handed over, or its client gone)."""
        self.answered = False
        """Its batch's answer (or error) has come."""
        self.handle: ModelHandle | None = None
        self.request: InferRequest | None = None
        self.outputs: tuple[int, ...] = ()
        self.held: Held | None = None
        self.pending: Any = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.waiting = False
        """Waiting for the rest of its body (in the server's tasks, for its shutdown)."""

    # --- the connection's side ------------------------------------------------------------

    def add_body(self, data: bytes) -> int:
        """Body bytes received; returns the bytes held (at most 64 KiB: never paused)."""
        self.chunks.append(data)
        return self.declared

    def body_done(self) -> None:
        """The whole body has been received."""
        self.more_body = False
        self._stop_waiting()
        if self.started and not self.complete:
            self._submit()

    def body_incomplete(self) -> None:
        """A read ended before the body did: from now on it has ``body_timeout_s`` (as the
        general way's body reader gives it), and the server's graceful shutdown waits for
        it as for a task (:meth:`cancel`)."""
        if self.waiting or not self.started or self.complete:
            return
        self.waiting = True
        timeout = self.lane.route.body_timeout_s
        if timeout:
            self.body_timer = self.conn.loop.call_later(timeout, self._body_timed_out)
        self.conn.state.tasks.add(self)

    def cancel(self, msg: object = None) -> bool:
        """The server's graceful shutdown is over and the body has not come (uvicorn cancels
        the tasks it still waits for): answered 503, closing, as the general way answers it
        (in the next turn of the loop: uvicorn is going through its tasks)."""
        if self.complete or not self.more_body:
            return False
        self.conn.loop.call_soon(self._cancelled)
        return True

    def _cancelled(self) -> None:
        if self.complete or not self.more_body:
            return
        gateway_log.warning("POST %s cancelled: the server is stopping", self.target[2])
        self.t0_ns = self.lane.dataplane.started()
        error = ModelNotReady("the server is shutting down; retry later")
        self._answer_error(error, "Cancelled", close=True)

    def start(self) -> None:
        """Its turn on the connection has come (pipelined requests wait for the one before)."""
        self.started = True
        lane = self.lane
        gateway = lane.gateway
        limit = gateway.limit_concurrency
        if limit is not None and gateway.active >= limit:
            self._hand_over()  # the gateway answers 503
            return
        try:
            handle = lane.dataplane.admit(self.target[0], self.target[1])
            held = Held(lane.route)
            held.grow(self.declared)
        except ServiceError:
            self._hand_over()  # answered the general way, before the body is read
            return
        gateway.active += 1
        self.handle = handle
        self.held = held
        if not self.more_body:
            self._submit()
        elif not self.conn.reading:
            self.body_incomplete()  # started after the read that brought its head

    def lost(self) -> None:
        """The client went away: a request still queued is dropped, never computed (as the
        general way drops it: counted as cancelled, logged 499, left out of the
        statistics); an answer still to come goes nowhere."""
        if self.complete:
            return
        self.complete = True
        handle = self.handle
        if not self.started or handle is None or self.answered:
            return  # never started, or its answer is written
        if self.pending is None and self.request is None:  # reading its body
            self.lane.dataplane.metrics.cancelled(handle.name, handle.version).inc()
            self.t0_ns = self.lane.dataplane.started()
        elif self.pending is not None:  # queued (None: a cache hit, answered next turn)
            handle.batcher.cancel(self.pending)
        self.answered = True
        self._finish("Cancelled", CLIENT_GONE, b"", b"", b"")

    # --- the request ----------------------------------------------------------------------

    def _submit(self) -> None:
        handle = self.handle
        assert handle is not None
        lane = self.lane
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        try:
            request = lane.rest.decode_now(handle, body, self.header_length)
            if request.outputs is not None and shared_outputs(request):
                self._hand_over()  # outputs into shared memory: written the general way
                return
            bound = handle.signature.bind(request)
            # The plane's own queueing (and response cache: a hit answers in the next turn).
            self.pending = enqueue(handle, request, bound, _Answer(self),
                                   request_id=self.request_id)  # fmt: skip
        except ServiceError:
            self._hand_over()  # the general way answers the error
            return
        self.request = request
        self.outputs = bound.outputs
        self.t0_ns = lane.dataplane.started()

    def computed(self, result: tuple[Result, BatchInfo]) -> None:
        """Its batch's outputs: the response is framed and written now."""
        self.answered = True
        handle, request = self.handle, self.request
        assert handle is not None
        assert request is not None
        arrays, info = result
        response = build_response(handle, request, self.outputs, arrays, info, self.request_id)
        if encodes_in_thread(request, response):
            conn = self.conn
            task = conn.loop.create_task(self._encode_in_thread(request, response))
            conn.state.tasks.add(task)
            task.add_done_callback(conn.state.tasks.discard)
            return
        self._respond(encode_infer_response(response, request))

    async def _encode_in_thread(self, request: InferRequest, response: Any) -> None:
        from service.dataplane import off_loop

        try:
            enc = await off_loop(lambda: encode_infer_response(response, request))
        except Exception as exc:
            log.exception("framing a response failed")
            self.failed(exc)
            return
        self._respond(enc)

    def _respond(self, enc: EncodedResponse) -> None:
        body = enc.body
        lines = [
            b"content-type: %b\r\ncontent-length: %d\r\nx-request-id: %b\r\n"
            % (enc.media_type.encode(), len(body), self.request_id.encode())
        ]
        lines += [b"%b: %b\r\n" % (k.lower().encode(), v.encode()) for k, v in enc.headers.items()]
        self._finish("success", 200, _OK, b"".join(lines), body)

    def failed(self, error: BaseException) -> None:
        """Its batch's error (or a timeout, an unload): answered as the general path does."""
        self.answered = True
        if not isinstance(error, ServiceError):  # the batcher sends ServiceErrors only
            error = ServiceError(f"internal error (request id {self.request_id})")
        path = self.target[2]
        if isinstance(error, Overloaded):
            self.lane.route.shed(path, shown_message(error))
        else:
            report(log, f"POST {path}", error)
        self._answer_error(error, type(error).__name__)

    def _answer_error(self, error: ServiceError, outcome: str, *, close: bool = False) -> None:
        status, headers, body = error_parts(error, self.request_id, close=close)
        closes = any(k == b"connection" and b"close" in v.lower() for k, v in headers)
        if closes:
            self.keep_alive = False
        lines = b"".join(b"%b: %b\r\n" % (k, v) for k, v in headers)
        self._finish(outcome, status, STATUS_LINES[status], lines, body, closes)

    def _finish(
        self,
        outcome: str,
        status: int,
        line: bytes,
        lines: bytes,
        body: bytes,
        closes: bool = False,
    ) -> None:
        """Count, log and write the answer (``closes``: ``lines`` say ``Connection: close``)."""
        lane = self.lane
        handle = self.handle
        lane.dataplane.finished(self.t0_ns, handle.name if handle else "_unknown", outcome, handle)
        self._release()
        self._stop_waiting()
        lane.gateway.active -= 1
        if lane.gateway.access_log:
            ms = (time.perf_counter() - self.t0) * 1e3
            access_lines.write("POST", self.target[2], status, ms, self.request_id)
        if self.complete:
            return  # the client went away: nothing to write
        conn = self.conn
        close = b"" if self.keep_alive or closes else b"connection: close\r\n"
        conn.transport.write(b"".join((line, conn.default_headers(), lines, close, b"\r\n", body)))
        self.complete = True
        conn.response_done(self)

    def _body_timed_out(self) -> None:
        self.body_timer = None
        if self.complete or not self.more_body:
            return
        timeout = self.lane.route.body_timeout_s
        self.t0_ns = self.lane.dataplane.started()
        self.failed(
            RequestTimeout(f"the request body did not arrive within {timeout:g} s (body timeout)")
        )

    def _release(self) -> None:
        if self.held is not None:
            self.held.release()
            self.held = None

    def _stop_waiting(self) -> None:
        if self.waiting:
            self.waiting = False
            self.conn.state.tasks.discard(self)
            if self.body_timer is not None:
                self.body_timer.cancel()
                self.body_timer = None

    def _hand_over(self) -> Any:
        """Give the request to the general way: an exchange takes its head and its body so
        far, and takes its place on the connection (its task starts if its turn has come)."""
        if self.handle is not None:
            self.lane.gateway.active -= 1
            self.handle = None
        self._release()
        self._stop_waiting()
        self.complete = True
        return self.conn.take_over(self)
