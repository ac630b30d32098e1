"""Everything the sync and async clients share that is not I/O.

:class:`BaseClient` reads the defaults (``$BITSERVE_URL``, ``$BITSERVE_TOKEN``), builds URLs,
headers and request bodies (packing inputs via :mod:`._spec`), compresses bodies, decodes
responses, maps HTTP and transport failures to the exception tree in :mod:`._exceptions` and
decides on retries. :class:`~._client.Client` and :class:`~._async_client.AsyncClient` only
send. Every helper here is private: the public surface is the methods of those two classes.
"""

from __future__ import annotations

import datetime
import email.utils
import gzip
import json
import logging
import os
import ssl
import time
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast
from urllib.parse import quote

import httpx
import numpy as np

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
from ._h1 import Reply, frame_body
from ._retry import Retry
from ._search import SearchOutputs, search_outputs, search_queries
from ._spec import Bitorder, ModelSpec, parse_model_spec, prepare_inputs, to_numpy
from ._types import InferResult, Inputs
from ._version import __version__

logger = logging.getLogger("bitserve_client")

Compression = Literal["gzip", "deflate"] | None
TimeoutTypes = float | None | httpx.Timeout
VerifyTypes = ssl.SSLContext | str | bool
CertTypes = str | tuple[str, str] | tuple[str, str, str]
ProxyTypes = str | httpx.URL | httpx.Proxy

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
# Idle connections are dropped after 4 s, under the server's 5 s keep-alive timeout: with
# equal timeouts a request can go out on a connection the server is closing at that moment.
DEFAULT_LIMITS = httpx.Limits(
    max_connections=64, max_keepalive_connections=64, keepalive_expiry=4.0
)
USER_AGENT = f"bitserve-client/{__version__}"
REQUEST_ID = "X-Request-ID"

# Transport failures retried for every call, inference included: the connection was never
# made, or it broke while the request or its answer was on the wire (typically a kept-alive
# connection the server closed: RemoteProtocolError, ReadError, WriteError). The request may
# then have reached the server, but V2 inference and the metadata calls have no side effects
# (an inference only computes its answer), and loading or unloading a model twice leaves the
# same state, so sending it again is safe. Timeouts other than the connect timeout are not
# retried: the server may still be computing.
_RETRYABLE_TRANSPORT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


