"""A tabulated response on the fly: every kernel (C, torch, Triton interpreted) and every
``forward_bits`` path against the float64 dense reference on fresh random tables.

A table is ``(xs, ys)``: K breakpoints, strictly increasing, and the response's values there,
linear in between and zero outside ``[xs[0], xs[-1]]``. The reference interpolates with
NumPy (``np.interp``) on the dense float64 ``T = r(c - x)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_ops import BandedResampler, OnTheFlyResampler, packbits, responses
from tests.common_utils import cpu_and_cuda, needs_triton
from tests.gpu_ops.resample_cases import RESPONSES, assert_close, coarse, dense_ref, grid, seed

Table = tuple[torch.Tensor, torch.Tensor]


def _table(gen: torch.Generator, K: int | None = None, negative: bool = True) -> Table:
    """A random table: K (2-30) irregular breakpoints over an asymmetric span around 0,
    values in [-0.3, 1] (or [0, 1]) that do not vanish at the ends."""
    K = K or int(torch.randint(2, 31, (1,), generator=gen))
    steps = torch.rand(K - 1, generator=gen, dtype=torch.float64) + 0.05
    xs = torch.cat([torch.zeros(1, dtype=torch.float64), steps.cumsum(0)])
    xs = xs / xs[-1] * (3 + 6 * float(torch.rand((), generator=gen))) - 2.5
    ys = torch.rand(K, generator=gen, dtype=torch.float64)
    if negative:
        ys = ys * 1.3 - 0.3
    return xs, ys


def _interp(table: Table) -> Callable[[torch.Tensor], torch.Tensor]:
    """The table as the reference evaluates it: np.interp, zero outside its ends."""
    xs, ys = (t.double().numpy() for t in table)

    def r(d: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.interp(d.numpy(), xs, ys, left=0.0, right=0.0))

    return r


def _interp_torch(table: Table, d: torch.Tensor) -> torch.Tensor:
    """The same, differentiable in d (float64): for autograd's gradient with respect to c."""
    xs, ys = table
    i = torch.bucketize(d.detach(), xs, right=True).clamp(1, xs.numel() - 1)
    t = (d - xs[i - 1]) / (xs[i] - xs[i - 1])
    val = ys[i - 1] + (ys[i] - ys[i - 1]) * t
    return torch.where((d >= xs[0]) & (d <= xs[-1]), val, torch.zeros_like(val))


def _problem(key: object, B: int = 300, A: int = 40) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed("table", key))
    x, c = grid(B, gen), coarse(2, A, gen) * 0.2 + 40  # windows of many fine points
    xs, ys = _table(gen)
    return x, c, xs, ys, torch.randn(3, 2, B, generator=gen, dtype=torch.float64)


