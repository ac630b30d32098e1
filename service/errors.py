"""Errors the service raises, each carrying its HTTP status.

Every non-200 answer has the body ``{"error": "<message>"}`` (what V2 clients parse); the
handlers that turn these into responses are registered in ``service.rest.app.create_app``.

    ServiceError (500)
     +-- InvalidInput (400)
     |    +-- ChangeFailed (400)
     +-- Unauthorized (401)
     +-- NotFound (404)
     |    +-- ModelNotFound (404)
     +-- RequestTimeout (408, Connection: close)
     +-- PayloadTooLarge (413)
     +-- UnsupportedMediaType (415)
     +-- Overloaded (503, Retry-After)
     +-- ModelNotReady (503)
     +-- Unimplemented (501)
     +-- DeadlineExceeded (504)
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: an error with an HTTP status and a message safe to show a client."""

    status_code: int = 500

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})


class InvalidInput(ServiceError):
    """The request is malformed or does not match the model's inputs."""

    status_code = 400


class ChangeFailed(InvalidInput):
    """A change of the server's state that was tried and failed, leaving a trace that every
    worker should show alike (a load whose files are bad: the index gives the reason)."""


class Unauthorized(ServiceError):
    """A bearer token is configured and the request did not carry it."""

    status_code = 401

    def __init__(self, message: str = "missing or invalid bearer token") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class NotFound(ServiceError):
    """No such thing (a shared memory region, say) by that name."""

    status_code = 404


class ModelNotFound(NotFound):
    """No model (or no such version) by that name in the repository."""


class RequestTimeout(ServiceError):
    """The body did not arrive within the body timeout; the connection is closed after it."""

    status_code = 408

    def __init__(self, message: str) -> None:
        # The rest of the body is never read, so the connection cannot be reused.
        super().__init__(message, headers={"Connection": "close"})


class PayloadTooLarge(ServiceError):
    """The body (before or after decompression) exceeds the configured limit."""

    status_code = 413


class UnsupportedMediaType(ServiceError):
    """An unsupported ``Content-Encoding``."""

    status_code = 415


class Overloaded(ServiceError):
    """The model's queue is full; the client should retry after ``retry_after`` seconds."""

    status_code = 503

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        seconds = max(1, round(retry_after))
        super().__init__(message, headers={"Retry-After": str(seconds)})
        self.retry_after = seconds


class ModelNotReady(ServiceError):
    """The model exists but is loading, unloading or failed to load."""

    status_code = 503


class Unimplemented(ServiceError):
    """An operation of the protocol this server does not offer (gRPC's UNIMPLEMENTED)."""

    status_code = 501


class DeadlineExceeded(ServiceError):
    """The request's ``parameters.timeout`` expired before it could be computed."""

    status_code = 504
