"""Training on bit-packed features: keep the bits packed until they are on the device.

Binary features held as int8 move 8 bits per feature to the GPU, as float32 32 bits; packed
(``np.packbits``) they move one. This module is the training-side half of bitserve:

* :func:`pack_array` converts an existing int8/bool feature matrix, or a ``.npy`` memmap
  larger than memory, to the packed format chunk by chunk (with an optional progress bar).
* :class:`PackedBitsDataset` serves packed rows (from memory or a memmap) plus optional
  dense labels/extra arrays; a batch is gathered with one fancy-index per array.
* :func:`collate_packed` makes :class:`PackedBatch` objects that a ``DataLoader`` can pin.
* :class:`DevicePrefetcher` wraps any such ``DataLoader``: it copies batch ``k + 1`` to the
  device on a side CUDA stream while the model works on batch ``k``, and unpacks it there
  straight into the training dtype with :func:`gpu_ops.unpackbits` into a reused buffer.
  On the CPU the same API works without streams.

Example::

    ds = PackedBitsDataset("features.npy", length=L, labels=y)
    loader = DataLoader(ds, batch_size=1024, shuffle=True, collate_fn=collate_packed,
                        pin_memory=torch.cuda.is_available())
    for x, y, _ in DevicePrefetcher(loader, "cuda"):   # x: (1024, L) float32 on the GPU
        loss = loss_fn(model(x), y)

Only NumPy and torch are needed; ``tqdm`` is imported only when a progress bar is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from gpu_ops.bits import unpackbits
from gpu_ops.transfer import to_device

__all__ = [
    "DeviceBatch",
    "DevicePrefetcher",
    "PackedBatch",
    "PackedBitsDataset",
    "collate_packed",
    "pack_array",
]

ArrayLike = np.ndarray[Any, Any] | str | os.PathLike[str]


def _load(source: ArrayLike, what: str) -> np.ndarray[Any, Any]:
    """An ndarray, or a read-only memmap of a ``.npy`` path (never unpickled)."""
    if isinstance(source, str | os.PathLike):
        loaded: np.ndarray[Any, Any] = np.load(source, mmap_mode="r", allow_pickle=False)
        return loaded
    if isinstance(source, torch.Tensor):
        return source.numpy()
    if not isinstance(source, np.ndarray):
        raise TypeError(f"{what} must be a NumPy array or a .npy path, got {type(source).__name__}")
    return source


class PackedBatch(NamedTuple):
    """A batch of packed rows on the host, as made by :func:`collate_packed`.

    Attributes:
        bits: uint8 tensor (batch, ..., ceil(L / 8)).
        labels: the labels rows (batch, ...) or ``None``.
        extras: the extra arrays' rows, each (batch, ...).
    """

    bits: torch.Tensor
    labels: torch.Tensor | None
    extras: tuple[torch.Tensor, ...]

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies (``DataLoader(pin_memory=True)`` calls this in its thread)."""
        return PackedBatch(
            self.bits.pin_memory(),
            None if self.labels is None else self.labels.pin_memory(),
            tuple(e.pin_memory() for e in self.extras),
        )


class DeviceBatch(NamedTuple):
    """A batch on the device, as yielded by :class:`DevicePrefetcher`.

    Attributes:
        features: the unpacked features (batch, ..., L) in the training dtype (or the packed
            uint8 bits when the prefetcher does not unpack).
        labels: the labels (batch, ...) on the device, or ``None``.
        extras: the extra arrays on the device.
    """

    features: torch.Tensor
    labels: torch.Tensor | None
    extras: tuple[torch.Tensor, ...]


