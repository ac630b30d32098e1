"""The infer route's express lane: HTTP framing alone, for a plain V2 request
(``InferRoute.plain``: a small binary body the general way would answer alike, or a body a
full queue sheds: 503 at once, the body skipped), answered without an ASGI scope, task or
future, through the data plane's core (:mod:`service.ticket`) and the general way's answer
builders (``answer_headers``, ``error_parts``, ``frame_head``); past the concurrency limit,
handed to the general way. The connection shows the lane each head (``http_cycle.Lane``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from service.errors import ModelNotReady, Overloaded, ServiceError
from service.protocol import EncodedResponse, InferResponse
from service.rest.bodies import body_timed_out
from service.rest.errors import error_parts
from service.rest.gateway import Gateway, access_lines
from service.rest.gateway import log as gateway_log
from service.rest.http_cycle import Connection, Head, frame_answer
from service.rest.infer_route import CLIENT_GONE, Held, InferRoute, Plain
from service.rest.inference import answer_headers, frame
from service.ticket import Ticket

log = logging.getLogger("service.rest.infer_route")  # its reports read as the infer route's


class ExpressLane:
    """An ``http_cycle.Lane`` beside the infer route: its limits, the gateway's ids and log."""

    def __init__(self, route: InferRoute, gateway: Gateway) -> None:
        self.route, self.gateway, self.dataplane = route, gateway, route.rest.dataplane

    def begin(self, conn: Connection, head: Head, keep_alive: bool) -> ExpressRequest | None:
        """Its request for a parsed head, or None: the general way (which traces)."""
        plain = self.route.plain(head) if self.dataplane.tracing is None else None
        if plain is None:
            return None
        rid = self.gateway.request_ids(plain.sent_id)
        return ExpressRequest(self, conn, plain, head, rid, keep_alive)