@pytest.fixture(params=["c", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU kernels: the compiled C ones (where built) or the torch ones."""
    if request.param == "torch":
        monkeypatch.setenv("BITSERVE_CPU_KERNELS", "0")
    return str(request.param)


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradients_match_the_dense_reference(
    kernels: str, case: int, dtype: torch.dtype
) -> None:
    x, c, xs, ys, f = _problem((kernels, case, dtype))
    g = torch.randn(3, 2, 40, generator=torch.Generator().manual_seed(case), dtype=torch.float64)
    op = OnTheFlyResampler(x, c, (xs, ys), dtype=dtype, trainable=True)
    assert op.table is not None
    assert op.table.dtype == dtype
    fr = f.to(dtype, copy=True).requires_grad_()
    out = op(fr)
    (out * g.to(dtype)).sum().backward()
    # The reference: autograd through the dense float64 T of the table as given.
    c_ = c.clone().requires_grad_()
    f_ = f.clone().requires_grad_()
    T = _interp_torch((xs, ys), c_[..., None] - x)
    ref = torch.einsum("nab,mnb->mna", T, f_)
    ref_f, ref_c = torch.autograd.grad(ref, (f_, c_), g)
    assert_close(ref.detach(), dense_ref(x, c, _interp((xs, ys)), f), 1e-12)  # the two agree
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    assert_close(out.detach(), ref.detach(), rtol)
    assert fr.grad is not None
    assert op.c.grad is not None
    assert_close(fr.grad, ref_f, rtol)
    assert_close(op.c.grad, ref_c, 10 * rtol)


def test_the_table_gets_no_gradient() -> None:
    x, c, xs, ys, f = _problem("grad")
    op = OnTheFlyResampler(x, c, (xs, ys), dtype=torch.float64)
    assert not op.table.requires_grad  # type: ignore[union-attr]
    assert [n for n, _ in op.named_parameters()] == ["c"]
    table = op.param.detach().clone().requires_grad_()
    out = torch.ops.bitserve.on_the_fly_forward(f, op.x, op.c, table, "tabulated", None)
    with pytest.raises(ValueError, match="tabulated response gets no gradient"):
        out.sum().backward()


def test_gradcheck_f_and_c() -> None:
    gen = torch.Generator().manual_seed(7)
    x, c = grid(60, gen), coarse(2, 5, gen) * 0.3 + 30
    op = OnTheFlyResampler(x, c, _table(gen, K=9), dtype=torch.float64)
    inputs = (
        torch.randn(2, 2, 60, generator=gen, dtype=torch.float64, requires_grad=True),
        op.c.detach().clone().requires_grad_(),
    )
    fn = torch.ops.bitserve.on_the_fly_forward
    table = op.param.detach()
    assert torch.autograd.gradcheck(lambda f, c: fn(f, op.x, c, table, "tabulated", None), inputs)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("density", [0.0, 0.01, 0.2, 0.7])
def test_every_bits_path_matches_the_float64_reference(
    kernels: str, device: str, density: float
) -> None:
    gen = torch.Generator().manual_seed(seed("bits", kernels, density))
    B = 203  # not a multiple of 8
    x, c = grid(B, gen), coarse(3, 29, gen)
    table = _table(gen)
    bits = torch.rand(4, 3, B, generator=gen) < density
    bits[0, 0], bits[0, 1] = False, True  # an empty row, a full row
    bits[1, 0], bits[1, 1] = False, False
    bits[1, 0, 0] = bits[1, 1, -1] = True  # one event at either edge
    ref = dense_ref(x, c, _interp(table), bits.double())
    for dtype in (torch.float32, torch.float64):
        op = OnTheFlyResampler(x, c, table, dtype=dtype, device=device)
        rtol = 1e-5 if dtype == torch.float32 else 1e-10
        with torch.no_grad():
            for path in ("band", "event", "auto"):
                out = op.forward_bits(packbits(bits, dim=-1).to(device), path=path)
                assert out.dtype == dtype
                assert_close(out.cpu(), ref, rtol)
            little = packbits(bits, dim=-1, bitorder="little").to(device)
            assert_close(op.forward_bits(little, "little", path="event").cpu(), ref, rtol)
            with pytest.raises(ValueError, match="not piecewise polynomial"):
                op.forward_bits(packbits(bits, dim=-1).to(device), path="prefix")


@pytest.mark.parametrize("name", ["triangle", "boxcar"])
def test_a_table_of_a_named_response_gives_its_results(name: str) -> None:
    """The closed form: a triangle and a boxcar are tables of 3 and 2 points."""
    gen = torch.Generator().manual_seed(seed("named", name))
    x, c = grid(300, gen), coarse(2, 40, gen)
    params, r = RESPONSES[name]
    (h,) = params.values()
    xs = torch.tensor([-h, 0.0, h] if name == "triangle" else [-h, h], dtype=torch.float64)
    ys = torch.tensor([0.0, 1.0, 0.0] if name == "triangle" else [1.0, 1.0], dtype=torch.float64)
    bits = torch.rand(2, 2, 300, generator=gen) < 0.3
    ref = dense_ref(x, c, r, bits.double())
    table = OnTheFlyResampler(x, c, (xs, ys))
    with torch.no_grad():
        assert_close(table(bits.float()), ref, 1e-5)
        assert_close(table.forward_bits(packbits(bits, dim=-1), path="event"), ref, 1e-5)


def test_options_center_normalize_border_scale() -> None:
    """The options against the closed forms, and against the stored band of the same table."""
    gen = torch.Generator().manual_seed(11)
    x = torch.arange(400, dtype=torch.float64) * 0.05  # a recording of 20 (x's units)
    c = torch.rand(2, 30, generator=gen, dtype=torch.float64) * 20
    # A causal triangle: 0 at 0, peak 1 at 1.5, 0 at 2. Area 1; its median is sqrt(1.5).
    table = (
        torch.tensor([0.0, 1.5, 2.0], dtype=torch.float64),
        torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64),
    )
    median, peak = math.sqrt(1.5), 1.5
    for center, shift in (("median", median), ("peak", peak), ("none", 0.0), (None, 0.0)):
        op = OnTheFlyResampler(x, c, table, dtype=torch.float64, center=center)
        assert op.shape.shift == pytest.approx(shift, abs=1e-12)  # type: ignore[union-attr]
        moved = (table[0] - shift, table[1])
        f = torch.randn(2, 2, 400, generator=gen, dtype=torch.float64)
        assert_close(op(f), dense_ref(x, c, _interp(moved), f), 1e-12)
    kw = {"normalize": True, "border": "correct", "scale": 2.5, "center": "median"}
    bits = torch.rand(3, 2, 400, generator=gen) < 0.2
    f = bits.double()
    moved = (table[0] - median, table[1])
    # Unit area (the table's is 1), then each output over the mass inside [0, 20).
    inside = dense_ref(x, c, _interp(moved), torch.ones(1, 2, 400, dtype=torch.float64))
    mass = inside[0] * 0.05  # the recording's fine step: the integral inside it
    expected = 2.5 * dense_ref(x, c, _interp(moved), f) / mass
    stored = BandedResampler.from_response(x, c, table, dtype=torch.float64, **kw)  # type: ignore[arg-type]
    for dtype in (torch.float32, torch.float64):
        op = OnTheFlyResampler(x, c, table, dtype=dtype, **kw)  # type: ignore[arg-type]
        rtol = 1e-5 if dtype == torch.float32 else 1e-10
        with torch.no_grad():
            assert_close(op(f.to(dtype)), stored(f), rtol)
            for path in ("band", "event"):
                assert_close(op.forward_bits(packbits(bits, dim=-1), path=path), stored(f), rtol)
    # The border correction uses the table's exact mass, the reference a Riemann sum of it.
    assert_close(stored(f), expected, 2e-2)


def test_save_and_load_keep_the_table_as_given(tmp_path: Path) -> None:
    x, c, xs, ys, f = _problem("save")
    for dtype in (torch.float32, torch.float64):
        op = OnTheFlyResampler(x, c, (xs, ys), dtype=dtype, center="peak", scale=3.0)
        op.save(tmp_path / "op.safetensors")
        back = OnTheFlyResampler.load(tmp_path / "op.safetensors")
        assert back.response == "tabulated"
        assert back.param.dtype == dtype
        assert torch.equal(back.param, op.param)
        with torch.no_grad():
            assert torch.equal(back(f.to(dtype)), op(f.to(dtype)))


def test_errors_name_the_problem() -> None:
    x = torch.linspace(0, 1, 50, dtype=torch.float64)
    c = torch.rand(2, 4, dtype=torch.float64)
    xs, ys = torch.tensor([-0.1, 0.0, 0.2]), torch.tensor([0.5, 1.0, -0.2])
    with pytest.raises(ValueError, match="implies its support"):
        OnTheFlyResampler(x, c, (xs, ys), 3.0)
    with pytest.raises(ValueError, match="unexpected parameters"):
        OnTheFlyResampler(x, c, (xs, ys), sigma=1.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        OnTheFlyResampler(x, c, (xs.flip(0), ys))
    with pytest.raises(ValueError, match="equal length"):
        OnTheFlyResampler(x, c, (xs, ys[:2]))
    with pytest.raises(ValueError, match="finite"):
        OnTheFlyResampler(x, c, (xs, torch.tensor([0.5, math.nan, 0.0])))
    with pytest.raises(ValueError, match="without negative values"):
        OnTheFlyResampler(x, c, (xs, ys), center="median")
    with pytest.raises(ValueError, match="positive area"):
        OnTheFlyResampler(x, c, (xs, -ys.abs()), normalize=True)
    close = torch.tensor([1.0, 1.0 + 1e-12, 2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dtype=torch\.float64"):
        OnTheFlyResampler(x, c, (close, ys))
    OnTheFlyResampler(x, c, (close, ys), dtype=torch.float64)  # float64 resolves them
    with pytest.raises(TypeError, match="a name or a table"):
        OnTheFlyResampler(x, c, lambda d: d)  # type: ignore[arg-type]


@needs_triton
@pytest.mark.parametrize("K", [2, 3, 17])
def test_triton_kernels_match_the_dense_reference(K: int) -> None:
    """Interpreted on CPU tensors when there is no GPU (TRITON_INTERPRET=1)."""
    from gpu_ops._triton import events as ke
    from gpu_ops._triton import resample_otf as ko

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed("triton", K))
    B = 203
    x, c = grid(B, gen), coarse(2, 29, gen) * 0.3 + 35
    table = _table(gen, K=K)
    r = _interp(table)
    f = torch.randn(3, 2, B, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 2, 29, generator=gen, dtype=torch.float64)
    c_ = c.clone().requires_grad_()
    f_ = f.clone().requires_grad_()
    ref = torch.einsum("nab,mnb->mna", _interp_torch(table, c_[..., None] - x), f_)
    ref_f, ref_c = torch.autograd.grad(ref, (f_, c_), g)
    resp = responses.KernelResponse("tabulated", torch.stack(table).float())
    geo = ko.prepare(x.to(device), c.float().to(device), resp, None)
    f32, g32 = f.float().to(device), g.float().to(device)
    assert_close(ko.forward(f32, geo).cpu(), ref.detach(), 1e-5)
    assert_close(ko.grad_f(g32, geo, B).cpu(), ref_f, 1e-5)
    gc, _ = ko.grad_c_param(f32, g32, geo)
    assert_close(gc.cpu(), ref_c, 1e-4)
    bits = torch.rand(2, 2, B, generator=gen) < 0.2
    bits[0, 0] = False
    bits[1, 1, 0] = bits[1, 1, -1] = True
    for big in (True, False):
        packed = packbits(bits, dim=-1, bitorder="big" if big else "little").to(device)
        c_sorted, order = c.sort(dim=1)
        first, last, _ = responses.windows(x, c_sorted, *resp.window(None))
        out = ke.events_otf(
            packed, big, x.to(device), c_sorted.to(device), first.to(device), last.to(device),
            resp,
        )  # fmt: skip
        got = out.cpu().gather(-1, order.argsort(dim=1).expand(2, -1, -1))
        assert_close(got, dense_ref(x, c, r, bits.double()), 1e-5)


@pytest.mark.needs_cuda
def test_cuda_module_matches_the_cpu_module() -> None:
    x, c, xs, ys, f = _problem("cuda", B=5000)
    ref_op = OnTheFlyResampler(x, c, (xs, ys), dtype=torch.float64, trainable=True)
    fr = f.clone().requires_grad_()
    ref = ref_op(fr)
    ref.square().sum().backward()
    op = OnTheFlyResampler(x, c, (xs, ys), device="cuda", trainable=True)
    fc = f.float().cuda().requires_grad_()
    out = op(fc)
    out.square().sum().backward()
    assert_close(out.detach().cpu(), ref.detach(), 1e-5)
    assert fc.grad is not None
    assert fr.grad is not None
    assert op.c.grad is not None
    assert ref_op.c.grad is not None
    assert_close(fc.grad.cpu(), fr.grad, 1e-4)
    assert_close(op.c.grad.cpu(), ref_op.c.grad, 1e-4)
    bits = torch.rand(3, 2, 5000) < 0.05
    with torch.no_grad():
        for path in ("band", "event"):
            got = op.forward_bits(packbits(bits, dim=-1).cuda(), path=path).cpu()
            assert_close(got, ref_op(bits.double()), 1e-5)
