"""Request ids, access logs, header limits and the last-resort 500 handler, as one pure ASGI
middleware.

Header limits are checked here, on the parsed ``scope["headers"]``, because the HTTP parser
cannot be trusted with them: h11 bounds only an *incomplete* request head, so a head that
arrives whole in one read passes at any size, and no parser bounds the number of headers.

Every request gets an id: the client's ``X-Request-ID`` when it is a sane token, else a fresh
one. It is echoed in the response's ``X-Request-ID``, put on every log record emitted while
the request is handled (``%(request_id)s``, via :class:`RequestIdFilter`), and quoted in the
body of a 500 so an operator can find the traceback, which is logged and never sent.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.protocol.response import dumps

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
log = logging.getLogger("bitserve.access")
error_log = logging.getLogger("bitserve.error")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request) so formats can use it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def logging_config(level: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for the server and uvicorn, with request ids."""
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "default",
        "filters": ["request_id"],
        "stream": "ext://sys.stderr",
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"default": {"format": LOG_FORMAT}},
        "handlers": {"default": handler},
        "loggers": {
            "bitserve": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "service": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            # Our own access log carries the request id; uvicorn's would duplicate it.
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }


class RequestContextMiddleware:
    """Assigns request ids, writes access logs, and turns unhandled exceptions into a 500.

    Args:
        app: the wrapped ASGI application.
        access_log: log one line per HTTP request.
        max_headers: requests with more header lines are answered 431.
        max_header_bytes: requests whose headers (``name: value\\r\\n`` each) add up to
            more bytes are answered 431.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        access_log: bool = True,
        max_headers: int = 100,
        max_header_bytes: int = 64 << 10,
    ) -> None:
        self.app = app
        self.access_log = access_log
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes

    def header_problem(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """Why ``headers`` are refused (a message for the 431), or None when they are fine."""
        if len(headers) > self.max_headers:
            return f"too many request headers: {len(headers)} (limit {self.max_headers})"
        size = sum(len(k) + len(v) + 4 for k, v in headers)  # as sent: "k: v\r\n"
        if size > self.max_header_bytes:
            return f"request headers of {size} bytes exceed the limit of {self.max_header_bytes}"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for k, v in scope.get("headers", ()):
            if k == b"x-request-id":
                candidate = v.decode("latin-1")
                if _VALID_ID.match(candidate):
                    rid = candidate
                break
        rid = rid or uuid.uuid4().hex
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        started = False
        status = 0
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            problem = self.header_problem(scope.get("headers", []))
            if problem is not None:
                status = 431
                body = dumps({"error": problem})
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 431,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            # the body was not read: the connection cannot be reused safely
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, send_with_id)
        except Exception:
            error_log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                status = 500
                body = dumps({"error": f"internal error (request id {rid})"})
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
        finally:
            if self.access_log:
                log.info(
                    "%s %s %d %.1fms",
                    scope["method"],
                    scope["path"],
                    status,
                    (time.perf_counter() - t0) * 1e3,
                )
            request_id_var.reset(token)
