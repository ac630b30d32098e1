"""The CPU kernels of the bit ops: a compiled C unpacker and NumPy's packbits.

Unpacking runs a compiled C kernel (``_bits_c.c``, built on first use by
:mod:`gpu_ops._cbuild`): per input byte one copy of a 256 x 8 table row of finished output
values, the work split over torch's threads, non-temporal stores for big reused outputs.
It takes any layout whose output is contiguous along the packed axis (``out`` slices of a
batch buffer included); other layouts, and hosts without a C compiler or with
``BITSERVE_CPU_KERNELS=0``, take the torch kernels of :mod:`gpu_ops._bits_torch`. Packing
calls NumPy's packbits on zero-copy views.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from gpu_ops import _bits_torch, _cbuild

_NUMPY_PACK_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)

_C_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}

# Outputs smaller than this are unpacked on the calling thread alone; bigger ones are split
# over torch.get_num_threads() threads started for the call. Starting threads costs tens of
# microseconds, and with every core busy a second thread only adds that (measured on the
# shared 2-core host: break-even at ~1-2 MiB when a core is free; 2x faster at 1 GiB).
C_PARALLEL_MIN_BYTES = 4 << 20
# Reused outputs at least this big are written with non-temporal stores, which skip reading
# each cache line before overwriting it (measured, float32: 2x faster at 64 MiB, 10% at
# 16 MiB, slower below 4 MiB). Not for fresh results: their pages are first touched (and
# zeroed by the OS, leaving them in cache) during the unpack, and streaming made that ~1.5x
# slower.
C_STREAM_MIN_BYTES = 16 << 20


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bs_unpack.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, cint, cint, cint]
    lib.bs_unpack.restype = None
    return lib


_LIBRARY = _cbuild.Library(
    Path(__file__).with_name("_bits_c.c"), "bits_c", _bind, "CPU bit kernels"
)


def kernels() -> ctypes.CDLL | None:
    """The compiled unpack kernel (``_bits_c.c``), built on first call; ``None`` if
    unavailable or disabled (``BITSERVE_CPU_KERNELS=0``)."""
    return _LIBRARY.get()


# Results at least this big are allocated through NumPy on the CPU (see ``empty``).
_HUGE_PAGE_MIN_BYTES = 4 << 20


def empty(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised result tensor; big CPU ones backed by transparent huge pages.

    Unpacking writes 8 to 64 times its input, so for a fresh result the page faults of
    first touch cost more than the unpacking (measured: 1 GiB of float32 takes ~4x longer
    to fill in a new ``torch.empty`` than in a reused buffer). NumPy asks the kernel for huge
    pages on large allocations (``madvise(MADV_HUGEPAGE)``), which torch's CPU allocator only
    does when THP_MEM_ALLOC_ENABLE=1 is set, so large CPU results are NumPy-allocated and
    shared with torch (``torch.from_numpy``: same memory, no copy). Pass ``out=`` to reuse
    a buffer instead.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _HUGE_PAGE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    # NumPy has no bfloat16: allocate same-sized integers and reinterpret.
    like = torch.empty(0, dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return torch.from_numpy(np.empty(shape, dtype=like.numpy().dtype)).view(dtype)


def _c_table(dtype: torch.dtype, bitorder: str) -> torch.Tensor:
    """(256, 8) ``dtype``: row v holds v's bits as finished 0/1 values, in output order."""
    key = (dtype, bitorder)
    table = _C_TABLES.get(key)
    if table is None:
        shifts = torch.arange(8)
        if bitorder == "big":
            shifts = 7 - shifts
        table = ((torch.arange(256)[:, None] >> shifts) & 1).to(dtype).contiguous()
        _C_TABLES[key] = table
    return table


def _row_stride(t: torch.Tensor) -> int | None:
    """The single stride stepping through the rows of ``t`` (*lead, L) in C order.

    0 when there is at most one row; None when the leading dims do not collapse into one
    (for example a transposed pair of them).
    """
    stride: int | None = None
    expected = 0
    for size, st in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1]), strict=True):
        if size == 1:
            continue
        if stride is None:
            stride = st
        elif st != expected:
            return None
        expected = st * size
    return 0 if stride is None else stride


