"""The Triton bit kernels, called directly.

Without CUDA, conftest.py sets TRITON_INTERPRET=1 and these run on CPU tensors (small inputs:
the interpreter is slow); on a GPU host the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_ops.bits import UNPACK_DTYPES
from tests.common_utils import HAS_TRITON, needs_triton

pytestmark = needs_triton

if HAS_TRITON:
    from gpu_ops._triton import bits as kernels

# Interpreted kernels run on CPU tensors; compiled ones need CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected_unpack(a: np.ndarray, dim: int, count: int, bitorder: str) -> np.ndarray:
    expected = np.unpackbits(a, axis=dim, count=count, bitorder=bitorder)  # type: ignore[call-overload]
    return np.zeros_like(expected) if a.size == 0 else expected


@st.composite
def kernel_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int, str, bool, int]:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    dim = draw(st.integers(0, len(shape) - 1))
    count = draw(st.integers(0, 8 * shape[dim] + 10))
    return (
        shape,
        dim,
        count,
        draw(st.sampled_from(("big", "little"))),
        draw(st.booleans()),
        draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=40, deadline=None)
@given(case=kernel_cases(), dtype=st.sampled_from(UNPACK_DTYPES))
def test_unpack_kernel_matches_numpy(
    case: tuple[tuple[int, ...], int, int, str, bool, int], dtype: torch.dtype
) -> None:
    shape, dim, count, bitorder, strided, seed = case
    a = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    x = torch.from_numpy(a).to(DEVICE)
    if strided and x.dim() >= 2:  # a transposed view: no dim has stride 1 where expected
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    out_shape = list(shape)
    out_shape[dim] = count
    # ``out`` is an interior slice of a padded buffer, so every stride is "foreign".
    buf = torch.full([s + 2 for s in out_shape], 7, dtype=dtype, device=DEVICE)
    out = buf[tuple(slice(1, 1 + s) for s in out_shape)]
    target = out.view(torch.uint8) if dtype == torch.bool else out
    kernels.unpack_into(x, target, dim, bitorder)
    expected = _expected_unpack(a, dim, count, bitorder)
    np.testing.assert_array_equal(out.cpu().to(torch.float64).numpy(), expected)
    border = torch.ones_like(buf, dtype=torch.bool)
    border[tuple(slice(1, 1 + s) for s in out_shape)] = False
    assert bool((buf[border] == torch.full((), 7, dtype=dtype)).all())


@settings(max_examples=40, deadline=None)
@given(
    case=kernel_cases(),
    dtype=st.sampled_from((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)),
)
def test_pack_kernel_matches_numpy(
    case: tuple[tuple[int, ...], int, int, str, bool, int], dtype: torch.dtype
) -> None:
    shape, dim, _, bitorder, strided, seed = case
    a = np.random.default_rng(seed).integers(-2, 3, shape).astype(str(dtype)[6:])
    x = torch.from_numpy(a).to(DEVICE)
    if strided and x.dim() >= 2:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    expected = np.packbits(a, axis=dim, bitorder=bitorder)  # type: ignore[call-overload]
    out = torch.full(expected.shape, 7, dtype=torch.uint8, device=DEVICE)
    kernels.pack_into(x, out, dim, bitorder)
    np.testing.assert_array_equal(out.cpu().numpy(), expected)


def test_unpack_kernel_batch_buffer_column() -> None:
    """buf[:, k] of a (B, K, L) buffer, count mid-byte: the server's out= call."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (5, 4), dtype=torch.uint8, generator=gen)
    buf = torch.zeros(5, 3, 29, dtype=torch.bfloat16)
    out = buf.to(DEVICE)
    kernels.unpack_into(packed.to(DEVICE), out[:, 1], 1, "big")
    expected = np.unpackbits(packed.numpy(), axis=1, count=29)
    np.testing.assert_array_equal(out[:, 1].float().cpu().numpy(), expected)
    assert out[:, 0].count_nonzero() == 0
    assert out[:, 2].count_nonzero() == 0


def test_plan_collapses_and_falls_back() -> None:
    x = torch.zeros(2, 3, 4, 5, dtype=torch.uint8)
    out = torch.zeros(2, 3, 32, 5)
    assert kernels._plan(x, out, 2) == ((6, 20, 32 * 5), (5, 1, 1))
    # Packed dim last: the merged rows become the inner dim.
    assert kernels._plan(x, torch.zeros(2, 3, 4, 40), 3) == ((1, 0, 0), (24, 5, 40))
    # Outer dims that do not merge in ``out``, plus an inner dim: no plan.
    scattered = torch.zeros(2, 7, 3, 32, 5)[:, 2]
    assert kernels._plan(x, scattered.permute(1, 0, 2, 3), 2) is None
    # ... which unpack_into handles through a temporary.
    xr = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8).to(DEVICE)
    dst = torch.zeros(3, 2, 32, 5, device=DEVICE).permute(1, 0, 2, 3)
    kernels.unpack_into(xr, dst, 2, "little")
    expected = np.unpackbits(xr.cpu().numpy(), axis=2, bitorder="little")
    np.testing.assert_array_equal(dst.cpu().numpy(), expected)
