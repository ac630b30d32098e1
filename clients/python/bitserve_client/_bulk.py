"""Bulk inference: stream many rows through a model with bounded concurrency, in order.

The input is cut into batches lazily (slices of an array or ``np.memmap`` are only read when
their request is packed), at most ``2 * concurrency`` batches are pending at once (the extra
``concurrency`` are finished results waiting for an earlier one, so order is kept without a
head-of-line stall), and each result is handed on (``infer_iter``) or written into its rows
of the output (``infer_many``, see :mod:`._sink`) as soon as it is next in order. Memory
therefore stays bounded by the window, whatever the number of rows.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from ._exceptions import BulkInferenceError, InvalidInputError
from ._progress import progress as make_progress
from ._sink import Out, _Sink
from ._spec import ModelSpec, to_numpy
from ._types import BulkResult, InferResult

if TYPE_CHECKING:
    from ._async_client import AsyncClient
    from ._base import TimeoutTypes
    from ._client import Client

Batch = dict[str, Any]


class Options(TypedDict):
    """The per-request options every batch is sent with (see ``Client.infer``)."""

    version: str | None
    deadline: float | None
    headers: Mapping[str, str] | None
    timeout: TimeoutTypes


@dataclass(frozen=True)
class Job:
    """One ``infer_iter`` / ``infer_many`` call's input and how to send it.

    Attributes:
        model: the model's name.
        data: the input, as given (see ``Client.infer_many``).
        outputs: the outputs asked for (None: all).
        batch_size: rows per request, or None for the model's default.
        concurrency: requests in flight, or None for :func:`default_concurrency`.
        options: what every request is sent with.
    """

    model: str
    data: Any
    outputs: Sequence[str] | None
    batch_size: int | None
    concurrency: int | None
    options: Options


# -- cutting the input into batches -----------------------------------------------------------


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or (
        hasattr(value, "shape") and hasattr(value, "__getitem__") and not isinstance(value, Mapping)
    )


def _column(value: Any, name: str) -> np.ndarray[Any, Any]:
    if isinstance(value, (str, os.PathLike)):
        # A memmap: rows are read from disk only when their batch is packed.
        return np.load(value, mmap_mode="r", allow_pickle=False)  # type: ignore[no-any-return]
    return to_numpy(value, name)


def _rows(batch: Batch) -> int:
    sizes = {k: (v.shape[0] if np.ndim(v) else -1) for k, v in batch.items()}
    if len(set(sizes.values())) != 1 or -1 in sizes.values():
        raise InvalidInputError(f"every input needs the same number of rows, got {sizes}")
    return next(iter(sizes.values()))


def _columns(spec: ModelSpec, data: Any) -> Batch | None:
    """The input as whole columns (name -> array of all rows), or None for batch iterables."""
    if isinstance(data, (str, os.PathLike)) or _is_array(data):
        if len(spec.inputs) != 1:
            raise InvalidInputError(
                f"model {spec.name!r} has inputs {list(spec.inputs)}: pass a dict name -> rows"
            )
        return {next(iter(spec.inputs)): _column(data, "data")}
    if isinstance(data, Mapping):
        return {str(k): _column(v, str(k)) for k, v in data.items()}
    return None


def _as_batch(spec: ModelSpec, item: Any) -> Batch:
    if isinstance(item, Mapping):
        return {str(k): to_numpy(v, str(k)) for k, v in item.items()}
    if len(spec.inputs) != 1:
        raise InvalidInputError(
            f"model {spec.name!r} has inputs {list(spec.inputs)}: yield dicts name -> batch"
        )
    return {next(iter(spec.inputs)): to_numpy(item, "batch")}


def _split(batch: Batch, batch_size: int, skip: int = 0) -> Iterator[tuple[Batch, int]]:
    """Batches of at most ``batch_size`` rows, after the first ``skip`` rows."""
    n = _rows(batch)
    for start in range(skip, n, batch_size):
        stop = min(n, start + batch_size)
        yield {k: v[start:stop] for k, v in batch.items()}, stop - start


class _Skipper:
    """Cuts source items into batches, dropping the first ``skip`` rows of the stream."""

    def __init__(self, spec: ModelSpec, batch_size: int, skip: int) -> None:
        self.spec, self.batch_size, self.left = spec, batch_size, skip

    def pieces(self, item: Any) -> Iterator[tuple[Batch, int]]:
        batch = _as_batch(self.spec, item)
        n = _rows(batch)
        drop = min(self.left, n)
        self.left -= drop
        return _split(batch, self.batch_size, drop)


def _source(spec: ModelSpec, data: Any) -> Batch | None:
    """The input's columns, or None for an iterable of batches; anything else is refused."""
    cols = _columns(spec, data)
    if cols is None and not isinstance(data, (Iterable, AsyncIterable)):
        raise InvalidInputError(f"cannot stream {type(data).__name__}: give an array or batches")
    return cols


