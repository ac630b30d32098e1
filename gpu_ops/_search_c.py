"""The CPU kernels of the search ops: compiled C (``_search_c.c``), the popcount instructions
chosen by the CPU's features.

The library is built on first use by :mod:`gpu_ops._cbuild`. Each call picks a popcount path:

============  ====================================================================================
``avx512``    AVX-512 VPOPCNTDQ: 64-byte vectors (CPUs with avx512f, avx512bw, avx512vpopcntdq)
``avx2``      AVX2: the nibble-table (``vpshufb``) count of 32-byte vectors, summed by ``vpsadbw``
``popcnt``    the POPCNT instruction on 64-bit words
``portable``  a SWAR bit count on 64-bit words (any CPU)
============  ====================================================================================

``auto`` (the default) takes the first of :data:`AUTO_ORDER` that the CPU supports; the
environment variable ``BITSERVE_POPCOUNT_PATH`` forces one (read at every call, so tests can
run each path), and asking for a path the CPU lacks raises ValueError. Every path gives the
same answers (the tests compare them with each other and with NumPy); only the speed differs.
Work is split over ``torch.get_num_threads()`` OpenMP threads; the results do not depend on
the thread count. Without a C compiler (or with ``BITSERVE_CPU_KERNELS=0``) the ops run the
torch kernels of :mod:`gpu_ops._search_torch`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from torch import Tensor

from gpu_ops import _cbuild, _search_torch

PATHS = ("portable", "popcnt", "avx2", "avx512")
#: The order ``auto`` tries the paths in (measured on Zen 3: AVX2 ahead of POPCNT words).
AUTO_ORDER = ("avx512", "avx2", "popcnt", "portable")
ENV = "BITSERVE_POPCOUNT_PATH"


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.bs_path_supported.argtypes = [cint]
    lib.bs_path_supported.restype = cint
    lib.bs_popcount.argtypes = [ptr, i64, i64, i64, ptr, cint, cint]
    lib.bs_popcount.restype = None
    lib.bs_hamming_topk.argtypes = [
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
        i64,
        ptr,
        i64,
        ptr,
        ptr,
        cint,
        cint,
    ]
    lib.bs_hamming_topk.restype = cint
    lib.bs_tanimoto_topk.argtypes = [
        ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, cint, i64, f32, ptr, ptr, cint, cint,
    ]  # fmt: skip
    lib.bs_tanimoto_topk.restype = cint
    lib.bs_tanimoto_threshold.argtypes = [
        ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, cint, f32, cint, cint, ctypes.POINTER(i64),
    ]  # fmt: skip
    lib.bs_tanimoto_threshold.restype = ptr
    lib.bs_threshold_take.argtypes = [ptr, ptr, ptr, ptr]
    lib.bs_threshold_take.restype = None
    return lib


_LIBRARY = _cbuild.Library(
    Path(__file__).with_name("_search_c.c"), "search_c", _bind, "CPU search kernels"
)


def kernels() -> ctypes.CDLL | None:
    """The compiled search kernels, built on first call; ``None`` if unavailable or disabled."""
    return _LIBRARY.get()


def supported_paths() -> tuple[str, ...]:
    """The popcount paths this CPU can run (empty without the compiled kernels)."""
    lib = kernels()
    if lib is None:
        return ()
    return tuple(name for i, name in enumerate(PATHS) if lib.bs_path_supported(i))


def path() -> str:
    """The path the next call takes: ``BITSERVE_POPCOUNT_PATH`` if set, else the fastest one
    this CPU supports.

    Raises:
        ValueError: the variable names no path, or one this CPU cannot run.
    """
    wanted = os.environ.get(ENV, "auto").strip().lower() or "auto"
    supported = supported_paths()
    if wanted == "auto":
        return next((p for p in AUTO_ORDER if p in supported), "portable")
    if wanted not in PATHS:
        raise ValueError(f"{ENV}={wanted!r}: expected auto or one of {', '.join(PATHS)}")
    if wanted not in supported:
        raise ValueError(
            f"{ENV}={wanted!r}: this CPU (or build) supports only {', '.join(supported)}"
        )
    return wanted


def _rows(t: Tensor) -> tuple[Tensor, int]:
    """``t`` with the bytes of each row contiguous, and its row stride in bytes."""
    if t.shape[1] > 1 and t.stride(1) != 1:
        t = t.contiguous()
    return t, (t.stride(0) if t.shape[0] > 1 else t.shape[1])


# Searches comparing fewer bytes than this run on the calling thread alone: starting (and on
# a busy host, waiting for) a second thread costs more than it saves.
PARALLEL_MIN_BYTES = 1 << 26


def _threads(Q: int, N: int, W: int) -> int:
    return torch.get_num_threads() if Q * N * W >= PARALLEL_MIN_BYTES else 1


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def popcount(packed: Tensor) -> Tensor:
    """Set bits per row of ``packed (R, W)`` uint8: int32 ``(R,)``."""
    lib = kernels()
    if lib is None:
        return _search_torch.popcount(packed)
    x, rs = _rows(packed)
    out = torch.empty(x.shape[0], dtype=torch.int32)
    if x.shape[0]:
        threads = torch.get_num_threads() if x.numel() >= 1 << 20 else 1
        lib.bs_popcount(x.data_ptr(), x.shape[0], rs, x.shape[1], out.data_ptr(),
                        PATHS.index(path()), threads)  # fmt: skip
    return out


def _common(queries: Tensor, corpus: Tensor) -> tuple[Tensor, int, Tensor, int]:
    q, qrs = _rows(queries)
    c, crs = _rows(corpus)
    return q, qrs, c, crs


def hamming_topk(
    queries: Tensor, corpus: Tensor, ids: Tensor | None, k: int
) -> tuple[Tensor, Tensor]:
    """(distances int32 (Q, k), ids int64 (Q, k)), nearest first, ties by the lower id;
    -1 / -1 past N."""
    lib = kernels()
    if lib is None:
        return _search_torch.hamming_topk(queries, corpus, ids, k)
    q, qrs, c, crs = _common(queries, corpus)
    Q, N, W = q.shape[0], c.shape[0], q.shape[1]
    dist = torch.empty((Q, k), dtype=torch.int32)
    idx = torch.empty((Q, k), dtype=torch.int64)
    ids_c = None if ids is None else ids.contiguous()
    if Q and not lib.bs_hamming_topk(
        q.data_ptr(), Q, qrs, c.data_ptr(), N, crs, W, _ptr(ids_c), k, dist.data_ptr(),
        idx.data_ptr(), PATHS.index(path()), _threads(Q, N, W),
    ):  # fmt: skip
        raise MemoryError(f"hamming_topk: out of memory for k={k}")
    return dist, idx


def tanimoto_topk(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, k: int,
    threshold: float, sorted: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(similarities float32 (Q, k), ids int64 (Q, k)), best first, ties by the lower id,
    only >= float32(threshold); empty slots 0 / -1. ``sorted``: the corpus is in popcount
    order (whole tiles and runs of rows are then skipped by the bound)."""
    lib = kernels()
    if lib is None:
        return _search_torch.tanimoto_topk(queries, corpus, popcounts, ids, k, threshold)
    q, qrs, c, crs = _common(queries, corpus)
    Q, N, W = q.shape[0], c.shape[0], q.shape[1]
    sims = torch.empty((Q, k), dtype=torch.float32)
    idx = torch.empty((Q, k), dtype=torch.int64)
    pcs = popcounts.to(torch.int32).contiguous()
    ids_c = None if ids is None else ids.contiguous()
    if Q and not lib.bs_tanimoto_topk(
        q.data_ptr(), Q, qrs, c.data_ptr(), N, crs, W, pcs.data_ptr(), _ptr(ids_c),
        int(sorted), k, threshold, sims.data_ptr(), idx.data_ptr(), PATHS.index(path()),
        _threads(Q, N, W),
    ):  # fmt: skip
        raise MemoryError(f"tanimoto_topk: out of memory for k={k}")
    return sims, idx


