"""Exact search on bit-packed rows, never unpacked: popcounts, Hamming and Tanimoto top-k.

Rows are uint8 ``(..., W)``: W bytes = 8W bits each, packed in any bit order (both sides in
the same one). The corpus is ``(N, W)``, queries ``(Q, W)``, on any device::

    >>> import torch, gpu_ops
    >>> corpus = torch.tensor([[0b1111_0000], [0b1000_0000], [0b1111_1111]], dtype=torch.uint8)
    >>> queries = torch.tensor([[0b1100_0000]], dtype=torch.uint8)
    >>> gpu_ops.hamming_topk(queries, corpus, k=2)
    (tensor([[1, 2]], dtype=torch.int32), tensor([[1, 0]]))
    >>> gpu_ops.tanimoto_topk(queries, corpus, k=2)
    (tensor([[0.5000, 0.5000]]), tensor([[0, 1]]))

- Hamming distance: popcount(q ^ r), nearest first.
- Tanimoto (Jaccard) similarity: c / (a + b - c) with c = popcount(q & r), a = popcount(q),
  b = popcount(r); two all-zero rows have similarity 0. It is computed in float64 and
  rounded once to float32 on every device and path, and compared with a threshold as
  float32 (``sim >= float32(threshold)``), so a similarity of exactly 0.7 passes 0.7.
- Ties go to the lower corpus row, on every device and at any thread count.

:class:`PackedCorpus` prepares a corpus once for repeated searches (the server's index):
rows reordered by popcount, so that the Tanimoto searches skip, without reading them, the
runs of rows that cannot reach the threshold or the current k-th best score by the bound
``T <= min(a, b) / max(a, b)``; its results are row numbers of the original order. The free
functions search a corpus as given (the CPU kernels skip the same rows one by one).

The functions check their arguments and call the torch operators of
:mod:`gpu_ops._search_ops` (compiled C on the CPU, Triton on CUDA, plain torch elsewhere).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gpu_ops import _search_ops
from gpu_ops.bits import _as_int

__all__ = ["PackedCorpus", "hamming_topk", "popcount", "tanimoto_threshold", "tanimoto_topk"]

# Row ids are carried in 32 bits inside the kernels' sort keys.
MAX_ROWS = 2**31 - 1


def _check_packed(x: object, name: str) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.uint8:
        raise TypeError(f"{name} must be a uint8 tensor of packed bits, got dtype {x.dtype}")
    return x


def _check_rows(x: object, name: str) -> Tensor:
    """A uint8 (rows, W) tensor with W >= 1."""
    t = _check_packed(x, name)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, bytes), got shape {tuple(t.shape)}")
    if t.shape[1] == 0:
        raise ValueError(f"{name} has rows of 0 bytes; a row needs at least one byte")
    return t


def _check_queries(queries: object, width: int, device: torch.device) -> Tensor:
    q = _check_rows(queries, "queries")
    if q.shape[1] != width:
        raise ValueError(
            f"queries have {q.shape[1]} bytes per row, the corpus {width} "
            f"({8 * q.shape[1]} bits against {8 * width})"
        )
    if q.device != device:
        raise ValueError(f"queries are on {q.device}, the corpus on {device}")
    return q


def _check_corpus(corpus: object) -> Tensor:
    c = _check_rows(corpus, "corpus")
    if c.shape[0] > MAX_ROWS:
        raise ValueError(f"the corpus has {c.shape[0]} rows; at most {MAX_ROWS} are supported")
    return c


def _check_k(k: object) -> int:
    value = _as_int(k, "k")
    if value < 1:
        raise ValueError(f"k must be at least 1, got {value}")
    return value


def _check_threshold(threshold: object) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"threshold must be a number, got {type(threshold).__name__}")
    value = float(threshold)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    return value


def _check_popcounts(popcounts: object, corpus: Tensor) -> Tensor:
    if not isinstance(popcounts, torch.Tensor):
        raise TypeError(f"corpus_popcounts must be a torch.Tensor, got {type(popcounts).__name__}")
    dtype = popcounts.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"corpus_popcounts must be an integer tensor, got {popcounts.dtype}")
    if tuple(popcounts.shape) != (corpus.shape[0],):
        raise ValueError(
            f"corpus_popcounts must have shape ({corpus.shape[0]},) (one per corpus row), "
            f"got {tuple(popcounts.shape)}"
        )
    if popcounts.device != corpus.device:
        raise ValueError(
            f"corpus_popcounts are on {popcounts.device}, the corpus on {corpus.device}"
        )
    return popcounts.to(torch.int32).contiguous()


def popcount(packed: Tensor) -> Tensor:
    """The set bits of each row of packed bytes.

    Args:
        packed: uint8 ``(..., W)`` (at least one dimension), any device, any strides.

    Returns:
        int32 ``(...)``: the number of 1 bits in each row's W bytes.

    Raises:
        TypeError: ``packed`` is not a uint8 tensor.
        ValueError: ``packed`` is 0-d.
    """
    x = _check_packed(packed, "packed")
    if x.dim() == 0:
        raise ValueError("packed must have at least one dimension (the bytes of a row)")
    lead, width = x.shape[:-1], x.shape[-1]
    if width == 0 or x.numel() == 0:
        return torch.zeros(lead, dtype=torch.int32, device=x.device)
    counts: Tensor = _search_ops.popcount(x.reshape(-1, width))
    return counts.reshape(lead)


def hamming_topk(queries: Tensor, corpus: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k corpus rows nearest each query in Hamming distance, popcount(q ^ r).

    Args:
        queries: uint8 ``(Q, W)``.
        corpus: uint8 ``(N, W)`` on the queries' device.
        k: how many rows per query, ``k >= 1``; ``k > N`` is allowed.

    Returns:
        ``(distances, indices)``: int32 ``(Q, k)`` and int64 ``(Q, k)``, nearest first, ties
        by the lower row. Slots past N hold index -1 and distance -1.

    Raises:
        TypeError: a tensor is not uint8, or ``k`` is not an int.
        ValueError: shapes (not 2-D, widths differ), devices differ, or ``k < 1``.
    """
    c = _check_corpus(corpus)
    q = _check_queries(queries, c.shape[1], c.device)
    out: tuple[Tensor, Tensor] = _search_ops.hamming_topk(q, c, None, _check_k(k))
    return out


