"""The envelope of every gRPC call: parsing, auth, request ids, status codes, the access log.

Handlers are registered without grpcio's (de)serializers: a request arrives as bytes and is
parsed here, so a malformed message is the client's INVALID_ARGUMENT (grpcio's own
deserializer would answer INTERNAL), and a response leaves as bytes.

Errors map to gRPC status codes by their HTTP status (:func:`grpc_code`), with REST's
messages; anything unexpected is logged with its request id and answered INTERNAL with only
that id, never the exception's text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from service.auth import check_bearer
from service.errors import Overloaded, ServiceError, report, shown_message
from service.grpc.codec import parse
from service.observability.request_ids import RequestIds, request_id_var

log = logging.getLogger(__name__)
request_log = logging.getLogger(f"{__name__}.access")  # one line per call

M = TypeVar("M", bound=Message)
Context = grpc.aio.ServicerContext[Any, Any]

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    431: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(error: ServiceError) -> grpc.StatusCode:
    """The gRPC status of a service error: by its HTTP status (400 INVALID_ARGUMENT, 401
    UNAUTHENTICATED, 404 NOT_FOUND, 413 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504
    DEADLINE_EXCEEDED, ...); another 4xx is INVALID_ARGUMENT, another 5xx INTERNAL."""
    code = _CODES.get(error.status_code)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if error.status_code < 500 else grpc.StatusCode.INTERNAL


def _metadata(context: Context, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("latin-1")
    return None


class Rpcs:
    """Wraps handlers into grpcio method handlers with the common envelope.

    Args:
        auth_token: the bearer token every call except the open ones must carry, or None.
        access_log: log one line per call (method, status, milliseconds, request id).
    """

    def __init__(self, *, auth_token: str | None = None, access_log: bool = True) -> None:
        self._token = auth_token.encode() if auth_token is not None else None
        self.access_log = access_log
        self.request_ids = RequestIds()

    def _begin(self, context: Context) -> tuple[str, Any]:
        sent = _metadata(context, "x-request-id")
        rid = self.request_ids(sent.encode("latin-1") if sent is not None else None)
        return rid, request_id_var.set(rid)

    def _end(self, method: str, code: str, t0: float, token: Any) -> None:
        if self.access_log:
            request_log.info("gRPC %s %s %.1fms", method, code, (time.perf_counter() - t0) * 1e3)
        request_id_var.reset(token)

    def authorize(self, context: Context) -> None:
        """Raise Unauthorized unless the call carries the bearer token (when one is set)."""
        if self._token is not None:
            check_bearer(_metadata(context, "authorization"), self._token)

    def unary(
        self,
        method: str,
        request_type: type[M] | None,
        fn: Callable[[Any, Context], Awaitable[Message | bytes]],
        *,
        open_: bool = False,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """A unary method: parse, authorize (unless ``open_``), call ``fn``, serialize.

        Args:
            method: the RPC's name (logs).
            request_type: the request message, or None to hand ``fn`` the raw bytes.
            fn: the handler; it returns the response message or its bytes.
            open_: no token needed (health, as REST's health endpoints).
        """

        async def call(raw: bytes, context: Context) -> bytes:
            t0 = time.perf_counter()
            rid, token = self._begin(context)
            code = "CANCELLED"
            try:
                try:
                    if not open_:
                        self.authorize(context)
                    request = raw if request_type is None else parse(request_type, raw)
                    response = await fn(request, context)
                    code = "OK"
                    return response if isinstance(response, bytes) else response.SerializeToString()
                except ServiceError as e:
                    status, details, trailers = self.status(e, method)
                except Exception:
                    log.exception("unhandled error in gRPC %s", method)
                    status, details = grpc.StatusCode.INTERNAL, f"internal error (request id {rid})"
                    trailers = ()
                code = status.name
                await context.abort(status, details, trailing_metadata=trailers)
            finally:
                self._end(method, code, t0, token)

        return grpc.unary_unary_rpc_method_handler(call)

    def stream(
        self,
        method: str,
        fn: Callable[[AsyncIterator[bytes], Context], AsyncIterator[bytes]],
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """A bidirectional streaming method: authorize once, then ``fn`` owns the stream
        (it answers each message's errors in-band)."""

        async def call(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
            # No request id of its own here: an async generator may be closed from another
            # context than the one it set a variable in; each message gets its id in ``fn``.
            t0 = time.perf_counter()
            code = "CANCELLED"
            try:
                try:
                    self.authorize(context)
                except ServiceError as e:
                    status, details, trailers = self.status(e, method)
                    code = status.name
                    await context.abort(status, details, trailing_metadata=trailers)
                async for out in fn(requests, context):
                    yield out
                code = "OK"
            finally:
                if self.access_log:
                    ms = (time.perf_counter() - t0) * 1e3
                    request_log.info("gRPC %s %s %.1fms", method, code, ms)

        return grpc.stream_stream_rpc_method_handler(call)

    @staticmethod
    def status(
        error: ServiceError, method: str
    ) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
        """The status, details and trailing metadata that answer ``error`` (shown and logged
        by the rule every transport follows: ``service.errors``)."""
        report(log, f"gRPC {method}", error)
        trailers: tuple[tuple[str, str], ...] = ()
        if isinstance(error, Overloaded):
            trailers = (("retry-after", str(error.retry_after)),)
        return grpc_code(error), shown_message(error), trailers
