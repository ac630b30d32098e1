"""The code ops as torch operators: ``torch.ops.bitserve.decode_codes`` and ``score_codes``.

Defined in the ``bitserve`` library (:mod:`gpu_ops._library`) like the bit ops
(:mod:`gpu_ops._bits_ops`): the dispatcher picks the kernel by device, and the ops work
under ``torch.compile`` and ``torch.export``.

===========  ===============================================================================
device       kernel
===========  ===============================================================================
CPU          compiled C (:mod:`gpu_ops._codes_c`)
CUDA         Triton (:mod:`gpu_ops._triton.codes`), registered when Triton is installed
any other    torch (:mod:`gpu_ops._codes_torch`): also CUDA without Triton
fake / meta  shapes only
===========  ===============================================================================

The ops take normalised arguments (:mod:`gpu_ops.codes` checks what users pass): ``x``
uint8 with the packed codes along its last dim, ``table`` float64 ``(2**code_bits,)`` and
``missing`` float64 ``(1,)`` or ``(count,)`` on ``x``'s device. No autograd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gpu_ops import _codes_c, _codes_torch
from gpu_ops._lazy_triton import triton_kernels
from gpu_ops._library import Op

if TYPE_CHECKING:
    from gpu_ops._triton import codes as _triton_codes
else:
    _triton_codes = triton_kernels("codes")


def _decoded_shape(x: Tensor, count: int) -> list[int]:
    return [*x.shape[:-1], count]


decode_codes = Op(
    "decode_codes(Tensor x, int code_bits, SymInt count, Tensor table, str bitorder, "
    "Tensor missing, ScalarType dtype) -> Tensor"
)


@decode_codes.register_kernel(None)
def _(
    x: Tensor, code_bits: int, count: int, table: Tensor, bitorder: str, missing: Tensor,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """x (..., nb) uint8 -> ``dtype`` (..., count). Kernel for devices without their own."""
    return _codes_torch.decode(x, code_bits, count, table, bitorder, missing, dtype)


@decode_codes.register_kernel("cpu")
def _(
    x: Tensor, code_bits: int, count: int, table: Tensor, bitorder: str, missing: Tensor,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    return _codes_c.decode(x, code_bits, count, table, bitorder, missing, dtype)


@decode_codes.register_fake
def _(
    x: Tensor, code_bits: int, count: int, table: Tensor, bitorder: str, missing: Tensor,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    return x.new_empty(_decoded_shape(x, count), dtype=dtype)


score_codes = Op("score_codes(Tensor x, Tensor lut) -> Tensor")


@score_codes.register_kernel(None)
def _(x: Tensor, lut: Tensor) -> Tensor:
    """x (N, nb) uint8, lut (nb, 256, S) -> (N, S). Kernel for devices without their own."""
    return _codes_torch.score(x, lut)


@score_codes.register_kernel("cpu")
def _(x: Tensor, lut: Tensor) -> Tensor:
    return _codes_c.score(x, lut)


@score_codes.register_fake
def _(x: Tensor, lut: Tensor) -> Tensor:
    return lut.new_empty((x.shape[0], lut.shape[-1]))


if _triton_codes is not None:
    _tc = _triton_codes

    @decode_codes.register_kernel("cuda")
    def _(
        x: Tensor, code_bits: int, count: int, table: Tensor, bitorder: str, missing: Tensor,
        dtype: torch.dtype,
    ) -> Tensor:  # fmt: skip
        return _tc.decode(x, code_bits, count, table, bitorder, missing, dtype)

    @score_codes.register_kernel("cuda")
    def _(x: Tensor, lut: Tensor) -> Tensor:
        return _tc.score(x, lut)
