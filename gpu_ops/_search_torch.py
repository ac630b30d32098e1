"""Plain-torch kernels of the search ops, for every device without kernels of its own (and CUDA
without Triton, and the CPU without a C compiler).

The corpus is scanned in chunks of rows; each chunk's pair counts come from a SWAR popcount on
int64 words (the rows zero-padded to a multiple of 8 bytes), and the running top-k of each
query is merged with the chunk's by ``torch.topk`` on one int64 key per pair that orders
pairs exactly as the ops promise (best score first, ties by the lower row id)::

    hamming:  key = distance << 32 | id
    tanimoto: key = (bits(+inf) - bits(similarity)) << 32 | id   (float32 bits, similarity >= 0)

Row ids are below 2**31 (:mod:`gpu_ops.search` checks the corpus size). The corpus's popcount
order (``sorted``) is not used here: no rows are skipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

# (Q, rows, words) int64 intermediates stay below this many elements per chunk.
_CHUNK_ELEMENTS = 1 << 23
_INF_BITS = 0x7F800000  # the bits of float32 +inf: every similarity's bits are below
NO_KEY = torch.iinfo(torch.int64).max  # an empty slot (a row below the threshold)
_M1, _M2, _M4 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F
_H01 = 0x0101010101010101


def words(packed: Tensor) -> Tensor:
    """``packed (R, W)`` uint8 as int64 words ``(R, ceil(W / 8))``, the tail zero-padded."""
    R, W = packed.shape
    padded = packed.new_zeros((R, -(-W // 8) * 8))
    padded[:, :W] = packed
    return padded.view(torch.int64)


def word_popcount(x: Tensor) -> Tensor:
    """Set bits of each int64 element (SWAR bit tricks; wrapping int64 arithmetic)."""
    x = x - ((x >> 1) & _M1)  # arithmetic shifts: the masks clear what they fill in
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    return (x * _H01) >> 56  # < 65: the top byte never reaches the sign bit


def popcount(packed: Tensor) -> Tensor:
    """Set bits per row of ``packed (R, W)`` uint8: int32 ``(R,)``."""
    if packed.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int32, device=packed.device)
    return word_popcount(words(packed)).sum(-1).to(torch.int32)


def _chunk_rows(Q: int, n_words: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, Q * n_words))


def _row_ids(ids: Tensor | None, start: int, stop: int, device: torch.device) -> Tensor:
    if ids is None:
        return torch.arange(start, stop, dtype=torch.int64, device=device)
    return ids[start:stop].to(torch.int64)


def _counts(qw: Tensor, cw: Tensor, op: str) -> Tensor:
    """popcount(q & r) or popcount(q ^ r) of every (query, chunk row) pair: int64 (Q, n)."""
    pairs = qw[:, None, :] & cw[None] if op == "and" else qw[:, None, :] ^ cw[None]
    return word_popcount(pairs).sum(-1)


def _similarities(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """float32 c / (a + b - c), computed in float64 (0 where a = b = 0): (Q, n)."""
    union = (a[:, None] + b[None, :] - c).double()
    return torch.where(union > 0, c.double() / union.clamp(min=1), 0.0).float()


def merge(best: Tensor, keys: Tensor, k: int) -> Tensor:
    """The k smallest of the running keys ``best (Q, <= k)`` and a chunk's ``keys (Q, n)``."""
    both = torch.cat([best, keys], dim=1)
    return torch.topk(both, min(k, both.shape[1]), dim=1, largest=False, sorted=True).values


def pad(best: Tensor, k: int) -> Tensor:
    """``best (Q, <= k)`` filled to k columns with NO_KEY (empty slots)."""
    fill = best.new_full((best.shape[0], k - best.shape[1]), NO_KEY)
    return torch.cat([best, fill], dim=1)


