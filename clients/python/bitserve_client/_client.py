"""The synchronous client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from ._base import (
    DEFAULT_LIMITS,
    DEFAULT_TIMEOUT,
    BaseClient,
    CertTypes,
    Compression,
    ProxyTypes,
    TimeoutTypes,
    VerifyTypes,
    _Answer,
    _Reply,
    _Request,
)
from ._bulk import Job, Options, infer_many_sync, iter_sync
from ._exceptions import ServerError
from ._h1 import H1Transport
from ._retry import Retry
from ._spec import Bitorder, ModelSpec
from ._types import ArrayLike, BulkResult, InferResult, Inputs

Headers = Mapping[str, str] | None
BulkData = ArrayLike | Mapping[str, ArrayLike] | str | Path | Iterable[Any]
BulkOut = str | Path | Mapping[str, str | Path] | None


class Client(BaseClient):
    """A synchronous client for bitserve and any Open Inference Protocol (V2) server.

    One client keeps a pool of kept-alive connections and is safe to share between threads.
    Use it as a context manager (or call :meth:`close`)::

        with Client("http://127.0.0.1:8000") as client:
            result = client.infer("demo", {"spikes": bits})   # bits: bool [batch, 20, 50000]
            result["resampled"]                               # float32 [batch, 20, 500]

    Every method takes ``headers=`` (extra headers for that call) and ``timeout=`` (that
    call's HTTP timeout; None: the client's).

    Args:
        url: the server's base URL (a path prefix such as an ingress route is kept); default
            ``$BITSERVE_URL``, else ``http://127.0.0.1:8000``.
        token: a bearer token sent as ``Authorization: Bearer <token>``; default
            ``$BITSERVE_TOKEN``; ``""`` sends none.
        timeout: the HTTP timeout in seconds or an ``httpx.Timeout`` (default 60 s, 10 s to
            connect; None: none); raises :class:`~bitserve_client.TimeoutException`.
        retries: retries after the first attempt (int) or a :class:`Retry` policy; retried
            are connection failures, connections dropped mid-call, and 503s; never other
            statuses, nor read timeouts.
        compression: ``"gzip"`` or ``"deflate"`` to compress request bodies and accept
            responses compressed the same way; None (the default) sends bodies as they are
            and asks for uncompressed responses (``Accept-Encoding: identity``).
        compression_level: zlib's level for request bodies, 0 (stored) to 9 (smallest);
            default 1, the fastest, which packed bits barely lose by (README "Compression").
        headers: extra headers for every request.
        verify: verify the server's TLS certificate (True, the default: against certifi's CA
            bundle), not (False), against a CA bundle file or folder (a path), or with an
            ``ssl.SSLContext``.
        cert: a client certificate for TLS: a file with the certificate and key, or a tuple
            (certificate file, key file[, key password]).
        proxy: a proxy URL (or ``httpx.Proxy``); by default the ``HTTPS_PROXY`` / ``HTTP_PROXY``
            environment applies.
        http2: use HTTP/2 where the server offers it (needs ``bitserve-client[http2]``).
        limits: connection pool limits (default 64 connections, all kept alive).
        transport: an httpx transport to send through (tests use ``httpx.MockTransport``).
            By default, for a plain ``http://`` URL with no proxy and ``http2=False``, a lean
            HTTP/1.1 transport of bitserve's own over kept-alive sockets (less than half the
            client's CPU per request; README "The Python client's transport"); httpx's own for
            anything else. ``transport=httpx.HTTPTransport()`` always uses httpx's.
    """

    _http: httpx.Client

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
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            url,
            token=token,
            timeout=timeout,
            retries=retries,
            compression=compression,
            compression_level=compression_level,
            headers=headers,
            verify=verify,
            cert=cert,
            proxy=proxy,
            http2=http2,
            limits=limits,
        )
        # The lean transport carries this client's own calls directly (_send), and sits
        # under the httpx client too, so anything sent through that goes the same way.
        self._lean: H1Transport | None = None
        if transport is None and self._lean_transport_applies(proxy, http2):
            self._lean = transport = H1Transport(limits)
            self._lean_setup()
        self._http = httpx.Client(**self._http_options, transport=transport)
        self._spec_lock = threading.Lock()
        self._sleep: Callable[[float], None] = time.sleep

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called; a closed client raises ``BitserveError``."""
        return self._http.is_closed

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- sending ---------------------------------------------------------------------------

    def _send(self, request: _Request) -> _Reply:
        """Send with retries; return a 200 response or raise."""
        attempt = 0
        while True:
            self._check_open(request)
            try:
                response: _Reply
                if self._lean is not None:
                    response = self._send_lean(self._lean, request)
                else:
                    response = self._http.request(
                        request.method,
                        request.path,
                        content=request.content(),
                        headers=request.headers,
                        timeout=request.timeout or httpx.USE_CLIENT_DEFAULT,
                    )
            except httpx.TransportError as exc:
                delay = self._after_failure(request, attempt, exc)
            except RuntimeError as exc:  # httpx: closed by another thread meanwhile
                self._check_open(request, exc)
                raise
            else:
                if response.status_code == 200:
                    return response
                delay = self._after_refusal(request, attempt, response)
            self._sleep(delay)
            attempt += 1

    def _send_lean(self, lean: H1Transport, request: _Request) -> _Answer:
        """One attempt over the lean transport: the head as httpx would build it."""
        head, parts, timeouts = self._lean_request(request)
        host, port = self._lean_host, self._lean_port
        reply = lean.exchange(host, port, head, parts, timeouts, request.method)
        return _Answer(reply, self._url + request.path)

    def _probe(self, request: _Request, model: str | None = None) -> bool:
        try:
            self._send(request)
        except ServerError as exc:
            return self._probe_answer(exc, model)
        return True

    # -- health and metadata ---------------------------------------------------------------

    def is_live(self, *, headers: Headers = None, timeout: TimeoutTypes = None) -> bool:
        """``GET /v2/health/live``: True on 200, False on 503.

        Raises:
            ServerError: any other answer (e.g. 404 from a wrong URL prefix).
            TransportError: no answer.
        """
        return self._probe(self._get("/v2/health/live", headers, timeout, retry=False))

    def is_ready(
        self,
        model: str | None = None,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> bool:
        """Whether the server (or one model) is ready: True on 200, False on 503.

        For a model, an unknown (or unloaded) one is not ready either (404: False).

        Raises:
            Unauthorized: the server wants a token (model readiness needs one where set).
            ServerError: any other answer.
            TransportError: no answer.
        """
        path = "/v2/health/ready" if model is None else self._model_path(model, version, "/ready")
        return self._probe(self._get(path, headers, timeout, retry=False), model)

    def server_metadata(
        self, *, headers: Headers = None, timeout: TimeoutTypes = None
    ) -> dict[str, Any]:
        """``GET /v2``: the server's name, version and extensions."""
        return self._decode_object(self._send(self._get("/v2", headers, timeout)))

    def model_metadata(
        self,
        model: str,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> dict[str, Any]:
        """``GET /v2/models/{model}``: inputs and outputs (packed inputs in wire form)."""
        path = self._model_path(model, version)
        return self._decode_object(self._send(self._get(path, headers, timeout)))

    def model_config(
        self,
        model: str,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> dict[str, Any]:
        """``GET /v2/models/{model}/config``: the Triton-style configuration."""
        path = self._model_path(model, version, "/config")
        return self._decode_object(self._send(self._get(path, headers, timeout)))

    def model_spec(
        self,
        model: str,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> ModelSpec:
        """The model's inputs, outputs and packing, fetched once and cached.

        The cache is dropped when an inference is refused with 400 or 404 and by
        :meth:`load_model` / :meth:`unload_model`.
        """
        spec = self._cached_spec(model, version)
        if spec is not None:
            return spec
        with self._spec_lock:  # one fetch, however many threads ask at once
            spec = self._cached_spec(model, version)
            if spec is not None:
                return spec
            metadata = self.model_metadata(model, version, headers=headers, timeout=timeout)
            config: dict[str, Any] | None
            try:
                config = self.model_config(model, version, headers=headers, timeout=timeout)
            except ServerError as exc:  # a plain V2 server (KServe) has no /config
                self._raise_if_denied(exc)
                config = None
            return self._store_spec(model, version, metadata, config)

    # -- model repository ------------------------------------------------------------------

    def repository_index(
        self, *, ready: bool = False, headers: Headers = None, timeout: TimeoutTypes = None
    ) -> list[dict[str, Any]]:
        """``POST /v2/repository/index``: every model version with its state.

        Args:
            ready: list only the versions that are ready.

        Returns:
            ``[{"name", "version", "state", "reason"}, ...]``; ``state`` is ``"READY"``,
            ``"UNAVAILABLE"``, ``"LOADING"``, ...
        """
        return self._decode_index(self._send(self._index_request(ready, headers, timeout)))

    def load_model(
        self,
        model: str,
        config: Mapping[str, Any] | str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> None:
        """``POST /v2/repository/models/{model}/load``: (re)load a model from the repository.

        Args:
            model: the model's name.
            config: a config override for this load: a dict (or its JSON text) with Triton's
                field names where they mean the same (e.g. ``{"max_batch_size": 4}``), sent
                as ``parameters.config``.

        Raises:
            ServerError: the model does not exist or failed to load (the message says why).
        """
        self._send(self._load_request(model, config, headers, timeout))

    def unload_model(
        self, model: str, *, headers: Headers = None, timeout: TimeoutTypes = None
    ) -> None:
        """``POST /v2/repository/models/{model}/unload``: stop serving a model."""
        self._send(self._unload_request(model, headers, timeout))

    # -- inference -------------------------------------------------------------------------

    def infer(
        self,
        model: str,
        inputs: Inputs,
        outputs: Sequence[str] | None = None,
        *,
        version: str | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
        binary: bool = True,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
        bitorder: Bitorder | None = None,
        priority: int | None = None,
    ) -> InferResult:
        """Run one inference.

        Args:
            model: the model's name.
            inputs: input name -> array, for every input of the model, or one array for a
                one-input model. Arrays have the batch dimension first, or are one item
                without it (outputs then come back without it). A bit-packed input takes
                bool / 0-1 arrays of the logical shape (packed here with ``np.packbits``
                along the last axis in the model's bit order) or already packed uint8
                arrays. NumPy arrays, anything ``np.asarray`` takes, or torch tensors.
            outputs: output names to return (None: all).
            version: the model version (None: the server's default).
            request_id: sent as the request ``id`` and echoed in ``result.id``.
            deadline: the server-side deadline in seconds (V2 ``parameters.timeout``): a
                request whose batch has not started by then fails with
                :class:`~bitserve_client.DeadlineExceeded`.
            binary: binary tensors both ways (default) or JSON.
            headers: extra headers for this call.
            timeout: this call's HTTP timeout (None: the client's). When it fires, the
                connection is closed: a server that drops requests whose client has gone
                (bitserve does) never computes this one if it is still queued.
            bitorder: the bit order of this call's bit-packed inputs, sent as each one's
                ``parameters.bitorder`` (the server unpacks them in it): uint8 arrays are
                taken as packed in it (RDKit's ``BitVectToBinaryText`` bytes: ``"little"``),
                bool arrays are packed in it. None: the model's (its metadata says which).
            priority: the request's priority level (V2 ``parameters.priority``, as Triton's):
                1 is the highest; None or 0: the model's default level.

        Returns:
            Every output by name (read-only NumPy arrays), with model name, version, id and
            the response headers.

        Raises:
            InvalidInputError: an input fails the local checks (nothing is sent).
            ServerError: the server refused the request (after retries for 503).
            TransportError: the connection failed or timed out.
        """
        spec = self.model_spec(model, version, headers=headers, timeout=timeout)
        request = self._infer_request(
            spec, model, inputs, outputs=outputs, version=version, request_id=request_id,
            deadline=deadline, binary=binary, headers=headers, timeout=timeout, bitorder=bitorder,
            priority=priority,
        )  # fmt: skip
        try:
            response = self._send(request)
        except ServerError as exc:
            self._infer_refused(model, exc)
            raise
        return self._decode_infer(response, request.single)

    def search(
        self,
        model: str,
        queries: Any,
        k: int | None = None,
        threshold: float | None = None,
        *,
        version: str | None = None,
        bitorder: Bitorder | None = None,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Search an index model: the ``k`` best corpus rows of each query.

        Args:
            model: an index model (``[index]``: one bit-packed input, INT64 ids and FP32
                scores).
            queries: ``(Q, L)`` bool / 0-1 bits, ``(Q, ceil(L / 8))`` packed uint8 (in the
                model's bit order, or ``bitorder``), or ``(Q, L)`` float embeddings
                binarised by sign (``> 0``, as sentence-transformers' ``ubinary``); one
                query without the batch axis gives ``(k,)`` answers.
            k: hits per query (None: the model's ``k``); at most the model's ``max_k``.
            threshold: the least Tanimoto similarity of a hit (a Tanimoto index only); the
                slots left empty have id -1 and score 0.
            version: the model version.
            bitorder: the bit order of packed uint8 queries (RDKit's ``BitVectToBinaryText``
                bytes: ``"little"``); None: the model's.
            headers: extra headers for this call.
            timeout: this call's HTTP timeout.

        Returns:
            ``(ids, scores)``: int64 and float32 arrays ``(Q, k)``, best first (Tanimoto:
            similarity, highest first; Hamming: distance, lowest first), ties by the lower
            corpus row; ids are the index file's ids, else row numbers.

        Raises:
            InvalidInputError: the model is not an index, or bad queries, k or threshold.
            ServerError: the server refused it (400 names what was wrong).
        """
        spec = self.model_spec(model, version, headers=headers, timeout=timeout)
        request, outputs = self._search_request(
            spec, model, queries, k, threshold, version=version, headers=headers,
            timeout=timeout, bitorder=bitorder,
        )  # fmt: skip
        try:
            response = self._send(request)
        except ServerError as exc:
            self._infer_refused(model, exc)
            raise
        return self._decode_search(response, request.single, outputs)

    def infer_iter(
        self,
        model: str,
        data: BulkData,
        outputs: Sequence[str] | None = None,
        *,
        batch_size: int | None = None,
        concurrency: int | None = None,
        version: str | None = None,
        deadline: float | None = None,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> Iterator[InferResult]:
        """Stream rows through the model, yielding each batch's result in input order.

        Takes the arguments of :meth:`infer_many` (without ``out``, ``resume``, ``progress``).
        At most ``2 * concurrency`` batches are pending; a result is yielded as soon as it
        and every earlier one are in. Closing the iterator early cancels what is pending.
        """
        options = Options(version=version, deadline=deadline, headers=headers, timeout=timeout)
        for result, _ in iter_sync(
            self, Job(model, data, outputs, batch_size, concurrency, options)
        ):
            yield result

    def infer_many(
        self,
        model: str,
        data: BulkData,
        outputs: Sequence[str] | None = None,
        *,
        batch_size: int | None = None,
        concurrency: int | None = None,
        progress: bool = True,
        out: BulkOut = None,
        resume: bool = False,
        version: str | None = None,
        deadline: float | None = None,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> BulkResult:
        """Stream many rows through the model in order, with bounded concurrency and progress.

        Args:
            model: the model's name.
            data: an array (or ``np.memmap``) with rows first, a path to a ``.npy`` file
                (opened as a memmap), a dict of such per input (for a model with several
                inputs), or an iterable of batches (each an array or a dict of arrays).
            outputs: output names to return (None: all).
            batch_size: rows per request (default: the model's max_batch_size, else 64).
            concurrency: requests in flight at once (a thread pool of this size). None:
                enough for two of the server's batches, one computing while the next fills
                (``2 * ceil(max_batch_size / batch_size)``, at least 4 and at most 16; 4
                for a model that does not batch), as Triton sizes a load for its dynamic
                batcher.
            progress: show progress: a tqdm bar when tqdm is installed, else a line on
                stderr every few seconds.
            out: write the results to ``.npy`` files instead of memory: a path when there is
                one output, or a dict output name -> path. The files' headers always state
                the rows written so far.
            resume: with ``out``, keep the rows the files already hold and send only the
                rest (after a :class:`~bitserve_client.BulkInferenceError`, or an
                interrupted run).
            version: the model version.
            deadline: the per-request server-side deadline in seconds.
            headers: extra headers for every request.
            timeout: the per-request HTTP timeout (None: the client's).

        Returns:
            Output name -> all rows, in input order (memmaps of the files with ``out``), and
            ``.rows``, the number of rows.

        Raises:
            BulkInferenceError: a request failed (its error is the ``__cause__``): says how
                many rows are done and holds their results.
            InvalidInputError: bad arguments, found before anything is sent.
        """
        options = Options(version=version, deadline=deadline, headers=headers, timeout=timeout)
        job = Job(model, data, outputs, batch_size, concurrency, options)
        return infer_many_sync(self, job, progress=progress, out=out, resume=resume)
