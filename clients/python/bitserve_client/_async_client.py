"""The asynchronous client: the same API as :class:`~._client.Client`, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from ._base import DEFAULT_LIMITS, DEFAULT_TIMEOUT, BaseClient, Compression, TimeoutTypes
from ._exceptions import BitserveError, ServerError
from ._retry import Retry
from ._spec import ModelSpec
from ._types import ArrayLike, InferResult, Inputs


class AsyncClient(BaseClient):
    """An asyncio client for bitserve and any Open Inference Protocol (V2) server.

    One client keeps a pool of kept-alive connections; share it between tasks of one event
    loop. Use it as an async context manager (or await :meth:`aclose`)::

        async with AsyncClient("http://127.0.0.1:8000") as client:
            result = await client.infer("demo", {"spikes": bits})

    Args:
        url: the server's base URL.
        token: a bearer token (``Authorization: Bearer ...``).
        timeout: the HTTP timeout in seconds or an ``httpx.Timeout`` (default 60 s, 10 s to
            connect); raises :class:`~bitserve_client.TimeoutException`.
        retries: retries after the first attempt (int) or a :class:`Retry` policy; retried
            are connection failures, connections dropped mid-call, and 503s; never other
            statuses, nor read timeouts.
        compression: ``"gzip"``, ``"deflate"`` or None: compress request bodies.
        headers: extra headers for every request.
        limits: connection pool limits (default 64 connections, all kept alive).
        transport: an httpx transport to send through (tests use ``httpx.MockTransport``).
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
        limits: httpx.Limits = DEFAULT_LIMITS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            url,
            token=token,
            timeout=timeout,
            retries=retries,
            compression=compression,
            headers=headers,
        )
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            timeout=self.timeout,
            limits=limits,
            transport=transport,
        )
        self._spec_lock = asyncio.Lock()
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

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

    async def _send(
        self,
        method: str,
        path: str,
        *,
        chunks: Callable[[], list[bytes]] | None = None,
        headers: Mapping[str, str] | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """Send with retries; return a 200 response or raise."""
        attempt = 0
        error: BitserveError
        while True:
            try:
                response = await self._http.request(
                    method,
                    path,
                    content=None if chunks is None else _aiter(chunks()),
                    headers=headers,
                )
            except httpx.TransportError as exc:
                error = self.transport_error(exc, method, self.url + path)
                delay = self.retry_delay(attempt, error, exc) if retry else None
                if delay is None:
                    raise error from exc
            else:
                if response.status_code == 200:
                    return response
                error = self.server_error(response)
                delay = self.retry_delay(attempt, error) if retry else None
                if delay is None:
                    raise error
            self.log_retry(method, path, error, delay, attempt)
            await self.sleep(delay)
            attempt += 1

    async def _get_json(self, path: str) -> dict[str, Any]:
        return self.decode_json(await self._send("GET", path))

    async def _get_ok(self, path: str) -> bool:
        try:
            await self._send("GET", path, retry=False)
        except ServerError:
            return False
        return True

    # -- API -------------------------------------------------------------------------------

    async def is_live(self) -> bool:
        """Whether the server answers ``/v2/health/live`` with 200 (transport errors raise)."""
        return await self._get_ok("/v2/health/live")

    async def is_ready(self, model: str | None = None, version: str | None = None) -> bool:
        """Whether the server (or one model) is ready to serve."""
        path = "/v2/health/ready" if model is None else self.model_path(model, version, "/ready")
        return await self._get_ok(path)

    async def server_metadata(self) -> dict[str, Any]:
        """``GET /v2``: name, version, extensions."""
        return await self._get_json("/v2")

    async def model_metadata(self, model: str, version: str | None = None) -> dict[str, Any]:
        """``GET /v2/models/{model}``: inputs and outputs (packed inputs in wire form)."""
        return await self._get_json(self.model_path(model, version))

    async def model_config(self, model: str, version: str | None = None) -> dict[str, Any]:
        """``GET /v2/models/{model}/config``: the Triton-style configuration."""
        return await self._get_json(self.model_path(model, version, "/config"))

    async def model_spec(self, model: str, version: str | None = None) -> ModelSpec:
        """The model's inputs, outputs and packing, fetched once and cached."""
        spec = self.cached_spec(model, version)
        if spec is not None:
            return spec
        async with self._spec_lock:
            spec = self.cached_spec(model, version)
            if spec is not None:
                return spec
            metadata = await self.model_metadata(model, version)
            try:
                config: dict[str, Any] | None = await self.model_config(model, version)
            except ServerError:  # a plain V2 server (KServe) has no /config
                config = None
            return self.store_spec(model, version, metadata, config)

    async def infer(
        self,
        model: str,
        inputs: Inputs,
        outputs: Sequence[str] | None = None,
        *,
        version: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        binary: bool = True,
    ) -> InferResult:
        """Run one inference.

        Args:
            model: the model's name.
            inputs: input name -> array, or one array for a one-input model. Arrays have the
                batch dimension first, or are one item without it (outputs then come back
                without it). A bit-packed input takes bool / 0-1 arrays of the logical shape
                (packed here with ``np.packbits`` along the last axis) or already packed
                uint8 arrays. NumPy arrays, anything ``np.asarray`` takes, or torch tensors.
            outputs: output names to return (None: all).
            version: the model version (None: the server's default).
            request_id: sent as the request ``id`` and echoed in the result.
            timeout: the server-side deadline in seconds (V2 ``parameters.timeout``): a
                request whose batch has not started by then fails with
                :class:`~bitserve_client.DeadlineExceeded`. The HTTP timeout is the
                client's ``timeout``.
            binary: binary tensors both ways (default) or JSON.

        Returns:
            The outputs by name (read-only NumPy arrays) with model name, version and id.

        Raises:
            InvalidInputError: an input fails the local checks (nothing is sent).
            ServerError: the server refused the request (after retries for 503).
            TransportError: the connection failed or timed out.
        """
        spec = await self.model_spec(model, version)
        call = self.prepare_infer(
            spec,
            model,
            inputs,
            outputs,
            version=version,
            request_id=request_id,
            timeout=timeout,
            binary=binary,
        )
        try:
            response = await self._send("POST", call.path, chunks=call.chunks, headers=call.headers)
        except ServerError as exc:
            if exc.status in (400, 404):  # the model may have been reloaded: refetch its spec
                self.forget_spec(model, version)
            raise
        return self.decode_infer(response, call.single)

    async def infer_many(
        self,
        model: str,
        data: ArrayLike | Mapping[str, ArrayLike] | str | Path | Iterable[Any] | AsyncIterable[Any],
        outputs: Sequence[str] | None = None,
        *,
        batch_size: int | None = None,
        concurrency: int = 4,
        progress: bool = True,
        out: str | Path | Mapping[str, str | Path] | None = None,
        version: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Stream many rows through the model; like ``Client.infer_many``.

        Args:
            model: the model's name.
            data: an array (or ``np.memmap``) with rows first, a path to a ``.npy`` file
                (opened as a memmap), a dict of such per input, or an iterable of batches
                (each an array or a dict of arrays), sync or async.
            outputs: output names to return (None: all).
            batch_size: rows per request (default: the model's max_batch_size, else 64).
            concurrency: requests in flight at once.
            progress: show a tqdm progress bar when tqdm is installed.
            out: write the results to ``.npy`` files instead of memory: a path when there is
                one output, or a dict output name -> path.
            version: the model version.
            timeout: the per-request server-side deadline in seconds.

        Returns:
            Output name -> all rows, in input order (memmaps of the files when ``out``).
        """
        from ._bulk import infer_many_async

        return await infer_many_async(
            self,
            model,
            data,
            outputs,
            batch_size=batch_size,
            concurrency=concurrency,
            progress=progress,
            out=out,
            version=version,
            timeout=timeout,
        )


async def _aiter(chunks: list[bytes]) -> AsyncIterator[bytes]:
    """httpx's async transport takes an async iterable body (a fresh one per attempt)."""
    for chunk in chunks:
        yield chunk
