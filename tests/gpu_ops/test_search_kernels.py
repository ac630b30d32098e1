"""Every kernel of the search ops against the NumPy references (``search_cases``).

Each backend is a module with the ops' kernel signatures: the chunked torch kernels (what
other devices and CUDA without Triton run), the ops as dispatched on the CPU, and every
compiled CPU popcount path, forced one at a time through ``BITSERVE_POPCOUNT_PATH`` (a path
this CPU lacks is skipped, saying so: the AVX-512 one on a CPU without VPOPCNTDQ). Each runs
on the corpus as given (row ids = row numbers) and on the corpus in popcount order with ids
(what PackedCorpus passes), which must give the same answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from gpu_ops import _search_c, _search_ops, _search_torch
from tests.common_utils import HAS_TRITON
from tests.gpu_ops.search_cases import (
    cases,
    np_hamming_topk,
    np_tanimoto_threshold,
    np_tanimoto_topk,
    popcount_sorted,
    random_rows,
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


C_PATHS = [f"c-{p}" for p in _search_c.PATHS]
# Interpreted (TRITON_INTERPRET=1, set by conftest) on CPU tensors without a GPU.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_triton_device(fn: Any) -> Any:
    """``fn`` with its tensor arguments moved to the Triton device and results moved back."""

    def call(*args: Any) -> Any:
        moved = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*moved)
        return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()

    return call


if HAS_TRITON:
    from gpu_ops._triton import search as _triton_search

    # light: the interpreter is slow, so a subset of the cases (widths 3, 9 and 65; the
    # corpus in popcount order with ids; the largest k).
    BACKENDS["triton"] = SimpleNamespace(
        light=True,
        popcount=_on_triton_device(_triton_search.popcount),
        hamming_topk=_on_triton_device(_triton_search.hamming_topk),
        tanimoto_topk=_on_triton_device(_triton_search.tanimoto_topk),
        tanimoto_threshold=_on_triton_device(_triton_search.tanimoto_threshold),
    )


def use_c_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the compiled kernels' popcount path ``name``; skip when this CPU lacks it."""
    if _search_c.kernels() is None:
        pytest.skip("the compiled CPU search kernels are not built here (no C compiler)")
    if name not in _search_c.supported_paths():
        pytest.skip(f"this CPU does not support the {name} popcount path")
    monkeypatch.setenv(_search_c.ENV, name)


@pytest.fixture(params=sorted(BACKENDS) + C_PATHS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    # Small chunks, so the torch kernels merge many chunks' top-k and hits.
    monkeypatch.setattr(_search_torch, "_CHUNK_ELEMENTS", 64)
    if request.param == "triton":  # chunks of 16 rows: the running top-k merges many
        monkeypatch.setattr(_triton_search, "_CHUNK_ROWS", 16)
    if request.param.startswith("c-"):
        use_c_path(request.param.removeprefix("c-"), monkeypatch)
        return _search_c
    return BACKENDS[request.param]


def _light(backend: Any) -> bool:
    return bool(getattr(backend, "light", False))


def _cases(backend: Any, seed: int) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    for label, q, c in cases(seed):
        if not _light(backend) or q.shape[1] in (3, 9, 65):
            yield label, q, c


def _ks(backend: Any, *ks: int) -> list[int]:
    return [max(ks)] if _light(backend) else sorted(set(ks))


def _layouts(
    corpus: np.ndarray, backend: Any = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]]:
    """(corpus, popcounts, ids, sorted): as given, then in popcount order."""
    c = torch.from_numpy(corpus)
    counts = torch.from_numpy(np.unpackbits(corpus, axis=-1).sum(-1).astype(np.int32))
    if not _light(backend):
        yield c, counts, None, False
    rows, pcs, order = popcount_sorted(c)
    yield rows, pcs, order, True


def test_popcount(backend: Any) -> None:
    for label, q, c in _cases(backend, 0):
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
    for label, q, c in _cases(backend, 1):
        N = c.shape[0]
        for k in _ks(backend, 1, 3, N, N + 2):
            want_d, want_i = np_hamming_topk(q, c, k)
            for rows, _, ids, _ in _layouts(c, backend):
                dist, idx = backend.hamming_topk(torch.from_numpy(q), rows, ids, k)
                assert dist.dtype == torch.int32
                assert idx.dtype == torch.int64
                np.testing.assert_array_equal(idx.numpy(), want_i, err_msg=f"{label} k={k}")
                np.testing.assert_array_equal(dist.numpy(), want_d, err_msg=f"{label} k={k}")


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7, 1.0])
def test_tanimoto_topk(backend: Any, threshold: float) -> None:
    for label, q, c in _cases(backend, 2):
        N = c.shape[0]
        for k in _ks(backend, 1, 4, N + 3):
            want_s, want_i = np_tanimoto_topk(q, c, k, threshold)
            for rows, pcs, ids, srt in _layouts(c, backend):
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
    for label, q, c in _cases(backend, 3):
        want = np_tanimoto_threshold(q, c, threshold)
        for rows, pcs, ids, srt in _layouts(c, backend):
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


def _big_case(seed: int, width: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """70 queries (two query blocks) against 3000 rows (many tiles), fingerprint-like."""
    rng = np.random.default_rng(seed)
    c = random_rows(rng, 3000, width, kind)
    q = np.concatenate([random_rows(rng, 66, width, kind), c[[5, 17, 2999, 0]]])
    return q, c


def _all_results(module: Any, q: np.ndarray, c: np.ndarray) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    qt = torch.from_numpy(q)
    for rows, pcs, ids, srt in _layouts(c):
        out += module.hamming_topk(qt, rows, ids, 7)
        out += module.tanimoto_topk(qt, rows, pcs, ids, 7, 0.0, srt)
        out += module.tanimoto_topk(qt, rows, pcs, ids, 3100, 0.2, srt)
        out += module.tanimoto_threshold(qt, rows, pcs, ids, 0.35, srt)
        out += [module.popcount(rows)]
    return out


@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize(("width", "kind"), [(256, "sparse"), (128, "dense"), (65, "dupes")])
def test_compiled_paths_match_torch_at_any_thread_count(
    path: str, width: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many tiles and two query blocks: every path, at 1 and 2 threads, gives the torch
    kernels' answers exactly (ties included)."""
    use_c_path(path.removeprefix("c-"), monkeypatch)
    monkeypatch.setattr(_search_c, "PARALLEL_MIN_BYTES", 0)  # threads even for small inputs
    q, c = _big_case(width, width, kind)
    want = _all_results(_search_torch, q, c)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = _all_results(_search_c, q, c)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), f"{path} at {n} threads"
    finally:
        torch.set_num_threads(threads)


def test_forcing_an_unknown_or_unsupported_path_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    if _search_c.kernels() is None:
        pytest.skip("the compiled CPU search kernels are not built here (no C compiler)")
    monkeypatch.setenv(_search_c.ENV, "sse9")
    with pytest.raises(ValueError, match="expected auto or one of"):
        _search_c.popcount(torch.zeros(2, 3, dtype=torch.uint8))
    missing = [p for p in _search_c.PATHS if p not in _search_c.supported_paths()]
    if missing:
        monkeypatch.setenv(_search_c.ENV, missing[0])
        with pytest.raises(ValueError, match="supports only"):
            _search_c.popcount(torch.zeros(2, 3, dtype=torch.uint8))
    monkeypatch.setenv(_search_c.ENV, "auto")
    assert _search_c.path() in _search_c.supported_paths()