def tanimoto_threshold(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, threshold: float,
    sorted: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Every hit >= float32(threshold) as CSR (offsets (Q + 1), ids (H,), similarities (H,)),
    each query's hits best first, ties by the lower id."""
    lib = kernels()
    if lib is None:
        return _search_torch.tanimoto_threshold(queries, corpus, popcounts, ids, threshold)
    q, qrs, c, crs = _common(queries, corpus)
    Q, N, W = q.shape[0], c.shape[0], q.shape[1]
    pcs = popcounts.to(torch.int32).contiguous()
    ids_c = None if ids is None else ids.contiguous()
    total = ctypes.c_int64(0)
    handle = lib.bs_tanimoto_threshold(
        q.data_ptr(), Q, qrs, c.data_ptr(), N, crs, W, pcs.data_ptr(), _ptr(ids_c),
        int(sorted), threshold, PATHS.index(path()), _threads(Q, N, W), ctypes.byref(total),
    )  # fmt: skip
    if not handle:
        raise MemoryError("tanimoto_threshold: out of memory collecting the hits")
    try:
        offsets = torch.zeros(Q + 1, dtype=torch.int64)
        idx = torch.empty(total.value, dtype=torch.int64)
        sims = torch.empty(total.value, dtype=torch.float32)
    except BaseException:
        lib.bs_threshold_take(handle, None, None, None)  # frees
        raise
    lib.bs_threshold_take(handle, offsets.data_ptr(), idx.data_ptr(), sims.data_ptr())
    return offsets, idx, sims
