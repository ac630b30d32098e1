"""Everything the sync and async clients share that is not I/O.

:class:`BaseClient` builds URLs and headers, frames requests (packing inputs via
:mod:`._spec`), compresses bodies, decodes responses, maps HTTP and transport failures to the
exception tree in :mod:`._exceptions` and decides on retries. :class:`~._client.Client` and
:class:`~._async_client.AsyncClient` only send.
"""

from __future__ import annotations

import datetime
import email.utils
import gzip
import json
import logging
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import quote

import httpx

from ._exceptions import (
    BitserveError,
    ConnectError,
    DecodeError,
    InvalidInputError,
    ServerError,
    TimeoutException,
    TransportError,
    error_for_status,
)
from ._framing import HEADER_LENGTH, EncodedBody, decode_response, encode_request, error_message
from ._retry import Retry
from ._spec import ModelSpec, parse_model_spec, prepare_inputs
from ._types import InferResult, Inputs
from ._version import __version__

logger = logging.getLogger("bitserve_client")

Compression = Literal["gzip", "deflate"] | None
TimeoutTypes = float | None | httpx.Timeout

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
# Idle connections are dropped after 4 s, under the server's 5 s keep-alive timeout: with
# equal timeouts a request can go out on a connection the server is closing at that moment.
DEFAULT_LIMITS = httpx.Limits(
    max_connections=64, max_keepalive_connections=64, keepalive_expiry=4.0
)
USER_AGENT = f"bitserve-client/{__version__}"

# Transport failures retried for every call, inference included: the connection was never
# made, or it broke while the request or its answer was on the wire (typically a kept-alive
# connection the server closed: RemoteProtocolError, ReadError, WriteError). The request may
# then have reached the server, but V2 inference and the metadata calls have no side effects
# (an inference only computes its answer), so sending it again is safe. Timeouts other than
# the connect timeout are not retried: the server may still be computing.
_RETRYABLE_TRANSPORT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


@dataclass(frozen=True)
class PreparedCall:
    """One framed inference call, ready to send (possibly several times)."""

    path: str
    body: EncodedBody | bytes
    headers: dict[str, str]
    single: bool

    def chunks(self) -> list[bytes]:
        """The body as bytes-like chunks; a fresh list for every attempt.

        Tensor chunks are memoryviews over the caller's arrays (typed as bytes for httpx):
        httpx and h11 take any bytes-like object, so the payload is never joined into one copy.
        """
        if isinstance(self.body, bytes):
            return [self.body]
        return cast("list[bytes]", list(self.body.chunks))


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP date (RFC 9110); None if absent."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # delta-seconds: digits only ("nan", "1e9": no)
        return float(int(value))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # no zone, or "-0000": HTTP dates are always GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - time.time())