class _Reply(Protocol):
    """What the decoders read from an answer: an ``httpx.Response`` or a :class:`_Answer`."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> httpx.Headers: ...
    @property
    def content(self) -> bytes: ...
    @property
    def url(self) -> httpx.URL | str: ...


class _Answer:
    """A whole answer from the lean transport (:mod:`._h1`), read as httpx would read it.

    Attributes:
        status_code: the status.
        headers: the header fields (case-insensitive, as ``httpx.Response.headers``).
        content: the body with its ``Content-Encoding`` (gzip, deflate) undone.
        url: the request's URL.
    """

    __slots__ = ("content", "headers", "status_code", "url")

    def __init__(self, reply: Reply, url: str) -> None:
        self.status_code = reply.status_code
        self.headers = httpx.Headers(reply.fields)
        self.url = url
        self.content = reply.body
        coding = self.headers.get("Content-Encoding")
        if coding:
            self.content = _undo_encoding(reply.body, coding, url)


def _undo_encoding(body: bytes, coding: str, url: str) -> bytes:
    """``body`` with the codings of a ``Content-Encoding`` value undone, last applied first.

    gzip and deflate (zlib, or raw deflate as some servers send it) as httpx decodes them;
    ``identity`` is nothing. Any other coding was not asked for: ``DecodeError``.
    """
    for name in reversed([c.strip().lower() for c in coding.split(",") if c.strip()]):
        try:
            if name == "gzip":
                body = zlib.decompress(body, 16 + zlib.MAX_WBITS)
            elif name == "deflate":
                try:
                    body = zlib.decompress(body)
                except zlib.error:
                    body = zlib.decompress(body, -zlib.MAX_WBITS)
            elif name != "identity":
                raise DecodeError(f"{url}: Content-Encoding {name!r} was not asked for")
        except zlib.error as exc:
            raise DecodeError(f"{url}: the answer is not valid {name}: {exc}") from None
    return body


def _field_line(name: str, value: str) -> bytes:
    """``Name: value\\r\\n``, refusing what httpx refuses: non-ASCII, CR, LF, NUL."""
    line = f"{name}: {value}\r\n"
    if not line.isascii() or any(c in line[:-2] for c in "\r\n\0") or not name or ":" in name:
        raise InvalidInputError(
            f"header {name!r}: names and values must be ASCII without CR, LF or NUL"
        )
    return line.encode("ascii")


@dataclass(frozen=True)
class _Request:
    """One call, ready to send (possibly several times).

    Attributes:
        method: the HTTP method.
        path: the path under the client's URL, names escaped.
        body: the body (framed tensors, or bytes), or None.
        headers: the call's own headers, on top of the client's.
        timeout: the call's HTTP timeout; None for the client's.
        retry: whether 503s and broken connections are retried.
        single: for an inference, whether the outputs drop the batch dimension.
    """

    method: str
    path: str
    body: EncodedBody | bytes | None = None
    headers: Mapping[str, str] | None = None
    timeout: httpx.Timeout | None = None
    retry: bool = True
    single: bool = False

    def content(self) -> bytes | list[bytes] | None:
        """The body: bytes, or framed tensors as chunks (a fresh list for every attempt).

        Tensor chunks are memoryviews over the caller's arrays (typed as bytes for httpx):
        httpx and h11 take any bytes-like object, so the payload is never joined into one copy.
        A chunked body is sent with the Content-Length the framing computed.
        """
        if self.body is None or isinstance(self.body, bytes):
            return self.body
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


def _ssl_verify(verify: VerifyTypes, cert: CertTypes | None) -> VerifyTypes:
    """What to give httpx as ``verify``: an SSL context when a client certificate is used.

    httpx deprecates ``cert=`` and ``verify=<path>`` in favour of an ``ssl.SSLContext``; the
    client still takes both (like tritonclient and requests) and builds the context here.
    """
    if cert is None and not isinstance(verify, str):
        return verify
    if isinstance(verify, ssl.SSLContext):
        ctx = verify
    elif verify is False:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, str):  # a CA bundle file or a folder of CA certificates
        is_dir = os.path.isdir(verify)
        ctx = ssl.create_default_context(
            cafile=None if is_dir else verify, capath=verify if is_dir else None
        )
    elif os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR"):  # as httpx does
        ctx = ssl.create_default_context(
            cafile=os.environ.get("SSL_CERT_FILE") or None,
            capath=os.environ.get("SSL_CERT_DIR") or None,
        )
    else:
        import certifi  # an httpx dependency; the CA bundle httpx itself uses

        ctx = ssl.create_default_context(cafile=certifi.where())
    if cert is not None:
        if isinstance(cert, str):
            ctx.load_cert_chain(cert)
        else:
            ctx.load_cert_chain(*cert)
    return ctx


class BaseClient:
    """The non-I/O half of a bitserve / V2 client (see ``Client`` for the arguments)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        retries: int | Retry = 3,
        compression: Compression = None,
        compression_level: int = 1,
        headers: Mapping[str, str] | None = None,
        verify: VerifyTypes = True,
        cert: CertTypes | None = None,
        proxy: ProxyTypes | None = None,
        http2: bool = False,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ) -> None:
        if compression not in (None, "gzip", "deflate"):
            raise ValueError(f"compression must be 'gzip', 'deflate' or None, not {compression!r}")
        if isinstance(compression_level, bool) or compression_level not in range(10):
            raise ValueError(f"compression_level must be an int 0..9, not {compression_level!r}")
        url = url or os.environ.get("BITSERVE_URL") or DEFAULT_URL
        if "://" not in url:
            url = "http://" + url
        if token is None:
            token = os.environ.get("BITSERVE_TOKEN") or None
        self._url = url.rstrip("/")
        self._compression: Compression = compression
        self._level = compression_level
        self._retry = retries if isinstance(retries, Retry) else Retry(retries=int(retries))
        # httpx asks for gzip/deflate responses by default, but bit-packed inputs give float
        # outputs that barely compress: the server's CPU and the latency are spent for ~10%.
        # So the responses come uncompressed unless compression was asked for.
        base_headers: dict[str, str] = {
            "User-Agent": USER_AGENT,
            "Accept-Encoding": compression or "identity",
        }
        if token:
            base_headers["Authorization"] = f"Bearer {token}"
        base_headers.update(headers or {})
        # Everything the httpx client is built with; Client / AsyncClient add the transport.
        self._http_options: dict[str, Any] = {
            "base_url": self._url,
            "headers": base_headers,
            "timeout": timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
            "limits": limits,
            "verify": _ssl_verify(verify, cert),
            "proxy": proxy,
            "http2": http2,
        }
        self._specs: dict[tuple[str, str | None], ModelSpec] = {}

    def _lean_transport_applies(self, proxy: ProxyTypes | None, http2: bool) -> bool:
        """Whether the lean HTTP/1.1 transport (:mod:`._h1`) can carry this client's calls.

        Only for a plain ``http://`` URL with no proxy: none given and none in the
        environment (``HTTP_PROXY`` / ``ALL_PROXY``, any case, even where ``NO_PROXY`` would
        exempt the host: those set-ups keep httpx's own transport), and no HTTP/2.
        """
        if proxy is not None or http2 or not self._url.lower().startswith("http://"):
            return False
        proxies = urllib.request.getproxies_environment()
        return "http" not in proxies and "all" not in proxies

    def _lean_setup(self) -> None:
        """What every request over the lean transport shares, computed once: where it goes
        (host, port, the URL's path prefix), the client's header fields as httpx would send
        them (``Host``, ``Accept``, then the client's), and the client's timeouts."""
        url = httpx.URL(self._url)
        self._lean_host = url.host
        self._lean_port = url.port or 80
        self._lean_prefix = url.raw_path.rstrip(b"/")
        fields = {"host": ("Host", url.netloc.decode("ascii")), "accept": ("Accept", "*/*")}
        for name, value in self._http_options["headers"].items():
            fields[name.lower()] = (name, value)
        self._lean_fields = {low: _field_line(*nv) for low, nv in fields.items()}
        self._lean_timeouts = cast(httpx.Timeout, self._http_options["timeout"]).as_dict()

    def _lean_request(
        self, request: _Request
    ) -> tuple[bytes, list[bytes | memoryview], dict[str, float | None]]:
        """One attempt's head, body pieces (the transport joins a small body to the head:
        one send) and timeouts, for the lean transport (sync or async)."""
        content = request.content()
        if content is None:
            parts: list[bytes | memoryview] = []
        else:
            parts = [content] if isinstance(content, bytes) else frame_body(content, chunked=False)
        head = self._lean_head(request, None if content is None else sum(len(p) for p in parts))
        timeouts = self._lean_timeouts if request.timeout is None else request.timeout.as_dict()
        return head, parts, timeouts

    def _lean_head(self, request: _Request, length: int | None) -> bytes:
        """The request line and header fields of ``request`` for the lean transport: the
        client's fields, the call's over them (case-insensitively, as httpx merges), and
        ``Content-Length`` for a body unless the call gave one."""
        fields = self._lean_fields
        if request.headers:
            fields = dict(fields)
            for name, value in request.headers.items():
                fields[name.lower()] = _field_line(name, value)
        if length is not None and "content-length" not in fields:
            fields = {**fields, "content-length": b"Content-Length: %d\r\n" % length}
        line = b"%s %s%s HTTP/1.1\r\n" % (
            request.method.encode("ascii"),
            self._lean_prefix,
            request.path.encode("ascii"),
        )
        return b"".join([line, *fields.values(), b"\r\n"])

    # Set by Client / AsyncClient: the httpx client that sends.
    _http: httpx.Client | httpx.AsyncClient

    @property
    def url(self) -> str:
        """The server's base URL (``$BITSERVE_URL`` or ``http://127.0.0.1:8000`` by default)."""
        return self._url

    # -- URLs ------------------------------------------------------------------------------

    @staticmethod
    def _model_path(model: str, version: str | None = None, suffix: str = "") -> str:
        """``/v2/models/{model}[/versions/{version}]{suffix}`` with the names escaped."""
        if not model:
            raise InvalidInputError("model name is empty")
        path = "/v2/models/" + quote(model, safe="")
        if version is not None:
            path += "/versions/" + quote(str(version), safe="")
        return path + suffix

    @staticmethod
    def _repository_path(model: str, action: str) -> str:
        if not model:
            raise InvalidInputError("model name is empty")
        return f"/v2/repository/models/{quote(model, safe='')}/{action}"

    # -- requests --------------------------------------------------------------------------

    @staticmethod
    def _timeout(timeout: TimeoutTypes) -> httpx.Timeout | None:
        """A call's own HTTP timeout, or None for the client's."""
        if timeout is None or isinstance(timeout, httpx.Timeout):
            return timeout
        return httpx.Timeout(timeout)

    def _get(
        self,
        path: str,
        headers: Mapping[str, str] | None,
        timeout: TimeoutTypes,
        *,
        retry: bool = True,
    ) -> _Request:
        return _Request("GET", path, None, headers, self._timeout(timeout), retry)

    def _post_json(
        self,
        path: str,
        doc: Mapping[str, Any],
        headers: Mapping[str, str] | None,
        timeout: TimeoutTypes,
    ) -> _Request:
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        body = json.dumps(doc, separators=(",", ":")).encode()
        return _Request("POST", path, body, all_headers, self._timeout(timeout))

    def _index_request(
        self, ready: bool, headers: Mapping[str, str] | None, timeout: TimeoutTypes
    ) -> _Request:
        doc = {"ready": True} if ready else {}
        return self._post_json("/v2/repository/index", doc, headers, timeout)

    def _load_request(
        self,
        model: str,
        config: Mapping[str, Any] | str | None,
        headers: Mapping[str, str] | None,
        timeout: TimeoutTypes,
    ) -> _Request:
        """``POST .../load``; a config override goes in ``parameters.config`` as a JSON string."""
        doc: dict[str, Any] = {}
        if config is not None:
            text = config if isinstance(config, str) else json.dumps(dict(config))
            doc["parameters"] = {"config": text}
        self._forget_spec(model)
        return self._post_json(self._repository_path(model, "load"), doc, headers, timeout)

    def _unload_request(
        self, model: str, headers: Mapping[str, str] | None, timeout: TimeoutTypes
    ) -> _Request:
        self._forget_spec(model)
        return self._post_json(self._repository_path(model, "unload"), {}, headers, timeout)

    def _cached_spec(self, model: str, version: str | None) -> ModelSpec | None:
        """The model's spec if it was fetched already."""
        return self._specs.get((model, version))

    def _store_spec(
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

    def _forget_spec(self, model: str) -> None:
        """Drop a model's cached specs (it may have been reloaded with another config)."""
        for key in [k for k in list(self._specs) if k[0] == model]:  # list(): other threads
            self._specs.pop(key, None)

    def _infer_request(
        self,
        spec: ModelSpec | None,
        model: str,
        inputs: Inputs,
        *,
        outputs: Sequence[str] | None,
        version: str | None,
        request_id: str | None,
        deadline: float | None,
        binary: bool,
        headers: Mapping[str, str] | None,
        timeout: TimeoutTypes,
        bitorder: Bitorder | None = None,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> _Request:
        """Check, pack and frame one inference call (the arguments of ``Client.infer``;
        ``parameters``: more request parameters, as :meth:`_search_request` sends)."""
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
        if deadline is not None and not deadline > 0:
            raise InvalidInputError(f"deadline must be > 0 seconds, got {deadline}")
        if priority is not None and (
            isinstance(priority, bool) or not isinstance(priority, int) or priority < 0
        ):
            raise InvalidInputError(f"priority must be an integer >= 0, got {priority!r}")
        if bitorder not in (None, "big", "little"):
            raise InvalidInputError(f"bitorder must be 'big' or 'little', got {bitorder!r}")
        prepared = prepare_inputs(spec, inputs, bitorder)
        body = encode_request(
            prepared.tensors,
            outputs,
            request_id=request_id,
            deadline_s=deadline,
            binary=binary,
            priority=priority,
            parameters=parameters,
        )
        all_headers = dict(body.headers)
        content: EncodedBody | bytes = body
        if self._compression is not None:
            raw = body.to_bytes()
            # gzip for "gzip"; RFC 9110's "deflate" is the zlib format (what zlib.compress makes).
            # Level 1 by default: packed bits compress about as well at 1 as at 9, in a
            # fraction of the time (README "Compression").
            content = (
                gzip.compress(raw, compresslevel=self._level)
                if self._compression == "gzip"
                else zlib.compress(raw, self._level)
            )
            all_headers["Content-Encoding"] = self._compression
            length = len(content)
        else:
            length = body.length
        all_headers["Content-Length"] = str(length)
        all_headers.update(headers or {})
        return _Request(
            "POST",
            self._model_path(model, version, "/infer"),
            content,
            all_headers,
            self._timeout(timeout),
            single=prepared.single,
        )

    def _search_request(
        self,
        spec: ModelSpec,
        model: str,
        queries: Any,
        k: int | None,
        threshold: float | None,
        *,
        version: str | None,
        headers: Mapping[str, str] | None,
        timeout: TimeoutTypes,
        bitorder: Bitorder | None,
    ) -> tuple[_Request, SearchOutputs]:
        """Check and frame one search of an index model (the arguments of ``Client.search``)."""
        query, outputs = search_outputs(spec, model)
        parameters: dict[str, Any] = {}
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
                raise InvalidInputError(f"k must be an integer >= 1, got {k!r}")
            parameters["k"] = int(k)
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, int | float | np.number):
                raise InvalidInputError(f"threshold must be a number in [0, 1], got {threshold!r}")
            if not 0.0 <= float(threshold) <= 1.0:
                raise InvalidInputError(f"threshold must be in [0, 1], got {threshold!r}")
            parameters["threshold"] = float(threshold)
        arr = search_queries(to_numpy(queries, query), query)
        request = self._infer_request(
            spec, model, {query: arr}, outputs=None, version=version, request_id=None,
            deadline=None, binary=True, headers=headers, timeout=timeout, bitorder=bitorder,
            parameters=parameters,
        )  # fmt: skip
        return request, outputs

    @classmethod
    def _decode_search(
        cls, response: _Reply, single: bool, outputs: SearchOutputs
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """``(ids, scores)`` of a search's answer."""
        result = cls._decode_infer(response, single)
        return result[outputs.ids], result[outputs.scores]

    # -- responses -------------------------------------------------------------------------

    @staticmethod
    def _server_error(response: _Reply) -> ServerError:
        """The exception for a non-200 response, carrying the server's error text."""
        return error_for_status(
            response.status_code,
            error_message(response.content),
            parse_retry_after(response.headers.get("Retry-After")),
            response.headers.get(REQUEST_ID),
        )

    @staticmethod
    def _decode_json(response: _Reply) -> Any:
        """The JSON document of a 200 response."""
        try:
            return json.loads(response.content)
        except ValueError as exc:
            raise DecodeError(f"{response.url}: response is not JSON: {exc}") from None

    @classmethod
    def _decode_object(cls, response: _Reply) -> dict[str, Any]:
        value = cls._decode_json(response)
        if not isinstance(value, dict):
            raise DecodeError(f"{response.url}: expected a JSON object")
        return value

    @classmethod
    def _decode_index(cls, response: _Reply) -> list[dict[str, Any]]:
        value = cls._decode_json(response)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise DecodeError(f"{response.url}: expected a JSON list of objects")
        return value

    @staticmethod
    def _decode_infer(response: _Reply, single: bool) -> InferResult:
        """Decode a 200 inference response (binary or JSON)."""
        raw = response.headers.get(HEADER_LENGTH)
        try:
            header_length = None if raw is None else int(raw)
        except ValueError:
            raise DecodeError(f"bad {HEADER_LENGTH} header {raw!r}") from None
        return decode_response(
            response.content, header_length, single=single, headers=response.headers
        )

    @staticmethod
    def _raise_if_denied(error: ServerError) -> None:
        """Raise ``error`` if it refused the call for want of credentials (401, 403).

        A refused ``/config`` fetch otherwise means no config: a plain V2 server (KServe)
        has no ``/config``.
        """
        if error.status in (401, 403):
            raise error

    def _infer_refused(self, model: str, error: ServerError) -> None:
        """An inference refused with 400 or 404: the model may have been reloaded with
        another config, so its spec is fetched again next time."""
        if error.status in (400, 404):
            self._forget_spec(model)

    @staticmethod
    def _probe_answer(error: ServerError, model: str | None) -> bool:
        """A health probe's non-200 answer: False for "not ready", else raise ``error``.

        503 is the server's "not live / not ready"; for a model, 404 (unknown, or unloaded)
        is "not ready" too, as in tritonclient. Anything else (401 without a token, 404 from
        a wrong URL prefix) is a failed call, not an answer, and raises.
        """
        if error.status == 503 or (model is not None and error.status == 404):
            return False
        raise error

    # -- failures and retries --------------------------------------------------------------

    @staticmethod
    def _transport_error(exc: httpx.TransportError, method: str, url: str) -> TransportError:
        """Map an httpx transport failure to the client's exception tree."""
        text = f"{method} {url}: {type(exc).__name__}: {exc}".rstrip(": ")
        if isinstance(exc, httpx.TimeoutException):
            return TimeoutException(text)
        if isinstance(exc, httpx.ConnectError):
            return ConnectError(text)
        return TransportError(text)

    @staticmethod
    def _closed_error(request: _Request) -> BitserveError:
        return BitserveError(f"{request.method} {request.path}: the client is closed")

    def _check_open(self, request: _Request, cause: BaseException | None = None) -> None:
        """Raise ``BitserveError`` if the client is closed (``cause``: what httpx raised)."""
        if self._http.is_closed:
            raise self._closed_error(request) from cause

    def _after_failure(self, request: _Request, attempt: int, exc: httpx.TransportError) -> float:
        """Seconds to wait before retrying after a transport failure; raises if not retried."""
        error = self._transport_error(exc, request.method, self._url + request.path)
        return self._next_attempt(request, attempt, error, exc)

    def _after_refusal(self, request: _Request, attempt: int, response: _Reply) -> float:
        """Seconds to wait before retrying after a non-200 answer; raises if not retried."""
        return self._next_attempt(request, attempt, self._server_error(response))

    def _next_attempt(
        self,
        request: _Request,
        attempt: int,
        error: BitserveError,
        cause: BaseException | None = None,
    ) -> float:
        """Log and return the delay before the next attempt, or raise ``error``."""
        delay = self._retry_delay(request, attempt, error, cause)
        if delay is None:
            raise error from cause
        self._log_retry(request, error, delay, attempt)
        return delay

    def _retry_delay(
        self,
        request: _Request,
        attempt: int,
        error: BitserveError,
        cause: BaseException | None = None,
    ) -> float | None:
        """Seconds to wait before retrying after ``error``, or None to raise it."""
        if not request.retry:
            return None
        if isinstance(error, ServerError):
            if error.status != 503:
                return None
            return self._retry.delay(attempt, error.retry_after)
        if isinstance(cause, _RETRYABLE_TRANSPORT):
            return self._retry.delay(attempt)
        return None

    @staticmethod
    def _log_retry(request: _Request, error: BitserveError, delay: float, attempt: int) -> None:
        logger.info(
            "retry %d of %s %s in %.3fs after: %s",
            attempt + 1,
            request.method,
            request.path,
            delay,
            error,
        )
