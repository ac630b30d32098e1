"""The banded operator's CPU kernels: small C libraries built on first use.

The C kernels (``_resample_c.c``) are compiled once per machine with the system C compiler
(see :mod:`gpu_ops._cbuild`: ``cc -O3 -march=native -fopenmp``, cached in
``$BITSERVE_CACHE_DIR``, else ``~/.cache/bitserve``) and called through :mod:`ctypes`; they
release the GIL. Where no compiler is found, or ``BITSERVE_CPU_KERNELS=0`` is set,
:func:`kernels` is ``None`` and the ops run the torch kernels of :mod:`gpu_ops._resample_torch`.
All take contiguous float32 inputs (weights also bfloat16 or float16) and return float32.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from gpu_ops import _cbuild, responses

_SOURCE = Path(__file__).with_name("_resample_c.c")
_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Fine points per task in the transposed band: big enough that scanning the A windows per
# task is cheap, small enough that M such rows stay in L2.
_BACKWARD_BLOCK = 2048
_BOXCAR = responses.named("boxcar").code


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bs_forward.argtypes = [ptr, ptr, cint, ptr, ptr, i64, i64, i64, i64, i64, cint]
    lib.bs_backward_f.argtypes = [ptr, ptr, cint, ptr, ptr, i64, i64, i64, i64, i64, i64, cint]
    lib.bs_backward_f_sorted.argtypes = [ptr, ptr, cint, ptr, ptr, i64, i64, i64, i64, i64, cint]
    lib.bs_backward_w.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, cint]
    f32 = ctypes.c_float
    resp: list[Any] = [f32, cint, ptr, i64]  # the parameter, the code, a table and its K
    lib.bs_otf_forward.argtypes = [ptr, ptr, ptr, ptr, ptr, *resp, ptr, *[i64] * 5, cint]
    lib.bs_otf_backward_f.argtypes = [ptr, ptr, ptr, ptr, ptr, *resp, ptr, *[i64] * 5, cint]
    lib.bs_otf_backward_cp.argtypes = [
        ptr, ptr, ptr, ptr, ptr, ptr, *resp, ptr, ptr, *[i64] * 5, cint,
    ]  # fmt: skip
    lib.bs_bit_counts.argtypes = [ptr, i64, i64, ptr, cint]
    lib.bs_events_band.argtypes = [ptr, i64, cint, ptr, cint, ptr, ptr, *[i64] * 5, cint]
    lib.bs_forward_bits.argtypes = [ptr, i64, cint, ptr, cint, ptr, ptr, *[i64] * 5, cint]
    lib.bs_events_otf.argtypes = [ptr, i64, cint, ptr, ptr, ptr, ptr, *resp, ptr,
                                  *[i64] * 4, cint]  # fmt: skip
    lib.bs_prefix.argtypes = [ptr, i64, cint, ptr, ptr, ptr, ptr, i64, ptr, *[i64] * 4, cint]
    lib.bs_events_lattice.argtypes = [ptr, i64, cint, ptr, ptr, i64, i64, i64, cint, ptr, ptr,
                                      ptr, *[i64] * 4, cint]  # fmt: skip
    for fn in (
        lib.bs_forward, lib.bs_backward_f, lib.bs_backward_f_sorted, lib.bs_backward_w,
        lib.bs_otf_forward, lib.bs_otf_backward_f, lib.bs_otf_backward_cp, lib.bs_bit_counts,
        lib.bs_events_band, lib.bs_events_otf, lib.bs_prefix, lib.bs_events_lattice,
        lib.bs_forward_bits,
    ):  # fmt: skip
        fn.restype = None
    return lib


_LIBRARY = _cbuild.Library(_SOURCE, "resample_c", _bind, "CPU resample kernels")


def kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first call; ``None`` if unavailable/disabled."""
    return _LIBRARY.get()