def _unpack_c(
    lib: ctypes.CDLL, x: torch.Tensor, out: torch.Tensor, bitorder: str, fresh: bool
) -> None:
    """Run ``bs_unpack`` on x (*lead, ceil(L / 8)) -> out (*lead, L), ``out`` rows contiguous.

    Leading dims that do not collapse into one row stride are looped over here.
    """
    xrs, ors = _row_stride(x), _row_stride(out)
    if xrs is None or ors is None:
        for i in range(x.shape[0]):
            _unpack_c(lib, x[i], out[i], bitorder, fresh)
        return
    nbytes = out.numel() * out.element_size()
    threads = torch.get_num_threads() if nbytes >= C_PARALLEL_MIN_BYTES else 1
    stream = not fresh and nbytes >= C_STREAM_MIN_BYTES
    lib.bs_unpack(
        x.data_ptr(), math.prod(x.shape[:-1]), xrs, x.stride(-1), out.data_ptr(), ors,
        _c_table(out.dtype, bitorder).data_ptr(), out.shape[-1], out.element_size(), threads,
        int(stream),
    )  # fmt: skip


def unpack_into(
    x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str, fresh: bool = False
) -> None:
    """Unpack the bytes of the CPU tensor ``x`` along ``dim`` into ``out``.

    The compiled kernel (:func:`kernels`) runs when ``out`` is contiguous along ``dim`` (any
    other strides); other layouts, and hosts without the compiled kernel, take
    :func:`gpu_ops._bits_torch.unpack_into`.

    Args:
        x: (..., n, ...) uint8, ``dim`` a non-negative axis of it.
        out: ``x``'s shape with ``count`` along ``dim``, any supported dtype, any strides
            without internal overlap; bits past 8n are zeroed.
        dim: the packed axis.
        bitorder: "big" or "little".
        fresh: ``out`` was just allocated (its pages are not yet touched): the compiled
            kernel then uses ordinary stores.
    """
    lib = kernels()
    if lib is None or (out.stride(dim) != 1 and out.shape[dim] > 1):
        _bits_torch.unpack_into(x, out, dim, bitorder)
        return
    xm, om = x.movedim(dim, -1), out.movedim(dim, -1)  # views: (*lead, n), (*lead, count)
    valid = min(om.shape[-1], 8 * xm.shape[-1])
    if valid < om.shape[-1]:
        om[..., valid:].zero_()
    if valid == 0 or om.numel() == 0:
        return
    _unpack_c(lib, xm[..., : (valid + 7) // 8], om[..., :valid], bitorder, fresh)


def pack_into(x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str) -> None:
    """Pack the nonzero elements of the CPU tensor ``x`` along ``dim`` into ``out``.

    NumPy's packbits runs on zero-copy views of each chunk: torch has no vectorised int64
    multiply here, so :func:`gpu_ops._bits_torch.pack_into` is about 3x slower than NumPy.
    dtypes NumPy lacks (torch's uint16/32/64) take that torch kernel.

    Args:
        x: (..., n, ...) bool or integer, ``dim`` a non-negative axis of it.
        out: uint8, ``x``'s shape with ceil(n / 8) along ``dim``.
        dim: the axis to pack.
        bitorder: "big" or "little".
    """
    if x.dtype not in _NUMPY_PACK_DTYPES:
        _bits_torch.pack_into(x, out, dim, bitorder)
        return
    order: Literal["big", "little"] = "big" if bitorder == "big" else "little"
    xm, om = x.movedim(dim, -1), out.movedim(dim, -1)  # (*lead, n), (*lead, nb)
    if om.numel() == 0:
        return
    for os, xs in _bits_torch.chunks(om, xm, _bits_torch.CPU_CHUNK_BYTES):
        packed = np.packbits(xs.numpy(), axis=-1, bitorder=order)
        # NumPy's copy, not torch's: each torch op is an OpenMP region, and on a loaded host
        # every region can stall for a time slice (measured: 451 ms instead of 55 ms for
        # 32 MiB at 2 threads, one region per chunk).
        np.copyto(os.numpy(), packed)