def hamming_topk(
    queries: Tensor, corpus: Tensor, ids: Tensor | None, k: int
) -> tuple[Tensor, Tensor]:
    """(distances int32 (Q, k), ids int64 (Q, k)), nearest first; -1 / -1 past N."""
    Q, N = queries.shape[0], corpus.shape[0]
    qw = words(queries)
    step = _chunk_rows(Q, qw.shape[1])
    best = torch.zeros((Q, 0), dtype=torch.int64, device=queries.device)
    for start in range(0, N, step):
        stop = min(N, start + step)
        dist = _counts(qw, words(corpus[start:stop]), "xor")
        keys = (dist << 32) | _row_ids(ids, start, stop, queries.device)[None, :]
        best = merge(best, keys, k)
    best = pad(best, k)
    empty = best == NO_KEY
    distances = torch.where(empty, -1, best >> 32).to(torch.int32)
    return distances, torch.where(empty, -1, best & 0xFFFFFFFF)


def _tanimoto_keys(
    qw: Tensor, qpc: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None,
    start: int, stop: int, threshold: Tensor,
) -> Tensor:  # fmt: skip
    """The keys of chunk ``[start, stop)``, ``NO_KEY`` below the threshold: (Q, n)."""
    c = _counts(qw, words(corpus[start:stop]), "and")
    sims = _similarities(c, qpc, popcounts[start:stop].to(torch.int64))
    bits = sims.view(torch.int32).to(torch.int64)
    keys = ((_INF_BITS - bits) << 32) | _row_ids(ids, start, stop, qw.device)[None, :]
    return torch.where(sims >= threshold, keys, NO_KEY)


def decode_tanimoto(keys: Tensor) -> tuple[Tensor, Tensor]:
    """Tanimoto keys to (similarities float32, ids int64); NO_KEY to 0 and -1."""
    empty = keys == NO_KEY
    bits = (_INF_BITS - (keys >> 32)).to(torch.int32)
    sims = torch.where(empty, 0.0, bits.view(torch.float32))
    return sims, torch.where(empty, -1, keys & 0xFFFFFFFF)


def tanimoto_topk(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, k: int,
    threshold: float, sorted: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(similarities float32 (Q, k), ids int64 (Q, k)), best first, only >= float32(threshold);
    empty slots 0 / -1."""
    Q, N = queries.shape[0], corpus.shape[0]
    qw = words(queries)
    qpc = word_popcount(qw).sum(-1)
    thr = torch.tensor(threshold, dtype=torch.float32, device=queries.device)
    step = _chunk_rows(Q, qw.shape[1])
    best = torch.zeros((Q, 0), dtype=torch.int64, device=queries.device)
    for start in range(0, N, step):
        stop = min(N, start + step)
        keys = _tanimoto_keys(qw, qpc, corpus, popcounts, ids, start, stop, thr)
        best = merge(best, keys, k)
    return decode_tanimoto(pad(best, k))


def tanimoto_threshold(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, threshold: float,
    sorted: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Every hit >= float32(threshold) as CSR (offsets (Q + 1), ids (H,), similarities (H,)),
    each query's hits best first, ties by the lower id."""
    Q, N = queries.shape[0], corpus.shape[0]
    device = queries.device
    qw = words(queries)
    qpc = word_popcount(qw).sum(-1)
    thr = torch.tensor(threshold, dtype=torch.float32, device=device)
    step = _chunk_rows(Q, qw.shape[1])
    found_q, found_keys = [], []
    for start in range(0, N, step):
        stop = min(N, start + step)
        keys = _tanimoto_keys(qw, qpc, corpus, popcounts, ids, start, stop, thr)
        q, j = torch.nonzero(keys != NO_KEY, as_tuple=True)
        found_q.append(q)
        found_keys.append(keys[q, j])
    return hits_to_csr(found_q, found_keys, Q, device)


def hits_to_csr(
    found_q: list[Tensor], found_keys: list[Tensor], Q: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Hits gathered chunk by chunk (query numbers and keys) as the threshold search's CSR:
    (offsets (Q + 1), ids (H,), similarities (H,)), each query's hits in key order."""
    q = torch.cat(found_q) if found_q else torch.zeros(0, dtype=torch.int64, device=device)
    keys = torch.cat(found_keys) if found_keys else q.clone()
    # By key, then (stably) by query: each query's hits in key order.
    keys, perm = torch.sort(keys)
    q, perm2 = torch.sort(q[perm], stable=True)
    sims, hit_ids = decode_tanimoto(keys[perm2])
    offsets = torch.zeros(Q + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(torch.bincount(q, minlength=Q), 0)
    return offsets, hit_ids, sims
