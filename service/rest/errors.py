"""REST's error answers: one writer for every layer of the HTTP stack (the HTTP protocol, the
gateway, the infer route, FastAPI's routes), after the rule every transport shares
(``service.errors``: the status, the message shown, the log level).

The body is ``{"error": "<message>"}``, escaped to ASCII JSON, with its status and the
error's own headers (``Retry-After``, ``WWW-Authenticate``, ``Connection: close``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

from starlette.responses import Response

from service.errors import ServiceError, shown_message

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_JSON = b"application/json"


def error_body(message: str) -> bytes:
    """``{"error": message}``, escaped to ASCII: any message makes valid JSON bytes (a lone
    surrogate an attacker put in a name included)."""
    return json.dumps({"error": message}).encode()


def error_parts(
    error: ServiceError, request_id: str | None = None, *, close: bool = False
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and body that answer ``error`` (``close``: the connection is
    closed after it)."""
    body = error_body(shown_message(error))
    headers = [(b"content-type", _JSON), (b"content-length", b"%d" % len(body))]
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode()))
    headers += [(k.lower().encode(), v.encode("latin-1")) for k, v in error.headers.items()]
    if close and not any(k == b"connection" for k, _ in headers):
        headers.append((b"connection", b"close"))
    return error.status_code, headers, body


async def send_error(
    send: Send, error: ServiceError, request_id: str, *, close: bool = False
) -> None:
    """Answer ``error`` through ASGI ``send``."""
    status, headers, body = error_parts(error, request_id, close=close)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_response(error: ServiceError) -> Response:
    """Answer ``error`` from a FastAPI exception handler (the gateway adds the request id)."""
    status, headers, body = error_parts(error)
    response = Response(body, status_code=status)
    response.raw_headers = headers
    return response


def error_bytes(error: ServiceError) -> bytes:
    """Answer ``error`` as HTTP/1.1 bytes, closing the connection (from the HTTP protocol,
    before or without an ASGI request)."""
    status, headers, body = error_parts(error, close=True)
    phrase = HTTPStatus(status).phrase.encode()
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, phrase)]
    lines += [b"%s: %s\r\n" % (k, v) for k, v in headers]
    return b"".join([*lines, b"\r\n", body])
