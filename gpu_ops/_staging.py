"""The pinned host staging pool behind :class:`gpu_ops.transfer.StagingPool`.

See :mod:`gpu_ops.transfer` for the overview; this module holds the pool's bookkeeping.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from gpu_ops._hostmem import DeviceLike, as_array, check_dtype, cuda_available

# Blocks are powers of two of at least this many bytes; free blocks beyond MAX_CACHED_BYTES
# are dropped (torch's host allocator itself holds pinned memory back until pending copies
# finish, so dropping is safe).
MIN_BLOCK_BYTES = 64 << 10
MAX_CACHED_BYTES = 256 << 20


class StagingBuffer:
    """A host staging buffer of ``nbytes`` bytes, lent by :meth:`StagingPool.acquire`.

    Fill it with :meth:`write`, then move it with :meth:`to_device`. It is valid only inside
    the ``with`` block that acquired it.
    """

    def __init__(self, block: torch.Tensor, nbytes: int) -> None:
        self._block = block
        self._nbytes = nbytes
        self._event: torch.cuda.Event | None = None
        self._detached = False
        self._released = False

    @property
    def nbytes(self) -> int:
        """The size that was asked for (the block behind it may be larger)."""
        return self._nbytes

    def write(self, data: Any, offset: int = 0) -> int:
        """Copy the raw bytes of ``data`` to ``offset`` and return the offset just past them.

        Waits first for a copy that may still be reading the buffer.

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

    def to_device(self, device: DeviceLike, *, non_blocking: bool = True) -> torch.Tensor:
        """Move the buffer's bytes to ``device`` with one copy; returns a 1-D uint8 tensor.

        On a CUDA device the copy is queued on the current stream and an event is recorded
        after it; the buffer returns to the pool only once that event has completed. Work
        queued later on the same stream sees the data; use it on another stream only after
        ``wait_stream`` (and ``record_stream``).

        On the CPU there is nothing to move: the buffer itself is returned and the pool lets
        go of it (it is never reused), so the result stays valid after release.
        """
        self._check_usable()
        self._wait_inflight()
        dev = torch.device(device)
        if dev.type != "cuda":
            self._detached = True
            return self._block[: self._nbytes].to(dev)
        with torch.cuda.device(dev):
            out = torch.empty(self._nbytes, dtype=torch.uint8, device=dev)
            out.copy_(self._block[: self._nbytes], non_blocking=non_blocking)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._event = event
        return out

    def _wait_inflight(self) -> None:
        # Overwriting the buffer while a DMA still reads it would corrupt the transfer;
        # waiting is cheap because the copy was queued first.
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _check_usable(self) -> None:
        if self._released:
            raise RuntimeError("this staging buffer was released; acquire a new one")
        if self._detached:
            raise RuntimeError("this staging buffer was handed out by to_device() on the CPU")


class StagingPool:
    """A thread-safe pool of reusable host staging buffers, pinned for a CUDA device.

    Example (what the server's pipeline does)::

        pool = StagingPool("cuda")
        with pool.acquire(sum(len(p) for p in payloads)) as buf:
            offset = 0
            for p in payloads:
                offset = buf.write(p, offset)
            batch = buf.to_device("cuda")  # one non_blocking copy; the buffer is recycled later

    An acquisition takes the smallest free block that fits (blocks are powers of two of at
    least 64 KiB). A released block whose copy is still in flight waits in a queue and is
    reused only after its CUDA event completes. Free blocks beyond 256 MiB in all are
    dropped, largest first.

    Args:
        device: the device payloads go to (default: ``"cuda"`` when available, else CPU).
            Buffers are page-locked when it is a CUDA device.
    """

    def __init__(self, device: DeviceLike | None = None) -> None:
        if device is None:
            device = "cuda" if cuda_available() else "cpu"
        self.device = torch.device(device)
        self._pin = cuda_available() and self.device.type == "cuda"
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._inflight: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()

    @contextmanager
    def acquire(self, nbytes: int) -> Iterator[StagingBuffer]:
        """Lend a buffer of at least ``nbytes`` bytes for the duration of the ``with`` block.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        block = self._take(nbytes)
        buf = StagingBuffer(block, nbytes)
        try:
            yield buf
        finally:
            buf._released = True
            if not buf._detached:
                self._give_back(block, buf._event)

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
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        size = max(MIN_BLOCK_BYTES, 1 << max(nbytes - 1, 0).bit_length())
        return torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)

    def _give_back(self, block: torch.Tensor, event: torch.cuda.Event | None) -> None:
        with self._lock:
            if event is not None and not event.query():  # type: ignore[no-untyped-call]
                self._inflight.append((block, event))
            else:
                self._free.append(block)
            # Drop the largest free blocks first: the rarest fit and the costliest to hold.
            cached = sum(b.numel() for b in self._free)
            cached += sum(b.numel() for b, _ in self._inflight)
            self._free.sort(key=lambda b: b.numel())
            while self._free and cached > MAX_CACHED_BYTES:
                cached -= self._free.pop().numel()
