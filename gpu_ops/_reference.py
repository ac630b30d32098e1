"""Slow, obviously correct implementations that the tests compare the fast paths with.

Nothing here is meant to be fast; everything here is meant to be easy to check by eye.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# --- bits: numpy.packbits / numpy.unpackbits semantics, in plain torch ---------------------


def _bit_shifts(bitorder: str, device: torch.device) -> torch.Tensor:
    """Shift of the j-th bit of a byte, j = 0..7: 7-j for "big", j for "little"."""
    j = torch.arange(8, device=device)
    return 7 - j if bitorder == "big" else j


def packbits_reference(
    x: torch.Tensor, dim: int | None = None, bitorder: str = "big"
) -> torch.Tensor:
    """numpy.packbits: nonzero elements become 1 bits, eight to a byte along ``dim``.

    Args:
        x: (...) bool or integer tensor; no argument checking is done here.
        dim: the axis to pack, or None to pack the C-order flattening.
        bitorder: "big" (first element in the top bit) or "little".

    Returns:
        uint8, the shape of ``x`` with ``dim`` shortened to ceil(n/8) (1-D when dim is None).
    """
    if dim is None or x.dim() == 0:
        x, dim = x.reshape(-1), 0
    bits = (x != 0).movedim(dim, -1).long()  # (..., n)
    n = bits.shape[-1]
    bits = torch.nn.functional.pad(bits, (0, -n % 8))  # (..., 8 * ceil(n/8))
    groups = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)  # (..., ceil(n/8), 8)
    packed = (groups << _bit_shifts(bitorder, x.device)).sum(-1)
    return packed.to(torch.uint8).movedim(-1, dim)


def unpackbits_reference(
    x: torch.Tensor,
    dim: int | None = None,
    count: int | None = None,
    bitorder: str = "big",
    dtype: torch.dtype = torch.uint8,
) -> torch.Tensor:
    """numpy.unpackbits: each uint8 becomes eight 0/1 elements along ``dim``.

    Args:
        x: (...) uint8 tensor; no argument checking is done here.
        dim: the axis to unpack, or None to unpack the C-order flattening.
        count: keep this many bits along ``dim`` (zero-padded past 8n); negative counts
            from the end (8n + count). None keeps all 8n.
        bitorder: "big" (top bit first) or "little".
        dtype: the output dtype.

    Returns:
        ``dtype``, the shape of ``x`` with ``dim`` of length ``count`` (8n when None).
    """
    if dim is None or x.dim() == 0:
        x, dim = x.reshape(-1), 0
    moved = x.movedim(dim, -1).long()  # (..., n)
    bits = (moved[..., None] >> _bit_shifts(bitorder, x.device)) & 1  # (..., n, 8)
    bits = bits.reshape(*moved.shape[:-1], 8 * moved.shape[-1])  # (..., 8n)
    total = bits.shape[-1]
    if count is None:
        count = total
    elif count < 0:
        count = total + count
    bits = torch.nn.functional.pad(bits, (0, max(count - total, 0)))[..., :count]
    return bits.to(dtype).movedim(-1, dim)


# --- resample: the banded response operator, densely ---------------------------------------


def banded_to_dense(starts: torch.Tensor, weights: torch.Tensor, num_fine: int) -> torch.Tensor:
    """The dense operator T (N, A, B) of a band: T[n, a, starts[n, a] + j] = weights[n, a, j]."""
    N, A, W = weights.shape
    T = torch.zeros(N, A, num_fine + W, dtype=weights.dtype, device=weights.device)
    cols = starts.long()[..., None] + torch.arange(W, device=weights.device)
    T.scatter_(-1, cols, weights)
    return T[..., :num_fine]


def banded_resample_reference(
    f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """out[..., n, a] = sum_j weights[n, a, j] * f[..., n, starts[n, a] + j], via gathered windows.

    Args:
        f: (N, B) or (M, N, B).
        starts: (N, A) integer.
        weights: (N, A, W).

    Returns:
        (N, A) or (M, N, A) in the promoted dtype of f and weights; autograd works throughout.
    """
    N, _, W = weights.shape
    cols = starts.long()[..., None] + torch.arange(W, device=f.device)  # (N, A, W)
    rows = torch.arange(N, device=f.device)[:, None, None]
    windows = f[..., rows, cols]  # (..., N, A, W)
    return (windows * weights).sum(-1)


def dense_response_operator(
    x: torch.Tensor, c: torch.Tensor, response: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """T[n, a, b] = response(c[n, a] - x[b]) for every fine point, shape (N, A, B)."""
    return response(c[..., None] - x)


# --- search: popcounts, Hamming and Tanimoto on packed rows, every pair at once ------------------

_BYTE_BITS = torch.tensor([bin(v).count("1") for v in range(256)], dtype=torch.int64)


def popcount_reference(packed: torch.Tensor) -> torch.Tensor:
    """Set bits per row of ``packed (..., W)`` uint8: int32 ``(...)``."""
    return _BYTE_BITS.to(packed.device)[packed.long()].sum(-1).to(torch.int32)


def shared_bits_reference(queries: torch.Tensor, corpus: torch.Tensor, op: str) -> torch.Tensor:
    """popcount(q & r) (``op="and"``) or popcount(q ^ r) (``op="xor"``) of every pair.

    Args:
        queries: (Q, W) uint8; corpus: (N, W) uint8.

    Returns:
        (Q, N) int64.
    """
    q, c = queries.long()[:, None, :], corpus.long()[None, :, :]
    pairs = q & c if op == "and" else q ^ c  # (Q, N, W)
    return _BYTE_BITS.to(queries.device)[pairs].sum(-1)


def tanimoto_reference(queries: torch.Tensor, corpus: torch.Tensor) -> torch.Tensor:
    """Tanimoto similarity c / (a + b - c) of every pair: float32 (Q, N).

    Computed in float64 and rounded once to float32, as every kernel does; two all-zero
    rows have similarity 0.
    """
    c = shared_bits_reference(queries, corpus, "and").double()
    a = popcount_reference(queries).double()[:, None]
    b = popcount_reference(corpus).double()[None, :]
    union = a + b - c
    return torch.where(union > 0, c / union.clamp(min=1), 0.0).float()


def _best_rows(scores: torch.Tensor, descending: bool, k: int) -> torch.Tensor:
    """The k best rows of each query, ties by the lower row: (Q, min(k, N)) int64.

    A stable sort of the rows (already in increasing order) keeps tied rows in that order.
    """
    order = torch.sort(scores, dim=1, descending=descending, stable=True).indices
    return order[:, :k]


def hamming_topk_reference(
    queries: torch.Tensor, corpus: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(distances int32 (Q, k), indices int64 (Q, k)): nearest first, ties by the lower row;
    slots past N hold index -1 and distance -1."""
    Q, N = queries.shape[0], corpus.shape[0]
    dist = shared_bits_reference(queries, corpus, "xor")
    rows = _best_rows(dist, False, k)
    distances = torch.full((Q, k), -1, dtype=torch.int32)
    indices = torch.full((Q, k), -1, dtype=torch.int64)
    distances[:, : min(k, N)] = dist.gather(1, rows).int()
    indices[:, : min(k, N)] = rows
    return distances, indices