class PackedBitsDataset(Dataset[PackedBatch]):
    """Rows of bit-packed binary features, with optional dense labels and extra arrays.

    Args:
        bits: uint8 array (rows, ..., ceil(L / 8)) packed along the last axis, or a path to
            a ``.npy`` file (opened as a read-only memmap, so it may exceed memory; each
            worker reopens it rather than pickling its contents).
        length: the logical length L of the last axis (default: 8 * bits.shape[-1]).
        bitorder: ``"big"`` (NumPy's default) or ``"little"``, as the bits were packed.
        labels: optional array (rows, ...) or ``.npy`` path.
        extras: optional further arrays (rows, ...) or paths, returned in order.

    Indexing with an int gives a :class:`PackedBatch` of one row (without the batch axis);
    ``DataLoader`` fetches a whole batch at once through ``__getitems__``, which needs
    ``collate_fn=collate_packed``.

    Raises:
        TypeError: ``bits`` is not uint8.
        ValueError: a bad ``length``/``bitorder`` or arrays with different row counts.
    """

    def __init__(
        self,
        bits: ArrayLike,
        length: int | None = None,
        *,
        bitorder: str = "big",
        labels: ArrayLike | None = None,
        extras: Sequence[ArrayLike] = (),
    ) -> None:
        self._sources: list[ArrayLike | None] = [bits, labels, *extras]
        arrays = self._open()
        packed = arrays[0]
        assert packed is not None
        if packed.dtype != np.uint8:
            raise TypeError(f"bits must be uint8 (packed), got {packed.dtype}; see pack_array()")
        if packed.ndim < 2:
            raise ValueError(f"bits must be (rows, ..., nbytes), got shape {packed.shape}")
        nbytes = packed.shape[-1]
        if length is None:
            length = 8 * nbytes
        if not isinstance(length, int) or not 8 * nbytes - 8 < length <= 8 * nbytes:
            raise ValueError(
                f"length={length!r} does not fit {nbytes} packed bytes per row "
                f"(expected {max(8 * nbytes - 7, 0)}..{8 * nbytes})"
            )
        if bitorder not in ("big", "little"):
            raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")
        for name, arr in zip(
            ("labels", *(f"extras[{i}]" for i in range(len(extras)))), arrays[1:], strict=True
        ):
            if arr is not None and len(arr) != len(packed):
                raise ValueError(f"{name} has {len(arr)} rows but bits has {len(packed)}")
        self.length = length
        self.bitorder = bitorder
        self._arrays = arrays

    def _open(self) -> list[np.ndarray[Any, Any] | None]:
        names = ["bits", "labels"] + [f"extras[{i}]" for i in range(len(self._sources) - 2)]
        return [
            None if s is None else _load(s, n) for s, n in zip(self._sources, names, strict=True)
        ]

    def __getstate__(self) -> dict[str, Any]:
        # Workers started with "spawn" would otherwise receive whole memmaps by value.
        state = self.__dict__.copy()
        state["_arrays"] = [
            None if isinstance(s, str | os.PathLike) else a
            for s, a in zip(self._sources, self._arrays, strict=True)
        ]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        reopened = self._open()
        self._arrays = [
            a if a is not None else r for a, r in zip(self._arrays, reopened, strict=True)
        ]

    @property
    def bits(self) -> np.ndarray[Any, Any]:
        """The packed array (rows, ..., ceil(L / 8))."""
        packed = self._arrays[0]
        assert packed is not None
        return packed

    def __len__(self) -> int:
        return len(self.bits)

    def __getitem__(self, index: int) -> PackedBatch:
        return self._take(np.asarray(index, dtype=np.intp))

    def __getitems__(self, indices: Sequence[int]) -> PackedBatch:
        """A whole batch with one fancy-index per array (the DataLoader's batched fetch)."""
        return self._take(np.asarray(indices, dtype=np.intp))

    def _take(self, idx: np.ndarray[Any, Any]) -> PackedBatch:
        n = len(self)
        if ((idx < -n) | (idx >= n)).any():
            raise IndexError(f"index out of range for a dataset of {n} rows")
        rows = [None if a is None else _gather(a, idx) for a in self._arrays]
        bits, labels, *extras = [None if r is None else torch.from_numpy(r) for r in rows]
        assert bits is not None
        return PackedBatch(bits, labels, tuple(e for e in extras if e is not None))


