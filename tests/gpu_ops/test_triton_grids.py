"""Triton launch grids of the resample kernels stay launchable for long A and B.

CUDA caps grid axes 1 and 2 at 65535 blocks; the kernels use one flat axis (2**31 - 1).
The launchers run on meta tensors with the kernels replaced by recorders: nothing is
allocated or computed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_ops import responses
from tests.common_utils import needs_triton

pytestmark = needs_triton


class _Recorder:
    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def _assert_launchable(grids: list[tuple[int, ...]]) -> None:
    assert grids
    for grid in grids:
        assert grid[0] < 2**31
        assert all(g <= 65535 for g in grid[1:]), grid


@pytest.mark.parametrize(("M", "A", "B"), [(1, 3_000_000, 5000), (70, 100, 5_000_000)])
def test_stored_band_grids(monkeypatch: pytest.MonkeyPatch, M: int, A: int, B: int) -> None:
    from gpu_ops._triton import resample as tr

    rec = _Recorder()
    for name in ("_forward_kernel", "_backward_f_kernel", "_backward_w_kernel"):
        monkeypatch.setattr(tr, name, rec)
    N, W = 2, 40
    f = torch.empty(M, N, B, device="meta")
    g = torch.empty(M, N, A, device="meta")
    starts = torch.empty(N, A, dtype=torch.int32, device="meta")
    weights = torch.empty(N, A, W, device="meta")
    tr.forward(f, starts, weights)
    tr.backward_f(g, starts, weights, B, True)
    tr.backward_w(g, f, starts, W)
    assert len(rec.grids) == 3
    _assert_launchable(rec.grids)


@pytest.mark.parametrize(("M", "A", "B"), [(1, 3_000_000, 5000), (70, 100, 5_000_000)])
def test_on_the_fly_grids(monkeypatch: pytest.MonkeyPatch, M: int, A: int, B: int) -> None:
    from gpu_ops._triton import resample_otf as ko

    rec = _Recorder()
    for name in ("_forward_kernel", "_grad_cp_kernel", "_grad_f_kernel"):
        monkeypatch.setattr(ko, name, rec)
    N = 2
    geo = ko.prepare(
        torch.empty(B, dtype=torch.float64, device="meta"),
        torch.empty(N, A, device="meta"),
        responses.KernelResponse("gaussian", torch.tensor(1.0)),
        4.0,  # the window lo <= c - x <= hi: four sigmas either side
    )
    f = torch.empty(M, N, B, device="meta")
    g = torch.empty(M, N, A, device="meta")
    ko.forward(f, geo)
    ko.grad_f(g, geo, B)
    ko.grad_c_param(f, g, geo)
    assert len(rec.grids) == 3
    _assert_launchable(rec.grids)


@pytest.mark.parametrize("block", [1, 7, 64])
def test_window_block_ranges_match_brute_force(block: int) -> None:
    """[lo, hi) holds exactly the windows that reach each fine block (sorted windows)."""
    from gpu_ops._triton._launch import window_block_ranges

    gen = torch.Generator().manual_seed(11)
    N, A, B = 3, 40, 150
    first = torch.sort(torch.randint(-5, B + 5, (N, A), generator=gen), dim=1).values
    widths = torch.randint(0, 9, (N, A), generator=gen)
    end = torch.cummax(first + widths, dim=1).values  # non-decreasing, as for sorted c
    first, end = first.to(torch.int32), end.to(torch.int32)
    lo, hi = window_block_ranges(first, end, B, block)
    nblk = -(-B // block)
    assert lo.shape == hi.shape == (N, nblk)
    assert lo.dtype == hi.dtype == torch.int32
    for n in range(N):
        for k in range(nblk):
            b0 = k * block
            reach = [a for a in range(A) if end[n, a] > b0 and first[n, a] < b0 + block]
            assert list(range(int(lo[n, k]), int(hi[n, k]))) == reach, (n, k)
