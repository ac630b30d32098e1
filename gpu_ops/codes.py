"""n-bit codes: values packed ``8 // code_bits`` to a byte, decoded through a code table.

PLINK's ``.bed`` is the example: 2-bit genotype codes, four to a byte, the first in the
lowest bits (``bitorder="little"``), code 0 = two copies of the first allele, 1 = missing,
2 = one copy, 3 = none; as the first allele's dosage the table is ``[2, nan, 1, 0]``::

    >>> import torch, gpu_ops
    >>> packed = torch.tensor([[0b11_10_01_00, 0b10]], dtype=torch.uint8)  # codes 0 1 2 3 2
    >>> gpu_ops.decode_codes(packed, 2, count=5, table=[2.0, float("nan"), 1.0, 0.0],
    ...                      missing=0.5)
    tensor([[2.0000, 0.5000, 1.0000, 0.0000, 1.0000]])

:func:`decode_codes` writes the values straight into the output dtype, a missing code
(NaN in the table) replaced by ``missing`` (one number, or one value per element: mean
imputation). :func:`score_codes` sums per-element weighted values without ever writing
them: :func:`score_table` folds weights, code tables and missing values into a lookup table
of every byte value at every byte position, and a score is one lookup and add per byte.

The functions check their arguments and call ``torch.ops.bitserve.decode_codes`` /
``score_codes`` (:mod:`gpu_ops._codes_ops`): compiled C on the CPU, Triton on CUDA, torch
elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gpu_ops import _codes_ops, _codes_torch

__all__ = ["CODE_BITS", "DECODE_DTYPES", "decode_codes", "score_codes", "score_table"]

#: The code widths: a byte holds 8, 4 or 2 codes.
CODE_BITS = (1, 2, 4)
#: The dtypes :func:`decode_codes` writes.
DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_bits(code_bits: object) -> int:
    if isinstance(code_bits, bool) or code_bits not in CODE_BITS:
        raise ValueError(f"code_bits must be one of {CODE_BITS}, got {code_bits!r}")
    assert isinstance(code_bits, int)
    return code_bits


def _check_bitorder(bitorder: object) -> str:
    if bitorder not in ("big", "little"):
        raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")
    assert isinstance(bitorder, str)
    return bitorder


def packed_length(count: int, code_bits: int) -> int:
    """Bytes holding ``count`` codes of ``code_bits`` bits: ``ceil(count * code_bits / 8)``."""
    return (count * code_bits + 7) // 8


def _check_packed(x: object, count: int, code_bits: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("packed must have at least one dimension")
    want = packed_length(count, code_bits)
    if x.shape[-1] != want:
        raise ValueError(
            f"packed's last dimension is {x.shape[-1]} bytes; {count} codes of {code_bits} "
            f"bits take {want}"
        )
    return x


def decode_codes(
    packed: torch.Tensor,
    code_bits: int,
    count: int,
    table: Sequence[float] | torch.Tensor,
    bitorder: str = "little",
    missing: float | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode packed n-bit codes through a code table into ``dtype``.

    Args:
        packed: (..., ceil(count * code_bits / 8)) uint8, the codes along the last dim.
        code_bits: 1, 2 or 4.
        count: L, the codes per row (the last byte's padding codes are ignored).
        table: (2**code_bits,) the value of each code; NaN marks a missing code.
        bitorder: ``"little"``: the first code in a byte's lowest bits (PLINK's);
            ``"big"``: in its highest (NumPy's ``packbits`` default).
        missing: what a missing code becomes: None (NaN), a number, or (L,) one value per
            element (mean imputation).
        dtype: float16, bfloat16, float32 or float64.

    Returns:
        (..., L) ``dtype`` on ``packed``'s device.
    """
    bits = _check_bits(code_bits)
    order = _check_bitorder(bitorder)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    x = _check_packed(packed, count, bits)
    if dtype not in DECODE_DTYPES:
        raise TypeError(f"dtype must be one of {DECODE_DTYPES}, got {dtype}")
    tab = torch.as_tensor(table, dtype=torch.float64).to(x.device).reshape(-1)
    if tab.numel() != 1 << bits:
        raise ValueError(f"table has {tab.numel()} values; code_bits={bits} needs {1 << bits}")
    if missing is None:
        miss = torch.full((1,), math.nan, dtype=torch.float64, device=x.device)
    elif isinstance(missing, torch.Tensor):
        miss = missing.to(device=x.device, dtype=torch.float64).reshape(-1)
        if miss.numel() not in (1, count):
            raise ValueError(f"missing has {miss.numel()} values; count is {count}")
    else:
        miss = torch.tensor([float(missing)], dtype=torch.float64, device=x.device)
    return _codes_ops.decode_codes(x, bits, count, tab, order, miss, dtype)  # type: ignore[no-any-return]


def score_table(tables: torch.Tensor, code_bits: int, bitorder: str = "little") -> torch.Tensor:
    """The lookup table :func:`score_codes` sums: every byte value at every byte position.

    Args:
        tables: (L, 2**code_bits, S) float: ``tables[l, k, s]``, what element l adds to
            score s when its code is k (a weight times the code's value, a missing code's
            imputed value included).
        code_bits: 1, 2 or 4.
        bitorder: as :func:`decode_codes`.

    Returns:
        (ceil(L * code_bits / 8), 256, S) in ``tables``' dtype and device: 256 S values a
        byte position (for S = 4 in float64, 8 KiB a byte, 2 KiB per 2-bit code).
    """
    bits = _check_bits(code_bits)
    order = _check_bitorder(bitorder)
    if tables.dim() != 3 or tables.shape[1] != 1 << bits:
        raise ValueError(
            f"tables must be (L, {1 << bits}, S) for code_bits={bits}, got {list(tables.shape)}"
        )
    if not tables.dtype.is_floating_point:
        raise TypeError(f"tables must be floating point, got {tables.dtype}")
    return _codes_torch.byte_table(tables, bits, order)


def score_codes(packed: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Scores of packed codes: ``out[n, s] = sum_p lut[p, packed[n, p], s]``.

    With ``lut = score_table(tables, ...)`` that is ``sum_l tables[l, code[n, l], s]``,
    the decoded (N, L) values never materialised.

    Args:
        packed: (N, nb) uint8.
        lut: (nb, 256, S) float, on ``packed``'s device (:func:`score_table`).

    Returns:
        (N, S) in ``lut``'s dtype.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError("packed must be a 2-d uint8 torch.Tensor (N, nb)")
    if lut.dim() != 3 or lut.shape[0] != packed.shape[1] or lut.shape[1] != 256:
        raise ValueError(
            f"lut must be ({packed.shape[1]}, 256, S) for packed {list(packed.shape)}, "
            f"got {list(lut.shape)}"
        )
    if lut.device != packed.device:
        raise ValueError(f"lut is on {lut.device}, packed on {packed.device}")
    return _codes_ops.score_codes(packed, lut)  # type: ignore[no-any-return]
