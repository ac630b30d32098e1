"""The pinned host staging pool behind :class:`gpu_ops.transfer.StagingPool`.

See :mod:`gpu_ops.transfer` for the overview; this module holds the pool's bookkeeping.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_ops._hostmem import DeviceLike, as_array, check_dtype, cuda_available


@dataclass(frozen=True)
class StagingStats:
    """A snapshot of a :class:`StagingPool`.

    Attributes:
        cached_bytes: bytes held by the pool (free, in flight or in use).
        free_blocks: blocks ready for reuse.
        inflight_blocks: released blocks whose copy has not finished yet.
        in_use_blocks: blocks currently acquired.
        allocations: blocks allocated so far (a reuse does not count).
        reuses: acquisitions served from a cached block.
    """

    cached_bytes: int
    free_blocks: int
    inflight_blocks: int
    in_use_blocks: int
    allocations: int
    reuses: int


class StagingBuffer:
    """A host staging buffer of ``nbytes`` bytes, lent by :meth:`StagingPool.acquire`.

    Fill it with :meth:`write` (or through :meth:`numpy`/:attr:`tensor`), then move it with
    :meth:`to_device`; or receive device results with :meth:`copy_from`. It is valid only
    inside the ``with`` block that acquired it.
    """

    def __init__(self, block: torch.Tensor, nbytes: int, pool: StagingPool) -> None:
        self._block = block
        self._nbytes = nbytes
        self._pool = pool
        self._event: torch.cuda.Event | None = None
        self._detached = False
        self._released = False

    @property
    def nbytes(self) -> int:
        """The size that was asked for (the block behind it may be larger)."""
        return self._nbytes

    @property
    def pinned(self) -> bool:
        """Whether the memory is page-locked (only where CUDA is available)."""
        return self._block.is_pinned()

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer as a 1-D uint8 CPU tensor of ``nbytes`` (a view, no copy).

        Waits first for a copy still reading the buffer (as :meth:`numpy` does): the caller
        is about to write or read it.
        """
        self._check_usable()
        self._wait_inflight()
        return self._block[: self._nbytes]

    def numpy(self) -> np.ndarray[Any, Any]:
        """The buffer as a writable 1-D uint8 ndarray of ``nbytes`` (a view, no copy)."""
        self._check_usable()
        self._wait_inflight()
        return self._block[: self._nbytes].numpy()

    def write(self, data: Any, offset: int = 0) -> int:
        """Copy the raw bytes of ``data`` to ``offset`` and return the offset just past them.

        Args:
            data: bytes, bytearray, memoryview, a NumPy array (any strides; its elements are
                written in C order) or a CPU tensor.
            offset: where in the buffer to start.

        Returns:
            ``offset + len(bytes of data)``, where the next payload can go.

        Raises:
            ValueError: the bytes do not fit in the buffer.
        """
        self._check_usable()
        self._wait_inflight()
        if isinstance(data, torch.Tensor):
            if data.device.type != "cpu":
                raise ValueError(f"write() takes host data, got a tensor on {data.device}")
            src = data.detach().contiguous().reshape(-1).view(torch.uint8)
            end = self._span(offset, src.numel())
            self._block[offset:end].copy_(src)
            return end
        # NumPy copies straight from the payload (request bodies are read-only ``bytes``):
        # no torch alias of read-only memory, which older NumPy/torch cannot make.
        arr = as_array(data)
        check_dtype(arr)
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))  # values, as torch would hold them
        end = self._span(offset, arr.nbytes)
        dst = self._block[offset:end].numpy().view(arr.dtype).reshape(arr.shape)
        np.copyto(dst, arr, casting="no")  # any source strides, written in C order
        return end

    def _span(self, offset: int, nbytes: int) -> int:
        end = offset + nbytes
        if offset < 0 or end > self._nbytes:
            raise ValueError(
                f"{nbytes} bytes at offset {offset} do not fit in a {self._nbytes}-byte "
                "staging buffer"
            )
        return end

    def to_device(
        self,
        device: DeviceLike | None = None,
        *,
        non_blocking: bool = True,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor:
        """Move the buffer's bytes to ``device`` with one copy; returns a 1-D uint8 tensor.

        On a CUDA device the copy is queued on ``stream`` (default: the current stream) and
        an event is recorded after it; the buffer returns to the pool only once that event
        has completed. The result is allocated on that stream, so work queued there later
        sees the data; use it on another stream only after ``wait_stream`` (and
        ``record_stream``).

        On the CPU there is nothing to move: the buffer itself is returned and the pool lets
        go of it (it is never reused), so the result stays valid after release.

        Args:
            device: target device; default: the pool's device.
            non_blocking: queue the copy asynchronously (CUDA only).
            stream: the CUDA stream to copy on.
        """
        self._check_usable()
        self._wait_inflight()
        dev = torch.device(device) if device is not None else self._pool.device
        if dev.type != "cuda":
            self._detached = True
            return self._block[: self._nbytes].to(dev)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            out = torch.empty(self._nbytes, dtype=torch.uint8, device=dev)
            out.copy_(self._block[: self._nbytes], non_blocking=non_blocking)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._event = event
        return out

    def copy_from(
        self, src: torch.Tensor, *, stream: torch.cuda.Stream | None = None
    ) -> torch.Tensor:
        """Copy ``src`` (any device) into the buffer and return it as a host tensor.

        The device-to-host copy goes into this (pinned) buffer on ``stream`` and is waited
        for before returning, so the result is readable at once. It is a view of the buffer:
        valid until the ``with`` block ends.

        Args:
            src: the tensor to fetch; its ``nbytes`` must fit in the buffer.
            stream: the CUDA stream to copy on (default: the current one).

        Returns:
            A CPU tensor with ``src``'s shape and dtype (contiguous).
        """
        self._check_usable()
        self._wait_inflight()
        nbytes = src.numel() * src.element_size()
        if nbytes > self._nbytes:
            raise ValueError(f"a {nbytes}-byte tensor does not fit in {self._nbytes} bytes")
        dst = self._block[:nbytes].view(src.dtype).view(src.shape)
        if src.device.type == "cuda":
            with torch.cuda.device(src.device), torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            event.synchronize()  # waits for this copy only, not the whole device
        else:
            dst.copy_(src)
        return dst

    def _wait_inflight(self) -> None:
        # Overwriting (or re-reading) the buffer while a DMA still reads it would corrupt the
        # transfer; waiting is cheap because the copy was queued first.
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _check_usable(self) -> None:
        if self._released:
            raise RuntimeError("this staging buffer was released; acquire a new one")
        if self._detached:
            raise RuntimeError("this staging buffer was handed out by to_device() on the CPU")


class StagingPool:
    """A thread-safe pool of reusable (pinned, where CUDA exists) host staging buffers.

    Example (what the batcher does)::

        pool = StagingPool("cuda")
        with pool.acquire(sum(len(p) for p in payloads)) as buf:
            offset = 0
            for p in payloads:
                offset = buf.write(p, offset)
            batch = buf.to_device()  # one non_blocking copy; the buffer is recycled later

    Or in one call: ``batch, offsets = pool.gather(payloads)``.

    Blocks are sized in powers of two (at least ``min_block_bytes``); an acquisition takes
    the smallest free block that fits. A released block whose copy is still in flight waits
    in a queue and is reused only after its CUDA event completes. Free blocks beyond
    ``max_cached_bytes`` are dropped (torch's host allocator itself holds pinned memory
    back until pending copies finish, so dropping is safe).

    Args:
        device: the device payloads go to (default: ``"cuda"`` when available, else CPU).
        pin_memory: page-lock the buffers. ``None`` (default): only when CUDA is available
            and ``device`` is a CUDA device. ``True`` without CUDA raises ``ValueError``.
        max_cached_bytes: the most memory to keep cached once released (default 256 MiB).
        min_block_bytes: the smallest block allocated (default 64 KiB).
    """

    def __init__(
        self,
        device: DeviceLike | None = None,
        *,
        pin_memory: bool | None = None,
        max_cached_bytes: int = 256 << 20,
        min_block_bytes: int = 64 << 10,
    ) -> None:
        if device is None:
            device = "cuda" if cuda_available() else "cpu"
        self.device = torch.device(device)
        if pin_memory is None:
            pin_memory = cuda_available() and self.device.type == "cuda"
        elif pin_memory and not cuda_available():
            raise ValueError("pin_memory=True needs CUDA, which this host does not have")
        if max_cached_bytes < 0 or min_block_bytes <= 0:
            raise ValueError("max_cached_bytes must be >= 0 and min_block_bytes > 0")
        self.pin_memory = pin_memory
        self.max_cached_bytes = max_cached_bytes
        self.min_block_bytes = min_block_bytes
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._inflight: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self._in_use = 0
        self._in_use_bytes = 0
        self._allocations = 0
        self._reuses = 0

    @contextmanager
    def acquire(self, nbytes: int) -> Iterator[StagingBuffer]:
        """Lend a buffer of at least ``nbytes`` bytes for the duration of the ``with`` block.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        block = self._take(nbytes)
        buf = StagingBuffer(block, nbytes, self)
        try:
            yield buf
        finally:
            buf._released = True
            self._give_back(block, buf._event, keep=not buf._detached)

    def gather(
        self, parts: Sequence[Any], device: DeviceLike | None = None, *, stream: Any = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Concatenate the raw bytes of ``parts`` on ``device`` with one host-to-device copy.

        Args:
            parts: payloads as accepted by :meth:`StagingBuffer.write`.
            device: target device (default: the pool's).
            stream: CUDA stream for the copy (default: the current one).

        Returns:
            ``(data, offsets)``: a 1-D uint8 tensor on ``device`` and ``len(parts) + 1``
            offsets; part ``i`` is ``data[offsets[i]:offsets[i + 1]]``.
        """
        arrays = [p if isinstance(p, torch.Tensor) else as_array(p) for p in parts]
        sizes = [
            a.numel() * a.element_size() if isinstance(a, torch.Tensor) else a.nbytes
            for a in arrays
        ]
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        with self.acquire(offsets[-1]) as buf:
            for a, off in zip(arrays, offsets, strict=False):
                buf.write(a, off)
            data = buf.to_device(device, stream=stream)
        return data, offsets

    def stats(self) -> StagingStats:
        """A consistent snapshot of the pool's counters."""
        with self._lock:
            self._reap()
            cached = sum(b.numel() for b in self._free)
            cached += sum(b.numel() for b, _ in self._inflight) + self._in_use_bytes
            return StagingStats(
                cached_bytes=cached,
                free_blocks=len(self._free),
                inflight_blocks=len(self._inflight),
                in_use_blocks=self._in_use,
                allocations=self._allocations,
                reuses=self._reuses,
            )

    def clear(self) -> None:
        """Drop every free block (in-flight and in-use blocks are left alone)."""
        with self._lock:
            self._reap()
            self._free.clear()

    def _reap(self) -> None:
        # Events complete in stream order on one stream, but blocks may have been copied on
        # different streams, so every entry is checked rather than stopping at the first.
        still: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        for block, event in self._inflight:
            if event.query():  # type: ignore[no-untyped-call]
                self._free.append(block)
            else:
                still.append((block, event))
        self._inflight = still

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._reap()
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                # By index: list.remove would compare tensors elementwise.
                block = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self._reuses += 1
            else:
                size = max(self.min_block_bytes, 1 << max(nbytes - 1, 0).bit_length())
                block = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
                self._allocations += 1
            self._in_use += 1
            self._in_use_bytes += block.numel()
            return block

    def _give_back(
        self, block: torch.Tensor, event: torch.cuda.Event | None, *, keep: bool
    ) -> None:
        with self._lock:
            self._in_use -= 1
            self._in_use_bytes -= block.numel()
            if not keep:
                return
            if event is not None and not event.query():  # type: ignore[no-untyped-call]
                self._inflight.append((block, event))
            else:
                self._free.append(block)
            self._trim()

    def _trim(self) -> None:
        # Drop the largest free blocks first: they are the rarest fit and the costliest to hold.
        cached = sum(b.numel() for b in self._free) + sum(b.numel() for b, _ in self._inflight)
        self._free.sort(key=lambda b: b.numel())
        while self._free and cached > self.max_cached_bytes:
            cached -= self._free.pop().numel()
