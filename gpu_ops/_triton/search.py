# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton.jit is untyped, and kernel arguments are untyped by convention)
"""Triton kernels of the search ops (CUDA; CPU tensors under the interpreter).

The rows are read as 32-bit words where they can be (W a multiple of 4, rows 4-byte aligned),
else as bytes; either way each lane is counted by a portable bit-trick popcount on int32 (no
``popc`` inline assembly, so the kernels also run under ``TRITON_INTERPRET=1``).

- :func:`popcount`: one program per block of rows.
- The pair kernel: one program per (block of queries, block of corpus rows) computes the
  popcount of the AND (Tanimoto) or XOR (Hamming) of every pair over the words, and writes one
  int64 key per pair, ordered as the ops promise (:mod:`gpu_ops._search_torch`'s keys: best
  score first, ties by the lower id; ``_NO_KEY`` for a Tanimoto pair below the threshold).
  Tanimoto similarities are c / (a + b - c) by the correctly rounded float32 division
  (``tl.math.div_rn``): for counts below 2**24 the same float32 as every other path's float64
  division rounded to float32.
- The corpus is scanned in chunks of rows; each chunk's keys are merged into the running top k
  by ``torch.topk`` (or gathered as hits), as in the torch kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from gpu_ops import _search_torch
from gpu_ops._triton import on_device

_CHUNK_ROWS = 1 << 16  # corpus rows per chunk: (Q, 65536) int64 keys at a time
_BQ, _BN, _BW = 16, 32, 8  # queries, corpus rows and words per program step


@triton.jit
def _popc(x):
    """Set bits of each int32 lane (arithmetic shifts: the masks clear what they fill)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


