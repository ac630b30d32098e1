"""The outermost ASGI layer: request ids, paths, access log, the concurrency limit, the
last-resort 500, and the dispatch of inference to the infer route
(``service.rest.infer_route``) ahead of FastAPI.

The request head's limits (its bytes, its number of headers, its time) belong to the HTTP
connection (``service.rest.http_protocol``), which counts them as the head arrives.

Paths are answered without redirects: a trailing slash is dropped (``/v2/`` is ``/v2``), so
no ``Location`` is ever built from the request's ``Host`` header. Paths are logged escaped and
cut (``service.observability.request_ids.printable_path``): a percent-encoded newline must not forge
a log line.

A request with ``Expect: 100-continue`` and a body that is answered before its body was asked
for (an unknown model, a full queue) has its connection closed after the answer: the client may
never send that body, and whatever it sends next could not be told apart from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from service.errors import ModelNotReady, Overloaded, ServiceError
from service.observability.access_log import AccessLog
from service.observability.request_ids import RequestIds, printable_path, request_id_var
from service.rest.bodies import Message, Receive
from service.rest.errors import send_error
from service.rest.infer_route import InferRoute, Scope, Send, match_infer

log = logging.getLogger(__name__)
request_log = logging.getLogger(f"{__name__}.access")  # one line per request
access_lines = AccessLog(request_log)

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _close_if_unread(receive: Receive, send: Send) -> tuple[Receive, Send]:
    """``receive`` and ``send`` of an ``Expect: 100-continue`` request: an answer that starts
    before the body was asked for (and so before uvicorn sent ``100 Continue``) closes the
    connection."""
    asked = False

    async def receive_body() -> Message:
        nonlocal asked
        asked = True
        return await receive()

    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start" and not asked:
            headers = [*message.get("headers", ()), (b"connection", b"close")]
            message = {**message, "headers": headers}
        await send(message)

    return receive_body, send_closing


async def _last_answer(send: Send, error: ServiceError, request_id: str) -> None:
    """A JSON error for a request whose handler failed, closing the connection; nothing if
    the handler had begun its own answer (uvicorn refuses a second start) or the client
    left."""
    with contextlib.suppress(RuntimeError, OSError):
        await send_error(send, error, request_id, close=True)


def _inspect(headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, bool]:
    """The sent ``X-Request-ID`` and whether the client expects ``100 Continue`` before a
    body (a request without a body has nothing to wait for: its connection stays open)."""
    sent = None
    expects = has_body = False
    for k, v in headers:
        if k == b"x-request-id":
            sent = v
        elif k == b"expect":
            expects = v.lower() == b"100-continue"
        elif k == b"transfer-encoding" or (k == b"content-length" and v.strip(b"0 \t")):
            has_body = True
    return sent, expects and has_body


class Gateway:
    """Every HTTP request passes here once.

    Args:
        fallback: the application for everything but inference (FastAPI's own stack).
        infer: the inference route.
        access_log: log one line per request (method, path, status, milliseconds, id).
        limit_concurrency: requests handled at once above which new ones are answered 503
            with ``Retry-After``; None: no limit.
    """

    def __init__(
        self,
        fallback: ASGIApp,
        infer: InferRoute,
        *,
        access_log: bool = True,
        limit_concurrency: int | None = None,
    ) -> None:
        self.fallback = fallback
        self.limit_concurrency = limit_concurrency
        self.active = 0
        """HTTP requests being handled now."""
        self.infer = infer
        self.access_log = access_log
        self.request_ids = RequestIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        t0 = time.perf_counter()
        sent, expects = _inspect(scope["headers"])
        if expects:
            receive, send = _close_if_unread(receive, send)
        rid = self.request_ids(sent)
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        path: str = scope["path"]
        if len(path) > 1 and path.endswith("/"):
            path = path.rstrip("/") or "/"
            scope["path"] = path
            raw = scope.get("raw_path")
            if isinstance(raw, bytes):
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        status = 0
        started = False
        self.active += 1
        limit = self.limit_concurrency
        over = limit is not None and self.active > limit

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            if over:
                # The body was not read: the connection cannot be reused safely.
                error = Overloaded(
                    f"the server is handling {self.active - 1} requests (limit_concurrency "
                    f"{limit}); retry later"
                )
                status = error.status_code
                await send_error(send, error, rid, close=True)
                return
            route = match_infer(scope["method"], path)
            if route is not None:
                status = await self.infer(scope, receive, send, route, rid)
            else:
                await self.fallback(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], printable_path(path))
            if not started and status == 0:
                status = 500
                await _last_answer(send, ServiceError(f"internal error (request id {rid})"), rid)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when graceful_shutdown_s is over;
            # it would answer them with a plain-text 500 and log a traceback each. The task
            # ends here either way: nothing awaits it.
            log.warning(
                "%s %s cancelled: the server is stopping", scope["method"], printable_path(path)
            )
            if not started and status == 0:
                status = 503
                await _last_answer(
                    send, ModelNotReady("the server is shutting down; retry later"), rid
                )
        finally:
            if self.access_log:
                ms = (time.perf_counter() - t0) * 1e3
                access_lines.write(scope["method"], printable_path(path), status, ms, rid)
            self.active -= 1
            request_id_var.reset(token)