def _sync_batches(
    spec: ModelSpec, data: Any, cols: Batch | None, batch_size: int, skip: int
) -> Iterator[tuple[Batch, int]]:
    if cols is not None:
        return _split(cols, batch_size, skip)
    if not isinstance(data, Iterable):
        raise InvalidInputError("an async iterable of batches needs the AsyncClient")
    skipper = _Skipper(spec, batch_size, skip)
    return (piece for item in data for piece in skipper.pieces(item))


async def _async_batches(
    spec: ModelSpec, data: Any, cols: Batch | None, batch_size: int, skip: int
) -> AsyncGenerator[tuple[Batch, int]]:
    if isinstance(data, AsyncIterable) and cols is None:
        skipper = _Skipper(spec, batch_size, skip)
        async for item in data:
            for piece in skipper.pieces(item):
                yield piece
        return
    for piece in _sync_batches(spec, data, cols, batch_size, skip):
        yield piece


CONCURRENCY_BOUNDS = (4, 16)
"""The fewest and the most requests :func:`default_concurrency` keeps in flight."""


def default_concurrency(max_batch_size: int, batch_size: int) -> int:
    """Requests in flight when ``concurrency`` is not given: enough for two of the server's
    batches (one computing while the next fills), as Triton's optimization guide sizes a
    load for its dynamic batcher (2 x max batch size x instances): ``2 * ceil(max_batch_size
    / batch_size)``, within :data:`CONCURRENCY_BOUNDS` (4 where the model does not batch).

    With fewer, one batch takes every request in flight and the server's device waits on the
    client's turnaround: the 2048-bit MLP (max_batch_size 256, 64 rows a request) served
    1.2x the rows at 8 in flight that it served at 4 on 2 cores (README, "A light model at high
    rates").
    """
    low, high = CONCURRENCY_BOUNDS
    if max_batch_size <= 0:
        return low
    return max(low, min(high, 2 * -(-max_batch_size // batch_size)))


def _check(spec: ModelSpec, job: Job) -> tuple[int, int]:
    """The job's rows a request and requests in flight (each as given, else the defaults:
    the model's max_batch_size, else 64; :func:`default_concurrency`), checked."""
    batch_size, concurrency = job.batch_size, job.concurrency
    if not spec.batched:
        raise InvalidInputError(f"model {spec.name!r} has no batch dimension; use infer()")
    if concurrency is not None and concurrency < 1:
        raise InvalidInputError(f"concurrency must be >= 1, got {concurrency}")
    if batch_size is None:
        batch_size = spec.max_batch_size if spec.max_batch_size > 0 else 64
    elif batch_size < 1 or (0 < spec.max_batch_size < batch_size):
        raise InvalidInputError(
            f"batch_size {batch_size} must be in 1..{spec.max_batch_size or 'any'} "
            f"for model {spec.name!r}"
        )
    if concurrency is None:
        concurrency = default_concurrency(spec.max_batch_size, batch_size)
    return batch_size, concurrency


class _Run:
    """One ``infer_many`` call: its input, where results go, and its progress display.

    Args:
        spec: the model's spec.
        job: the call's input and options.
        progress: show progress.
        out: where the results go (see ``_Sink``).
        resume: keep the rows ``out`` already holds.
    """

    def __init__(self, spec: ModelSpec, job: Job, progress: bool, out: Out, resume: bool) -> None:
        self.spec = spec
        self.size, self.concurrency = _check(spec, job)
        self.cols = _source(spec, job.data)
        total = None if self.cols is None else _rows(self.cols)
        self.sink = _Sink(spec, job.outputs, total, out, resume)
        self.bar = make_progress(progress, total, spec.name, initial=self.sink.done)

    @contextmanager
    def sending(self) -> Iterator[None]:
        """Around sending the batches: a failure is raised as the error of :meth:`stopped`,
        and the sink and the progress display are closed in the end."""
        try:
            yield
        except Exception as exc:
            raise self.stopped(exc) from exc
        finally:
            self.close()

    def record(self, result: InferResult, rows: int) -> None:
        """The next batch's result, in order."""
        self.sink.write(result, rows)
        self.bar.update(rows)

    def stopped(self, exc: Exception) -> BulkInferenceError:
        """The error that says how far the run got and how to continue it."""
        sink = self.sink
        of = f" of {sink.total}" if sink.total is not None else ""
        result = sink.result()
        if result.paths:
            files = ", ".join(str(p) for p in result.paths.values())
            where = f"; they are in {files}: run again with resume=True to send only the rest"
        else:
            where = "; their results are in this error's .result"
        return BulkInferenceError(
            f"infer_many of model {self.spec.name!r} stopped after {sink.done}{of} rows{where} "
            f"({type(exc).__name__}: {exc})",
            rows_done=sink.done,
            total=sink.total,
            result=result,
        )

    def close(self) -> None:
        self.bar.close()
        self.sink.close()


def _spec_args(job: Job) -> dict[str, Any]:
    """The ``model_spec`` arguments of a job: model, version, headers and timeout."""
    options = job.options
    return {
        "model": job.model,
        "version": options["version"],
        "headers": options["headers"],
        "timeout": options["timeout"],
    }


# -- sync ---------------------------------------------------------------------------------------


def _ordered_sync(
    client: Client, job: Job, batches: Iterator[tuple[Batch, int]], concurrency: int
) -> Iterator[tuple[InferResult, int]]:
    """(result, rows) per batch in input order, from a pool of ``concurrency`` threads."""
    pending: deque[tuple[Future[InferResult], int]] = deque()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bitserve-bulk")
    try:
        for batch, rows in batches:
            future = pool.submit(client.infer, job.model, batch, job.outputs, **job.options)
            pending.append((future, rows))
            while len(pending) >= 2 * concurrency or (pending and pending[0][0].done()):
                head, n = pending.popleft()
                yield head.result(), n
        while pending:
            head, n = pending.popleft()
            yield head.result(), n
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def iter_sync(client: Client, job: Job) -> Iterator[tuple[InferResult, int]]:
    """``Client.infer_iter``: (result, rows) per batch in input order."""
    spec = client.model_spec(**_spec_args(job))
    size, concurrency = _check(spec, job)
    batches = _sync_batches(spec, job.data, _source(spec, job.data), size, 0)
    return _ordered_sync(client, job, batches, concurrency)


def infer_many_sync(
    client: Client, job: Job, *, progress: bool, out: Out, resume: bool
) -> BulkResult:
    """``Client.infer_many``: a thread pool of ``run.concurrency`` workers sharing the client."""
    spec = client.model_spec(**_spec_args(job))
    run = _Run(spec, job, progress, out, resume)
    batches = _sync_batches(spec, job.data, run.cols, run.size, run.sink.done)
    with run.sending():
        for result, rows in _ordered_sync(client, job, batches, run.concurrency):
            run.record(result, rows)
    return run.sink.result()


# -- async --------------------------------------------------------------------------------------


async def _next_in_order(
    pending: deque[tuple[asyncio.Task[InferResult], int]],
) -> tuple[InferResult, int]:
    # The head leaves `pending` only once done, so a cancelled wait still cancels it.
    head, n = pending[0]
    result = await head
    pending.popleft()
    return result, n


async def _ordered_async(
    client: AsyncClient, job: Job, batches: AsyncIterator[tuple[Batch, int]], concurrency: int
) -> AsyncGenerator[tuple[InferResult, int]]:
    """(result, rows) per batch in input order, at most ``concurrency`` requests in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(batch: Batch) -> InferResult:
        async with gate:
            return await client.infer(job.model, batch, job.outputs, **job.options)

    pending: deque[tuple[asyncio.Task[InferResult], int]] = deque()
    try:
        async for batch, rows in batches:
            pending.append((asyncio.ensure_future(one(batch)), rows))
            while len(pending) >= 2 * concurrency or (pending and pending[0][0].done()):
                yield await _next_in_order(pending)
        while pending:
            yield await _next_in_order(pending)
    finally:
        for task, _ in pending:
            task.cancel()
        await asyncio.gather(*(t for t, _ in pending), return_exceptions=True)


async def iter_async(client: AsyncClient, job: Job) -> AsyncGenerator[tuple[InferResult, int]]:
    """``AsyncClient.infer_iter``: (result, rows) per batch in input order."""
    spec = await client.model_spec(**_spec_args(job))
    size, concurrency = _check(spec, job)
    batches = _async_batches(spec, job.data, _source(spec, job.data), size, 0)
    ordered = _ordered_async(client, job, batches, concurrency)
    try:
        async for item in ordered:
            yield item
    finally:
        await ordered.aclose()


async def infer_many_async(
    client: AsyncClient, job: Job, *, progress: bool, out: Out, resume: bool
) -> BulkResult:
    """``AsyncClient.infer_many``: at most ``run.concurrency`` requests in flight on one loop."""
    spec = await client.model_spec(**_spec_args(job))
    run = _Run(spec, job, progress, out, resume)
    batches = _async_batches(spec, job.data, run.cols, run.size, run.sink.done)
    ordered = _ordered_async(client, job, batches, run.concurrency)
    with run.sending():
        try:
            async for result, rows in ordered:
                run.record(result, rows)
        finally:
            await ordered.aclose()
    return run.sink.result()