class BaseClient:
    """The non-I/O half of a bitserve / V2 client.

    Args:
        url: the server's base URL, e.g. ``"http://127.0.0.1:8000"`` (a path prefix such as
            an ingress route is kept).
        token: a bearer token sent as ``Authorization: Bearer <token>``.
        timeout: the HTTP timeout in seconds (or an ``httpx.Timeout``); default 60 s,
            10 s to connect. A timeout raises :class:`TimeoutException`.
        retries: how many retries (an int) or a :class:`Retry` policy.
        compression: ``"gzip"`` or ``"deflate"`` to compress request bodies and accept
            responses compressed the same way, or None (the default: neither; responses are
            asked for with ``Accept-Encoding: identity``).
        headers: extra headers sent with every request.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        retries: int | Retry = 3,
        compression: Compression = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if compression not in (None, "gzip", "deflate"):
            raise ValueError(f"compression must be 'gzip', 'deflate' or None, not {compression!r}")
        if "://" not in url:
            url = "http://" + url
        self.url = url.rstrip("/")
        self.compression: Compression = compression
        self.retry = retries if isinstance(retries, Retry) else Retry(retries=int(retries))
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        # httpx asks for gzip/deflate responses by default, but bit-packed inputs give float
        # outputs that barely compress: the server's CPU and the latency are spent for ~10%.
        # So the responses come uncompressed unless compression was asked for.
        self.headers: dict[str, str] = {
            "User-Agent": USER_AGENT,
            "Accept-Encoding": compression or "identity",
        }
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"
        self.headers.update(headers or {})
        self._specs: dict[tuple[str, str | None], ModelSpec] = {}

    # -- URLs ------------------------------------------------------------------------------

    @staticmethod
    def model_path(model: str, version: str | None = None, suffix: str = "") -> str:
        """``/v2/models/{model}[/versions/{version}]{suffix}`` with the names escaped."""
        if not model:
            raise InvalidInputError("model name is empty")
        path = "/v2/models/" + quote(model, safe="")
        if version is not None:
            path += "/versions/" + quote(str(version), safe="")
        return path + suffix

    # -- requests --------------------------------------------------------------------------

    def cached_spec(self, model: str, version: str | None) -> ModelSpec | None:
        """The model's spec if it was fetched already."""
        return self._specs.get((model, version))

    def store_spec(
        self,
        model: str,
        version: str | None,
        metadata: Mapping[str, Any],
        config: Mapping[str, Any] | None,
    ) -> ModelSpec:
        """Parse and cache a model's spec from its metadata and config."""
        spec = parse_model_spec(metadata, config)
        self._specs[(model, version)] = spec
        return spec

    def forget_spec(self, model: str, version: str | None) -> None:
        """Drop a cached spec (the model may have been reloaded with another config)."""
        self._specs.pop((model, version), None)

    def prepare_infer(
        self,
        spec: ModelSpec | None,
        model: str,
        inputs: Inputs,
        outputs: Sequence[str] | None = None,
        *,
        version: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        binary: bool = True,
    ) -> PreparedCall:
        """Check, pack and frame one inference call (see ``Client.infer``)."""
        if not isinstance(inputs, Mapping):
            if spec is None or len(spec.inputs) != 1:
                names = list(spec.inputs) if spec is not None else "unknown"
                raise InvalidInputError(
                    f"model {model!r} has inputs {names}: pass a dict of name -> array"
                )
            inputs = {next(iter(spec.inputs)): inputs}
        if isinstance(outputs, str):
            outputs = [outputs]
        if outputs is not None and spec is not None and spec.outputs:
            unknown = [o for o in outputs if o not in spec.outputs]
            if unknown:
                raise InvalidInputError(
                    f"model {model!r} has no outputs {unknown}; outputs: {list(spec.outputs)}"
                )
        if timeout is not None and timeout <= 0:
            raise InvalidInputError(f"timeout must be > 0 seconds, got {timeout}")
        prepared = prepare_inputs(spec, inputs)
        body = encode_request(
            prepared.tensors,
            outputs,
            request_id=request_id,
            timeout_s=timeout,
            binary=binary,
        )
        headers = dict(body.headers)
        content: EncodedBody | bytes = body
        if self.compression is not None:
            raw = body.to_bytes()
            # gzip for "gzip"; RFC 9110's "deflate" is the zlib format (what zlib.compress makes).
            content = gzip.compress(raw) if self.compression == "gzip" else zlib.compress(raw)
            headers["Content-Encoding"] = self.compression
            length = len(content)
        else:
            length = body.length
        headers["Content-Length"] = str(length)
        return PreparedCall(
            self.model_path(model, version, "/infer"), content, headers, prepared.single
        )

    # -- responses -------------------------------------------------------------------------

    @staticmethod
    def server_error(response: httpx.Response) -> ServerError:
        """The exception for a non-200 response, carrying the server's error text."""
        return error_for_status(
            response.status_code,
            error_message(response.content),
            parse_retry_after(response.headers.get("Retry-After")),
        )

    @staticmethod
    def decode_json(response: httpx.Response) -> dict[str, Any]:
        """The JSON object of a 200 response."""
        try:
            value = json.loads(response.content)
        except ValueError as exc:
            raise DecodeError(f"{response.request.url}: response is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise DecodeError(f"{response.request.url}: expected a JSON object")
        return value

    @staticmethod
    def decode_infer(response: httpx.Response, single: bool) -> InferResult:
        """Decode a 200 inference response (binary or JSON)."""
        raw = response.headers.get(HEADER_LENGTH)
        try:
            header_length = None if raw is None else int(raw)
        except ValueError:
            raise DecodeError(f"bad {HEADER_LENGTH} header {raw!r}") from None
        return decode_response(response.content, header_length, single=single)

    # -- failures and retries --------------------------------------------------------------

    @staticmethod
    def transport_error(exc: httpx.TransportError, method: str, url: str) -> TransportError:
        """Map an httpx transport failure to the client's exception tree."""
        text = f"{method} {url}: {type(exc).__name__}: {exc}".rstrip(": ")
        if isinstance(exc, httpx.TimeoutException):
            return TimeoutException(text)
        if isinstance(exc, httpx.ConnectError):
            return ConnectError(text)
        return TransportError(text)

    def retry_delay(
        self, attempt: int, error: BitserveError, cause: BaseException | None = None
    ) -> float | None:
        """Seconds to wait before retrying after ``error``, or None to raise it."""
        if isinstance(error, ServerError):
            if error.status != 503:
                return None
            return self.retry.delay(attempt, error.retry_after)
        if isinstance(cause, _RETRYABLE_TRANSPORT):
            return self.retry.delay(attempt)
        return None

    @staticmethod
    def log_retry(method: str, url: str, error: BitserveError, delay: float, attempt: int) -> None:
        logger.info("retry %d of %s %s in %.3fs after: %s", attempt + 1, method, url, delay, error)
