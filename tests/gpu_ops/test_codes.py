"""n-bit codes (``gpu_ops.codes``): decode and score against NumPy and float64 references,
on every kernel (C, torch, Triton interpreted on the CPU without a GPU), every code width and
bit order, lengths that leave a partial last byte."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gpu_ops
from gpu_ops import _codes_c, _codes_ops, _codes_torch
from tests.common_utils import HAS_TRITON, cpu_and_cuda, needs_triton

BITS = (1, 2, 4)
ORDERS = ("little", "big")


def _pack_np(codes: np.ndarray, bits: int, bitorder: str) -> np.ndarray:
    """NumPy reference packing: (..., L) codes -> (..., ceil(L * bits / 8)) uint8."""
    per = 8 // bits
    L = codes.shape[-1]
    nb = (L * bits + 7) // 8
    padded = np.zeros((*codes.shape[:-1], nb * per), np.uint8)
    padded[..., :L] = codes
    groups = padded.reshape(*codes.shape[:-1], nb, per).astype(np.uint32)
    c = np.arange(per)
    shift = 8 - bits * (c + 1) if bitorder == "big" else bits * c
    return (groups << shift).sum(-1).astype(np.uint8)


def _case(
    rng: np.random.Generator, bits: int, rows: int, L: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    codes = rng.integers(0, 1 << bits, (rows, L), dtype=np.uint8)
    table = rng.normal(size=1 << bits)
    table[rng.integers(0, 1 << bits)] = np.nan
    missing = rng.normal(size=L)
    expected = table[codes]
    expected = np.where(np.isnan(expected), missing, expected)
    return codes, table, missing, expected


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("L", [1, 7, 13, 64, 301])
def test_decode_matches_numpy(device: str, bits: int, bitorder: str, L: int) -> None:
    rng = np.random.default_rng(L * 10 + bits)
    codes, table, missing, expected = _case(rng, bits, 5, L)
    packed = torch.from_numpy(_pack_np(codes, bits, bitorder)).to(device)
    for dtype in (torch.float32, torch.float64):
        got = gpu_ops.decode_codes(packed, bits, L, table.tolist(), bitorder,
                                   torch.from_numpy(missing), dtype)  # fmt: skip
        assert got.dtype == dtype
        assert got.shape == (5, L)
        np.testing.assert_allclose(got.cpu().double().numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bitorder", ORDERS)
def test_decode_kernels_agree(bits: int, bitorder: str) -> None:
    """C and torch kernels on the same random input, a scalar missing value, leading dims."""
    rng = np.random.default_rng(bits)
    L = 37
    codes = rng.integers(0, 1 << bits, (2, 3, L), dtype=np.uint8)
    packed = torch.from_numpy(_pack_np(codes, bits, bitorder))
    table = torch.from_numpy(rng.normal(size=1 << bits))
    table[0] = math.nan
    miss = torch.tensor([0.25], dtype=torch.float64)
    expected = np.where(codes == 0, 0.25, table.numpy()[codes])
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        c = _codes_c.decode(packed, bits, L, table, bitorder, miss, dtype)
        t = _codes_torch.decode(packed, bits, L, table, bitorder, miss, dtype)
        assert c.dtype == t.dtype == dtype
        torch.testing.assert_close(c, t)
        tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6
        np.testing.assert_allclose(c.double().numpy(), expected, rtol=tol, atol=tol)


def test_decode_plink_example_and_nan_default() -> None:
    packed = torch.tensor([[0b11_10_01_00, 0b10]], dtype=torch.uint8)
    plink = [2.0, math.nan, 1.0, 0.0]
    got = gpu_ops.decode_codes(packed, 2, 5, plink, missing=0.5)
    assert got.tolist() == [[2.0, 0.5, 1.0, 0.0, 1.0]]
    got = gpu_ops.decode_codes(packed, 2, 5, plink)
    assert math.isnan(got[0, 1])
    assert got[0, 0] == 2.0


def test_decode_refuses_bad_arguments() -> None:
    packed = torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="code_bits must be one of"):
        gpu_ops.decode_codes(packed, 3, 8, [0.0] * 8)
    with pytest.raises(ValueError, match="table has 3 values; code_bits=2 needs 4"):
        gpu_ops.decode_codes(packed, 2, 12, [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="3 bytes; 13 codes of 2 bits take 4"):
        gpu_ops.decode_codes(packed, 2, 13, [0.0] * 4)
    with pytest.raises(ValueError, match="missing has 2 values"):
        gpu_ops.decode_codes(packed, 2, 12, [0.0] * 4, missing=torch.zeros(2))
    with pytest.raises(TypeError, match="uint8"):
        gpu_ops.decode_codes(packed.int(), 2, 12, [0.0] * 4)
    with pytest.raises(ValueError, match="bitorder"):
        gpu_ops.decode_codes(packed, 2, 12, [0.0] * 4, bitorder="middle")


def _score_reference(codes: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """Decode then sum in float64: out[n, s] = sum_l tables[l, codes[n, l], s]."""
    L = codes.shape[1]
    values = tables[np.arange(L)[None, :], codes]  # (N, L, S)
    return values.sum(1)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("S", [1, 4, 5])
def test_score_matches_decode_then_sum(device: str, bits: int, bitorder: str, S: int) -> None:
    rng = np.random.default_rng(bits * 7 + S)
    N, L = 9, 203
    codes = rng.integers(0, 1 << bits, (N, L), dtype=np.uint8)
    tables = rng.normal(size=(L, 1 << bits, S))
    packed = torch.from_numpy(_pack_np(codes, bits, bitorder)).to(device)
    lut = gpu_ops.score_table(torch.from_numpy(tables).to(device), bits, bitorder)
    expected = _score_reference(codes, tables)
    got = gpu_ops.score_codes(packed, lut)
    np.testing.assert_allclose(got.cpu().numpy(), expected, rtol=1e-12, atol=1e-12)
    got32 = gpu_ops.score_codes(packed, lut.float())
    np.testing.assert_allclose(got32.cpu().double().numpy(), expected, rtol=1e-4, atol=1e-4)


def test_score_kernels_agree_on_strided_rows() -> None:
    """C and torch kernels, rows that are slices of a wider buffer."""
    rng = np.random.default_rng(3)
    wide = torch.from_numpy(rng.integers(0, 256, (40, 70), dtype=np.uint8))
    x = wide[::3, 5:65]
    lut = torch.from_numpy(rng.normal(size=(60, 256, 4)))
    torch.testing.assert_close(_codes_c.score(x, lut), _codes_torch.score(x, lut))
    torch.testing.assert_close(_codes_c.score(x, lut.float()), _codes_torch.score(x, lut.float()))


def test_score_equals_plink_style_matmul() -> None:
    """Weights times decoded dosages, means for missing codes: the decode-then-matmul answer."""
    rng = np.random.default_rng(5)
    N, L, S = 30, 50, 3
    codes = rng.integers(0, 4, (N, L), dtype=np.uint8)
    dosage = np.array([2.0, np.nan, 1.0, 0.0])
    means = rng.uniform(0, 2, L)
    w = rng.normal(size=(L, S))
    tables = np.where(np.isnan(dosage)[None, :, None], means[:, None, None],
                      dosage[None, :, None]) * w[:, None, :]  # fmt: skip
    packed = torch.from_numpy(_pack_np(codes, 2, "little"))
    lut = gpu_ops.score_table(torch.from_numpy(tables), 2)
    got = gpu_ops.score_codes(packed, lut).numpy()
    x = gpu_ops.decode_codes(packed, 2, L, dosage.tolist(), missing=torch.from_numpy(means),
                             dtype=torch.float64).numpy()  # fmt: skip
    np.testing.assert_allclose(got, x @ w, rtol=1e-12, atol=1e-12)


def test_score_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"lut must be \(3, 256, S\)"):
        gpu_ops.score_codes(torch.zeros(2, 3, dtype=torch.uint8), torch.zeros(4, 256, 1))
    with pytest.raises(ValueError, match=r"tables must be \(L, 4, S\)"):
        gpu_ops.score_table(torch.zeros(5, 3, 1), 2)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_opcheck(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (3, 4, 5), generator=gen, dtype=torch.uint8).to(device)
    table = torch.tensor([2.0, math.nan, 1.0, 0.0], dtype=torch.float64, device=device)
    miss = torch.rand(19, dtype=torch.float64, generator=gen).to(device)
    torch.library.opcheck(
        _codes_ops.decode_codes.overload, (x, 2, 19, table, "little", miss, torch.float32)
    )
    lut = torch.randn(5, 256, 3, generator=gen, dtype=torch.float64).to(device)
    torch.library.opcheck(_codes_ops.score_codes.overload, (x[0], lut))


def test_export_records_the_op() -> None:
    class Score(torch.nn.Module):
        def __init__(self, lut: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("lut", lut)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.bitserve.score_codes(x, self.lut)  # type: ignore[no-any-return]

    lut = torch.randn(4, 256, 2, dtype=torch.float64)
    x = torch.randint(0, 256, (3, 4), dtype=torch.uint8)
    ep = torch.export.export(Score(lut), (x,))
    assert "bitserve.score_codes" in str(ep.graph)
    torch.testing.assert_close(ep.module()(x), _codes_torch.score(x, lut))


if HAS_TRITON:
    from gpu_ops._triton import codes as triton_codes

# Interpreted kernels run on CPU tensors; compiled ones need CUDA tensors.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bitorder", ORDERS)
def test_triton_decode_matches_numpy(bits: int, bitorder: str) -> None:
    rng = np.random.default_rng(bits + 100)
    L = 21
    codes, table, missing, expected = _case(rng, bits, 3, L)
    packed = torch.from_numpy(_pack_np(codes, bits, bitorder)).to(TRITON_DEVICE)
    tab = torch.from_numpy(table).to(TRITON_DEVICE)
    for miss, want in ((torch.from_numpy(missing), expected),
                       (torch.tensor([0.5], dtype=torch.float64),
                        np.where(np.isnan(table[codes]), 0.5, table[codes]))):  # fmt: skip
        for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-15)):
            got = triton_codes.decode(packed, bits, L, tab, bitorder, miss.to(TRITON_DEVICE),
                                      dtype)  # fmt: skip
            assert got.dtype == dtype
            np.testing.assert_allclose(got.cpu().double().numpy(), want, rtol=tol)


@needs_triton
@pytest.mark.parametrize("bits", BITS)
def test_triton_score_matches_reference(bits: int) -> None:
    rng = np.random.default_rng(bits + 200)
    N, L, S = 5, 23, 3
    codes = rng.integers(0, 1 << bits, (N, L), dtype=np.uint8)
    tables = rng.normal(size=(L, 1 << bits, S))
    packed = torch.from_numpy(_pack_np(codes, bits, "little")).to(TRITON_DEVICE)
    lut = _codes_torch.byte_table(torch.from_numpy(tables), bits, "little").to(TRITON_DEVICE)
    got = triton_codes.score(packed, lut)
    np.testing.assert_allclose(got.cpu().numpy(), _score_reference(codes, tables), rtol=1e-10)


def test_c_kernels_split_over_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows split over several threads give the single thread's answer."""
    monkeypatch.setattr(_codes_c, "C_PARALLEL_MIN_BYTES", 0)
    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.integers(0, 256, (37, 29), dtype=np.uint8))
    table = torch.tensor([2.0, math.nan, 1.0, 0.0], dtype=torch.float64)
    miss = torch.from_numpy(rng.normal(size=115))
    lut = torch.from_numpy(rng.normal(size=(29, 256, 4)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        many = (_codes_c.decode(x, 2, 115, table, "little", miss, torch.float64),
                _codes_c.score(x, lut))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(many[0], _codes_torch.decode(x, 2, 115, table, "little", miss,
                                                            torch.float64))  # fmt: skip
    torch.testing.assert_close(many[1], _codes_torch.score(x, lut))
