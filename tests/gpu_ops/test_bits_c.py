"""The compiled CPU unpack kernel (gpu_ops/_bits_c.c) against NumPy and the torch path."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_ops import _bits_c, _bits_torch, unpackbits
from gpu_ops._reference import unpackbits_reference
from gpu_ops.bits import UNPACK_DTYPES

BITORDERS = ("big", "little")


@pytest.fixture
def lib() -> object:
    lib = _bits_c.kernels()
    if lib is None:
        pytest.skip("no C compiler here (or BITSERVE_CPU_KERNELS=0)")
    return lib


@pytest.fixture(params=["one thread, cached stores", "threads, streamed stores"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Small inputs through both kernel variants: the thresholds are lowered to 0 so that
    threads split rows (and bytes inside rows) and non-temporal stores run, aligned or not."""
    if request.param.startswith("threads"):
        monkeypatch.setattr(_bits_c, "C_PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(_bits_c, "C_STREAM_MIN_BYTES", 0)
        threads = torch.get_num_threads()
        torch.set_num_threads(3)  # more threads than cores: uneven splits
        yield request.param
        torch.set_num_threads(threads)
    else:
        monkeypatch.setattr(_bits_c, "C_PARALLEL_MIN_BYTES", 1 << 62)
        monkeypatch.setattr(_bits_c, "C_STREAM_MIN_BYTES", 1 << 62)
        yield request.param


def _expected(x: torch.Tensor, dim: int, count: int | None, bitorder: str) -> np.ndarray:
    return np.unpackbits(x.numpy(), axis=dim, count=count, bitorder=bitorder)  # type: ignore[arg-type]


def _torch_path(
    x: torch.Tensor, dim: int, count: int | None, bitorder: str, dtype: torch.dtype
) -> torch.Tensor:
    shape = list(x.shape)
    n = 8 * shape[dim]
    shape[dim] = n if count is None else (count if count >= 0 else n + count)
    out = torch.empty(shape, dtype=dtype)
    target = out.view(torch.uint8) if dtype == torch.bool else out
    _bits_torch.unpack_into(x, target, dim, bitorder)
    return out


@pytest.mark.parametrize("dtype", UNPACK_DTYPES)
@pytest.mark.parametrize("bitorder", BITORDERS)
def test_c_kernel_matches_numpy_and_torch_path(
    lib: object, mode: str, dtype: torch.dtype, bitorder: str
) -> None:
    """Every dim, counts mid-byte / beyond 8n / negative, contiguous and strided inputs."""
    gen = torch.Generator().manual_seed(hash((str(dtype), bitorder, mode)) % 2**31)
    for x in (
        torch.randint(0, 256, (3, 7, 5), dtype=torch.uint8, generator=gen),
        torch.randint(0, 256, (6, 9, 11), dtype=torch.uint8, generator=gen)[::2, 1::2, ::3],
    ):
        for dim in range(-3, 3):
            n = x.shape[dim]
            for count in (None, 0, 1, 8 * n - 3, 8 * n + 9, -5, -8 * n):
                got = unpackbits(x, dim=dim, count=count, bitorder=bitorder, dtype=dtype)
                expected = _expected(x, dim, count, bitorder)
                assert np.array_equal(got.to(torch.float64).numpy(), expected), (dim, count)
                assert torch.equal(got, _torch_path(x, dim, count, bitorder, dtype))


@pytest.mark.parametrize("dtype", UNPACK_DTYPES)
def test_c_kernel_out_slices_of_a_batch_buffer(lib: object, mode: str, dtype: torch.dtype) -> None:
    """buf[i:j] and buf[:, k] of a (capacity, N, L) buffer: rows end mid-byte, rows start
    unaligned (L odd), and everything outside the slice keeps its sentinel."""
    gen = torch.Generator().manual_seed(5)
    capacity, N, L = 7, 3, 1001
    sentinel = 1 if dtype == torch.bool else 7
    for index in ((slice(2, 6),), (slice(None), 1), (slice(1, 2), slice(None, None, 2))):
        buf = torch.full((capacity, N, L), sentinel, dtype=dtype)
        view = buf[index]
        packed = torch.randint(0, 256, (*view.shape[:-1], 126), dtype=torch.uint8, generator=gen)
        result = unpackbits(packed, dim=-1, count=L, dtype=dtype, out=view)
        assert result.data_ptr() == view.data_ptr()
        expected = unpackbits_reference(packed, -1, L, "big", dtype)
        assert torch.equal(buf[index], expected)
        border = torch.ones(capacity, N, L, dtype=torch.bool)
        border[index] = False
        assert bool((buf[border] == sentinel).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.float64])
