"""Every kernel of the search ops against the NumPy references (``search_cases``).

Each backend is a module with the ops' kernel signatures: the chunked torch kernels (what
other devices and CUDA without Triton run), the ops as dispatched on the CPU, and every
compiled CPU path this CPU supports, forced one at a time. Each runs on the corpus as given
(row ids = row numbers) and on the corpus in popcount order with ids (what PackedCorpus
passes), which must give the same answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from gpu_ops import _search_ops, _search_torch
from tests.gpu_ops.search_cases import (
    cases,
    np_hamming_topk,
    np_tanimoto_threshold,
    np_tanimoto_topk,
    popcount_sorted,
)

BACKENDS: dict[str, Any] = {
    "torch": _search_torch,
    "ops": SimpleNamespace(
        popcount=_search_ops.popcount,
        hamming_topk=_search_ops.hamming_topk,
        tanimoto_topk=_search_ops.tanimoto_topk,
        tanimoto_threshold=_search_ops.tanimoto_threshold,
    ),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    # Small chunks, so the torch kernels merge many chunks' top-k and hits.
    monkeypatch.setattr(_search_torch, "_CHUNK_ELEMENTS", 64)
    return BACKENDS[request.param]


def _layouts(
    corpus: np.ndarray,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]]:
    """(corpus, popcounts, ids, sorted): as given, then in popcount order."""
    c = torch.from_numpy(corpus)
    counts = torch.from_numpy(np.unpackbits(corpus, axis=-1).sum(-1).astype(np.int32))
    yield c, counts, None, False
    rows, pcs, order = popcount_sorted(c)
    yield rows, pcs, order, True


def test_popcount(backend: Any) -> None:
    for label, q, c in cases():
        got = backend.popcount(torch.from_numpy(c))
        assert got.dtype == torch.int32
        expected = np.unpackbits(c, axis=-1).sum(-1)
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=label)
        # A non-contiguous view: every other byte of a wider buffer.
        wide = torch.from_numpy(np.repeat(q, 2, axis=1))[:, ::2]
        np.testing.assert_array_equal(
            backend.popcount(wide).numpy(), np.unpackbits(q, axis=-1).sum(-1), err_msg=label
        )


def test_hamming_topk(backend: Any) -> None:
    for label, q, c in cases(1):
        N = c.shape[0]
        for k in sorted({1, 3, N, N + 2}):
            want_d, want_i = np_hamming_topk(q, c, k)
            for rows, _, ids, _ in _layouts(c):
                dist, idx = backend.hamming_topk(torch.from_numpy(q), rows, ids, k)
                assert dist.dtype == torch.int32
                assert idx.dtype == torch.int64
                np.testing.assert_array_equal(idx.numpy(), want_i, err_msg=f"{label} k={k}")
                np.testing.assert_array_equal(dist.numpy(), want_d, err_msg=f"{label} k={k}")


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7, 1.0])
def test_tanimoto_topk(backend: Any, threshold: float) -> None:
    for label, q, c in cases(2):
        N = c.shape[0]
        for k in sorted({1, 4, N + 3}):
            want_s, want_i = np_tanimoto_topk(q, c, k, threshold)
            for rows, pcs, ids, srt in _layouts(c):
                sims, idx = backend.tanimoto_topk(
                    torch.from_numpy(q), rows, pcs, ids, k, threshold, srt
                )
                assert sims.dtype == torch.float32
                assert idx.dtype == torch.int64
                msg = f"{label} k={k} sorted={srt}"
                np.testing.assert_array_equal(idx.numpy(), want_i, err_msg=msg)
                np.testing.assert_array_equal(sims.numpy(), want_s, err_msg=msg)


@pytest.mark.parametrize("threshold", [0.0, 0.2, 0.5, 0.7, 1.0])
def test_tanimoto_threshold(backend: Any, threshold: float) -> None:
    for label, q, c in cases(3):
        want = np_tanimoto_threshold(q, c, threshold)
        for rows, pcs, ids, srt in _layouts(c):
            got = backend.tanimoto_threshold(torch.from_numpy(q), rows, pcs, ids, threshold, srt)
            assert [t.dtype for t in got] == [torch.int64, torch.int64, torch.float32]
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g.numpy(), w, err_msg=f"{label} sorted={srt}")


def test_threshold_with_no_hits(backend: Any) -> None:
    rng = np.random.default_rng(5)
    q = rng.integers(0, 256, (3, 16), dtype=np.uint8)
    c = rng.integers(0, 256, (20, 16), dtype=np.uint8)
    for rows, pcs, ids, srt in _layouts(c):
        offsets, idx, sims = backend.tanimoto_threshold(
            torch.from_numpy(q), rows, pcs, ids, 1.0, srt
        )
        assert offsets.tolist() == [0, 0, 0, 0]
        assert idx.shape == (0,)
        assert sims.shape == (0,)
        sims_k, idx_k = backend.tanimoto_topk(torch.from_numpy(q), rows, pcs, ids, 2, 1.0, srt)
        assert (idx_k == -1).all()
        assert (sims_k == 0).all()


def test_all_zero_rows_have_similarity_zero(backend: Any) -> None:
    q = np.zeros((2, 5), np.uint8)
    c = np.zeros((3, 5), np.uint8)
    for rows, pcs, ids, srt in _layouts(c):
        sims, idx = backend.tanimoto_topk(torch.from_numpy(q), rows, pcs, ids, 4, 0.0, srt)
        assert sims.tolist() == [[0.0] * 4] * 2
        assert idx.tolist() == [[0, 1, 2, -1]] * 2  # threshold 0: every row is a hit
        offsets, hit, _ = backend.tanimoto_threshold(torch.from_numpy(q), rows, pcs, ids, 0.01, srt)
        assert offsets.tolist() == [0, 0, 0]
        assert hit.numel() == 0
