"""The asynchronous client: the API of :class:`~._client.Client`, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
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
from ._bulk import Job, Options, infer_many_async, iter_async
from ._client import BulkData, BulkOut, Headers
from ._exceptions import ServerError
from ._h1_async import AsyncH1Transport
from ._retry import Retry
from ._spec import Bitorder, ModelSpec
from ._types import BulkResult, InferResult, Inputs


class AsyncClient(BaseClient):
    """An asyncio client for bitserve and any Open Inference Protocol (V2) server.

    It takes the arguments of :class:`~bitserve_client.Client` (``transport`` is an
    ``httpx.AsyncBaseTransport``) and has its methods as coroutines, except that it is closed
    with ``await client.aclose()`` (there is no ``close()``), as httpx's ``AsyncClient``.
    ``infer_iter`` is an async iterator. One client keeps a pool of kept-alive connections;
    share it between the tasks of one event loop::

        async with AsyncClient("http://127.0.0.1:8000") as client:
            result = await client.infer("demo", {"spikes": bits})
    """

    _http: httpx.AsyncClient

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
        transport: httpx.AsyncBaseTransport | None = None,
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
        # As the sync client's: the lean transport carries this client's own calls directly
        # (_send), and sits under the httpx client for anything sent through that.
        self._lean: AsyncH1Transport | None = None
        if transport is None and self._lean_transport_applies(proxy, http2):
            self._lean = transport = AsyncH1Transport(limits)
            self._lean_setup()
        self._http = httpx.AsyncClient(**self._http_options, transport=transport)
        self._spec_lock = asyncio.Lock()
        self._sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`aclose` was called; a closed client raises ``BitserveError``."""
        return self._http.is_closed

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- sending ---------------------------------------------------------------------------

    async def _send(self, request: _Request) -> _Reply:
        """Send with retries; return a 200 response or raise."""
        attempt = 0
        while True:
            self._check_open(request)
            try:
                response: _Reply
                if self._lean is not None:
                    response = await self._send_lean(self._lean, request)
                else:
                    content = request.content()
                    response = await self._http.request(
                        request.method,
                        request.path,
                        content=_aiter(content) if isinstance(content, list) else content,
                        headers=request.headers,
                        timeout=request.timeout or httpx.USE_CLIENT_DEFAULT,
                    )
            except httpx.TransportError as exc:
                delay = self._after_failure(request, attempt, exc)
            except RuntimeError as exc:  # httpx: closed by another task meanwhile
                self._check_open(request, exc)
                raise
            else:
                if response.status_code == 200:
                    return response
                delay = self._after_refusal(request, attempt, response)
            await self._sleep(delay)
            attempt += 1

    async def _send_lean(self, lean: AsyncH1Transport, request: _Request) -> _Answer:
        """One attempt over the lean transport (as ``Client._send_lean``); a task cancelled
        while waiting closes its connection."""
        head, parts, timeouts = self._lean_request(request)
        host, port = self._lean_host, self._lean_port
        reply = await lean.exchange(host, port, head, parts, timeouts, request.method)
        return _Answer(reply, self._url + request.path)

    async def _probe(self, request: _Request, model: str | None = None) -> bool:
        try:
            await self._send(request)
        except ServerError as exc:
            return self._probe_answer(exc, model)
        return True

    # -- health and metadata ---------------------------------------------------------------

    async def is_live(self, *, headers: Headers = None, timeout: TimeoutTypes = None) -> bool:
        """``GET /v2/health/live``: True on 200, False on 503; see ``Client.is_live``."""
        return await self._probe(self._get("/v2/health/live", headers, timeout, retry=False))

    async def is_ready(
        self,
        model: str | None = None,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> bool:
        """Whether the server (or one model) is ready; see ``Client.is_ready``."""
        path = "/v2/health/ready" if model is None else self._model_path(model, version, "/ready")
        return await self._probe(self._get(path, headers, timeout, retry=False), model)

    async def server_metadata(
        self, *, headers: Headers = None, timeout: TimeoutTypes = None
    ) -> dict[str, Any]:
        """``GET /v2``: the server's name, version and extensions."""
        return self._decode_object(await self._send(self._get("/v2", headers, timeout)))

    async def model_metadata(
        self,
        model: str,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> dict[str, Any]:
        """``GET /v2/models/{model}``: inputs and outputs (packed inputs in wire form)."""
        path = self._model_path(model, version)
        return self._decode_object(await self._send(self._get(path, headers, timeout)))

    async def model_config(
        self,
        model: str,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> dict[str, Any]:
        """``GET /v2/models/{model}/config``: the Triton-style configuration."""
        path = self._model_path(model, version, "/config")
        return self._decode_object(await self._send(self._get(path, headers, timeout)))

    async def model_spec(
        self,
        model: str,
        version: str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> ModelSpec:
        """The model's inputs, outputs and packing, fetched once and cached."""
        spec = self._cached_spec(model, version)
        if spec is not None:
            return spec
        async with self._spec_lock:  # one fetch, however many tasks ask at once
            spec = self._cached_spec(model, version)
            if spec is not None:
                return spec
            metadata = await self.model_metadata(model, version, headers=headers, timeout=timeout)
            config: dict[str, Any] | None
            try:
                config = await self.model_config(model, version, headers=headers, timeout=timeout)
            except ServerError as exc:  # a plain V2 server (KServe) has no /config
                self._raise_if_denied(exc)
                config = None
            return self._store_spec(model, version, metadata, config)

    # -- model repository ------------------------------------------------------------------

    async def repository_index(
        self, *, ready: bool = False, headers: Headers = None, timeout: TimeoutTypes = None
    ) -> list[dict[str, Any]]:
        """``POST /v2/repository/index``; see ``Client.repository_index``."""
        request = self._index_request(ready, headers, timeout)
        return self._decode_index(await self._send(request))

    async def load_model(
        self,
        model: str,
        config: Mapping[str, Any] | str | None = None,
        *,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> None:
        """``POST /v2/repository/models/{model}/load``; see ``Client.load_model``."""
        await self._send(self._load_request(model, config, headers, timeout))

    async def unload_model(
        self, model: str, *, headers: Headers = None, timeout: TimeoutTypes = None
    ) -> None:
        """``POST /v2/repository/models/{model}/unload``: stop serving a model."""
        await self._send(self._unload_request(model, headers, timeout))

    # -- inference -------------------------------------------------------------------------

    async def infer(
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
        """Run one inference; the arguments, result and errors of ``Client.infer``.

        Cancelling the task that awaits it (or its ``timeout`` firing) closes the request's
        connection: bitserve then drops the request if it is still queued, never computing
        it.
        """
        spec = await self.model_spec(model, version, headers=headers, timeout=timeout)
        request = self._infer_request(
            spec, model, inputs, outputs=outputs, version=version, request_id=request_id,
            deadline=deadline, binary=binary, headers=headers, timeout=timeout, bitorder=bitorder,
            priority=priority,
        )  # fmt: skip
        try:
            response = await self._send(request)
        except ServerError as exc:
            self._infer_refused(model, exc)
            raise
        return self._decode_infer(response, request.single)

    async def search(
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
        """Search an index model; the arguments, result and errors of ``Client.search``."""
        spec = await self.model_spec(model, version, headers=headers, timeout=timeout)
        request, outputs = self._search_request(
            spec, model, queries, k, threshold, version=version, headers=headers,
            timeout=timeout, bitorder=bitorder,
        )  # fmt: skip
        try:
            response = await self._send(request)
        except ServerError as exc:
            self._infer_refused(model, exc)
            raise
        return self._decode_search(response, request.single, outputs)

    async def infer_iter(
        self,
        model: str,
        data: BulkData | AsyncIterable[Any],
        outputs: Sequence[str] | None = None,
        *,
        batch_size: int | None = None,
        concurrency: int | None = None,
        version: str | None = None,
        deadline: float | None = None,
        headers: Headers = None,
        timeout: TimeoutTypes = None,
    ) -> AsyncIterator[InferResult]:
        """Yield each batch's result in input order; see ``Client.infer_iter``.

        ``data`` may also be an async iterable of batches. Close the iterator when you stop
        early (``contextlib.aclosing``), so that what is pending is cancelled at once.
        """
        options = Options(version=version, deadline=deadline, headers=headers, timeout=timeout)
        results = iter_async(self, Job(model, data, outputs, batch_size, concurrency, options))
        try:
            async for result, _ in results:
                yield result
        finally:
            await results.aclose()

    async def infer_many(
        self,
        model: str,
        data: BulkData | AsyncIterable[Any],
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
        """Stream many rows through the model; see ``Client.infer_many``.

        ``data`` may also be an async iterable of batches; ``concurrency`` requests are in
        flight at once on this event loop.
        """
        options = Options(version=version, deadline=deadline, headers=headers, timeout=timeout)
        job = Job(model, data, outputs, batch_size, concurrency, options)
        return await infer_many_async(self, job, progress=progress, out=out, resume=resume)


async def _aiter(chunks: list[bytes]) -> AsyncIterator[bytes]:
    """httpx's async transport takes an async iterable body (a fresh one per attempt)."""
    for chunk in chunks:
        yield chunk
