"""Bit packing and unpacking on the CPU, and in plain torch for any device.

On the CPU, unpacking runs a compiled C kernel (``_bits_cpu.c``, built on first use by
:mod:`gpu_ops._cbuild`): per input byte one copy of a 256 x 8 table row of finished output
values, the work split over torch's threads, non-temporal stores for big reused outputs.
It takes any layout whose output is contiguous along the packed axis (``out`` slices of a
batch buffer included); other layouts, and hosts without a C compiler or with
``BITSERVE_CPU_KERNELS=0``, take the torch path below. Packing calls NumPy's packbits.

The torch path: plain broadcast shifts (``(x[..., None] >> shifts) & 1``) run one elementwise
pass per operation over the whole output and are several times slower than ``numpy.unpackbits``.
Here the work goes in chunks small enough to stay in cache, and each chunk takes a few
passes:

- unpack, 1-byte outputs (uint8, bool): one ``index_select`` per input byte from a 256-entry
  table whose int64 entries hold the byte's eight 0/1 output bytes, written straight into
  ``out`` when its layout allows.
- unpack, float16: the same with a 16-entry table per nibble, whose int64 entries hold four
  finished float16 values (torch's uint8 -> float16 conversion is slow).
- unpack, bfloat16, float32, float64: the byte table into a cache-resident uint8 scratch,
  then one converting ``copy_`` into ``out`` (torch vectorises that conversion; a table of
  16- to 64-byte rows is slower, since ``index_select`` copies rows one at a time).
- pack: ``ne(0)`` into a zero-padded uint8 scratch, whose groups of 8 bytes, read as int64,
  become one byte each with a multiply and a shift (the multiply gathers the eight 0/1 bytes
  into the top byte without carries).

Everything is ordinary torch, so this also runs on CUDA; it is the CUDA path when Triton is
not installed. Chunks are views of the caller's tensors (no copies of the input, no
intermediate the size of the output), so strided inputs and ``out`` slices cost nothing
extra. Each torch op still uses torch's intra-op threads.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from gpu_ops import _cbuild

# Input bytes per chunk. The scratch buffers (up to 24 bytes per input byte) stay in the
# last-level cache, and each op has enough work that torch's intra-op threads pay off: every
# op is an OpenMP parallel region, and on an oversubscribed host each region can stall for
# milliseconds, so fewer, bigger regions are the robust choice (measured: 64 KiB chunks and
# 256 KiB chunks run equally fast single-threaded).
CPU_CHUNK_BYTES = 1 << 18
# On a GPU each op is a kernel launch; chunks only bound the scratch memory there.
CUDA_CHUNK_BYTES = 1 << 24

# The multiply that gathers eight 0/1 bytes (read as a little-endian int64, element j in
# byte j) into the top byte: element j lands on bit 7-j ("big") or bit j ("little"). Each
# output byte of the product is a sum of distinct powers of two, so nothing carries.
_PACK_MULTIPLIER = {
    "big": 0x8040201008040201 - (1 << 64),  # as a signed int64
    "little": 0x0102040810204080,
}

# NumPy's packbits takes these (torch's uint16/32/64 have NumPy twins too, but keep it plain).
_NUMPY_PACK_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)

_TABLES: dict[tuple[str, str, torch.device], torch.Tensor] = {}
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
    Path(__file__).with_name("_bits_cpu.c"), "bits_cpu", _bind, "CPU bit kernels"
)


def kernels() -> ctypes.CDLL | None:
    """The compiled unpack kernel (``_bits_cpu.c``), built on first call; ``None`` if
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


def _chunk_bytes(device: torch.device) -> int:
    return CPU_CHUNK_BYTES if device.type == "cpu" else CUDA_CHUNK_BYTES


def _table(kind: str, bitorder: str, device: torch.device) -> torch.Tensor:
    """A cached lookup table, 1-D int64: the entry for value v holds v's bits as values.

    ``kind`` "byte": 256 entries, the 8 bits of v as eight uint8 0/1 bytes.
    ``kind`` "float16": 16 entries, the 4 bits of the nibble v as four float16 0.0/1.0.
    """
    key = (kind, bitorder, device)
    table = _TABLES.get(key)
    if table is None:
        width = 8 if kind == "byte" else 4
        shifts = torch.arange(width)
        if bitorder == "big":
            shifts = width - 1 - shifts
        bits = (torch.arange(1 << width)[:, None] >> shifts) & 1  # (2**width, width)
        dtype = torch.uint8 if kind == "byte" else getattr(torch, kind)
        table = bits.to(dtype).contiguous().view(torch.int64).reshape(-1).to(device)
        _TABLES[key] = table
    return table


