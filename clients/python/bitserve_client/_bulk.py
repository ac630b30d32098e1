"""Bulk inference: stream many rows through a model with bounded concurrency, in order.

The input is cut into batches lazily (slices of an array or ``np.memmap`` are only read when
their request is packed), at most ``2 * concurrency`` batches are pending at once (the extra
``concurrency`` are finished results waiting for an earlier one, so order is kept without a
head-of-line stall), and each result is written into its rows of the output as soon as it is
next in order. Memory therefore stays bounded by the window, whatever the number of rows: a
million rows written to ``.npy`` files never exist in memory at once.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._exceptions import DecodeError, InvalidInputError
from ._spec import DATATYPES, ModelSpec, to_numpy
from ._types import InferResult

if TYPE_CHECKING:
    from ._async_client import AsyncClient
    from ._client import Client

Batch = dict[str, Any]
Out = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None


class _Bar(Protocol):
    def update(self, n: int) -> Any: ...
    def close(self) -> None: ...


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool, total: int | None, desc: str, unit: str = "row") -> _Bar:
    """A tqdm bar when asked for and tqdm is installed; otherwise a no-op."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is an optional extra ("bitserve-client[progress]")
        return _NoBar()
    bar: _Bar = tqdm(total=total, unit=unit, desc=desc, dynamic_ncols=True)
    return bar


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


def _split(batch: Batch, batch_size: int) -> Iterator[tuple[Batch, int]]:
    n = _rows(batch)
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        yield {k: v[start:stop] for k, v in batch.items()}, stop - start


def _sync_batches(
    spec: ModelSpec, data: Any, batch_size: int
) -> tuple[Iterator[tuple[Batch, int]], int | None]:
    cols = _columns(spec, data)
    if cols is not None:
        return _split(cols, batch_size), _rows(cols)
    if not isinstance(data, Iterable):
        raise InvalidInputError(f"cannot stream {type(data).__name__}: give an array or batches")

    def gen() -> Iterator[tuple[Batch, int]]:
        for item in data:
            yield from _split(_as_batch(spec, item), batch_size)

    return gen(), None