@triton.jit
def _popcount_kernel(x_ptr, out_ptr, R, NW, sr, sw, BR: tl.constexpr, BW: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros([BR], dtype=tl.int32)
    for w0 in range(0, NW, BW):
        w = w0 + tl.arange(0, BW)
        m = (r[:, None] < R) & (w[None, :] < NW)
        v = tl.load(x_ptr + r[:, None].to(tl.int64) * sr + w[None, :] * sw, mask=m, other=0)
        acc += tl.sum(_popc(v.to(tl.int32)), axis=1)
    tl.store(out_ptr + r, acc, mask=r < R)


@triton.jit
def _pair_keys_kernel(
    q_ptr, c_ptr, ids_ptr, qpc_ptr, cpc_ptr, keys_ptr,
    Q, N, NW, row0, sq, sqw, sc, scw, thr,
    TANIMOTO: tl.constexpr, HAS_IDS: tl.constexpr,
    BQ: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """keys (Q, N) int64 of corpus rows ``row0 + [0, N)`` (``ids`` are of the whole corpus)."""
    qi = tl.program_id(0) * BQ + tl.arange(0, BQ)
    ni = tl.program_id(1) * BN + tl.arange(0, BN)
    q_ok, n_ok = qi < Q, ni < N
    rows = (row0 + ni).to(tl.int64)
    acc = tl.zeros([BQ, BN], dtype=tl.int32)
    for w0 in range(0, NW, BW):
        w = w0 + tl.arange(0, BW)
        w_ok = w < NW
        qv = tl.load(
            q_ptr + qi[:, None].to(tl.int64) * sq + w[None, :] * sqw,
            mask=q_ok[:, None] & w_ok[None, :], other=0,
        ).to(tl.int32)  # fmt: skip
        cv = tl.load(
            c_ptr + rows[:, None] * sc + w[None, :] * scw,
            mask=n_ok[:, None] & w_ok[None, :], other=0,
        ).to(tl.int32)  # fmt: skip
        if TANIMOTO:  # noqa: SIM108 (a constexpr branch: one is compiled)
            pair = qv[:, None, :] & cv[None, :, :]
        else:
            pair = qv[:, None, :] ^ cv[None, :, :]
        acc += tl.sum(_popc(pair), axis=2)
    if HAS_IDS:  # noqa: SIM108 (a constexpr branch: one is compiled)
        ids = tl.load(ids_ptr + rows, mask=n_ok, other=0)
    else:
        ids = rows
    if TANIMOTO:
        a = tl.load(qpc_ptr + qi, mask=q_ok, other=0)
        b = tl.load(cpc_ptr + rows, mask=n_ok, other=0)
        union = a[:, None] + b[None, :] - acc
        # Correctly rounded float32 division of integers below 2**24: the same float32 as
        # float64 division rounded to float32 (double rounding is innocuous for division
        # when 53 >= 2 * 24 + 2), which every other path computes.
        ratio = tl.math.div_rn(acc.to(tl.float32), tl.maximum(union, 1).to(tl.float32))
        sim = tl.where(union > 0, ratio, 0.0)
        bits = sim.to(tl.int32, bitcast=True).to(tl.int64)
        keys = ((0x7F800000 - bits) << 32) | ids[None, :]
        keys = tl.where(sim >= thr, keys, 0x7FFFFFFFFFFFFFFF)
    else:
        keys = (acc.to(tl.int64) << 32) | ids[None, :]
    out = keys_ptr + qi[:, None].to(tl.int64) * N + ni[None, :]
    tl.store(out, keys, mask=q_ok[:, None] & n_ok[None, :])


def _words(t: Tensor) -> tuple[Tensor, int, int, int]:
    """(tensor, words per row, row stride, word stride) in elements: int32 words when the
    rows allow, else the bytes."""
    W = t.shape[1]
    aligned = t.data_ptr() % 4 == 0 and (t.shape[0] <= 1 or t.stride(0) % 4 == 0)
    if W % 4 == 0 and t.stride(1) == 1 and aligned:
        v = t.view(torch.int32) if t.is_contiguous() else None
        if v is not None:
            return v, W // 4, v.stride(0), 1
    return t, W, t.stride(0), t.stride(1)


def _same_kind(
    q: Tensor, c: Tensor
) -> tuple[tuple[Tensor, int, int, int], tuple[Tensor, int, int, int]]:
    """Both as words, or both as bytes."""
    qw, cw = _words(q), _words(c)
    if qw[0].dtype != cw[0].dtype:
        qw = (q, q.shape[1], q.stride(0), q.stride(1))
        cw = (c, c.shape[1], c.stride(0), c.stride(1))
    return qw, cw


def popcount(packed: Tensor) -> Tensor:
    """Set bits per row of ``packed (R, W)`` uint8: int32 ``(R,)``."""
    R = packed.shape[0]
    out = torch.empty(R, dtype=torch.int32, device=packed.device)
    if R == 0:
        return out
    x, NW, sr, sw = _words(packed)
    BR = 32
    with on_device(packed):
        _popcount_kernel[(triton.cdiv(R, BR),)](x, out, R, NW, sr, sw, BR=BR, BW=_BW)
    return out


def _chunk_keys(
    q: Tensor, c: Tensor, ids: Tensor | None, qpc: Tensor | None, cpc: Tensor | None,
    start: int, stop: int, threshold: float, tanimoto: bool,
) -> Tensor:  # fmt: skip
    (qx, NW, sq, sqw), (cx, _, sc, scw) = _same_kind(q, c)
    Q, n = q.shape[0], stop - start
    keys = torch.empty((Q, n), dtype=torch.int64, device=q.device)
    dummy = keys  # an unused pointer argument
    grid = (triton.cdiv(Q, _BQ), triton.cdiv(n, _BN))
    with on_device(q):
        _pair_keys_kernel[grid](
            qx, cx, dummy if ids is None else ids, dummy if qpc is None else qpc,
            dummy if cpc is None else cpc, keys, Q, n, NW, start, sq, sqw, sc, scw,
            float(threshold), TANIMOTO=tanimoto, HAS_IDS=ids is not None,
            BQ=_BQ, BN=_BN, BW=_BW,
        )  # fmt: skip
    return keys


def hamming_topk(
    queries: Tensor, corpus: Tensor, ids: Tensor | None, k: int
) -> tuple[Tensor, Tensor]:
    """(distances int32 (Q, k), ids int64 (Q, k)), nearest first; -1 / -1 past N."""
    Q, N = queries.shape[0], corpus.shape[0]
    ids_c = None if ids is None else ids.contiguous()
    best = torch.zeros((Q, 0), dtype=torch.int64, device=queries.device)
    for start in range(0, N if Q else 0, _CHUNK_ROWS):
        stop = min(N, start + _CHUNK_ROWS)
        keys = _chunk_keys(queries, corpus, ids_c, None, None, start, stop, 0.0, False)
        best = _search_torch.merge(best, keys, k)
    best = _search_torch.pad(best, k)
    empty = best == _search_torch.NO_KEY
    return torch.where(empty, -1, best >> 32).to(torch.int32), torch.where(
        empty, -1, best & 0xFFFFFFFF
    )


def tanimoto_topk(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, k: int,
    threshold: float, sorted: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(similarities float32 (Q, k), ids int64 (Q, k)), best first, only >= float32(threshold);
    empty slots 0 / -1. Every row is scanned (``sorted`` is not used)."""
    Q, N = queries.shape[0], corpus.shape[0]
    ids_c = None if ids is None else ids.contiguous()
    qpc, cpc = popcount(queries), popcounts.to(torch.int32).contiguous()
    best = torch.zeros((Q, 0), dtype=torch.int64, device=queries.device)
    for start in range(0, N if Q else 0, _CHUNK_ROWS):
        stop = min(N, start + _CHUNK_ROWS)
        keys = _chunk_keys(queries, corpus, ids_c, qpc, cpc, start, stop, threshold, True)
        best = _search_torch.merge(best, keys, k)
    return _search_torch.decode_tanimoto(_search_torch.pad(best, k))


def tanimoto_threshold(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, threshold: float,
    sorted: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Every hit >= float32(threshold) as CSR (offsets (Q + 1), ids (H,), similarities (H,)),
    each query's hits best first, ties by the lower id."""
    Q, N = queries.shape[0], corpus.shape[0]
    device = queries.device
    ids_c = None if ids is None else ids.contiguous()
    qpc, cpc = popcount(queries), popcounts.to(torch.int32).contiguous()
    found_q, found_keys = [], []
    for start in range(0, N if Q else 0, _CHUNK_ROWS):
        stop = min(N, start + _CHUNK_ROWS)
        keys = _chunk_keys(queries, corpus, ids_c, qpc, cpc, start, stop, threshold, True)
        q, j = torch.nonzero(keys != _search_torch.NO_KEY, as_tuple=True)
        found_q.append(q)
        found_keys.append(keys[q, j])
    return _search_torch.hits_to_csr(found_q, found_keys, Q, device)
