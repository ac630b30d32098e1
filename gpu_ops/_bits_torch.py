"""Bit packing and unpacking in plain torch ops: the kernels for any device.

These run wherever no compiled kernel does: on CUDA when Triton is not installed, on other
devices, and on the CPU without a C compiler (or with ``BITSERVE_CPU_KERNELS=0``; see
:mod:`gpu_ops._bits_c`). Plain broadcast shifts (``(x[..., None] >> shifts) & 1``) run one
elementwise pass per operation over the whole output and are several times slower than
``numpy.unpackbits``. Here the work goes in chunks small enough to stay in cache, and each
chunk takes a few passes:

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

Chunks are views of the caller's tensors (no copies of the input, no intermediate the size of
the output), so strided inputs and ``out`` slices cost nothing extra. Each torch op still
uses torch's intra-op threads.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

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

_TABLES: dict[tuple[str, str, torch.device], torch.Tensor] = {}


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


def chunks(
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


def unpack_into(x: torch.Tensor, out: torch.Tensor, dim: int, bitorder: str) -> None:
    """Unpack the bytes of ``x`` along ``dim`` into ``out``, in torch ops only (any device).

    Args:
        x: (..., n, ...) uint8, ``dim`` a non-negative axis of it.
        out: ``x``'s shape with ``count`` along ``dim``, any supported dtype (bool viewed as
            uint8), any strides without internal overlap; bits past 8n are zeroed.
        dim: the packed axis.
        bitorder: "big" or "little".
    """
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
    for xs, os in chunks(xm, om, chunk):
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
    """Pack the nonzero elements of ``x`` along ``dim`` into the bits of ``out`` (any device).

    Args:
        x: (..., n, ...) integer (bool viewed as uint8), ``dim`` a non-negative axis of it.
        out: uint8, ``x``'s shape with ceil(n / 8) along ``dim``.
        dim: the axis to pack.
        bitorder: "big" or "little".
    """
    xm, om = x.movedim(dim, -1), out.movedim(dim, -1)  # (*lead, n), (*lead, nb)
    if om.numel() == 0:
        return
    chunk = _chunk_bytes(x.device)
    scratch = torch.empty(8 * chunk, dtype=torch.uint8, device=x.device)
    product = torch.empty(chunk, dtype=torch.int64, device=x.device)
    multiplier = _PACK_MULTIPLIER[bitorder]
    for os, xs in chunks(om, xm, chunk):
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