def test_c_kernel_scattered_outputs(lib: object, mode: str, dtype: torch.dtype) -> None:
    """Leading dims that do not collapse (transposed), a packed dim in the middle, and an
    output strided along the packed dim (the torch path takes that one)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(0, 256, (4, 5, 6), dtype=torch.uint8, generator=gen)
    for dim in range(3):
        expected = unpackbits_reference(x, dim, None, "little", dtype)
        # Transposed lead dims, packed dim last-and-contiguous in memory:
        base = torch.zeros(*reversed(expected.movedim(dim, -1).shape[:-1]), 8 * x.shape[dim])
        moved = base.to(dtype).transpose(0, 1)  # (*lead, L), lead dims swapped in memory
        out = moved.movedim(-1, dim)
        unpackbits(x, dim=dim, bitorder="little", dtype=dtype, out=out)
        assert torch.equal(out, expected)
        # Strided along the packed dim: every other element of a wider buffer.
        shape = list(expected.shape)
        shape[dim] *= 2
        wide = torch.zeros(shape, dtype=dtype)
        lead = (slice(None),) * dim
        strided = wide[(*lead, slice(0, None, 2))]
        unpackbits(x, dim=dim, bitorder="little", dtype=dtype, out=strided)
        assert torch.equal(strided, expected)
        assert not bool(wide[(*lead, slice(1, None, 2))].ne(0).any())


def test_c_kernel_large_reused_and_fresh_outputs(lib: object) -> None:
    """Above the real thresholds: threads and non-temporal stores (reused out=), and plain
    stores into a fresh result; both against NumPy."""
    gen = np.random.default_rng(7)
    a = gen.integers(0, 256, (5, (_bits_c.C_STREAM_MIN_BYTES // 4 + 5 * 8000) // 40), np.uint8)
    x = torch.from_numpy(a)
    expected = np.unpackbits(a, axis=-1, count=8 * a.shape[1] - 3)
    out = torch.full(expected.shape, -1.0)
    unpackbits(x, dim=-1, count=8 * a.shape[1] - 3, dtype=torch.float32, out=out)
    assert np.array_equal(out.numpy(), expected)
    fresh = unpackbits(x, dim=-1, count=8 * a.shape[1] - 3, dtype=torch.float32)
    assert np.array_equal(fresh.numpy(), expected)


def test_disabled_kernels_use_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """BITSERVE_CPU_KERNELS=0 at call time: no compiled kernel, same results."""
    monkeypatch.setenv("BITSERVE_CPU_KERNELS", "0")
    assert _bits_c.kernels() is None
    gen = torch.Generator().manual_seed(8)
    x = torch.randint(0, 256, (3, 13), dtype=torch.uint8, generator=gen)
    for dtype in UNPACK_DTYPES:
        got = unpackbits(x, dim=1, count=99, dtype=dtype, bitorder="little")
        assert torch.equal(got, unpackbits_reference(x, 1, 99, "little", dtype))


@pytest.mark.slow  # fresh processes and C builds: `make test` runs it, `make test-unit` not
def test_without_a_compiler_unpack_falls_back_with_a_warning(tmp_path: Path) -> None:
    """A fresh process with no usable compiler: a warning, the torch path, right answers."""
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from gpu_ops import _bits_c, unpackbits\n"
        "assert _bits_c.kernels() is None\n"
        "x = torch.tensor([[176, 255]], dtype=torch.uint8)\n"
        "print(unpackbits(x, dim=1, count=10, dtype=torch.float32).int().tolist())\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "BITSERVE_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": str(root),
        "CC": str(tmp_path / "no-such-compiler"),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[1, 0, 1, 1, 0, 0, 0, 0, 1, 1]]"
    assert "CPU bit kernels" in done.stderr
    assert "falling back to torch" in done.stderr
    assert not list((tmp_path / "cache").glob("*.so"))
