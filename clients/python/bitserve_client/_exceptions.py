"""Exceptions raised by the bitserve client.

Every error the client raises on purpose derives from :class:`BitserveError`::

    BitserveError
     +-- TransportError           no usable HTTP answer came back
     |    +-- ConnectError        could not connect (refused, DNS, reset before a response)
     |    +-- TimeoutException    the HTTP timeout fired (also a builtins.TimeoutError)
     +-- ServerError              the server answered non-200; .status, .message (its text),
     |    |                       .request_id (its X-Request-ID)
     |    +-- Unauthorized        401 / 403: a missing or wrong token
     |    +-- ModelNotFound       404
     |    +-- Unavailable         503 (queue full / model not ready); .retry_after
     |    +-- DeadlineExceeded    504: the request's deadline passed on the server
     |                            (also a builtins.TimeoutError)
     +-- InvalidInputError        an input failed a local check; nothing was sent
     |                            (also a ValueError)
     +-- DecodeError              the answer is not a valid V2 response
     +-- BulkInferenceError       infer_many stopped part way; .rows_done, .result; the
                                  cause is the error above that stopped it

A call on a closed client raises :class:`BitserveError` itself.

``except TimeoutError`` therefore catches both a client-side and a server-side timeout.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._types import BulkResult

__all__ = [
    "BitserveError",
    "BulkInferenceError",
    "ConnectError",
    "DeadlineExceeded",
    "DecodeError",
    "InvalidInputError",
    "ModelNotFound",
    "ServerError",
    "TimeoutException",
    "TransportError",
    "Unauthorized",
    "Unavailable",
]


class BitserveError(Exception):
    """Base class of every error the client raises on purpose."""


class TransportError(BitserveError):
    """No usable HTTP answer: the connection failed, broke or timed out."""


class ConnectError(TransportError):
    """The connection could not be made (refused, unreachable, reset before a response)."""


class TimeoutException(TransportError, builtins.TimeoutError):
    """The client's HTTP timeout (connect, write, read or pool) fired."""


class ServerError(BitserveError):
    """The server answered with a non-200 status.

    Attributes:
        status: the HTTP status code.
        message: the server's error text (the ``"error"`` field of a V2 error body, or the
            raw body when it is not JSON).
        retry_after: seconds from the ``Retry-After`` header, or None.
        request_id: the response's ``X-Request-ID`` (bitserve logs the details of a 500
            under it), or None when the server sent none.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after: float | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.request_id = request_id


class Unauthorized(ServerError):
    """401 or 403: the server wants a (different) bearer token (``token=``, ``$BITSERVE_TOKEN``)."""


class ModelNotFound(ServerError):
    """404: no such model or version on the server."""


class Unavailable(ServerError):
    """503: the model's queue is full or the model is not ready; retried by default."""


class DeadlineExceeded(ServerError, builtins.TimeoutError):
    """504: the request's deadline (``infer(..., timeout=)``) passed on the server."""


class InvalidInputError(BitserveError, ValueError):
    """An input failed a local check (name, dtype, shape, values); nothing was sent."""


class DecodeError(BitserveError):
    """The server's answer is not a valid V2 response (bad JSON, sizes that do not add up)."""


class BulkInferenceError(BitserveError):
    """``infer_many`` stopped part way; the error that stopped it is ``__cause__``.

    The first ``rows_done`` rows are complete: in ``result`` and, with ``out=``, in the
    ``.npy`` files, whose headers state exactly those rows (``np.load`` reads them). Run the
    same call again with ``resume=True`` to send only the remaining rows.

    Attributes:
        rows_done: how many rows, from the first, have their results.
        total: the number of input rows, or None when the input was an iterator.
        result: the results of the first ``rows_done`` rows.
    """

    def __init__(
        self, message: str, *, rows_done: int, total: int | None, result: BulkResult
    ) -> None:
        super().__init__(message)
        self.rows_done = rows_done
        self.total = total
        self.result = result


def error_for_status(
    status: int, message: str, retry_after: float | None, request_id: str | None = None
) -> ServerError:
    """The most specific :class:`ServerError` subclass for an HTTP status."""
    cls: type[ServerError]
    if status in (401, 403):
        cls = Unauthorized
    elif status == 404:
        cls = ModelNotFound
    elif status == 503:
        cls = Unavailable
    elif status == 504:
        cls = DeadlineExceeded
    else:
        cls = ServerError
    return cls(status, message, retry_after=retry_after, request_id=request_id)
