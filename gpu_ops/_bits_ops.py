"""The bit ops as torch operators: ``torch.ops.bitserve.packbits``, ``unpackbits`` and
``unpackbits_into``.

Defined in the ``bitserve`` library (:mod:`gpu_ops._library`), so the torch dispatcher
picks the kernel by device and the ops work under ``torch.compile`` (no graph break) and
``torch.export``:

===========  ===============================================================================
device       kernel
===========  ===============================================================================
CPU          the compiled C unpacker and NumPy's packbits (:mod:`gpu_ops._bits_c`)
CUDA         fused Triton kernels (:mod:`gpu_ops._triton.bits`), registered when Triton is installed
any other    chunked torch lookups (:mod:`gpu_ops._bits_torch`): also CUDA without Triton
fake / meta  shapes only (``register_fake``), for compile and export
===========  ===============================================================================

The ops take normalised arguments: a tensor with at least one dimension, a non-negative
``dim``, a resolved ``count >= 0``. :mod:`gpu_ops.bits` checks and normalises what users pass
and is the API to call; these are what a compiled graph or an exported program records.
No autograd: bits are integers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gpu_ops import _bits_c, _bits_torch
from gpu_ops._lazy_triton import triton_kernels
from gpu_ops._library import Op

# Triton is optional (without it CUDA tensors take the torch kernels) and imported at the
# first CUDA call (gpu_ops._lazy_triton).
if TYPE_CHECKING:
    from gpu_ops._triton import bits as _triton_bits
else:
    _triton_bits = triton_kernels("bits")

Kernel = Callable[[Tensor, Tensor, int, str], None]


def _packed_shape(x: Tensor, dim: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = (shape[dim] + 7) // 8
    return shape


def _unpacked_shape(x: Tensor, dim: int, count: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = count
    return shape


def _as_bytes(t: Tensor) -> Tensor:
    """The kernels read and write bytes; a bool is a 0/1 byte."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


# --- packbits -----------------------------------------------------------------------------


packbits = Op("packbits(Tensor x, SymInt dim, str bitorder) -> Tensor")


@packbits.register_kernel(None)
def _(x: Tensor, dim: int, bitorder: str) -> Tensor:
    """x (..., n, ...) bool or integer -> uint8 (..., ceil(n / 8), ...) along ``dim``.

    This body is the kernel for devices without their own (the torch kernels).
    """
    return _pack(_bits_torch.pack_into, x, dim, bitorder)


def _pack(kernel: Kernel, x: Tensor, dim: int, bitorder: str) -> Tensor:
    out = torch.empty(_packed_shape(x, dim), dtype=torch.uint8, device=x.device)
    if out.numel():
        kernel(_as_bytes(x), out, dim, bitorder)
    return out


@packbits.register_kernel("cpu")
def _(x: Tensor, dim: int, bitorder: str) -> Tensor:
    return _pack(_bits_c.pack_into, x, dim, bitorder)


@packbits.register_fake
def _(x: Tensor, dim: int, bitorder: str) -> Tensor:
    return x.new_empty(_packed_shape(x, dim), dtype=torch.uint8)


# --- unpackbits: a new result ---------------------------------------------------------------


unpackbits = Op(
    "unpackbits(Tensor x, SymInt dim, SymInt count, str bitorder, ScalarType dtype) -> Tensor"
)


@unpackbits.register_kernel(None)
def _(x: Tensor, dim: int, count: int, bitorder: str, dtype: torch.dtype) -> Tensor:
    """x (..., n, ...) uint8 -> ``dtype`` (..., count, ...): the bits along ``dim``.

    Bits past 8n are zeros. This body is the kernel for devices without their own.
    """
    return _unpack(_bits_torch.unpack_into, x, dim, count, bitorder, dtype)


def _unpack(
    kernel: Kernel, x: Tensor, dim: int, count: int, bitorder: str, dtype: torch.dtype
) -> Tensor:
    out = torch.empty(_unpacked_shape(x, dim, count), dtype=dtype, device=x.device)
    if out.numel():
        kernel(x, _as_bytes(out), dim, bitorder)
    return out


@unpackbits.register_kernel("cpu")
def _(x: Tensor, dim: int, count: int, bitorder: str, dtype: torch.dtype) -> Tensor:
    out = _bits_c.empty(_unpacked_shape(x, dim, count), dtype, x.device)  # huge pages
    if out.numel():
        _bits_c.unpack_into(x, _as_bytes(out), dim, bitorder, fresh=True)
    return out


@unpackbits.register_fake
def _(x: Tensor, dim: int, count: int, bitorder: str, dtype: torch.dtype) -> Tensor:
    return x.new_empty(_unpacked_shape(x, dim, count), dtype=dtype)


# --- unpackbits_into: into a caller's buffer --------------------------------------------------


unpackbits_into = Op("unpackbits_into(Tensor x, SymInt dim, str bitorder, Tensor(a!) out) -> ()")


@unpackbits_into.register_kernel(None)
def _(x: Tensor, dim: int, bitorder: str, out: Tensor) -> None:
    """Unpack x (..., n, ...) uint8 along ``dim`` into ``out`` (..., count, ...), any strides.

    ``out`` must not overlap ``x`` (:mod:`gpu_ops.bits` checks). Kernel for other devices.
    """
    if out.numel():
        _bits_torch.unpack_into(x, _as_bytes(out), dim, bitorder)


@unpackbits_into.register_kernel("cpu")
def _(x: Tensor, dim: int, bitorder: str, out: Tensor) -> None:
    if out.numel():
        _bits_c.unpack_into(x, _as_bytes(out), dim, bitorder)


@unpackbits_into.register_fake
def _(x: Tensor, dim: int, bitorder: str, out: Tensor) -> None:
    return None


# --- CUDA -------------------------------------------------------------------------------------

if _triton_bits is not None:
    _tb = _triton_bits

    @packbits.register_kernel("cuda")
    def _(x: Tensor, dim: int, bitorder: str) -> Tensor:
        return _pack(_tb.pack_into, x, dim, bitorder)

    @unpackbits.register_kernel("cuda")
    def _(x: Tensor, dim: int, count: int, bitorder: str, dtype: torch.dtype) -> Tensor:
        return _unpack(_tb.unpack_into, x, dim, count, bitorder, dtype)

    @unpackbits_into.register_kernel("cuda")
    def _(x: Tensor, dim: int, bitorder: str, out: Tensor) -> None:
        if out.numel():
            _tb.unpack_into(x, _as_bytes(out), dim, bitorder)