def _chunks(
    packed: torch.Tensor, bits: torch.Tensor, chunk: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of views (packed[s], bits[s]) covering both tensors in pieces of ~``chunk`` bytes.

    Args:
        packed: (*lead, nb) bytes.
        bits: (*lead, L) with ceil(L / 8) == nb: bit 8k+j of a row belongs to byte k.
        chunk: the number of packed bytes to aim for per piece.

    Yields:
        Views of ``packed`` (*lead', nb') and the matching views of ``bits`` (*lead', L'):
        slices along one leading dim (looping over the dims before it one index at a time),
        or slices of the byte axis when a single row is longer than ``chunk``.
    """
    *lead, nb = packed.shape
    L = bits.shape[-1]
    # Fold trailing leading dims into one piece while it still fits in a chunk.
    row, split = nb, len(lead)
    while split > 0 and row * lead[split - 1] <= chunk:
        split -= 1
        row *= lead[split]
    if row > chunk:  # single rows are longer than a chunk: slice the byte axis
        for index in itertools.product(*(range(size) for size in lead)):
            p, b = packed[index], bits[index]
            for s in range(0, nb, chunk):
                e = min(s + chunk, nb)
                yield p[s:e], b[8 * s : min(8 * e, L)]
    elif split == 0:
        yield packed, bits
    else:
        step = chunk // row
        for index in itertools.product(*(range(size) for size in lead[: split - 1])):
            p, b = packed[index], bits[index]
            for s in range(0, lead[split - 1], step):
                yield p[s : s + step], b[s : s + step]


def _direct_int64(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a flat int64 view when it is contiguous and 8-byte aligned, else None."""
    if not t.is_contiguous() or t.numel() * t.element_size() % 8:
        return None
    if t.data_ptr() % 8:
        return None
    return t.view(-1).view(torch.int64)


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
    """Unpack the bytes of ``x`` along ``dim`` into ``out``.

    On the CPU, the compiled kernel (:func:`kernels`) runs when ``out`` is contiguous along
    ``dim`` (any other strides); other layouts, other devices, and hosts without the
    compiled kernel take :func:`unpack_into_torch`.

    Args:
        x: (..., n, ...) uint8, ``dim`` a non-negative axis of it.
        out: ``x``'s shape with ``count`` along ``dim``, any supported dtype, any strides
            without internal overlap; bits past 8n are zeroed.
        dim: the packed axis.
        bitorder: "big" or "little".
        fresh: ``out`` was just allocated (its pages are not yet touched): the compiled
            kernel then uses ordinary stores.
    """
    lib = kernels() if x.device.type == "cpu" else None
    if lib is None or (out.stride(dim) != 1 and out.shape[dim] > 1):
        unpack_into_torch(x, out, dim, bitorder)
        return
    xm, om = x.movedim(dim, -1), out.movedim(dim, -1)  # views: (*lead, n), (*lead, count)
    valid = min(om.shape[-1], 8 * xm.shape[-1])
    if valid < om.shape[-1]:
        om[..., valid:].zero_()
    if valid == 0 or om.numel() == 0:
        return
    _unpack_c(lib, xm[..., : (valid + 7) // 8], om[..., :valid], bitorder, fresh)


def unpack_into_torch(x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str) -> None:
    """:func:`unpack_into` in torch ops only (any device); same arguments."""
    xm, om = x.movedim(dim, -1), out.movedim(dim, -1)  # views: (*lead, n), (*lead, count)
    n, count = xm.shape[-1], om.shape[-1]
    valid = min(count, 8 * n)
    if valid < count:
        om[..., valid:].zero_()
    if valid == 0 or om.numel() == 0:
        return
    xm, om = xm[..., : (valid + 7) // 8], om[..., :valid]
    chunk = _chunk_bytes(x.device)
    # float16 uses the nibble table: torch's uint8 -> float16 conversion is slow here (~2x
    # slower through it), while uint8 -> bfloat16 is fast (the nibble table is ~1.4x slower).
    nibble = out.dtype == torch.float16
    # Scratch reused by every chunk: int32 indices (2 per byte for the nibble tables) and
    # int64 table entries.
    per_byte = 2 if nibble else 1
    index = torch.empty(chunk * per_byte, dtype=torch.int32, device=x.device)
    scratch = torch.empty(chunk * per_byte, dtype=torch.int64, device=x.device)
    kind = "float16" if nibble else "byte"
    table = _table(kind, bitorder, x.device)
    for xs, os in _chunks(xm, om, chunk):
        m = xs.numel()
        if nibble:
            # Nibble indices, first-in-order nibble first: (..., nb, 2).
            idx = index[: 2 * m].view(*xs.shape, 2)
            high, low = (
                (idx[..., 0], idx[..., 1]) if bitorder == "big" else (idx[..., 1], idx[..., 0])
            )
            torch.bitwise_right_shift(xs, 4, out=high)
            torch.bitwise_and(xs, 15, out=low)
            flat_idx = idx.view(-1)
        else:
            idx = index[:m].view(xs.shape)
            idx.copy_(xs)
            flat_idx = idx.view(-1)
        full = os.shape[-1] == 8 * xs.shape[-1]
        one_pass = nibble or out.element_size() == 1
        target = _direct_int64(os) if full and one_pass else None
        if target is not None:
            torch.index_select(table, 0, flat_idx, out=target)
            continue
        entries = scratch[: flat_idx.numel()]
        torch.index_select(table, 0, flat_idx, out=entries)
        values = entries.view(out.dtype if nibble else torch.uint8)
        values = values.view(*xs.shape[:-1], 8 * xs.shape[-1])[..., : os.shape[-1]]
        os.copy_(values)


def pack_into(x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str) -> None:
    """Pack the nonzero elements of ``x`` along ``dim`` into the bits of ``out``.

    On the CPU, NumPy's packbits runs on zero-copy views of each chunk: torch has no
    vectorised int64 multiply here, so :func:`pack_into_torch` is about 3x slower than
    NumPy there. Other devices use :func:`pack_into_torch`.

    Args:
        x: (..., n, ...) bool or integer, ``dim`` a non-negative axis of it.
        out: uint8, ``x``'s shape with ceil(n / 8) along ``dim``.
        dim: the axis to pack.
        bitorder: "big" or "little".
    """
    if x.device.type != "cpu" or x.dtype not in _NUMPY_PACK_DTYPES:
        pack_into_torch(x, out, dim, bitorder)
        return
    order: Literal["big", "little"] = "big" if bitorder == "big" else "little"
    xm, om = x.movedim(dim, -1), out.movedim(dim, -1)  # (*lead, n), (*lead, nb)
    if om.numel() == 0:
        return
    for os, xs in _chunks(om, xm, CPU_CHUNK_BYTES):
        packed = np.packbits(xs.numpy(), axis=-1, bitorder=order)
        # NumPy's copy, not torch's: each torch op is an OpenMP region, and on a loaded host
        # every region can stall for a time slice (measured: 451 ms instead of 55 ms for
        # 32 MiB at 2 threads, one region per chunk).
        np.copyto(os.numpy(), packed)


def pack_into_torch(x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str) -> None:
    """:func:`pack_into` in torch ops only (any device); same arguments."""
    xm, om = x.movedim(dim, -1), out.movedim(dim, -1)  # (*lead, n), (*lead, nb)
    if om.numel() == 0:
        return
    chunk = _chunk_bytes(x.device)
    scratch = torch.empty(8 * chunk, dtype=torch.uint8, device=x.device)
    product = torch.empty(chunk, dtype=torch.int64, device=x.device)
    multiplier = _PACK_MULTIPLIER[bitorder]
    for os, xs in _chunks(om, xm, chunk):
        m = os.numel()
        groups = scratch[: 8 * m].view(*os.shape[:-1], 8 * os.shape[-1])
        L = xs.shape[-1]
        if groups.shape[-1] > L:  # the zero padding of the last byte
            groups[..., L:].zero_()
        # Casting to bool is "!= 0" and much faster than torch.ne(..., out=).
        groups[..., :L].view(torch.bool).copy_(xs)
        prod = product[:m]
        torch.mul(groups.view(-1).view(torch.int64), multiplier, out=prod)
        prod.bitwise_right_shift_(56)
        # int64 -> uint8 keeps the low byte, which is all the shift left in place.
        os.copy_(prod.view(os.shape))
