"""Reading a request body from ASGI ``receive``, bounded in size and in time: one reader for
the infer route (``service.rest.infer_route``) and the control routes
(``service.rest.endpoints``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from service.errors import InvalidInput, PayloadTooLarge, RequestTimeout

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]

CONTROL_BODY_BYTES = 1 << 20
"""The largest body of a control route (repository index options, load parameters, log
settings, shared-memory registrations): small JSON objects."""


class Budget(Protocol):
    """A share of a memory budget that grows as a body arrives (see ``infer_route.Held``)."""

    def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all; raises to refuse."""


def body_timed_out(timeout_s: float | None) -> RequestTimeout:
    """The error of a body that did not arrive within ``timeout_s`` (both REST ways)."""
    return RequestTimeout(f"the request body did not arrive within {timeout_s:g} s (body timeout)")


async def read_body(
    receive: Receive,
    *,
    declared: int | None,
    limit: int,
    timeout_s: float | None,
    held: Budget | None = None,
) -> bytes | bytearray:
    """The whole request body: one ``receive`` when it came in one piece, else gathered.

    Args:
        receive: the request's ASGI ``receive``.
        declared: its ``Content-Length`` (checked against ``limit`` by the caller), or None.
        limit: the most bytes a body without a Content-Length may have.
        timeout_s: the most seconds the whole body may take; None: no limit.
        held: for a body without a Content-Length, its share of the in-flight byte budget,
            grown as it arrives.

    Raises:
        RequestTimeout: the body was slower than ``timeout_s``.
        PayloadTooLarge: a body without a Content-Length passed ``limit``.
        InvalidInput: the body is shorter or longer than declared, or the client left.
        Overloaded: ``held`` would pass the in-flight budget.
    """
    try:
        async with asyncio.timeout(timeout_s):
            message = await receive()
            body: bytes | bytearray = message.get("body", b"")
            if declared is None:
                if len(body) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                if held is not None:
                    held.grow(len(body))
            if message.get("more_body", False):
                body = await _gather(receive, body, declared, limit, held)
    except TimeoutError:
        raise body_timed_out(timeout_s) from None
    if message["type"] == "http.disconnect":
        raise InvalidInput("client disconnected while sending the body")
    if declared is not None and len(body) != declared:
        raise InvalidInput(f"request body ended after {len(body)} of {declared} bytes")
    return body


async def _gather(
    receive: Receive,
    first: bytes | bytearray,
    declared: int | None,
    limit: int,
    held: Budget | None,
) -> bytearray:
    bound = limit if declared is None else declared
    # ``+=`` on a bytearray grows geometrically and glibc moves a big buffer by remapping its
    # pages: about one copy per byte, and a slow client holds only what it has sent.
    out = bytearray(first)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidInput("client disconnected while sending the body")
        chunk = message.get("body", b"")
        if len(out) + len(chunk) > bound:
            if declared is not None:
                raise InvalidInput("request body is longer than its Content-Length")
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if declared is None and held is not None:
            held.grow(len(out) + len(chunk))
        out += chunk
        if not message.get("more_body", False):
            return out
