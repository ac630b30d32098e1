"""The on-the-fly event path on a lattice (gpu_ops._lattice): which grids are one, and the
kernel (compiled C, and its plain-torch reference) against the float64 dense reference on
fresh random bits, baked and walking, for every named response and a table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_ops import OnTheFlyResampler, _lattice, packbits
from gpu_ops._bits_resample import choose
from tests.gpu_ops.resample_cases import RESPONSES, assert_close, dense_ref, seed

TABLE = (
    torch.tensor([-3.0, -0.7, 0.0, 1.1, 4.5], dtype=torch.float64),
    torch.tensor([0.3, 0.9, 1.0, -0.2, 0.4], dtype=torch.float64),
)


def _lattice_grid(
    B: int, step: int, dx: float, gen: torch.Generator, N: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """x = x0 + b dx, and per row coarse points step fine points apart from their own c0 (two
    rows share one, a third sits another fraction of a fine step off), past both ends."""
    x0 = float(torch.rand((), generator=gen)) * 10 - 5
    x = x0 + torch.arange(B, dtype=torch.float64) * dx
    A = B // step + 4
    # Off the fine points, so that no offset c - x falls on a cut (a tie the dense reference
    # could round the other way).
    starts = torch.tensor([-2 * step + 0.25, -2 * step + 0.25, -2 * step + 0.62])[:N] * dx + x0
    c = starts[:, None].double() + torch.arange(A, dtype=torch.float64) * (step * dx)
    return x, c


def _bits(M: int, N: int, B: int, density: float, gen: torch.Generator) -> torch.Tensor:
    bits = torch.rand(M, N, B, generator=gen) < density
    bits[0, 0], bits[0, 1] = False, True  # an empty row, a full row
    bits[1, 0], bits[1, 1] = False, False
    bits[1, 0, 0] = bits[1, 1, -1] = True  # one event at either edge
    return bits


def _interp(d: torch.Tensor) -> torch.Tensor:
    """TABLE at offsets d (float64), linear between its points, 0 outside (NumPy)."""
    xs, ys = (t.numpy() for t in TABLE)
    return torch.from_numpy(np.interp(d.numpy(), xs, ys, left=0.0, right=0.0))


@pytest.fixture(params=["c", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setenv("BITSERVE_CPU_KERNELS", "0")
    return str(request.param)


def _geometry_lattice(op: OnTheFlyResampler) -> _lattice.Lattice:
    """The lattice op's event path uses (found with the C kernels present)."""
    with torch.no_grad():
        lat = op._geometry().lattice
    assert lat is not None
    return lat


@pytest.mark.parametrize("name", [*sorted(RESPONSES), "tabulated"])
@pytest.mark.parametrize("density", [0.0, 0.004, 0.1, 0.6])
def test_the_lattice_kernel_matches_the_float64_reference(
    kernels: str, name: str, density: float
) -> None:
    gen = torch.Generator().manual_seed(seed("lattice", kernels, name, density))
    step = int(torch.randint(1, 9, (1,), generator=gen))
    dx = 0.05 + float(torch.rand((), generator=gen))
    B = 8 * int(torch.randint(20, 40, (1,), generator=gen)) + 3  # a part-padded last byte
    x, c = _lattice_grid(B, step, dx, gen)
    if name == "tabulated":  # the table in units of the fine step
        op = OnTheFlyResampler(x, c, (TABLE[0] * dx, TABLE[1]))
        r0 = _interp
    else:  # the response's widths of a few fine steps
        params, r0 = RESPONSES[name]
        op = OnTheFlyResampler(x, c, name, **{k: v * dx for k, v in params.items()})

    def r(d: torch.Tensor) -> torch.Tensor:
        return r0(d / dx)

    if kernels == "torch":  # the module found its lattice with the C kernels; find it here
        with torch.no_grad():
            geo = op._geometry()
            resp = op._kernel()
            lat = _lattice.find(op.x, geo.c, geo.first, geo.last, resp, resp.window(op.support))
            assert lat is not None
    else:
        lat = _geometry_lattice(op)
        geo = op._geometry()
    assert lat.tables.shape[1] == step
    assert lat.tables.shape[0] == 2  # rows 0 and 1 share their offset
    assert lat.tid.tolist() == [0, 0, 1]
    bits = _bits(3, 3, B, density, gen)
    ref = dense_ref(x, c, r, bits.double())
    for bitorder in ("big", "little"):
        packed = packbits(bits, dim=-1, bitorder=bitorder)
        for walk in (False, True):  # walking the exact windows is right for any tables
            got = torch.ops.bitserve.events_lattice_forward(
                packed, geo.first, geo.last, lat.tables, lat.tid, lat.jmin, walk, B,
                bitorder == "big",
            )  # fmt: skip
            assert_close(got, ref, 1e-5)
    if kernels == "c":
        with torch.no_grad():
            assert_close(op.forward_bits(packbits(bits, dim=-1), path="event"), ref, 1e-5)