def tanimoto_topk(
    queries: Tensor,
    corpus: Tensor,
    k: int,
    threshold: float = 0.0,
    *,
    corpus_popcounts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The k corpus rows most Tanimoto-similar to each query, at least ``threshold``.

    Args:
        queries: uint8 ``(Q, W)``.
        corpus: uint8 ``(N, W)`` on the queries' device.
        k: how many rows per query, ``k >= 1``.
        threshold: only similarities ``>= float32(threshold)`` count, in [0, 1]; default 0
            (every row: the top k always fill when ``N >= k``).
        corpus_popcounts: ``popcount(corpus)`` if already known (any integer dtype, ``(N,)``).

    Returns:
        ``(similarities, indices)``: float32 ``(Q, k)`` and int64 ``(Q, k)``, best first, ties
        by the lower row; empty slots hold index -1 and similarity 0.

    Raises:
        TypeError: a tensor of the wrong dtype, ``k`` not an int, ``threshold`` not a number.
        ValueError: shapes or devices, ``k < 1``, or ``threshold`` outside [0, 1].
    """
    c = _check_corpus(corpus)
    q = _check_queries(queries, c.shape[1], c.device)
    kk, thr = _check_k(k), _check_threshold(threshold)
    pc = popcount(c) if corpus_popcounts is None else _check_popcounts(corpus_popcounts, c)
    out: tuple[Tensor, Tensor] = _search_ops.tanimoto_topk(q, c, pc, None, kk, thr, False)
    return out


def tanimoto_threshold(
    queries: Tensor,
    corpus: Tensor,
    threshold: float,
    *,
    corpus_popcounts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Every corpus row with Tanimoto similarity ``>= float32(threshold)`` to each query.

    Args:
        queries: uint8 ``(Q, W)``.
        corpus: uint8 ``(N, W)`` on the queries' device.
        threshold: in [0, 1]. 0 makes every row a hit.
        corpus_popcounts: ``popcount(corpus)`` if already known (any integer dtype, ``(N,)``).

    Returns:
        CSR ``(offsets, indices, similarities)``: int64 ``(Q + 1,)``, int64 ``(H,)`` and
        float32 ``(H,)``; query i's hits are ``indices[offsets[i]:offsets[i + 1]]``, best
        first, ties by the lower row.

    Raises:
        TypeError, ValueError: as :func:`tanimoto_topk`.
    """
    c = _check_corpus(corpus)
    q = _check_queries(queries, c.shape[1], c.device)
    thr = _check_threshold(threshold)
    pc = popcount(c) if corpus_popcounts is None else _check_popcounts(corpus_popcounts, c)
    out: tuple[Tensor, Tensor, Tensor] = _search_ops.tanimoto_threshold(q, c, pc, None, thr, False)
    return out


class PackedCorpus:
    """A corpus prepared once for repeated searches: rows reordered by popcount.

    Holds the corpus's rows sorted by popcount (ties by row), their popcounts (int32) and
    the permutation (int64: sorted row -> original row), computed once at construction on
    the corpus's device. Searches return row numbers of the ORIGINAL order, and break ties
    by them, exactly as the free functions do on the unsorted corpus.

    Args:
        corpus: uint8 ``(N, W)``, any device, any strides (it is copied; the caller's tensor
            can be freed afterwards).

    Raises:
        TypeError: ``corpus`` is not a uint8 tensor.
        ValueError: it is not 2-D, has 0-byte rows, or more than 2**31 - 1 rows.
    """

    def __init__(self, corpus: Tensor) -> None:
        c = _check_corpus(corpus)
        counts = popcount(c)
        # Stable: rows of one popcount stay in their order.
        self._popcounts, order = torch.sort(counts, stable=True)
        self._order = order.to(torch.int64)
        self._corpus = c.index_select(0, self._order).contiguous()

    @property
    def num_rows(self) -> int:
        """N, the number of rows."""
        return int(self._corpus.shape[0])

    @property
    def width_bytes(self) -> int:
        """W, the bytes per row (8W bits)."""
        return int(self._corpus.shape[1])

    @property
    def device(self) -> torch.device:
        """Where the corpus lives (and where queries must be)."""
        return self._corpus.device

    @property
    def nbytes(self) -> int:
        """Resident bytes: the sorted rows, their popcounts and the permutation."""
        return sum(
            t.numel() * t.element_size() for t in (self._corpus, self._popcounts, self._order)
        )

    @property
    def order(self) -> Tensor:
        """int64 ``(N,)``: the original row of each stored (popcount-sorted) row."""
        return self._order

    def __repr__(self) -> str:
        return (
            f"PackedCorpus(num_rows={self.num_rows}, width_bytes={self.width_bytes}, "
            f"device={self.device})"
        )

    def hamming_topk(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """As :func:`hamming_topk` on the original corpus: ``(distances int32 (Q, k),
        indices int64 (Q, k))``."""
        q = _check_queries(queries, self.width_bytes, self.device)
        out: tuple[Tensor, Tensor] = _search_ops.hamming_topk(
            q, self._corpus, self._order, _check_k(k)
        )
        return out

    def tanimoto_topk(
        self, queries: Tensor, k: int, threshold: float = 0.0
    ) -> tuple[Tensor, Tensor]:
        """As :func:`tanimoto_topk` on the original corpus: ``(similarities float32 (Q, k),
        indices int64 (Q, k))``."""
        q = _check_queries(queries, self.width_bytes, self.device)
        kk, thr = _check_k(k), _check_threshold(threshold)
        out: tuple[Tensor, Tensor] = _search_ops.tanimoto_topk(
            q, self._corpus, self._popcounts, self._order, kk, thr, True
        )
        return out

    def tanimoto_threshold(
        self, queries: Tensor, threshold: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """As :func:`tanimoto_threshold` on the original corpus: CSR ``(offsets (Q + 1),
        indices (H,), similarities (H,))``."""
        q = _check_queries(queries, self.width_bytes, self.device)
        thr = _check_threshold(threshold)
        out: tuple[Tensor, Tensor, Tensor] = _search_ops.tanimoto_threshold(
            q, self._corpus, self._popcounts, self._order, thr, True
        )
        return out