class ExpressRequest:
    """To its connection an ``http_cycle.Request`` (and ``Cancellable`` while waiting)."""

    __slots__ = ("chunks", "complete", "conn", "head", "held", "keep_alive", "lane",
                 "more_body", "open", "plain", "request_id", "t0", "task", "ticket", "timer",
                 "waiting")  # fmt: skip

    def __init__(self, lane: ExpressLane, conn: Connection, plain: Plain, head: Head,
                 request_id: str, keep_alive: bool) -> None:  # fmt: skip
        self.lane, self.conn, self.plain, self.head = lane, conn, plain, head
        self.request_id, self.keep_alive, self.t0 = request_id, keep_alive, time.perf_counter()
        self.chunks: list[bytes] = []
        self.more_body, self.complete, self.open, self.waiting = True, False, False, False
        self.ticket: Ticket | None = None
        self.held: Held | None = None
        self.task: Any = None  # a load awaited, or framing off the loop
        self.timer: Any = None  # the body's timeout

    def add_body(self, data: bytes) -> int:  # once answered, the connection skips the rest
        self.chunks.append(data)
        return self.plain.size  # at most 64 KiB (a shed one's pauses reading till its turn)

    def body_done(self) -> None:
        self.more_body = False
        if self.waiting:
            self._stop_waiting()
        if self.ticket is not None and not self.complete:
            self._submit()

    def body_incomplete(self) -> None:
        """A read ended before the body: ``body_timeout_s`` from now, and the shutdown waits."""
        if self.waiting or self.ticket is None or self.complete:
            return
        self.waiting = True
        timeout = self.lane.route.body_timeout_s
        if timeout:
            self.timer = self.conn.loop.call_later(timeout, self._failed, body_timed_out(timeout))
        self.conn.track(self)

    def cancel(self, msg: object = None) -> bool:  # the shutdown is over, the body not come
        if self.complete or not self.more_body:
            return False
        self.conn.loop.call_soon(self._stopping)
        return True

    def start(self) -> None:
        lane, gateway = self.lane, self.lane.gateway
        if gateway.limit_concurrency is not None and gateway.active >= gateway.limit_concurrency:
            self.complete = True  # the gateway answers 503
            self.conn.take_over(self, self.head, self.chunks)
            return
        gateway.active += 1
        self.open = True
        try:
            self.ticket = lane.dataplane.admit(*self.plain[:2], request_id=self.request_id)
            if self.plain.shed:  # its queue had room again since: shed all the same
                raise Overloaded(f"model {self.plain.model!r} is overloaded; retry later")
            self.held = Held(lane.route)
            self.held.grow(self.plain.size)
        except ServiceError as e:
            self._failed(e)
            return
        if not self.more_body:
            self._submit()
        elif not self.conn.reading:
            self.body_incomplete()  # started after the read that brought its head

    def lost(self) -> None:  # the client went away: dropped as a general request is (499)
        if not self.complete and self.ticket is not None:
            self.ticket.cancel()  # never computed if still queued; counted cancelled
            if self.task is not None:
                self.task.cancel()
            self._end(CLIENT_GONE)
        self.complete = True

    def _submit(self) -> None:
        ticket, rest, length = self.ticket, self.lane.route.rest, self.plain.header_length
        assert ticket is not None
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        try:
            request = rest.decode_now(ticket.handle, body, length)
        except ServiceError as e:
            self._failed(e)
            return
        self.task = ticket.proceed(request, lambda h: rest.decode_now(h, body, length), self._done)
        if self.task is not None:  # evicted: its load is awaited (and the shutdown waits)
            self.conn.track(self.task)

    def _done(self, outcome: InferResponse | EncodedResponse | BaseException) -> None:
        """Its response (framed now, or in a task for large JSON), its bytes, or its error."""
        ticket = self.ticket  # (a client gone: nothing is framed)
        if isinstance(outcome, InferResponse) and ticket and ticket.request and not self.complete:
            framed = frame(ticket.request, outcome, self._done)
            if isinstance(framed, asyncio.Task):
                self.task = framed
                self.conn.track(framed)
                return
            outcome = framed
        if isinstance(outcome, EncodedResponse):
            if ticket is not None:
                ticket.finish(request=ticket.request)
            self._write(200, answer_headers(outcome, self.request_id), outcome.body)
        elif isinstance(outcome, BaseException):
            self._failed(outcome)

    def _failed(self, error: BaseException) -> None:  # answered as the general way answers it
        if self.complete:
            return
        if isinstance(error, asyncio.CancelledError):  # the server stops during a load
            self._stopping()
            return
        if self.ticket is not None:
            self.ticket.fail(error, self.ticket.request)
        if not isinstance(error, ServiceError):
            log.error("an express request failed", exc_info=error)
            error = ServiceError(f"internal error (request id {self.request_id})")
        self.lane.route.refused(self.plain.path, error)
        self._write(*error_parts(error, self.request_id))

    def _stopping(self) -> None:
        if self.complete or (self.task is None and not self.more_body):
            return  # answered meanwhile, or its body came
        gateway_log.warning("POST %s cancelled: the server is stopping", self.plain.path)
        if self.ticket is not None:
            self.ticket.cancel()
        error = ModelNotReady("the server is shutting down; retry later")
        self._write(*error_parts(error, self.request_id, close=True))

    def _write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """End the request and write its answer (unless its client has gone)."""
        self._end(status)
        if not self.complete:
            self.complete = True
            defaults = self.conn.default_headers()
            data, self.keep_alive = frame_answer(defaults, status, headers, body, self.keep_alive)
            self.conn.respond(self, data)

    def _end(self, status: int) -> None:
        """Once: give back the budget and the concurrency slot, write the access line."""
        if self.open:
            self.open = False
            if self.held is not None:
                self.held.release()
            if self.waiting:
                self._stop_waiting()
            self.lane.gateway.active -= 1
            if self.lane.gateway.access_log:
                ms = (time.perf_counter() - self.t0) * 1e3
                access_lines.write("POST", self.plain.path, status, ms, self.request_id)

    def _stop_waiting(self) -> None:
        self.waiting = False
        self.conn.untrack(self)
        if self.timer is not None:
            self.timer.cancel()
