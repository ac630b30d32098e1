"""``POST /v2/models/{m}[/versions/{v}]/infer`` as a raw ASGI handler, ahead of FastAPI.

The inference route is the one hot path, so it runs without a framework: the path is matched
as a string, the headers are read in one pass over the ASGI scope, the body is gathered
straight from ``receive`` (the server's one buffer when it came in one piece, else one copy
into a buffer of the declared size), and the answer goes out in two ``send`` calls. What the
route decides about the request is all in :class:`service.dataplane.DataPlane` (framed by
:class:`service.rest.inference.RestInference`); this module is the HTTP envelope: auth,
limits, shedding before the body is read, and error bodies.

Before a byte of the body is read, a request is refused when:

- its token is missing or wrong (401), its ``Content-Length`` is malformed (400) or larger
  than ``max_body_bytes`` (413);
- the model is unknown (404) or not ready (503);
- the model's queue is full (503 with ``Retry-After``): a server past capacity answers in
  microseconds instead of after reading and decoding the upload;
- the bytes of the bodies being received would pass ``max_inflight_bytes`` (503 with
  ``Retry-After``).

The budget counts a body from before it is read until its answer is ready: the declared
``Content-Length`` at once, a chunked body as it arrives, and the inflated copy of a
compressed body as it inflates (a refusal then comes mid-way, also 503).

A client that closes its connection before its answer cancels the request
(:mod:`service.rest.disconnect`): still queued, it is dropped and never computed; the
access log shows 499 (nginx's "client closed request"), and nothing is answered.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, NamedTuple

from service.auth import check_bearer
from service.dataplane import THREAD_BYTES
from service.errors import (
    InvalidInput,
    Overloaded,
    PayloadTooLarge,
    ServiceError,
    log_level,
    report,
    shown_message,
)
from service.observability.request_ids import Tally, printable_path
from service.protocol import choose_encoding
from service.rest.bodies import Message, Receive, read_body
from service.rest.disconnect import is_gone, on_disconnect
from service.rest.errors import send_error
from service.rest.http_cycle import Head
from service.rest.inference import RestInference, answer_headers

Scope = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger(__name__)

_GENERAL = frozenset((b"expect", b"content-encoding", b"transfer-encoding"))
"""Request headers that make a request not plain (:meth:`InferRoute.plain`)."""
_PREFIX = "/v2/models/"
_SUFFIX = "/infer"
_JSON = b"application/json"
_SPAN = "POST /v2/models/{model}/infer"
"""The server span's name of a traced request (OpenTelemetry's ``{method} {route}``)."""
CLIENT_GONE = 499
"""The status logged for a request whose client went away before its answer (nginx's)."""


def match_infer(method: str, path: str) -> tuple[str, str | None] | None:
    """``(model, version)`` when ``method path`` is the infer route, else None.

    ``version`` is None for ``/v2/models/{m}/infer``. Names are returned as sent (the
    repository refuses names it does not know).
    """
    if method != "POST" or not path.startswith(_PREFIX) or not path.endswith(_SUFFIX):
        return None
    parts = path[len(_PREFIX) : -len(_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
        return parts[0], parts[2]
    return None


class Plain(NamedTuple):
    """A plain infer request, as its head says (:meth:`InferRoute.plain`)."""

    model: str
    version: str | None
    path: str
    """The path as logged."""
    size: int
    header_length: str | None
    sent_id: bytes | None
    shed: bool = False
    """A body too large for the lane that a full queue refuses: 503 at once, body skipped."""


def parse_content_length(value: bytes) -> int:
    """A ``Content-Length`` value: ASCII digits only (``int()`` would take ``-1``, ``+5``,
    ``1_0`` and `` 7 ``).

    Raises:
        InvalidInput: anything else.
    """
    if not (value.isdigit() and value.isascii()):
        raise InvalidInput(f"malformed Content-Length {value[:64].decode('latin-1')!r}")
    return int(value)


class InferRoute:
    """The infer route's HTTP envelope around :meth:`RestInference.infer`.

    Args:
        rest: REST's inference over the server's data plane.
        max_body_bytes: the most bytes a body may have (checked before reading).
        body_timeout_s: the most seconds a body may take to arrive (408 after).
        max_inflight_bytes: the most body bytes held at once by requests being received or
            computed, over all connections; 0: no limit.
        auth_token: the bearer token every request must carry, or None.
    """

    def __init__(
        self,
        rest: RestInference,
        *,
        max_body_bytes: int,
        body_timeout_s: float | None,
        max_inflight_bytes: int = 0,
        auth_token: str | None = None,
    ) -> None:
        self.rest = rest
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_inflight_bytes = max_inflight_bytes
        self.token = auth_token.encode() if auth_token is not None else None
        """The bearer token every request must carry, or None."""
        self.inflight_bytes = 0
        """Body bytes reserved now by requests being received or computed."""
        self.lock = threading.Lock()
        """Guards ``inflight_bytes`` (inflated bodies are counted in worker threads)."""
        self.shed = Tally(log, log_level(Overloaded("")), "POST %s -> 503 (shed): %s")
        """Counts (and now and then logs) a request shed: by the thousand under overload."""
        self.largest = min(max_body_bytes, THREAD_BYTES)
        """The largest body of a plain request (:meth:`plain`)."""
        self._targets: dict[bytes, tuple[str, str | None, str] | None] = {}

    async def __call__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: tuple[str, str | None],
        request_id: str,
    ) -> int:
        """Answer one infer request; returns the status sent (for the access log)."""
        held = Held(self)
        task = asyncio.current_task()
        try:
            declared, encoding, header_length, accept = self._headers(scope["headers"])

            async def body() -> bytes | bytearray:
                if declared is not None:
                    held.grow(declared)
                return await read_body(
                    receive,
                    declared=declared,
                    limit=self.max_body_bytes,
                    timeout_s=self.body_timeout_s,
                    held=held,
                )

            tracing = self.rest.dataplane.tracing
            trace = None
            if tracing is not None:  # tracing off: not a header is looked at for it
                attributes = {
                    "http.request.method": "POST",
                    "url.path": printable_path(scope["path"]),
                }
                trace = tracing.begin(route[0], scope["headers"], _SPAN, attributes)
            if task is not None:  # only while the data plane has the request
                on_disconnect(scope, task.cancel)
            try:
                enc = await self.rest.infer(
                    route[0],
                    route[1],
                    body,
                    content_encoding=encoding,
                    header_length=header_length,
                    accept_encoding=accept,
                    reserve=held.inflated,
                    trace=trace,
                )
            finally:
                on_disconnect(scope, None)
        except ServiceError as e:
            # The unread rest of a body refused early is skipped by the HTTP server, so the
            # connection stays usable; a timed-out upload is closed (RequestTimeout says so).
            self.refused(printable_path(scope["path"]), e)
            await send_error(send, e, request_id)
            return e.status_code
        except asyncio.CancelledError:
            if task is None or not is_gone(scope):
                raise  # the server is stopping
            task.uncancel()  # the client went away: this task ends here, unanswered
            log.debug("POST %s: the client went away", printable_path(scope["path"]))
            return CLIENT_GONE
        finally:
            held.release()
        headers = answer_headers(enc, request_id)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": enc.body})
        return 200

    def plain(self, head: Head) -> Plain | None:
        """The express lane's question: is this request plain? A ``POST`` of exactly this
        route's path with a ``Content-Length`` body of at most 64 KiB (larger ones decode
        off the loop), no ``Expect``, ``Content-Encoding`` or chunked body, no answer the
        client would have compressed, and the right token (else the general way answers).
        A larger body (within ``max_body_bytes``) is plain too while its model's queue is
        full: the lane sheds it (503) without an ASGI task, and skips its body."""
        method, _, url, headers = head
        target = self._target(url) if method == b"POST" else None
        if target is None:
            return None
        size = header_length = sent_id = token = accept = None
        for k, v in headers:
            if k == b"content-length":
                size = v
            elif k == b"inference-header-content-length":
                header_length = v.decode("latin-1")
            elif k == b"x-request-id":
                sent_id = v
            elif k == b"authorization" and token is None:
                token = v  # the first, as every route reads it
            elif k == b"accept-encoding":
                accept = v
            elif k in _GENERAL:
                return None
        if size is None or not (size.isdigit() and size.isascii()):
            return None
        shed = int(size) > self.largest
        if shed and not (
            int(size) <= self.max_body_bytes and self.rest.dataplane.would_shed(*target[:2])
        ):
            return None
        expected = self.token
        if expected is not None and not hmac.compare_digest(token or b"", b"Bearer " + expected):
            return None  # the general way answers it (or takes another spelling of it)
        compresses = self.rest.response_compression != "never"
        if accept is not None and compresses and choose_encoding(accept.decode("latin-1")):
            return None
        return Plain(*target, int(size), header_length, sent_id, shed)

    def _target(self, url: bytes) -> tuple[str, str | None, str] | None:
        """``(model, version, path as logged)`` when ``url`` is exactly this route."""
        if url in self._targets:
            return self._targets[url]
        found = None
        if b"%" not in url and b"?" not in url and b"#" not in url and url.isascii():
            route = match_infer("POST", url.decode("ascii"))
            if route is not None:
                found = (route[0], route[1], printable_path(url.decode("ascii")))
        if len(self._targets) < 1024:  # clients send a handful of targets
            self._targets[url] = found
        return found

    def refused(self, path: str, error: ServiceError) -> None:
        """Log a refused request (both REST ways): a shed one is counted (by the thousand
        under overload, not each logged), any other reported at its error's level."""
        if isinstance(error, Overloaded):
            self.shed(path, shown_message(error))
        else:
            report(log, f"POST {path}", error)

    def _headers(
        self, raw: list[tuple[bytes, bytes]]
    ) -> tuple[int | None, str | None, str | None, str | None]:
        """One pass over the request headers: auth, and what the route needs of them."""
        declared = encoding = header_length = accept = None
        token = None
        for k, v in raw:
            if k == b"content-length":
                declared = parse_content_length(v)
            elif k == b"content-encoding":
                encoding = v.decode("latin-1")
            elif k == b"inference-header-content-length":
                header_length = v.decode("latin-1")
            elif k == b"accept-encoding":
                accept = v.decode("latin-1")
            elif k == b"authorization" and token is None:
                token = v.decode("latin-1")  # the first, as every route reads it
        check_bearer(token, self.token)
        if declared is not None and declared > self.max_body_bytes:
            raise PayloadTooLarge(
                f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes} bytes"
            )
        if accept is not None and self.rest.response_compression != "never":
            accept = choose_encoding(accept)
        else:
            accept = None
        return declared, encoding, header_length, accept


class Held:
    """One request's share of the route's in-flight byte budget: its body as received, and
    the inflated copy of a compressed body (counted from a worker thread: hence the lock)."""

    __slots__ = ("body", "nbytes", "route")

    def __init__(self, route: InferRoute) -> None:
        self.route = route
        self.nbytes = 0
        self.body = 0

    def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all for the body (more than now).

        Raises:
            Overloaded: the budget would be passed; nothing more is held then.
        """
        self._hold(nbytes)
        self.body = nbytes

    def inflated(self, nbytes: int) -> None:
        """Hold ``nbytes`` for the inflated copy of the body, on top of the body."""
        self._hold(self.body + nbytes)

    def _hold(self, nbytes: int) -> None:
        route = self.route
        limit = route.max_inflight_bytes
        with route.lock:
            more = nbytes - self.nbytes
            if limit and more > 0 and route.inflight_bytes + more > limit:
                raise Overloaded(
                    f"the server holds {route.inflight_bytes} bytes of request bodies; "
                    f"{more} more would pass its limit of {limit} (max_inflight_bytes); "
                    "retry later",
                    retry_after=1.0,
                )
            route.inflight_bytes += more
            self.nbytes = nbytes

    def release(self) -> None:
        """Give back everything held."""
        with self.route.lock:
            self.route.inflight_bytes -= self.nbytes
        self.nbytes = self.body = 0