def tanimoto_topk_reference(
    queries: torch.Tensor, corpus: torch.Tensor, k: int, threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(similarities float32 (Q, k), indices int64 (Q, k)): best first, ties by the lower
    row, only similarities >= float32(threshold); empty slots index -1, similarity 0."""
    Q = queries.shape[0]
    sims = tanimoto_reference(queries, corpus)
    thr = torch.tensor(threshold, dtype=torch.float32)
    similarities = torch.zeros((Q, k), dtype=torch.float32)
    indices = torch.full((Q, k), -1, dtype=torch.int64)
    for q in range(Q):
        rows = _best_rows(sims[q : q + 1], True, k)[0]
        rows = rows[sims[q, rows] >= thr]
        similarities[q, : len(rows)] = sims[q, rows]
        indices[q, : len(rows)] = rows
    return similarities, indices


def tanimoto_threshold_reference(
    queries: torch.Tensor, corpus: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every pair with similarity >= float32(threshold), as CSR ``(offsets int64 (Q + 1),
    indices int64 (H,), similarities float32 (H,))``, each query's hits best first, ties by
    the lower row."""
    sims = tanimoto_reference(queries, corpus)
    thr = torch.tensor(threshold, dtype=torch.float32)
    offsets, indices, values = [0], [], []
    for q in range(queries.shape[0]):
        rows = _best_rows(sims[q : q + 1], True, corpus.shape[0])[0]
        rows = rows[sims[q, rows] >= thr]
        indices.append(rows)
        values.append(sims[q, rows])
        offsets.append(offsets[-1] + len(rows))
    return (
        torch.tensor(offsets, dtype=torch.int64),
        torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64),
        torch.cat(values) if values else torch.zeros(0, dtype=torch.float32),
    )