def _gather(a: np.ndarray[Any, Any], idx: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``a[idx]`` as a fresh writable array that ``torch.from_numpy`` can own.

    An integer-array index already copies (also out of a read-only memmap), so the result is
    used as is; only what is not such a copy is copied: the NumPy scalar a 0-d index gives on
    a 1-D array, or a result that is read-only or still shares memory with ``a``.
    """
    rows = a[idx]
    if isinstance(rows, np.ndarray) and rows.flags.writeable and not np.may_share_memory(rows, a):
        return rows
    return np.array(rows)


def collate_packed(samples: PackedBatch | Sequence[PackedBatch]) -> PackedBatch:
    """Batch packed rows: ``collate_fn`` for a ``DataLoader`` over a packed dataset.

    Args:
        samples: either one :class:`PackedBatch` already gathered by
            ``PackedBitsDataset.__getitems__`` (passed through), or single-row samples from
            ``__getitem__`` (stacked along a new batch axis).

    Returns:
        A :class:`PackedBatch`; ``DataLoader(pin_memory=True)`` then pins it.
    """
    if isinstance(samples, PackedBatch):
        return samples
    if not samples:
        raise ValueError("cannot collate an empty batch")
    bits = torch.stack([s.bits for s in samples])
    labels = [s.labels for s in samples if s.labels is not None]
    if labels and len(labels) != len(samples):
        raise ValueError("some samples have labels and some do not")
    extras = tuple(torch.stack(list(col)) for col in zip(*(s.extras for s in samples), strict=True))
    return PackedBatch(bits, torch.stack(labels) if labels else None, extras)


class DevicePrefetcher:
    """Iterate a loader of :class:`PackedBatch` as unpacked batches on ``device``.

    On CUDA, batch ``k + 1`` is copied (``non_blocking`` from pinned memory) and unpacked on
    a side stream while the caller's stream works on batch ``k``. The caller's stream waits
    on an event recorded after the unpack before a batch is handed out, and the side stream
    waits on the caller's stream before it overwrites a reused buffer, so no batch is read
    before its copy finishes and no buffer is overwritten while still in use. The side stream
    is the prefetcher's for its life, so an epoch left early (a copy still in flight) is
    ordered before the next epoch's writes. Labels and
    extras are allocated on the side stream and ``record_stream``-ed on the caller's.

    On the CPU there are no streams: each batch is unpacked when it is asked for.

    With ``reuse_buffers`` (default) the features of batch ``k`` live in one of two buffers
    and are overwritten when batch ``k + 2`` is produced: use a batch within its iteration
    (as a training step does) or ``.clone()`` it. ``reuse_buffers=False`` allocates afresh.

    Args:
        loader: any iterable of :class:`PackedBatch` (a ``DataLoader`` with
            ``collate_fn=collate_packed``; ``pin_memory=True`` on CUDA for full overlap).
        device: where the batches go.
        length: the logical length L (default: ``loader.dataset.length``).
        bitorder: the bit order (default: ``loader.dataset.bitorder``, else ``"big"``).
        dtype: the features' dtype (default float32; bf16, float16, uint8, bool work too).
        unpack: unpack the bits (default). ``False`` hands over the packed bits, or, for a
            dense (already unpacked) loader, its features converted to ``dtype``.
        reuse_buffers: unpack into two reused buffers instead of fresh tensors.
    """

    def __init__(
        self,
        loader: Iterable[PackedBatch],
        device: torch.device | str,
        *,
        length: int | None = None,
        bitorder: str | None = None,
        dtype: torch.dtype = torch.float32,
        unpack: bool = True,
        reuse_buffers: bool = True,
    ) -> None:
        dataset = getattr(loader, "dataset", None)
        self.loader = loader
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.length = length if length is not None else getattr(dataset, "length", None)
        self.bitorder = str(bitorder or getattr(dataset, "bitorder", "big"))
        self.dtype = dtype
        self.unpack = unpack
        self.reuse_buffers = reuse_buffers
        self._buffers: list[torch.Tensor | None] = [None, None]
        # One side stream for the prefetcher's life: an epoch that stops with a copy in
        # flight leaves it queued there, ahead of the next epoch's writes to the same buffers.
        self._side: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _features(self, bits: torch.Tensor, slot: int) -> torch.Tensor:
        """Unpack (or convert) ``bits`` on the device into buffer ``slot`` (or a new tensor)."""
        if self.unpack:
            shape = (
                *bits.shape[:-1],
                self.length if self.length is not None else 8 * bits.shape[-1],
            )
        else:
            shape = tuple(bits.shape)
        out: torch.Tensor | None = None
        if self.reuse_buffers:
            buf = self._buffers[slot]
            if buf is None or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                self._buffers[slot] = buf
            out = buf[: shape[0]]
        if self.unpack:
            return unpackbits(
                bits, dim=-1, count=shape[-1], bitorder=self.bitorder, dtype=self.dtype, out=out
            )
        if out is None:
            return bits.to(self.dtype)
        return out.copy_(bits)

    def _load(self, batch: PackedBatch, slot: int) -> DeviceBatch:
        if not isinstance(batch, PackedBatch):
            raise TypeError(
                f"expected PackedBatch items (use collate_fn=collate_packed), got "
                f"{type(batch).__name__}"
            )
        bits = to_device(batch.bits, self.device)
        labels = None if batch.labels is None else to_device(batch.labels, self.device)
        extras = tuple(to_device(e, self.device) for e in batch.extras)
        return DeviceBatch(self._features(bits, slot), labels, extras)

    def __iter__(self) -> Iterator[DeviceBatch]:
        if self.device.type != "cuda":
            for k, batch in enumerate(self.loader):
                yield self._load(batch, k % 2)
            return
        yield from self._iter_cuda()

    def _iter_cuda(self) -> Iterator[DeviceBatch]:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side = self._side
        it = iter(self.loader)

        def issue(k: int) -> tuple[DeviceBatch, torch.cuda.Event] | None:
            batch = next(it, None)
            if batch is None:
                return None
            main = torch.cuda.current_stream(self.device)
            # The buffer being overwritten held batch k - 2, which the caller's stream may
            # still be reading: wait for everything queued there so far.
            side.wait_stream(main)
            with torch.cuda.stream(side):
                loaded = self._load(batch, k % 2)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(side)
            # Reused buffers were allocated on ``side`` itself, so the allocator already
            # orders their reuse after this write; no record_stream(side) is needed.
            return loaded, done

        k = 0
        pending = issue(k)
        while pending is not None:
            loaded, done = pending
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)
            # These were allocated on the side stream; tell the allocator the caller's stream
            # uses them too, so their memory is not reused before that work is done.
            for t in (loaded.features, loaded.labels, *loaded.extras):
                if t is not None:
                    t.record_stream(main)
            pending = issue(k + 1)  # batch k + 1 copies while the caller computes on batch k
            yield loaded
            k += 1


# --- conversion to the packed format ---------------------------------------------------------


def pack_array(
    arr: ArrayLike,
    dim: int = -1,
    *,
    bitorder: str = "big",
    out: str | os.PathLike[str] | None = None,
    chunk_bytes: int = 64 << 20,
    check_binary: bool = False,
    progress: bool = False,
) -> np.ndarray[Any, Any]:
    """Pack a 0/1 feature array along ``dim`` with ``np.packbits``, chunk by chunk.

    The array is read in chunks of rows (along axis 0) of about ``chunk_bytes``, so an input
    memmap and an ``out`` file may both be larger than memory. When ``dim`` is axis 0 itself,
    chunks hold a multiple of 8 rows so each chunk packs into whole output rows.

    Args:
        arr: bool or integer array (rows, ..., L) — an ndarray, a memmap, or a ``.npy`` path.
            Any nonzero element is a 1, as in ``np.packbits``.
        dim: the axis to pack (default -1, the layout :class:`PackedBitsDataset` reads).
        bitorder: ``"big"`` or ``"little"``.
        out: a ``.npy`` path to write (as a memmap); ``None`` returns an in-memory array.
        chunk_bytes: input bytes per chunk (default 64 MiB).
        check_binary: raise ``ValueError`` if an element is neither 0 nor 1.
        progress: show a ``tqdm`` progress bar over rows (needs ``tqdm``).

    Returns:
        The packed uint8 array (a flushed memmap when ``out`` is given), shaped like ``arr``
        with ``dim`` of length ``ceil(L / 8)``.

    Raises:
        TypeError: ``arr`` is not bool or integer.
        ValueError: a bad ``dim``/``bitorder``, ``out`` naming the input's own file, or (with
            ``check_binary``) a value not 0/1.
        ImportError: ``progress=True`` without ``tqdm`` installed.
    """
    src = _load(arr, "arr")
    if src.dtype != np.bool_ and src.dtype.kind not in "iu":
        raise TypeError(f"pack_array needs a bool or integer array, got {src.dtype}")
    if bitorder not in ("big", "little"):
        raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")
    if src.ndim == 0:
        raise ValueError("pack_array needs at least one axis")
    if not -src.ndim <= dim < src.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {src.ndim} dimensions")
    dim %= src.ndim
    shape = list(src.shape)
    shape[dim] = (shape[dim] + 7) // 8
    if out is None:
        dst: np.ndarray[Any, Any] = np.empty(shape, dtype=np.uint8)
    else:
        _check_out_is_not_input(arr, out)
        dst = np.lib.format.open_memmap(out, mode="w+", dtype=np.uint8, shape=tuple(shape))

    rows = src.shape[0]
    row_bytes = max(src[:1].nbytes, 1)
    step = max(1, chunk_bytes // row_bytes)
    if dim == 0:
        step = max(8, step - step % 8)
    bar = _progress_bar(rows, enabled=progress)
    try:
        for start in range(0, rows, step):
            chunk = np.asarray(src[start : start + step])
            if check_binary and ((chunk != 0) & (chunk != 1)).any():
                raise ValueError(f"a value other than 0/1 in rows {start}..{start + len(chunk)}")
            packed = np.packbits(chunk, axis=dim, bitorder=cast(Literal["big", "little"], bitorder))
            if dim == 0:
                dst[start // 8 : start // 8 + len(packed)] = packed
            else:
                dst[start : start + len(packed)] = packed
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    if isinstance(dst, np.memmap):
        dst.flush()
    return dst


def _source_files(arr: object) -> list[str]:
    """The files ``arr`` reads: its path, or the file(s) behind a memmap (or a view of one)."""
    if isinstance(arr, str | os.PathLike):
        return [os.fspath(arr)]
    files = []
    base: object = arr
    while base is not None:  # a view of a memmap (even a plain ndarray view) keeps it as .base
        name = getattr(base, "filename", None) if isinstance(base, np.memmap) else None
        if name is not None:
            files.append(os.fspath(name))
        base = getattr(base, "base", None)
    return files


def _check_out_is_not_input(arr: object, out: str | os.PathLike[str]) -> None:
    """Refuse an ``out`` that is the input's file: opening it for writing truncates it."""
    target = Path(out).resolve()
    for name in _source_files(arr):
        src = Path(name).resolve()
        if src == target or (target.exists() and src.exists() and os.path.samefile(src, target)):
            raise ValueError(
                f"out {os.fspath(out)!r} is the file being packed ({name!r}); writing it would "
                "truncate the input: choose another path"
            )


def _progress_bar(total: int, *, enabled: bool) -> Any:
    """A tqdm bar over ``total`` rows, or ``None``; tqdm is only imported when asked for."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(
            "progress=True needs tqdm: pip install tqdm (or bitserve[data])"
        ) from None
    return tqdm(total=total, unit="row", desc="packing")
