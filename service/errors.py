"""Errors the service raises, each carrying its HTTP status, and the one rule every transport
answers and logs them by.

Every transport writes an error the same way: the status it carries (gRPC maps it to a status
code, ``service.grpc.rpc.grpc_code``), its message made safe to show (:func:`shown_message`:
control characters escaped, at most ``MAX_MESSAGE_CHARS``), and one log line at the level
:func:`log_level` gives (:func:`report`). REST's body is ``{"error": "<message>"}`` (what V2
clients parse), written by ``service.rest.errors``; gRPC's is the status details.

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
     +-- Relayed (the status another layer answered: a peer worker, FastAPI's router)
"""

from __future__ import annotations

import logging

from service.text import safe_text

MAX_MESSAGE_CHARS = 4096
"""The longest message an answer carries (a longer one is cut, saying so)."""


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


class Relayed(ServiceError):
    """An error another layer answered, passed on with its status (a peer worker's answer to
    a change, FastAPI's router's 404 and 405)."""

    def __init__(
        self, status_code: int, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message, headers=headers)
        self.status_code = status_code


class HeaderLimit(ServiceError):
    """Too many request headers, or too many bytes of them (431; the body is never read)."""

    status_code = 431


def shown_message(error: ServiceError) -> str:
    """The message of ``error`` as an answer shows it: control and unprintable characters
    escaped, at most :data:`MAX_MESSAGE_CHARS` characters."""
    return safe_text(error.message, MAX_MESSAGE_CHARS)


def log_level(error: ServiceError) -> int:
    """How an answered error is logged, the same for every transport: trouble on the server's
    side (a 5xx, but 501: a part of the protocol not offered, which clients may ask about) is a
    warning; a client's mistake or question is info."""
    trouble = error.status_code >= 500 and error.status_code != Unimplemented.status_code
    return logging.WARNING if trouble else logging.INFO


def report(logger: logging.Logger, where: str, error: ServiceError) -> None:
    """Log an answered error: ``<where> -> <status>: <message>`` at :func:`log_level`."""
    logger.log(log_level(error), "%s -> %d: %s", where, error.status_code, shown_message(error))
