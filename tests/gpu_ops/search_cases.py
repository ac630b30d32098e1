"""NumPy references and input cases shared by the search tests.

The references unpack the bits with NumPy and rank by ``np.lexsort`` (score, then row), so
they share no code with ``gpu_ops``: not the popcounts, not the ordering.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

WIDTHS = (1, 3, 7, 9, 63, 65, 128, 256)


def np_pair_counts(q: np.ndarray, c: np.ndarray, op: str) -> np.ndarray:
    """popcount(q & r) or popcount(q ^ r): int64 (Q, N)."""
    pairs = q[:, None, :] & c[None] if op == "and" else q[:, None, :] ^ c[None]
    return np.unpackbits(pairs, axis=-1).sum(-1, dtype=np.int64)


def np_tanimoto(q: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 (Q, N): c / (a + b - c) in float64 rounded once; 0 for two all-zero rows."""
    shared = np_pair_counts(q, c, "and").astype(np.float64)
    a = np.unpackbits(q, axis=-1).sum(-1).astype(np.float64)[:, None]
    b = np.unpackbits(c, axis=-1).sum(-1).astype(np.float64)[None, :]
    union = a + b - shared
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, shared / union, 0.0).astype(np.float32)


def _ranked(scores: np.ndarray, descending: bool) -> np.ndarray:
    rows = np.arange(scores.shape[0])
    return np.lexsort((rows, -scores if descending else scores))


def np_hamming_topk(q: np.ndarray, c: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    dist = np_pair_counts(q, c, "xor")
    out_d = np.full((q.shape[0], k), -1, dtype=np.int32)
    out_i = np.full((q.shape[0], k), -1, dtype=np.int64)
    for i in range(q.shape[0]):
        rows = _ranked(dist[i], False)[:k]
        out_d[i, : len(rows)] = dist[i, rows]
        out_i[i, : len(rows)] = rows
    return out_d, out_i


def np_tanimoto_topk(
    q: np.ndarray, c: np.ndarray, k: int, threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    sims = np_tanimoto(q, c)
    out_s = np.zeros((q.shape[0], k), dtype=np.float32)
    out_i = np.full((q.shape[0], k), -1, dtype=np.int64)
    for i in range(q.shape[0]):
        rows = _ranked(sims[i], True)
        rows = rows[sims[i, rows] >= np.float32(threshold)][:k]
        out_s[i, : len(rows)] = sims[i, rows]
        out_i[i, : len(rows)] = rows
    return out_s, out_i


def np_tanimoto_threshold(
    q: np.ndarray, c: np.ndarray, threshold: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sims = np_tanimoto(q, c)
    offsets, rows_all, sims_all = [0], [], []
    for i in range(q.shape[0]):
        rows = _ranked(sims[i], True)
        rows = rows[sims[i, rows] >= np.float32(threshold)]
        rows_all.append(rows)
        sims_all.append(sims[i, rows])
        offsets.append(offsets[-1] + len(rows))
    return (
        np.array(offsets, dtype=np.int64),
        np.concatenate(rows_all).astype(np.int64) if rows_all else np.zeros(0, np.int64),
        np.concatenate(sims_all).astype(np.float32) if sims_all else np.zeros(0, np.float32),
    )


def random_rows(rng: np.random.Generator, n: int, width: int, kind: str) -> np.ndarray:
    """uint8 (n, width) rows of one flavour.

    "dense": uniform bytes; "sparse": about 3% of bits set (fingerprint-like, many ties);
    "dupes": rows drawn from 3 distinct ones, a few of them all-zero or all-one.
    """
    if kind == "dense":
        return rng.integers(0, 256, (n, width), dtype=np.uint8)
    if kind == "sparse":
        return np.packbits(rng.random((n, 8 * width)) < 0.03, axis=-1)
    pool = np.stack(
        [
            np.zeros(width, np.uint8),
            np.full(width, 255, np.uint8),
            rng.integers(0, 256, width, dtype=np.uint8),
        ]
    )
    return pool[rng.integers(0, 3, n)]


def cases(seed: int = 0) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(label, queries, corpus): every width, several sizes and flavours, Q = 1 and N = 1."""
    rng = np.random.default_rng(seed)
    for width in WIDTHS:
        for kind in ("dense", "sparse", "dupes"):
            Q, N = int(rng.integers(1, 6)), int(rng.integers(1, 40))
            q = random_rows(rng, Q, width, kind)
            c = random_rows(rng, N, width, kind)
            if kind == "dupes":  # a query equal to a corpus row, and an all-zero query
                q[0] = c[-1]
                q[-1] = 0
            yield f"w{width}-{kind}-q{Q}-n{N}", q, c
    yield "n1", random_rows(rng, 3, 16, "dense"), random_rows(rng, 1, 16, "dense")
    yield "q1", random_rows(rng, 1, 32, "sparse"), random_rows(rng, 50, 32, "sparse")


def popcount_sorted(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What PackedCorpus stores: (rows sorted by popcount, their int32 popcounts, order)."""
    counts = torch.from_numpy(np.unpackbits(corpus.numpy(), axis=-1).sum(-1).astype(np.int32))
    pcs, order = torch.sort(counts, stable=True)
    return corpus[order].contiguous(), pcs, order