def _shape(f: torch.Tensor, weights: torch.Tensor) -> tuple[int, int, int, int, int]:
    M, N, B = f.shape
    _, A, W = weights.shape
    return M, N, A, B, W


def forward(
    lib: ctypes.CDLL, f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """out (M, N, A) float32 from f (M, N, B) float32, starts (N, A), weights (N, A, W)."""
    M, N, A, B, W = _shape(f, weights)
    out = torch.empty(M, N, A, dtype=torch.float32)
    lib.bs_forward(
        f.data_ptr(), weights.data_ptr(), _WEIGHT_CODES[weights.dtype], starts.data_ptr(),
        out.data_ptr(), M, N, A, B, W, torch.get_num_threads(),
    )  # fmt: skip
    return out


def backward_f(
    lib: ctypes.CDLL,
    g: torch.Tensor,
    starts: torch.Tensor,
    weights: torch.Tensor,
    B: int,
    sorted_starts: bool = False,
) -> torch.Tensor:
    """grad_f (M, N, B) float32 from g (M, N, A) float32: the transposed band.

    With ``sorted_starts`` (non-decreasing along each row, as BandedResampler stores them)
    and M >= 4 the register-blocked tile kernel runs; otherwise every window is scanned.
    """
    M, N, A = g.shape
    W = weights.shape[-1]
    out = torch.empty(M, N, B, dtype=torch.float32)
    args = (g.data_ptr(), weights.data_ptr(), _WEIGHT_CODES[weights.dtype], starts.data_ptr())
    # Measured: the tile kernel wins from 4 inputs on (1.5x at M=16, 2.8x at M=64); with
    # fewer, the scan (one pass per window, no register blocking to gain) is a little faster.
    if sorted_starts and M >= 4:
        lib.bs_backward_f_sorted(*args, out.data_ptr(), M, N, A, B, W, torch.get_num_threads())
    else:
        lib.bs_backward_f(
            *args, out.data_ptr(), M, N, A, B, W, _BACKWARD_BLOCK, torch.get_num_threads()
        )
    return out


def backward_w(
    lib: ctypes.CDLL, g: torch.Tensor, f: torch.Tensor, starts: torch.Tensor, W: int
) -> torch.Tensor:
    """grad_w (N, A, W) float32 from g (M, N, A) and f (M, N, B), both float32."""
    M, N, B = f.shape
    A = g.shape[-1]
    out = torch.empty(N, A, W, dtype=torch.float32)
    lib.bs_backward_w(
        g.data_ptr(), f.data_ptr(), starts.data_ptr(), out.data_ptr(), M, N, A, B, W,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


# --- on the fly ------------------------------------------------------------------------------


class Windows:
    """What the on-the-fly kernels take besides f or g: float64 x and c, the windows.

    Args:
        x: (B,) float64 fine grid.
        c: (N, A) coarse points (any float dtype; offsets are formed in float64).
        resp: the response (a named one at its parameter, or a float32 table).
        support: its cut (None: the response's default; a table's are its ends).
    """

    def __init__(
        self, x: torch.Tensor, c: torch.Tensor, resp: responses.KernelResponse,
        support: float | None,
    ) -> None:  # fmt: skip
        self.x = x.contiguous()
        self.c = c.detach().to(torch.float64).contiguous()
        # wmax sizes the kernels' per-thread buffers (at least 1).
        lo, hi = resp.window(support)
        self.first, self.last, self.wmax = responses.windows(self.x, self.c, lo, hi, resp.tie_ends)
        self._response(resp)

    def _response(self, resp: responses.KernelResponse) -> None:
        self.code, self.param = resp.code, resp.value
        # A table goes to the kernels as its K breakpoints then its K values, float32.
        self.table = resp.param.detach().float().contiguous() if resp.tabulated else None

    @classmethod
    def given(
        cls, x: torch.Tensor, c: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
        resp: responses.KernelResponse,
    ) -> Windows:  # fmt: skip
        """Windows ``[first, last)`` (N, A) int64 found elsewhere, of float64 c."""
        win = cls.__new__(cls)
        win.x, win.c = x.contiguous(), c.contiguous()
        win.first, win.last = first.contiguous(), last.contiguous()
        win.wmax = max(1, int((last - first).max())) if first.numel() else 1
        win._response(resp)
        return win

    def args(self) -> tuple[int | float, ...]:
        table, K = (0, 0) if self.table is None else (self.table.data_ptr(), self.table.shape[1])
        return (
            self.x.data_ptr(), self.c.data_ptr(), self.first.data_ptr(), self.last.data_ptr(),
            self.param, self.code, table, K,
        )  # fmt: skip


def otf_forward(lib: ctypes.CDLL, f: torch.Tensor, win: Windows) -> torch.Tensor:
    """out (M, N, A) float32 from contiguous float32 f (M, N, B)."""
    M, N, B = f.shape
    A = win.c.shape[1]
    out = torch.empty(M, N, A, dtype=torch.float32)
    lib.bs_otf_forward(
        f.data_ptr(), *win.args(), out.data_ptr(), M, N, A, B, win.wmax, torch.get_num_threads()
    )
    return out


def otf_backward_f(lib: ctypes.CDLL, g: torch.Tensor, win: Windows, B: int) -> torch.Tensor:
    """grad_f (M, N, B) float32 from contiguous float32 g (M, N, A)."""
    M, N, A = g.shape
    out = torch.empty(M, N, B, dtype=torch.float32)
    lib.bs_otf_backward_f(
        g.data_ptr(), *win.args(), out.data_ptr(), M, N, A, B, _BACKWARD_BLOCK,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def otf_backward_c_param(
    lib: ctypes.CDLL, f: torch.Tensor, g: torch.Tensor, win: Windows
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_c (N, A), grad_param 0-d), float32, from contiguous float32 f and g.

    A boxcar's derivatives are zero almost everywhere (the kernel says so too): zeros without
    a kernel call.
    """
    M, N, B = f.shape
    A = g.shape[-1]
    gc = torch.zeros(N, A, dtype=torch.float32)
    gp = torch.zeros(N, A, dtype=torch.float32)
    if win.code != _BOXCAR:
        lib.bs_otf_backward_cp(
            f.data_ptr(), g.data_ptr(), *win.args(), gc.data_ptr(), gp.data_ptr(), M, N, A, B,
            win.wmax, torch.get_num_threads(),
        )  # fmt: skip
    return gc, gp.sum(dtype=torch.float64).float()


# --- from packed bits --------------------------------------------------------------------------


def bit_counts(lib: ctypes.CDLL, packed: torch.Tensor) -> torch.Tensor:
    """Set bits per row of contiguous uint8 ``packed (R, nbytes)``: int64 ``(R,)``."""
    R, nbytes = packed.shape
    out = torch.zeros(R, dtype=torch.int64)
    if nbytes and R:
        lib.bs_bit_counts(packed.data_ptr(), R, nbytes, out.data_ptr(), torch.get_num_threads())
    return out


def _band_on_bits(
    fn: Any, packed: torch.Tensor, big: bool, starts: torch.Tensor,
    weights: torch.Tensor, B: int,
) -> torch.Tensor:  # fmt: skip
    M, N, nbytes = packed.shape
    _, A, W = weights.shape
    out = torch.empty(M, N, A, dtype=torch.float32)
    fn(
        packed.data_ptr(),
        nbytes,
        int(big),
        weights.data_ptr(),
        _WEIGHT_CODES[weights.dtype],
        starts.data_ptr(),
        out.data_ptr(),
        M,
        N,
        A,
        B,
        W,
        torch.get_num_threads(),
    )
    return out


def forward_bits(
    lib: ctypes.CDLL, packed: torch.Tensor, big: bool, starts: torch.Tensor,
    weights: torch.Tensor, B: int,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A) float32: the stored band on ``packed (M, N, nbytes)`` (bits ``b < B``),
    each row unpacked into a per-thread buffer; ``starts (N, A)`` int32 and ``weights
    (N, A, W)`` contiguous (float32, bfloat16 or float16)."""
    return _band_on_bits(lib.bs_forward_bits, packed, big, starts, weights, B)


def events_band(
    lib: ctypes.CDLL, packed: torch.Tensor, big: bool, starts: torch.Tensor,
    weights: torch.Tensor, B: int,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A) float32: the stored band applied to the events of ``packed (M, N, nbytes)``.

    ``starts (N, A)`` int32 must be non-decreasing along each row; ``weights (N, A, W)``
    contiguous float32, bfloat16 or float16.
    """
    return _band_on_bits(lib.bs_events_band, packed, big, starts, weights, B)


def events_otf(
    lib: ctypes.CDLL, packed: torch.Tensor, big: bool, win: Windows, B: int
) -> torch.Tensor:
    """out (M, N, A) float32, the response evaluated per event; ``win.c`` sorted per row."""
    M, N, nbytes = packed.shape
    A = win.c.shape[1]
    out = torch.empty(M, N, A, dtype=torch.float32)
    lib.bs_events_otf(
        packed.data_ptr(), nbytes, int(big), *win.args(), out.data_ptr(), M, N, A, B,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def prefix(
    lib: ctypes.CDLL, packed: torch.Tensor, big: bool, x: torch.Tensor, c: torch.Tensor,
    bounds: torch.Tensor, coef: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A) float32 by prefix sums of a piecewise polynomial response.

    Args:
        packed: (M, N, nbytes) contiguous uint8.
        big: the bit order.
        x: (B,) float64; c: (N, A) float64, sorted per row.
        bounds: (P + 1, N, A) int64, piece k of (n, a) covers fine points
            ``[bounds[k + 1, n, a], bounds[k, n, a])``, each bound non-decreasing in a.
        coef: (P, 3) float64, ``r(d) = coef[k, 0] + coef[k, 1] d + coef[k, 2] d²`` there.
    """
    M, N, nbytes = packed.shape
    A = c.shape[1]
    P = coef.shape[0]
    out = torch.empty(M, N, A, dtype=torch.float32)
    lib.bs_prefix(
        packed.data_ptr(), nbytes, int(big), x.data_ptr(), c.data_ptr(), bounds.data_ptr(),
        coef.data_ptr(), P, out.data_ptr(), M, N, A, x.numel(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def events_lattice(
    lib: ctypes.CDLL, packed: torch.Tensor, big: bool, first: torch.Tensor, last: torch.Tensor,
    tables: torch.Tensor, tid: torch.Tensor, jmin: int, walk: bool, B: int,
) -> torch.Tensor:  # fmt: skip
    """out (M, N, A) float32: the events of ``packed (M, N, nbytes)`` (bits ``b < B``) on a
    lattice.

    Args:
        first, last: (N, A) int64 contiguous, the windows (coarse points sorted per row).
        tables: (T, step, J) float32 contiguous, ``tables[t, s, j - jmin]`` the response at
            the offset of phase s and coarse distance j (see :mod:`gpu_ops._lattice`).
        tid: (N,) int64, each row's table.
        jmin: the first j of the tables.
        walk: each event reaches the coarse points of its windows (else: the tables' whole
            run, zero outside the windows).
    """
    M, N, nbytes = packed.shape
    A = first.shape[1]
    _, step, J = tables.shape
    out = torch.empty(M, N, A, dtype=torch.float32)
    lib.bs_events_lattice(
        packed.data_ptr(), nbytes, int(big), tables.data_ptr(), tid.data_ptr(), step, J, jmin,
        int(walk), first.data_ptr(), last.data_ptr(), out.data_ptr(), M, N, A, B,
        torch.get_num_threads(),
    )  # fmt: skip
    return out