def test_the_lattice_is_baked_unless_a_rounding_tips_a_window() -> None:
    """A boxcar of half-width 5 fine steps cuts exactly on the lattice: whether an offset
    c - x of exactly 0.5 counts depends on its rounding, which differs between coarse
    points; the tables then keep their values and each event walks the exact windows. A
    Laplacian cut at 5 fine steps counts such a tie whatever its rounding
    (responses.inclusive): its windows are the lattice's own."""
    B, dx, step = 400, 0.1, 10
    x = torch.arange(B, dtype=torch.float64) * dx
    c = (torch.arange(B // step, dtype=torch.float64) * (step * dx)).expand(2, -1).contiguous()
    gen = torch.Generator().manual_seed(3)
    bits = torch.rand(2, 2, B, generator=gen) < 0.3
    cases = (("boxcar", {"half_width": 0.5}, True), ("boxcar", {"half_width": 0.3}, False),
             ("laplacian", {"tau": 0.1}, False))  # fmt: skip
    for name, kw, walk in cases:
        support = 5.0 if name == "laplacian" else None
        op = OnTheFlyResampler(x, c, name, support, **kw)
        assert _geometry_lattice(op).walk is walk
        with torch.no_grad():
            ref = op(bits.float())
            assert_close(op.forward_bits(packbits(bits, dim=-1), path="event"), ref, 1e-6)


def test_grids_that_are_not_a_lattice() -> None:
    gen = torch.Generator().manual_seed(4)
    B, step, dx = 200, 4, 0.25
    x, c = _lattice_grid(B, step, dx, gen)
    resp = OnTheFlyResampler(x, c, "gaussian", sigma=0.5)._kernel()

    def found(x: torch.Tensor, c: torch.Tensor) -> bool:
        c = c.sort(dim=1).values
        first = torch.searchsorted(x, c - 2.0)
        last = torch.searchsorted(x, c + 2.0, side="right")
        return _lattice.find(x, c, first, last, resp, (-2.0, 2.0)) is not None

    assert found(x, c)
    assert found(x, c[:, :1])  # one coarse point: any offset is on a lattice
    uneven = x.clone()
    uneven[77] += 1e-6 * dx  # one fine point off by a millionth of a step
    assert not found(uneven, c)
    shifted = c.clone()
    shifted[2, 5:] += 1e-6 * dx  # one row's coarse points off the lattice
    assert not found(x, shifted)
    a = torch.arange(B // 3, dtype=torch.float64)
    assert not found(x, (x[0] + a * 2.5 * dx).expand(2, -1).contiguous())  # 2.5 steps apart
    assert found(x, (x[0] + 0.3 * dx + a * 3 * dx).expand(2, -1).contiguous())  # 3 apart
    rows = torch.stack([c[0], c[0] + 0.5 * step * dx])[:, :10]  # rows half a coarse step apart
    assert found(x, rows)  # the rows' coarse steps agree; their offsets differ
    mixed = torch.stack([c[0, :10], c[0, 0] + torch.arange(10).double() * 2 * step * dx])
    assert not found(x, mixed)


def test_float64_and_the_tables_size_cap_evaluate_per_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(5)
    x, c = _lattice_grid(300, 5, 0.1, gen)
    assert OnTheFlyResampler(x, c, "gaussian", sigma=0.3)._geometry().lattice is not None
    wide = OnTheFlyResampler(x, c, "gaussian", sigma=0.3, dtype=torch.float64)
    assert wide._geometry().lattice is None
    monkeypatch.setattr(_lattice, "MAX_TABLE_ITEMS", 10)
    assert OnTheFlyResampler(x, c, "gaussian", sigma=0.3)._geometry().lattice is None


def test_the_cost_model_takes_the_lattice_for_dense_spikes() -> None:
    """The demo of bench_elephant: 10% of 50,000 fine points, 500 coarse points 100 apart,
    a Gaussian of sigma 10 fine points to 2,000: the lattice's event path beats the band."""
    B, A, N = 50_000, 500, 20
    events = N * B // 10
    for width in (100.0, 1000.0, 20_000.0):
        plain = choose(events, N, B, A, width, on_the_fly=True, pieces=None)
        on_lattice = choose(events, N, B, A, width, on_the_fly=True, pieces=None, lattice=True)
        assert on_lattice.path == "event"
        assert on_lattice.costs["event"] < plain.costs["event"]


def test_the_module_event_path_on_a_lattice_equals_it_off_one() -> None:
    """forward_bits with the lattice against the same operator without (float64 module)."""
    gen = torch.Generator().manual_seed(6)
    x, c = _lattice_grid(800, 10, 1e-3, gen)
    kw = {"sigma": 0.004, "normalize": True, "border": "correct", "scale": 2.0}
    op = OnTheFlyResampler(x, c, "laplacian", **kw)  # type: ignore[arg-type]
    exact = OnTheFlyResampler(x, c, "laplacian", dtype=torch.float64, **kw)  # type: ignore[arg-type]
    bits = torch.rand(4, 3, 800, generator=gen) < 0.2
    packed = packbits(bits, dim=-1)
    with torch.no_grad():
        assert op.plan_bits(packed).path == "event"
        assert not _geometry_lattice(op).walk
        assert_close(op.forward_bits(packed), exact.forward_bits(packed), 1e-5)
