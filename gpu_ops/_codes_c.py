"""The CPU kernels of the code ops: compiled C (``_codes_c.c``, built on first use by
:mod:`gpu_ops._cbuild`), the torch kernels of :mod:`gpu_ops._codes_torch` where it is
unavailable (no compiler, ``BITSERVE_CPU_KERNELS=0``) or for output dtypes it does not write.

Both kernels split rows over ``torch.get_num_threads()`` pthreads for big calls only:
starting a thread costs tens of microseconds (see :mod:`gpu_ops._bits_c`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_ops import _cbuild, _codes_torch

# Below this many output (decode) or input (score) bytes a call runs on the calling thread.
C_PARALLEL_MIN_BYTES = 4 << 20
_C_DTYPES = {torch.float32: 0, torch.float64: 1}


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bs_decode_codes.argtypes = [
        ptr, i64, i64, ptr, i64, i64, cint, cint, ptr, ptr, i64, cint, cint
    ]  # fmt: skip
    lib.bs_decode_codes.restype = None
    lib.bs_score_codes.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, cint, cint]
    lib.bs_score_codes.restype = None
    return lib


_LIBRARY = _cbuild.Library(
    Path(__file__).with_name("_codes_c.c"), "codes_c", _bind, "CPU code kernels"
)


def kernels() -> ctypes.CDLL | None:
    """The compiled library, built on first call; None if unavailable or disabled."""
    return _LIBRARY.get()


def _threads(nbytes: int) -> int:
    return torch.get_num_threads() if nbytes >= C_PARALLEL_MIN_BYTES else 1


def decode(
    x: torch.Tensor,
    code_bits: int,
    count: int,
    table: torch.Tensor,
    bitorder: str,
    missing: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """x (..., nb) uint8 -> ``dtype`` (..., count); arguments as ``decode_codes`` takes them.

    float32 and float64 are written by the C kernel; other dtypes decode to float32 first.
    """
    lib = kernels()
    if lib is None:
        return _codes_torch.decode(x, code_bits, count, table, bitorder, missing, dtype)
    kind = _C_DTYPES.get(dtype)
    if kind is None:
        mid = decode(x, code_bits, count, table, bitorder, missing, torch.float32)
        return mid.to(dtype)
    xc = x.contiguous()
    nb = xc.shape[-1]
    rows = xc.numel() // nb if nb else 0
    out = torch.empty((*x.shape[:-1], count), dtype=dtype)
    if out.numel() == 0:
        return out
    tab = table.to(torch.float64).contiguous()
    miss = missing.to(torch.float64).contiguous()
    lib.bs_decode_codes(
        xc.data_ptr(), rows, nb, out.data_ptr(), count, count, code_bits,
        int(bitorder == "big"), tab.data_ptr(), miss.data_ptr(), int(miss.numel() > 1), kind,
        _threads(out.numel() * out.element_size()),
    )  # fmt: skip
    return out


def score(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """x (N, nb) uint8, lut (nb, 256, S) float -> (N, S) in lut's dtype (see ``score_codes``)."""
    lib = kernels()
    kind = _C_DTYPES.get(lut.dtype)
    if lib is None or kind is None:
        return _codes_torch.score(x, lut)
    xc = x if x.stride(-1) == 1 else x.contiguous()
    n, nb = xc.shape
    S = lut.shape[-1]
    out = torch.zeros((n, S), dtype=lut.dtype)
    if n == 0 or nb == 0 or S == 0:
        return out
    lc = lut.contiguous()
    xrs = xc.stride(0) if n > 1 else nb
    lib.bs_score_codes(
        xc.data_ptr(), n, xrs, nb, lc.data_ptr(), S, out.data_ptr(), kind,
        _threads(n * nb),
    )  # fmt: skip
    return out
