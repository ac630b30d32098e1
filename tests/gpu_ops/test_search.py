"""The public search API (``gpu_ops.popcount``, ``hamming_topk``, ``tanimoto_topk``,
``tanimoto_threshold``, ``PackedCorpus``): results against the NumPy references, argument
checks, ``opcheck`` of the ops, and hypothesis over shapes and contents."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu_ops
from gpu_ops import _reference, _search_ops
from tests.common_utils import HAS_TRITON, cpu_and_cuda
from tests.gpu_ops.search_cases import (
    cases,
    np_hamming_topk,
    np_tanimoto,
    np_tanimoto_threshold,
    np_tanimoto_topk,
    random_rows,
)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_popcount_any_leading_shape(device: str) -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (2, 3, 9), dtype=np.uint8)
    x = torch.from_numpy(a).to(device)
    got = gpu_ops.popcount(x)
    assert got.dtype == torch.int32
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(_np(got), np.unpackbits(a, axis=-1).sum(-1))
    np.testing.assert_array_equal(  # a transposed (non-contiguous) view
        _np(gpu_ops.popcount(x.transpose(0, 1))), np.unpackbits(a, axis=-1).sum(-1).T
    )
    assert gpu_ops.popcount(x[:, :, :0]).tolist() == [[0, 0, 0], [0, 0, 0]]
    one = gpu_ops.popcount(x[0, 0])  # a single row: a 0-d count
    assert one.shape == ()
    assert one.item() == int(np.unpackbits(a[0, 0]).sum())
    assert gpu_ops.popcount(torch.zeros(0, 4, dtype=torch.uint8, device=device)).shape == (0,)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_free_functions_and_packed_corpus_match_numpy(device: str) -> None:
    for label, q, c in cases(7):
        qt, ct = torch.from_numpy(q).to(device), torch.from_numpy(c).to(device)
        index = gpu_ops.PackedCorpus(ct)
        k = min(5, c.shape[0] + 1)
        want_d, want_i = np_hamming_topk(q, c, k)
        for dist, idx in (gpu_ops.hamming_topk(qt, ct, k), index.hamming_topk(qt, k)):
            np.testing.assert_array_equal(_np(idx), want_i, err_msg=label)
            np.testing.assert_array_equal(_np(dist), want_d, err_msg=label)
        for thr in (0.0, 0.4):
            want_s, want_i = np_tanimoto_topk(q, c, k, thr)
            for sims, idx in (
                gpu_ops.tanimoto_topk(qt, ct, k, thr),
                gpu_ops.tanimoto_topk(qt, ct, k, thr, corpus_popcounts=gpu_ops.popcount(ct)),
                index.tanimoto_topk(qt, k, thr),
            ):
                np.testing.assert_array_equal(_np(idx), want_i, err_msg=label)
                np.testing.assert_array_equal(_np(sims), want_s, err_msg=label)
            want = np_tanimoto_threshold(q, c, thr)
            for got in (gpu_ops.tanimoto_threshold(qt, ct, thr), index.tanimoto_threshold(qt, thr)):
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(_np(g), w, err_msg=label)


def test_reference_matches_numpy() -> None:
    for label, q, c in cases(11):
        qt, ct = torch.from_numpy(q), torch.from_numpy(c)
        np.testing.assert_array_equal(
            _reference.tanimoto_reference(qt, ct).numpy(), np_tanimoto(q, c)
        )
        for got, want in zip(
            _reference.hamming_topk_reference(qt, ct, 4), np_hamming_topk(q, c, 4), strict=True
        ):
            np.testing.assert_array_equal(got.numpy(), want, err_msg=label)
        for got, want in zip(
            _reference.tanimoto_topk_reference(qt, ct, 4, 0.3),
            np_tanimoto_topk(q, c, 4, 0.3),
            strict=True,
        ):
            np.testing.assert_array_equal(got.numpy(), want, err_msg=label)
        for got, want in zip(
            _reference.tanimoto_threshold_reference(qt, ct, 0.3),
            np_tanimoto_threshold(q, c, 0.3),
            strict=True,
        ):
            np.testing.assert_array_equal(got.numpy(), want, err_msg=label)


def test_documented_example_and_edge_values() -> None:
    corpus = torch.tensor([[0b1111_0000], [0b1000_0000], [0b1111_1111]], dtype=torch.uint8)
    queries = torch.tensor([[0b1100_0000]], dtype=torch.uint8)
    dist, idx = gpu_ops.hamming_topk(queries, corpus, k=4)
    assert dist.tolist() == [[1, 2, 6, -1]]
    assert idx.tolist() == [[1, 0, 2, -1]]
    sims, idx = gpu_ops.tanimoto_topk(queries, corpus, k=4, threshold=0.3)
    assert sims.tolist() == [[0.5, 0.5, 0.0, 0.0]]
    assert idx.tolist() == [[0, 1, -1, -1]]
    # 7 of 10 bits shared: exactly 0.7 in float32 passes threshold 0.7.
    q = torch.tensor([[0xFF, 0b1100_0000]], dtype=torch.uint8)  # 10 bits
    c = torch.tensor([[0xFE, 0]], dtype=torch.uint8)  # 7 bits, all shared
    offsets, idx, sims = gpu_ops.tanimoto_threshold(q, c, 0.7)
    assert offsets.tolist() == [0, 1]
    assert idx.tolist() == [0]
    assert sims.tolist() == [np.float32(0.7)]


def test_non_contiguous_inputs() -> None:
    rng = np.random.default_rng(3)
    q = random_rows(rng, 4, 9, "sparse")
    c = random_rows(rng, 30, 9, "sparse")
    qt = torch.from_numpy(np.ascontiguousarray(q.T)).t()  # column-major
    ct = torch.from_numpy(np.repeat(c, 2, axis=0))[::2]  # every other row
    assert not qt.is_contiguous()
    assert not ct.is_contiguous()
    for got, want in zip(
        gpu_ops.tanimoto_topk(qt, ct, 6), np_tanimoto_topk(q, c, 6, 0.0), strict=True
    ):
        np.testing.assert_array_equal(_np(got), want)
    for got, want in zip(gpu_ops.hamming_topk(qt, ct, 6), np_hamming_topk(q, c, 6), strict=True):
        np.testing.assert_array_equal(_np(got), want)
    index = gpu_ops.PackedCorpus(ct)
    for got, want in zip(
        index.tanimoto_threshold(qt, 0.2), np_tanimoto_threshold(q, c, 0.2), strict=True
    ):
        np.testing.assert_array_equal(_np(got), want)


def test_packed_corpus_attributes() -> None:
    c = torch.randint(0, 256, (10, 12), dtype=torch.uint8)
    index = gpu_ops.PackedCorpus(c)
    assert (index.num_rows, index.width_bytes, index.device) == (10, 12, torch.device("cpu"))
    assert index.nbytes == 10 * 12 + 10 * 4 + 10 * 8
    pcs = gpu_ops.popcount(c)
    assert torch.equal(pcs[index.order], pcs[index.order].sort().values)
    assert "num_rows=10" in repr(index)


U8 = torch.zeros(2, 4, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: gpu_ops.popcount(torch.zeros(3, dtype=torch.int32)), TypeError, "uint8"),
        (lambda: gpu_ops.popcount(torch.tensor(3, dtype=torch.uint8)), ValueError, "dimension"),
        (lambda: gpu_ops.popcount([1, 2]), TypeError, "torch.Tensor"),
        (lambda: gpu_ops.hamming_topk(U8.float(), U8, 1), TypeError, "queries must be a uint8"),
        (lambda: gpu_ops.hamming_topk(U8, U8.int(), 1), TypeError, "corpus must be a uint8"),
        (
            lambda: gpu_ops.hamming_topk(U8, U8[:, :3], 1),
            ValueError,
            "4 bytes per row, the corpus 3",
        ),
        (lambda: gpu_ops.hamming_topk(U8[0], U8, 1), ValueError, "queries must be 2-D"),
        (lambda: gpu_ops.hamming_topk(U8, U8[:, :0], 1), ValueError, "0 bytes"),
        (lambda: gpu_ops.hamming_topk(U8, U8, 0), ValueError, "k must be at least 1"),
        (lambda: gpu_ops.hamming_topk(U8, U8, 1.5), TypeError, "k must be an int"),
        (
            lambda: gpu_ops.tanimoto_topk(U8, U8, 2, 1.5),
            ValueError,
            r"threshold must be in \[0, 1\]",
        ),
        (lambda: gpu_ops.tanimoto_topk(U8, U8, 2, -0.1), ValueError, "threshold"),
        (lambda: gpu_ops.tanimoto_topk(U8, U8, 2, float("nan")), ValueError, "threshold"),
        (lambda: gpu_ops.tanimoto_topk(U8, U8, 2, "0.5"), TypeError, "threshold must be a number"),
        (lambda: gpu_ops.tanimoto_threshold(U8, U8, 2.0), ValueError, "threshold"),
        (
            lambda: gpu_ops.tanimoto_threshold(U8, U8, 0.5, corpus_popcounts=torch.zeros(3)),
            TypeError,
            "integer",
        ),
        (
            lambda: gpu_ops.tanimoto_topk(
                U8, U8, 1, corpus_popcounts=torch.zeros(3, dtype=torch.int32)
            ),
            ValueError,
            r"shape \(2,\)",
        ),
        (lambda: gpu_ops.PackedCorpus(U8.bool()), TypeError, "uint8"),
        (lambda: gpu_ops.PackedCorpus(U8).hamming_topk(U8[:, :2], 1), ValueError, "bytes per row"),
        (lambda: gpu_ops.PackedCorpus(U8).tanimoto_topk(U8, 0), ValueError, "k must be"),
        (lambda: gpu_ops.PackedCorpus(U8).tanimoto_threshold(U8, 7), ValueError, "threshold"),
    ],
)
def test_bad_arguments(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def _opcheck_cases(device: str) -> list[tuple[Any, tuple[Any, ...]]]:
    rng = np.random.default_rng(0)
    q = torch.from_numpy(random_rows(rng, 3, 9, "sparse")).to(device)
    c = torch.from_numpy(random_rows(rng, 12, 9, "sparse")).to(device)
    pcs = gpu_ops.popcount(c)
    ids = torch.arange(12, device=device).flip(0)
    return [
        (_search_ops.popcount, (c,)),
        (_search_ops.popcount, (c.t().contiguous().t(),)),
        (_search_ops.hamming_topk, (q, c, None, 4)),
        (_search_ops.hamming_topk, (q, c, ids, 15)),
        (_search_ops.tanimoto_topk, (q, c, pcs, None, 5, 0.1, False)),
        (_search_ops.tanimoto_topk, (q, c, pcs, ids, 20, 0.0, False)),
        (_search_ops.tanimoto_threshold, (q, c, pcs, None, 0.1, False)),
        (_search_ops.tanimoto_threshold, (q, c, pcs, ids, 0.9, False)),
    ]


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_opcheck(device: str) -> None:
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op.overload, args)


def test_default_kernels_match_the_cpu_kernels() -> None:
    for op, args in _opcheck_cases("cpu"):
        fast, slow = op(*args), op.kernels[None](*args)
        fast = fast if isinstance(fast, tuple) else (fast,)
        slow = slow if isinstance(slow, tuple) else (slow,)
        for a, b in zip(fast, slow, strict=True):
            assert torch.equal(a, b), op.name


@st.composite
def search_inputs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, float]:
    width = draw(st.integers(1, 40))
    Q, N = draw(st.integers(1, 4)), draw(st.integers(1, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["dense", "sparse", "dupes"]))
    q, c = random_rows(rng, Q, width, kind), random_rows(rng, N, width, kind)
    return q, c, draw(st.integers(1, N + 3)), draw(st.sampled_from([0.0, 0.1, 1 / 3, 0.5, 1.0]))


@settings(max_examples=40, deadline=None)
@given(inputs=search_inputs())
def test_hypothesis_against_numpy(inputs: tuple[np.ndarray, np.ndarray, int, float]) -> None:
    q, c, k, thr = inputs
    qt, ct = torch.from_numpy(q), torch.from_numpy(c)
    index = gpu_ops.PackedCorpus(ct)
    for got, want in zip(index.hamming_topk(qt, k), np_hamming_topk(q, c, k), strict=True):
        np.testing.assert_array_equal(_np(got), want)
    for got, want in zip(
        index.tanimoto_topk(qt, k, thr), np_tanimoto_topk(q, c, k, thr), strict=True
    ):
        np.testing.assert_array_equal(_np(got), want)
    for got, want in zip(
        gpu_ops.tanimoto_threshold(qt, ct, thr), np_tanimoto_threshold(q, c, thr), strict=True
    ):
        np.testing.assert_array_equal(_np(got), want)


def test_kernels_are_registered_per_device() -> None:
    for name in ("popcount", "hamming_topk", "tanimoto_topk", "tanimoto_threshold"):
        qual = f"bitserve::{name}"
        for key in ("CPU", "Meta", "CompositeExplicitAutograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), (name, key)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA") == HAS_TRITON, name
