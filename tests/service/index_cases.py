"""Index models for the tests: a model folder writer and a NumPy reference of the search.

The reference is plain NumPy on the unpacked bits (``np.unpackbits``), independent of
``gpu_ops``: Tanimoto ``|a & b| / |a | b|`` (0 for two empty rows), Hamming ``|a ^ b|``,
best first with ties by the lower row, ``k`` slots with empty ones ``(-1, 0)`` (Tanimoto) or
``(-1, -1)`` (Hamming).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.index.build import config_text

Array = np.ndarray[Any, Any]


def write_index(
    folder: Path,
    corpus: Array,
    *,
    metric: str = "tanimoto",
    nbits: int | None = None,
    ids: Array | None = None,
    k: int = 5,
    max_k: int = 50,
    bitorder: str = "big",
    max_batch_size: int = 8,
    npy: bool = False,
    extra: str = "",
) -> Path:
    """An index model folder (config.toml + corpus.safetensors or corpus.npy); returns it."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    nbits = nbits if nbits is not None else 8 * corpus.shape[1]
    text = config_text(metric, nbits, bitorder, k, max_k, max_batch_size) + extra
    if npy:
        np.save(folder / "corpus.npy", corpus)
        text = text.replace("corpus.safetensors", "corpus.npy")
    else:
        tensors = {"corpus": np.ascontiguousarray(corpus)}
        if ids is not None:
            tensors["ids"] = np.ascontiguousarray(ids)
        save_file(tensors, str(folder / "corpus.safetensors"))
    (folder / "config.toml").write_text(text)
    return folder


def random_bits(rng: np.random.Generator, n: int, nbits: int, density: float = 0.3) -> Array:
    """``(n, nbits)`` bool rows."""
    return rng.random((n, nbits)) < density


def reference_search(
    queries: Array, corpus: Array, k: int, metric: str, threshold: float | None = None
) -> tuple[Array, Array]:
    """``(rows int64 (Q, k), scores float32 (Q, k))`` of packed queries against packed rows
    (any bit order: the counts do not depend on it)."""
    q = np.unpackbits(queries, axis=1).astype(np.int64)
    c = np.unpackbits(corpus, axis=1).astype(np.int64)
    inter = q @ c.T
    pq, pc = q.sum(1)[:, None], c.sum(1)[None, :]
    n = corpus.shape[0]
    rows = np.full((len(q), k), -1, np.int64)
    if metric == "hamming":
        scores = np.full((len(q), k), -1.0, np.float32)
        dist = pq + pc - 2 * inter
        for i in range(len(q)):
            order = np.argsort(dist[i], kind="stable")[:k]
            rows[i, : order.size] = order
            scores[i, : order.size] = dist[i, order]
        return rows, scores
    scores = np.zeros((len(q), k), np.float32)
    union = pq + pc - inter
    sim = np.where(union > 0, inter / np.maximum(union, 1), 0.0)
    for i in range(len(q)):
        order = np.argsort(-sim[i], kind="stable")[: min(k, n)]
        if threshold is not None:
            order = order[sim[i, order] >= threshold]
        rows[i, : order.size] = order
        scores[i, : order.size] = sim[i, order]
    return rows, scores


def as_ids(rows: Array, ids: Array | None) -> Array:
    """Row numbers (-1: empty) as the file's ids."""
    if ids is None:
        return rows
    return np.where(rows >= 0, ids[np.maximum(rows, 0)], -1)
