"""Host-to-device transfer: zero-copy views, pinned staging buffers and DLPack interop.

Which paths share memory and which copy (``obj`` is what you pass to :func:`to_device`):

==========================================  ==========================================
source                                      result
==========================================  ==========================================
tensor already on ``device``, same dtype    ``obj`` itself
writable buffer / NumPy array, CPU target   a view (``torch.from_numpy``), no copy
read-only buffer (``bytes``), CPU target    one copy (or a view with ``share_readonly``)
any host data, CUDA target                  one copy into pinned memory, one
                                            ``non_blocking`` host-to-device copy
narrowing dtype (float64 -> float32)        converted on the host, inside that copy
widening dtype (uint8 -> float32)           converted on the device, after the copy
==========================================  ==========================================

torch has no read-only tensors: ``torch.frombuffer``/``torch.from_numpy`` warn when handed
immutable memory, because writing through the tensor would change a ``bytes`` object. Read-only
sources are therefore only ever *read* here (through a private DLPack alias) unless the caller
opts into sharing them.

:class:`StagingPool` is for callers that gather many small payloads into one transfer (the
server's batcher): payloads are copied into one pinned buffer and moved with one
``non_blocking`` copy; the buffer goes back to the pool only once a CUDA event recorded after
that copy has completed, so it is never overwritten while the DMA engine still reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack as _torch_from_dlpack

from gpu_ops._hostmem import DeviceLike, as_array, cuda_available, host_view
from gpu_ops._staging import StagingBuffer, StagingPool

__all__ = [
    "StagingBuffer",
    "StagingPool",
    "from_dlpack",
    "to_device",
    "to_dlpack",
    "to_numpy",
]


def _narrows(src: torch.dtype, dst: torch.dtype | None) -> bool:
    """Whether converting to ``dst`` before the copy moves fewer bytes than after it."""
    return dst is not None and dst != src and dst.itemsize < src.itemsize


def _pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    # torch's caching host allocator records an event on every non_blocking copy from its
    # blocks and reuses a block only after that event, so dropping this tensor right after
    # the copy is queued is safe.
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=cuda_available())


def _host_to_cuda(
    src: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype | None,
    non_blocking: bool,
    src_pinned: bool,
) -> torch.Tensor:
    """Copy the CPU tensor ``src`` to ``device`` through (at most) one pinned host buffer."""
    host_dtype = dtype if dtype is not None and _narrows(src.dtype, dtype) else src.dtype
    if src_pinned and host_dtype == src.dtype:
        staged = src
    else:
        staged = _pinned_empty(src.shape, host_dtype)
        staged.copy_(src)  # one pass: gathers strides and converts the dtype
    out = staged.to(device, non_blocking=non_blocking)
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


def to_device(
    obj: Any,
    device: DeviceLike,
    dtype: torch.dtype | None = None,
    non_blocking: bool = True,
    *,
    share_readonly: bool = False,
) -> torch.Tensor:
    """Move ``obj`` to ``device`` as a tensor, copying only where it has to.

    Args:
        obj: a ``torch.Tensor``, a NumPy array or scalar, a buffer (``bytes``, ``bytearray``,
            ``memoryview``; 1-D uint8 unless the memoryview carries another format), or any
            DLPack producer (an object with ``__dlpack__``, e.g. a CuPy array).
        device: the target device.
        dtype: the result dtype; ``None`` keeps the source dtype. A narrowing conversion
            (float64 -> float32) happens on the host so fewer bytes cross the bus; a widening
            one (uint8 -> float32) on the device after the copy.
        non_blocking: for a CUDA target, queue the host-to-device copy asynchronously on the
            current stream (the source is staged in pinned memory, so this is real overlap).
            Work queued later on the same stream sees the data; other streams must wait on
            it. Device-to-host copies are always synchronous, so a CPU result is readable at
            once.
        share_readonly: return a view of read-only host memory (``bytes``, read-only arrays)
            instead of a copy when the target is the CPU. The tensor must then never be
            written: torch has no read-only tensors, and writing would change the ``bytes``.

    Returns:
        A tensor of ``obj``'s shape on ``device``. It shares ``obj``'s memory when ``obj`` is
        already there with the right dtype, or is writable host memory and the target is the
        CPU (see the module docstring for the full table).

    Raises:
        TypeError: ``obj`` is of an unsupported type or dtype.
    """
    device = torch.device(device)
    if device.type == "cuda" and not cuda_available():
        raise RuntimeError(f"cannot move data to {device}: CUDA is not available on this host")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(obj, torch.Tensor):
        return _tensor_to_device(obj, device, dtype, non_blocking)
    if not isinstance(obj, np.ndarray | np.generic) and hasattr(obj, "__dlpack__"):
        return _tensor_to_device(from_dlpack(obj), device, dtype, non_blocking)
    arr = as_array(obj)
    if device.type == "cpu":
        host, _ = host_view(arr, share_readonly=share_readonly)
        return host if dtype is None else host.to(dtype)
    # Only read below, so a read-only source may be aliased without a copy.
    host, _ = host_view(arr, share_readonly=True)
    if device.type == "cuda":
        return _host_to_cuda(host, device, dtype, non_blocking, src_pinned=False)
    return host.to(device=device, dtype=dtype)


def _tensor_to_device(
    t: torch.Tensor, device: torch.device, dtype: torch.dtype | None, non_blocking: bool
) -> torch.Tensor:
    if t.device == device:
        return t if dtype is None or dtype == t.dtype else t.to(dtype)
    if t.device.type == "cpu" and device.type == "cuda":
        return _host_to_cuda(t, device, dtype, non_blocking, src_pinned=t.is_pinned())
    if device.type == "cpu":
        # Synchronous on purpose: a non_blocking device-to-host copy would hand back memory
        # that is not yet written.
        return t.to(device=device, dtype=dtype)
    return t.to(device=device, dtype=dtype, non_blocking=non_blocking)


# --- DLPack -----------------------------------------------------------------------------------


def from_dlpack(obj: Any) -> torch.Tensor:
    """A tensor sharing the memory of a DLPack producer, on the producer's device.

    Args:
        obj: an object with ``__dlpack__``/``__dlpack_device__`` (NumPy >= 1.22, CuPy, JAX,
            another tensor) or a legacy ``PyCapsule`` from ``to_dlpack``. NumPy arrays with
            negative strides or non-native byte order cannot be described by DLPack and are
            copied (torch aborts the process on a negative DLPack stride, so this is checked
            first).

    Returns:
        A tensor aliasing ``obj`` (writes are visible to the producer).

    Raises:
        TypeError: ``obj`` speaks no DLPack or has a dtype DLPack cannot describe.
    """
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        return host_view(obj, share_readonly=True)[0]
    if not hasattr(obj, "__dlpack__") and type(obj).__name__ != "PyCapsule":
        raise TypeError(f"{type(obj).__name__} is not a DLPack producer (no __dlpack__)")
    try:
        return _torch_from_dlpack(obj)
    except BufferError as exc:
        raise TypeError(f"cannot import {type(obj).__name__} through DLPack: {exc}") from None


def to_dlpack(tensor: torch.Tensor) -> Any:
    """A legacy DLPack capsule aliasing ``tensor`` (for consumers that want a capsule).

    Modern consumers take the tensor itself (``np.from_dlpack(t)``, ``cupy.from_dlpack(t)``);
    this helper also detaches tensors that require grad, which DLPack cannot carry.

    Args:
        tensor: any tensor, on any device.

    Returns:
        A ``PyCapsule`` named ``"dltensor"``, consumable once.
    """
    return tensor.detach().__dlpack__()


def to_numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """``tensor`` as a NumPy array: a view for CPU tensors, one copy from other devices.

    Args:
        tensor: any tensor; ``bfloat16`` has no NumPy dtype and raises ``TypeError``.

    Returns:
        An ndarray of the same shape and dtype (writes reach a CPU tensor).
    """
    if tensor.dtype == torch.bfloat16:
        raise TypeError("bfloat16 has no NumPy dtype; convert with .float() first")
    return tensor.detach().cpu().resolve_conj().resolve_neg().numpy()