class _NpyAppender:
    """Writes a ``.npy`` file row block by row block when the row count is not known ahead.

    The header is written with room for any row count and rewritten, same length, at the
    end, so the data is never copied or held in memory.
    """

    _RESERVED_ROWS = 10**18  # the final shape's repr is never longer than this one's

    def __init__(self, path: Path, dtype: np.dtype[Any], item: tuple[int, ...]) -> None:
        self.path, self.dtype, self.item, self.rows = path, dtype, item, 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed in finish()/abort()
        head = self._header(self._RESERVED_ROWS)
        self._size = len(head)
        self._file.write(head)

    def _header(self, rows: int, size: int | None = None) -> bytes:
        text = repr(
            {
                "descr": np.lib.format.dtype_to_descr(self.dtype),
                "fortran_order": False,
                "shape": (rows, *self.item),
            }
        )
        # magic (6) + version (2) + length (2) + text + "\n", padded to 64 bytes with spaces.
        total = size if size is not None else -(-(10 + len(text) + 1) // 64) * 64
        text = text.ljust(total - 10 - 1) + "\n"
        return b"\x93NUMPY\x01\x00" + (total - 10).to_bytes(2, "little") + text.encode("latin1")

    def write(self, block: np.ndarray[Any, Any]) -> None:
        self._file.write(np.ascontiguousarray(block, dtype=self.dtype).data)
        self.rows += block.shape[0]

    def finish(self) -> np.ndarray[Any, Any]:
        self._file.seek(0)
        self._file.write(self._header(self.rows, self._size))
        self._file.close()
        return np.load(self.path, mmap_mode="r")  # type: ignore[no-any-return]

    def abort(self) -> None:
        self._file.close()


class _Sink:
    """Collects results in order: into memory or ``.npy`` files, sized ahead when possible."""

    def __init__(self, spec: ModelSpec, outputs: Sequence[str] | None, total: int | None, out: Out):
        self.total, self.done = total, 0
        names = list(outputs) if outputs is not None else list(spec.outputs) or None
        self.paths: dict[str, Path] | None = None
        if isinstance(out, Mapping):
            self.paths = {str(k): Path(v) for k, v in out.items()}
            if names is not None and sorted(self.paths) != sorted(names):
                raise InvalidInputError(
                    f"out names {sorted(self.paths)} != outputs {sorted(names)}"
                )
        elif out is not None:
            if names is not None and len(names) != 1:
                raise InvalidInputError(
                    f"model {spec.name!r} has outputs {names}: give out as a dict name -> path, "
                    "or select one output"
                )
            self.paths = {names[0] if names else "": Path(out)}
        self.arrays: dict[str, np.ndarray[Any, Any]] = {}
        self.parts: dict[str, list[np.ndarray[Any, Any]]] = {}
        self.appenders: dict[str, _NpyAppender] = {}

    def _open(self, result: InferResult) -> None:
        if self.paths is not None and "" in self.paths:  # one path, output name learnt now
            if len(result) != 1:
                raise InvalidInputError(f"results have outputs {list(result)}: give out as a dict")
            self.paths = {next(iter(result)): self.paths[""]}
        for name, arr in result.items():
            item = tuple(arr.shape[1:])
            path = None if self.paths is None else self.paths.get(name)
            if self.paths is not None and path is None:
                continue  # an output without a path is not kept
            if self.total is None:
                if path is None:
                    self.parts[name] = []
                else:
                    self.appenders[name] = _NpyAppender(path, arr.dtype, item)
            elif path is None:
                self.arrays[name] = np.empty((self.total, *item), dtype=arr.dtype)
            else:
                self.arrays[name] = np.lib.format.open_memmap(
                    path, mode="w+", dtype=arr.dtype, shape=(self.total, *item)
                )

    def write(self, result: InferResult, rows: int) -> None:
        if self.done == 0 and not (self.arrays or self.parts or self.appenders):
            self._open(result)
        for name, arr in result.items():
            if arr.ndim == 0 or arr.shape[0] != rows:
                raise DecodeError(f"output {name!r}: {arr.shape} for a batch of {rows} rows")
            if name in self.arrays:
                self.arrays[name][self.done : self.done + rows] = arr
            elif name in self.parts:
                self.parts[name].append(arr)
            elif name in self.appenders:
                self.appenders[name].write(arr)
        self.done += rows

    def finish(self, spec: ModelSpec) -> dict[str, np.ndarray[Any, Any]]:
        result: dict[str, np.ndarray[Any, Any]] = {}
        for name, arr in self.arrays.items():
            if isinstance(arr, np.memmap):
                arr.flush()
            result[name] = arr
        for name, parts in self.parts.items():
            result[name] = np.concatenate(parts) if parts else np.empty(0)
        for name, appender in self.appenders.items():
            result[name] = appender.finish()
        if self.done == 0:  # no rows at all: empty outputs shaped from the spec
            for name, t in spec.outputs.items():
                shape = (0, *(max(d, 0) for d in t.shape))
                result[name] = np.empty(shape, dtype=DATATYPES.get(t.datatype, np.dtype(object)))
        return result

    def abort(self) -> None:
        for appender in self.appenders.values():
            appender.abort()


def _check(spec: ModelSpec, batch_size: int | None, concurrency: int) -> int:
    if not spec.batched:
        raise InvalidInputError(f"model {spec.name!r} has no batch dimension; use infer()")
    if concurrency < 1:
        raise InvalidInputError(f"concurrency must be >= 1, got {concurrency}")
    if batch_size is None:
        return spec.max_batch_size if spec.max_batch_size > 0 else 64
    if batch_size < 1 or (0 < spec.max_batch_size < batch_size):
        raise InvalidInputError(
            f"batch_size {batch_size} must be in 1..{spec.max_batch_size or 'any'} "
            f"for model {spec.name!r}"
        )
    return batch_size


def infer_many_sync(
    client: Client,
    model: str,
    data: Any,
    outputs: Sequence[str] | None,
    *,
    batch_size: int | None,
    concurrency: int,
    progress: bool,
    out: Out,
    version: str | None,
    timeout: float | None,
) -> dict[str, np.ndarray[Any, Any]]:
    """``Client.infer_many``: a thread pool of ``concurrency`` workers sharing the client."""
    spec = client.model_spec(model, version)
    size = _check(spec, batch_size, concurrency)
    batches, total = _sync_batches(spec, data, size)
    sink = _Sink(spec, outputs, total, out)
    bar = _progress(progress, total, model)
    pending: deque[tuple[Future[InferResult], int]] = deque()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bitserve-bulk")
    try:
        for batch, rows in batches:
            fut = pool.submit(client.infer, model, batch, outputs, version=version, timeout=timeout)
            pending.append((fut, rows))
            while len(pending) >= 2 * concurrency or (pending and pending[0][0].done()):
                head, n = pending.popleft()
                sink.write(head.result(), n)
                bar.update(n)
        while pending:
            head, n = pending.popleft()
            sink.write(head.result(), n)
            bar.update(n)
    except BaseException:
        sink.abort()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return sink.finish(spec)


async def _async_batches(
    spec: ModelSpec, data: Any, batch_size: int
) -> tuple[AsyncIterator[tuple[Batch, int]], int | None]:
    if isinstance(data, AsyncIterable):

        async def agen() -> AsyncIterator[tuple[Batch, int]]:
            async for item in data:
                for piece in _split(_as_batch(spec, item), batch_size):
                    yield piece

        return agen(), None
    batches, total = _sync_batches(spec, data, batch_size)

    async def wrap() -> AsyncIterator[tuple[Batch, int]]:
        for piece in batches:
            yield piece

    return wrap(), total


async def infer_many_async(
    client: AsyncClient,
    model: str,
    data: Any,
    outputs: Sequence[str] | None,
    *,
    batch_size: int | None,
    concurrency: int,
    progress: bool,
    out: Out,
    version: str | None,
    timeout: float | None,
) -> dict[str, np.ndarray[Any, Any]]:
    """``AsyncClient.infer_many``: at most ``concurrency`` requests in flight on one loop."""
    spec = await client.model_spec(model, version)
    size = _check(spec, batch_size, concurrency)
    batches, total = await _async_batches(spec, data, size)
    sink = _Sink(spec, outputs, total, out)
    bar = _progress(progress, total, model)
    gate = asyncio.Semaphore(concurrency)

    async def one(batch: Batch) -> InferResult:
        async with gate:
            return await client.infer(model, batch, outputs, version=version, timeout=timeout)

    pending: deque[tuple[asyncio.Task[InferResult], int]] = deque()
    try:
        async for batch, rows in batches:
            pending.append((asyncio.ensure_future(one(batch)), rows))
            while len(pending) >= 2 * concurrency or (pending and pending[0][0].done()):
                head, n = pending.popleft()
                sink.write(await head, n)
                bar.update(n)
        while pending:
            head, n = pending.popleft()
            sink.write(await head, n)
            bar.update(n)
    except BaseException:
        for task, _ in pending:
            task.cancel()
        await asyncio.gather(*(t for t, _ in pending), return_exceptions=True)
        sink.abort()
        raise
    finally:
        bar.close()
    return sink.finish(spec)
