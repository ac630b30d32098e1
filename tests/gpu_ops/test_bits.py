"""gpu_ops.packbits / unpackbits against NumPy, the plain-torch reference and each other."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu_ops
from gpu_ops import _bits_torch, packbits, unpackbits
from gpu_ops._reference import packbits_reference, unpackbits_reference
from gpu_ops.bits import UNPACK_DTYPES
from tests.common_utils import cpu_and_cuda

PACK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
BITORDERS = ("big", "little")
# Fewer examples where CUDA runs them too: each new layout there may compile a kernel variant.
SETTINGS = settings(max_examples=25 if torch.cuda.is_available() else 60, deadline=None)


def np_unpack(a: np.ndarray, dim: int | None, count: int | None, bitorder: Any) -> np.ndarray:
    """numpy.unpackbits, with zeros where NumPy leaves an empty input's padding uninitialised."""
    expected = np.unpackbits(a, axis=dim, count=count, bitorder=bitorder)
    return np.zeros_like(expected) if a.size == 0 else expected


def layout(a: np.ndarray, kind: str) -> torch.Tensor:
    """``a`` as a tensor: contiguous, strided (every other element of a bigger buffer) or
    permuted (a transposed view of a contiguous buffer)."""
    if kind == "strided" and a.ndim:
        big = np.zeros(tuple(2 * s + 1 for s in a.shape), dtype=a.dtype)
        view = tuple(slice(1, 1 + 2 * s, 2) for s in a.shape)
        big[view] = a
        return torch.from_numpy(big)[view]
    if kind == "permuted" and a.ndim >= 2:
        perm = list(range(a.ndim))[::-1]
        base = torch.from_numpy(np.ascontiguousarray(a.transpose(perm)))
        return base.permute(perm)  # inverse of a reversal is itself
    return torch.from_numpy(a.copy())


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=4)))
    ndim = len(shape)
    dims: list[int | None] = [None]
    if ndim:
        dims += list(range(-ndim, ndim))
    elif draw(st.booleans()):
        dims += [0, -1]  # NumPy treats a 0-d array as 1-D for these
    dim = draw(st.sampled_from(dims))
    n = int(np.prod(shape)) if dim is None else (shape[dim] if ndim else 1)
    count = draw(
        st.one_of(
            st.none(),
            st.just(0),
            st.integers(1, 8 * n + 12),
            st.integers(-8 * n, -1) if n else st.none(),
        )
    )
    return {
        "shape": shape,
        "dim": dim,
        "count": count,
        "bitorder": draw(st.sampled_from(BITORDERS)),
        "layout": draw(st.sampled_from(("contiguous", "strided", "permuted"))),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@pytest.mark.parametrize("device", cpu_and_cuda())
@SETTINGS
@given(case=cases(), dtype=st.sampled_from(UNPACK_DTYPES))
def test_unpackbits_matches_numpy(device: str, case: dict[str, Any], dtype: torch.dtype) -> None:
    a = np.random.default_rng(case["seed"]).integers(0, 256, case["shape"], dtype=np.uint8)
    x = layout(a, case["layout"]).to(device)
    dim, count, order = case["dim"], case["count"], case["bitorder"]
    got = unpackbits(x, dim=dim, count=count, bitorder=order, dtype=dtype)
    expected = np_unpack(a, dim, count, order)
    assert got.dtype == dtype
    assert got.device == x.device
    assert tuple(got.shape) == expected.shape
    np.testing.assert_array_equal(got.cpu().to(torch.float64).numpy(), expected)
    ref = unpackbits_reference(x, dim, count, order, dtype)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", cpu_and_cuda())
@SETTINGS
@given(case=cases(), dtype=st.sampled_from(PACK_DTYPES))
def test_packbits_matches_numpy(device: str, case: dict[str, Any], dtype: torch.dtype) -> None:
    rng = np.random.default_rng(case["seed"])
    a = rng.integers(-3, 4, case["shape"]).astype(str(dtype).removeprefix("torch."))
    x = layout(a, case["layout"]).to(device)
    dim, order = case["dim"], case["bitorder"]
    got = packbits(x, dim=dim, bitorder=order)
    expected = np.packbits(a, axis=dim, bitorder=order)
    assert got.dtype == torch.uint8
    assert tuple(got.shape) == expected.shape
    np.testing.assert_array_equal(got.cpu().numpy(), expected)
    assert torch.equal(got, packbits_reference(x, dim, order))


@pytest.mark.parametrize("device", cpu_and_cuda())
@SETTINGS
@given(case=cases(), dtype=st.sampled_from(UNPACK_DTYPES))
def test_pack_unpack_round_trip(device: str, case: dict[str, Any], dtype: torch.dtype) -> None:
    rng = np.random.default_rng(case["seed"])
    x = layout(rng.integers(0, 2, case["shape"]).astype(bool), case["layout"]).to(device)
    dim, order = case["dim"], case["bitorder"]
    n = x.numel() if dim is None else (x.shape[dim] if x.dim() else 1)
    back = unpackbits(packbits(x, dim, order), dim, count=n, bitorder=order, dtype=dtype)
    flat = x.reshape(-1) if dim is None or x.dim() == 0 else x
    assert torch.equal(back, flat.to(dtype))


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("dtype", UNPACK_DTYPES)
@pytest.mark.parametrize("bitorder", BITORDERS)
def test_unpackbits_larger_inputs_match_reference(
    device: str, dtype: torch.dtype, bitorder: str
) -> None:
    """Bigger inputs than hypothesis draws, in every dim, with mid-byte counts."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (3, 90, 5, 17), dtype=torch.uint8, generator=gen).to(device)
    for dim in range(-4, 4):
        n = x.shape[dim]
        for count in (None, 8 * n - 3, 8 * n + 9):
            got = unpackbits(x, dim=dim, count=count, bitorder=bitorder, dtype=dtype)
            assert torch.equal(got, unpackbits_reference(x, dim, count, bitorder, dtype))


@pytest.mark.parametrize("chunk", [1, 3, 8, 100])
@pytest.mark.parametrize("dtype", UNPACK_DTYPES)
def test_cpu_chunking(monkeypatch: pytest.MonkeyPatch, chunk: int, dtype: torch.dtype) -> None:
    """Tiny chunks of the torch path: pieces split along the byte axis and each leading dim."""
    monkeypatch.setenv("BITSERVE_CPU_KERNELS", "0")  # unpack through the chunked torch path
    monkeypatch.setattr(_bits_torch, "CPU_CHUNK_BYTES", chunk)
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (4, 3, 21), dtype=torch.uint8, generator=gen)
    for dim in range(3):
        for count in (None, 8 * x.shape[dim] - 5):
            got = unpackbits(x, dim=dim, count=count, bitorder="little", dtype=dtype)
            assert torch.equal(got, unpackbits_reference(x, dim, count, "little", dtype))
        bits = x > 100
        assert torch.equal(packbits(bits, dim), packbits_reference(bits, dim))


@pytest.mark.parametrize("dtype", PACK_DTYPES)
@pytest.mark.parametrize("bitorder", BITORDERS)
def test_torch_only_pack_path(dtype: torch.dtype, bitorder: str) -> None:
    """The multiply-and-shift pack (the CUDA path without Triton) on the CPU."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (5, 37, 3), generator=gen).to(dtype)
    for dim in range(3):
        ref = packbits_reference(x, dim, bitorder)
        out = torch.empty_like(ref)
        src = x.view(torch.uint8) if dtype == torch.bool else x
        _bits_torch.pack_into(src, out, dim, bitorder)
        assert torch.equal(out, ref)


# --- out= ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("dtype", UNPACK_DTYPES)
def test_out_batch_buffer_slices(device: str, dtype: torch.dtype) -> None:
    """The server's call: rows of L bits into slices of a (B, K, L + pad) batch buffer."""
    gen = torch.Generator().manual_seed(4)
    L = 45
    packed = torch.randint(0, 256, (3, (L + 7) // 8), dtype=torch.uint8, generator=gen)
    packed = packed.to(device)
    expected = unpackbits_reference(packed, -1, L, "big", dtype)
    views: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "rows buf[i:j, k, :L]": lambda t: t[2:5, 1, :L],
        "column buf[j, :3, 1:L+1]": lambda t: t[4, :3, 1 : L + 1],
        "transposed": lambda t: t[0, :L, :3].t(),
    }
    for name, view in views.items():
        buf = torch.full((6, 4, L + 3), 7, dtype=dtype, device=device)
        if name == "transposed":
            buf = torch.full((6, L + 3, 4), 7, dtype=dtype, device=device)
        out = view(buf)
        ret = unpackbits(packed, dim=-1, count=L, dtype=dtype, out=out)
        assert ret is out, name
        assert torch.equal(out, expected), name
        written = torch.zeros(buf.shape, dtype=torch.bool, device=device)
        view(written).fill_(True)
        sentinel = torch.full((), 7, dtype=dtype, device=device)
        assert bool((buf[~written] == sentinel).all()), f"{name}: wrote outside the slice"


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_out_in_a_middle_dim_and_a_scattered_layout(device: str) -> None:
    """``out`` whose dims do not merge into (outer, bits, inner), and a mid-axis unpack."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8, generator=gen).to(device)
    buf = torch.zeros(3, 2, 7, 4, 23, dtype=torch.float32, device=device)
    out = buf[1, :, 2:5, :, 3:].permute(0, 1, 2, 3)  # (2, 3, 4, 20): strides that do not merge
    unpackbits(x, dim=-1, count=20, dtype=torch.float32, out=out)
    assert torch.equal(out, unpackbits_reference(x, -1, 20, "big", torch.float32))
    assert buf[0].count_nonzero() == 0
    assert buf[2].count_nonzero() == 0
    buf2 = torch.zeros(2, 30, 4, 5, dtype=torch.bfloat16, device=device)
    out2 = buf2[:, 1:26]
    unpackbits(x, dim=1, count=25, bitorder="little", dtype=torch.bfloat16, out=out2)
    assert torch.equal(out2, unpackbits_reference(x, 1, 25, "little", torch.bfloat16))
    assert buf2[:, 0].count_nonzero() == 0
    assert buf2[:, 26:].count_nonzero() == 0


def test_out_errors() -> None:
    x = torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"out has shape \(2, 23\), expected \(2, 24\)"):
        unpackbits(x, dim=1, out=torch.empty(2, 23))
    with pytest.raises(
        ValueError, match=re.escape("out has dtype torch.float32, expected torch.uint8")
    ):
        unpackbits(x, dim=1, out=torch.empty(2, 24))
    with pytest.raises(ValueError, match="out is on meta, expected cpu"):
        unpackbits(x, dim=1, out=torch.empty(2, 24, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="expanded"):
        unpackbits(x, dim=1, out=torch.empty(1, 24, dtype=torch.uint8).expand(2, 24))
    with pytest.raises(TypeError, match=re.escape("out must be a torch.Tensor")):
        unpackbits(x, out=np.empty(24, np.uint8))  # type: ignore[arg-type]


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_out_overlapping_the_input_is_refused(device: str) -> None:
    buf = torch.zeros(64, dtype=torch.uint8, device=device)
    buf[:4] = torch.tensor([0b10110000, 1, 255, 0x5A], dtype=torch.uint8)
    x = buf[:4]
    before = buf.clone()
    for out in (buf[2:34], buf[:32], buf[3:35]):  # partial overlaps and the same start
        with pytest.raises(ValueError, match="overlaps the input"):
            unpackbits(x, out=out)
    f32 = torch.zeros(40, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="overlaps the input"):  # another dtype, same memory
        unpackbits(f32.view(torch.uint8)[100:104], dtype=torch.float32, out=f32[:32])
    with pytest.raises(ValueError, match="overlaps the input"):  # out ending inside x
        unpackbits(buf[40:44], out=buf[9:41])
    assert torch.equal(buf, before)  # nothing was written
    # A disjoint slice of the same storage is allowed, and right.
    out = buf[4:36]
    assert unpackbits(x, out=out) is out
    assert torch.equal(out, unpackbits_reference(before[:4], 0, 32, "big", torch.uint8))
    assert torch.equal(buf[:4], before[:4])
    assert torch.equal(buf[36:], before[36:])
    tail = f32[32:]  # bytes 128..160 of f32, x reads bytes 100..101
    unpackbits(f32.view(torch.uint8)[100:101], dtype=torch.float32, out=tail)
    assert torch.equal(tail, torch.zeros(8, device=device))


# --- edge cases and errors -----------------------------------------------------------------


def test_zero_dim_and_empty() -> None:
    assert packbits(torch.tensor(True)).tolist() == [128]
    assert packbits(torch.tensor(3), dim=-1, bitorder="little").tolist() == [1]
    assert unpackbits(torch.tensor(5, dtype=torch.uint8), dim=0).tolist() == [
        0,
        0,
        0,
        0,
        0,
        1,
        0,
        1,
    ]
    assert unpackbits(torch.tensor(5, dtype=torch.uint8), count=-5).tolist() == [0, 0, 0]
    empty = torch.zeros(0, 3, dtype=torch.uint8)
    assert unpackbits(empty, dim=1).shape == (0, 24)
    assert packbits(empty.bool(), dim=0).shape == (0, 3)
    # NumPy leaves these uninitialised; ours are zeros.
    assert unpackbits(empty, count=5, dtype=torch.float32).tolist() == [0.0] * 5
    assert unpackbits(torch.zeros(2, 0, dtype=torch.uint8), dim=1, count=3).count_nonzero() == 0


def test_count_semantics() -> None:
    x = torch.tensor([0b10110001, 0b11000000], dtype=torch.uint8)
    assert unpackbits(x, count=3).tolist() == [1, 0, 1]
    assert unpackbits(x, count=10).tolist() == [1, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert unpackbits(x, count=-14).tolist() == [1, 0]
    assert unpackbits(x, count=18).tolist()[16:] == [0, 0]
    assert unpackbits(x, count=np.int64(2)).tolist() == [1, 0]
    assert unpackbits(x, count=0).shape == (0,)
    assert unpackbits(x, count=3, bitorder="little").tolist() == [1, 0, 0]


def test_input_type_errors() -> None:
    with pytest.raises(TypeError, match="packbits expects a bool or integer tensor, got dtype"):
        packbits(torch.zeros(8))
    with pytest.raises(
        TypeError, match=re.escape("unpackbits expects a uint8 tensor, got dtype torch.int8")
    ):
        unpackbits(torch.zeros(8, dtype=torch.int8))
    with pytest.raises(TypeError, match=re.escape("expects a torch.Tensor, got ndarray")):
        unpackbits(np.zeros(3, np.uint8))  # type: ignore[arg-type]
    x = torch.zeros(4, dtype=torch.uint8)
    for bad in (True, 2.0, "3"):
        with pytest.raises(TypeError, match="count must be an int"):
            unpackbits(x, count=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dim must be an int, got float"):
        packbits(x, dim=0.0)  # type: ignore[arg-type]


def test_value_errors() -> None:
    x = torch.zeros(2, 3, dtype=torch.uint8)
    for bad in ("LITTLE", "l", None):
        with pytest.raises(ValueError, match="bitorder must be 'big' or 'little', got"):
            unpackbits(x, bitorder=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bitorder must be 'big' or 'little'"):
            packbits(x, bitorder=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dim 2 is out of range .* \(expected -2 <= dim < 2\)"):
        unpackbits(x, dim=2)
    with pytest.raises(ValueError, match="dim -3 is out of range"):
        packbits(x, dim=-3)
    with pytest.raises(ValueError, match="dim 1 is out of range for a tensor with 0 dim"):
        packbits(torch.tensor(1), dim=1)
    with pytest.raises(ValueError, match="count=-25 asks to drop more bits than the 24"):
        unpackbits(x, dim=1, count=-25)
    with pytest.raises(ValueError, match="dtype must be one of uint8, bool, float16"):
        unpackbits(x, dtype=torch.int32)


def test_public_names() -> None:
    assert gpu_ops.packbits is packbits
    assert gpu_ops.unpackbits is unpackbits
    assert {"packbits", "unpackbits"} <= set(gpu_ops.__all__)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.bfloat16, torch.float16])
def test_large_cpu_results(dtype: torch.dtype) -> None:
    """Results past the huge-page threshold (allocated through NumPy) are ordinary tensors."""
    a = np.random.default_rng(6).integers(0, 256, (512, 1024), dtype=np.uint8)
    got = unpackbits(torch.from_numpy(a), dim=1, count=8000, bitorder="little", dtype=dtype)
    assert got.dtype == dtype
    assert got.shape == (512, 8000)
    assert got.is_contiguous()
    expected = np.unpackbits(a, axis=1, count=8000, bitorder="little")
    np.testing.assert_array_equal(got.to(torch.float64).numpy(), expected)
    got.add_(1) if dtype != torch.bool else got.logical_not_()  # writable, owns its memory


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_packbits_unsigned_wide_ints(device: str, dtype: torch.dtype) -> None:
    """torch's newer unsigned dtypes take the torch-only path on the CPU."""
    a = np.random.default_rng(7).integers(0, 3, (4, 19)).astype(str(dtype).removeprefix("torch."))
    x = torch.from_numpy(a).to(device)
    for dim in (None, 0, 1):
        expected = np.packbits(a, axis=dim)
        np.testing.assert_array_equal(packbits(x, dim=dim).cpu().numpy(), expected)
