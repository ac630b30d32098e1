"""Triton launch grids of the resample kernels stay launchable for long A and B.

CUDA caps grid axes 1 and 2 at 65535 blocks; the kernels use one flat axis (2**31 - 1).
The launchers run on meta tensors with the kernels replaced by recorders: nothing is
allocated or computed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

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
        "gaussian",
        1.0,
        4.0,
    )
    f = torch.empty(M, N, B, device="meta")
    g = torch.empty(M, N, A, device="meta")
    ko.forward(f, geo)
    ko.grad_f(g, geo, B)
    ko.grad_c_param(f, g, geo)
    assert len(rec.grids) == 3
    _assert_launchable(rec.grids)
