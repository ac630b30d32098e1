"""forward_bits: every path of both resamplers against the float64 dense reference on fresh
random bits, the choice of path, and the errors.

The compiled C kernels run wherever a C compiler is found (CPU); the Triton kernels run
interpreted on CPU tensors without a GPU (TRITON_INTERPRET=1, set by conftest).
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_ops import BandedResampler, OnTheFlyResampler, packbits, responses
from gpu_ops._bits_resample import choose
from gpu_ops._events_torch import piece_bounds
from tests.common_utils import cpu_and_cuda, needs_triton
from tests.gpu_ops.resample_cases import RESPONSES, assert_close, coarse, dense_ref, grid, seed

POLYNOMIAL = ("boxcar", "triangle", "epanechnikov")


def _bits(M: int, N: int, B: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Random 0/1 rows of the given density, and the edge rows every test wants: empty,
    all ones, one event at the first fine point, one at the last."""
    bits = torch.rand(M, N, B, generator=gen) < density
    if M >= 2 and N >= 2:
        bits[0, 0] = False
        bits[0, 1] = True
        bits[1, 0] = False
        bits[1, 0, 0] = True
        bits[1, 1] = False
        bits[1, 1, -1] = True
    return bits


def _paths(name: str) -> list[str]:
    return ["band", "event", "prefix"] if name in POLYNOMIAL else ["band", "event"]


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("name", sorted(RESPONSES))
@pytest.mark.parametrize("density", [0.0, 0.003, 0.1, 0.6])
def test_every_path_matches_the_float64_reference(device: str, name: str, density: float) -> None:
    gen = torch.Generator().manual_seed(seed(name, density))
    B = 203  # not a multiple of 8: the last byte is part padding
    x, c = grid(B, gen), coarse(3, 29, gen)
    params, r = RESPONSES[name]
    bits = _bits(4, 3, B, density, gen)
    packed = packbits(bits, dim=-1).to(device)
    ref = dense_ref(x, c, r, bits.double())
    stored = BandedResampler.from_response(x, c, name, device=device, **params)
    otf = OnTheFlyResampler(x, c, name, device=device, **params)
    with torch.no_grad():
        for path in ("band", "event"):
            out = stored.forward_bits(packed, path=path)
            assert out.shape == (4, 3, 29)
            assert out.dtype == torch.float32
            assert_close(out.cpu(), ref, 1e-5)
        for path in _paths(name):
            assert_close(otf.forward_bits(packed, path=path).cpu(), ref, 1e-5)
        auto = otf.forward_bits(packed)
        assert_close(auto.cpu(), ref, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 6])
def test_the_band_from_bits_equals_the_band_on_unpacked_floats(dtype: torch.dtype, M: int) -> None:
    """The stored band's band path reads the bits (each row unpacked into a per-thread buffer
    on the CPU): the same sums in the same order as on the unpacked floats, bit for bit."""
    gen = torch.Generator().manual_seed(seed("band bits", dtype, M))
    B = 389  # the last byte part padding, and set there
    x, c = grid(B, gen), coarse(4, 23, gen)  # unsorted coarse points
    params, r = RESPONSES["gaussian"]
    op = BandedResampler.from_response(x, c, "gaussian", dtype=dtype, **params)
    bits = torch.rand(M, 4, B, generator=gen) < 0.3
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))  # the compiled kernel takes rows >= threads
    try:
        _band_from_bits(op, bits, B)
    finally:
        torch.set_num_threads(threads)
    ref = dense_ref(x, c, r, bits.double())
    rtol = 1e-2 if dtype != torch.float32 else 1e-5
    assert_close(op.forward_bits(packbits(bits, dim=-1), path="band").float(), ref, rtol)


def _band_from_bits(op: BandedResampler, bits: torch.Tensor, B: int) -> None:
    """forward_bits' band path and the op against the band on the unpacked bits."""
    dtype = op.weights.dtype
    for bitorder in ("big", "little"):
        packed = packbits(bits, dim=-1, bitorder=bitorder)
        packed[..., -1] |= 0x01 if bitorder == "big" else 0x80  # a set bit past B: ignored
        with torch.no_grad():
            got = op.forward_bits(packed, bitorder, path="band")
            assert torch.equal(got, op(bits.to(dtype)))
            raw = torch.ops.bitserve.banded_bits_forward(
                packed, op.starts, op.weights, B, bitorder == "big"
            )
            unpacked = torch.ops.bitserve.unpackbits(packed, 2, B, bitorder, torch.float32)
            assert torch.equal(
                raw, torch.ops.bitserve.banded_forward(unpacked, op.starts, op.weights, True)
            )


@pytest.mark.parametrize("name", sorted(RESPONSES))
def test_float64_paths_and_options(name: str) -> None:
    """float64 modules (the torch kernels) and the shape options (normalize, border, scale)."""
    gen = torch.Generator().manual_seed(seed(name))
    B = 150
    x = torch.arange(B, dtype=torch.float64) * 0.5
    c = torch.rand(2, 17, generator=gen, dtype=torch.float64) * 75
    params, _ = RESPONSES[name]
    bits = _bits(3, 2, B, 0.2, gen)
    packed = packbits(bits, dim=-1)
    kw = {"normalize": True, "border": "correct", "scale": 2.5, **params}
    for dtype in (torch.float32, torch.float64):
        otf = OnTheFlyResampler(x, c, name, dtype=dtype, **kw)  # type: ignore[arg-type]
        with torch.no_grad():
            ref = otf(bits.to(dtype))
            for path in _paths(name):
                out = otf.forward_bits(packed, path=path)
                assert out.dtype == dtype
                assert_close(out, ref.double(), 1e-5 if dtype == torch.float32 else 1e-12)


def test_leading_dims_bitorder_and_half_precision() -> None:
    gen = torch.Generator().manual_seed(3)
    B = 64
    x, c = grid(B, gen), coarse(2, 11, gen)
    bits = torch.rand(2, 3, 2, B, generator=gen) < 0.3
    little = packbits(bits, dim=-1, bitorder="little")
    stored = BandedResampler.from_response(x, c, "gaussian", sigma=2.0, dtype=torch.bfloat16)
    out = stored.forward_bits(little, "little", path="event")
    assert out.shape == (2, 3, 2, 11)
    assert out.dtype == torch.bfloat16
    ref = stored(bits.to(torch.bfloat16).reshape(6, 2, B)).reshape(2, 3, 2, 11)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    single = stored.forward_bits(packbits(bits[0, 0], dim=-1))  # (N, nbytes): no batch
    assert single.shape == (2, 11)


def test_the_choice_follows_density_and_width() -> None:
    gen = torch.Generator().manual_seed(4)
    B, N, A = 4000, 2, 50
    x = torch.arange(B, dtype=torch.float64)
    c = torch.linspace(0, B - 1, A, dtype=torch.float64).expand(N, A).contiguous()
    narrow = BandedResampler.from_response(x, c, "gaussian", sigma=2.0)
    otf_wide = OnTheFlyResampler(x, c, "gaussian", sigma=400.0)
    box_wide = OnTheFlyResampler(x, c, "boxcar", half_width=1500.0)
    empty = torch.zeros(1, N, B // 8, dtype=torch.uint8)
    full = torch.full((1, N, B // 8), 255, dtype=torch.uint8)
    sparse = packbits(torch.rand(1, N, B, generator=gen) < 0.002, dim=-1)
    with torch.no_grad():
        assert narrow.plan_bits(full).path == "band"  # dense, narrow: the band is cheapest
        assert narrow.plan_bits(empty).path == "event"  # nothing to scatter
        assert otf_wide.plan_bits(sparse).path == "event"
        assert box_wide.plan_bits(full).path == "prefix"  # width does not count
        assert box_wide.plan_bits(full).events == (N * B,)
    # Frozen (the default), grad mode changes nothing; with gradients asked for c and the
    # parameter, only the band path has a backward.
    assert otf_wide.plan_bits(sparse).path == "event"
    otf_wide.requires_grad_()
    assert otf_wide.plan_bits(sparse).path == "band"
    with pytest.raises(ValueError, match="has no backward"):
        otf_wide.forward_bits(sparse, path="event")
    plan = choose(10, 2, 1000, 10, 20.0, on_the_fly=False, pieces=None)
    assert set(plan.costs) == {"band", "event"}
    assert plan.path == min(plan.costs, key=plan.costs.__getitem__)


def test_a_light_operator_takes_the_band_without_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the band costs less per item than counting and choosing (a few fine points, a
    coarse point or two), every item takes it whatever its bits, and nothing is counted; a
    larger operator still counts."""
    from gpu_ops import _bits_resample

    gen = torch.Generator().manual_seed(7)
    x = torch.arange(8, dtype=torch.float64)
    tiny = BandedResampler.from_response(x, torch.tensor([[3.5]]), "boxcar", half_width=4.0)
    otf = OnTheFlyResampler(x, torch.tensor([[3.5]]), "boxcar", half_width=4.0)
    bits = torch.rand(5, 1, 8, generator=gen) < 0.5
    bits[0] = False  # an empty item: the event path's case at any size
    packed = packbits(bits, dim=-1)
    big = BandedResampler.from_response(
        torch.arange(4000, dtype=torch.float64), coarse(2, 50, gen), "gaussian", sigma=3.0
    )

    def counted(packed3: torch.Tensor) -> list[int]:
        raise AssertionError("counted")

    monkeypatch.setattr(_bits_resample, "item_events", counted)
    with torch.no_grad():
        for op in (tiny, otf):
            assert op.plan_bits(packed).paths == ("band",) * 5
            out = op.forward_bits(packed)
            assert torch.equal(out, op(bits.float()))  # the band itself
            assert_close(out, bits.double().sum(-1, keepdim=True), 1e-6)  # a count of ones
        with pytest.raises(AssertionError, match="counted"):
            big.plan_bits(torch.zeros(1, 2, 500, dtype=torch.uint8))


@pytest.mark.parametrize("kind", ["stored", "on_the_fly"])
def test_each_item_takes_its_own_path_and_gets_the_same_bits_in_any_batch(kind: str) -> None:
    """A server batches requests together: an item's result must not depend on the others."""
    gen = torch.Generator().manual_seed(6)
    B, N, A = 4000, 2, 50
    x = torch.arange(B, dtype=torch.float64)
    c = torch.rand(N, A, generator=gen, dtype=torch.float64) * B
    op: BandedResampler | OnTheFlyResampler
    if kind == "stored":
        op = BandedResampler.from_response(x, c, "gaussian", sigma=3.0)
    else:
        op = OnTheFlyResampler(x, c, "gaussian", sigma=3.0)
    dense = packbits(torch.rand(1, N, B, generator=gen) < 0.9, dim=-1)
    sparse = packbits(torch.rand(1, N, B, generator=gen) < 0.0005, dim=-1)
    batch = torch.cat([dense, sparse, dense])
    with torch.no_grad():
        plan = op.plan_bits(batch)
        assert plan.paths == ("band", "event", "band")
        assert plan.path == "mixed"
        together = op.forward_bits(batch)
        alone = torch.cat([op.forward_bits(dense), op.forward_bits(sparse), op.forward_bits(dense)])
    assert torch.equal(together, alone)
    bits = torch.ops.bitserve.unpackbits(batch, 2, B, "big", torch.float32)
    assert_close(together, op(bits).detach().double(), 1e-5)


def test_band_path_keeps_gradients_of_c_and_the_parameter() -> None:
    """With gradients wanted, forward_bits is the band path: the same gradients as the
    module on the unpacked bits, which gradcheck confirms for the op it calls."""
    gen = torch.Generator().manual_seed(5)
    B = 40
    x, c = grid(B, gen), coarse(2, 4, gen)
    op = OnTheFlyResampler(
        x, c, "laplacian", dtype=torch.float64, sigma=3.0, normalize=True, trainable=True
    )
    bits = torch.rand(2, 2, B, generator=gen) < 0.4
    packed = packbits(bits, dim=-1)
    op.forward_bits(packed).square().sum().backward()
    grads = (op.c.grad.clone(), op.param.grad.clone())  # type: ignore[union-attr]
    op.zero_grad()
    op(bits.double()).square().sum().backward()
    torch.testing.assert_close(grads, (op.c.grad, op.param.grad))
    inputs = (op.c.detach().clone().requires_grad_(), op.param.detach().clone().requires_grad_())
    f = bits.double()
    op_fn = torch.ops.bitserve.on_the_fly_forward
    assert torch.autograd.gradcheck(
        lambda cc, p: op_fn(f, op.x, cc, p, op.spec.name, op.support), inputs
    )


def test_errors_are_clear() -> None:
    x = torch.linspace(0, 1, 50, dtype=torch.float64)
    c = torch.rand(2, 4, dtype=torch.float64)
    op = BandedResampler.from_response(x, c, "gaussian", sigma=0.05)
    good = torch.zeros(3, 2, 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, 7\]"):
        op.forward_bits(torch.zeros(3, 2, 6, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        op.forward_bits(good.float())
    with pytest.raises(ValueError, match="bitorder"):
        op.forward_bits(good, "middle")
    with pytest.raises(ValueError, match="path must be"):
        op.forward_bits(good, path="fft")
    with pytest.raises(ValueError, match="no prefix-sum path"):
        op.forward_bits(good, path="prefix")
    otf = OnTheFlyResampler(x, c, "gaussian", sigma=0.05)
    with torch.no_grad(), pytest.raises(ValueError, match="not piecewise polynomial"):
        otf.forward_bits(good, path="prefix")
    assert math.isfinite(float(op.forward_bits(good).sum()))


@needs_triton
@pytest.mark.parametrize("name", sorted(RESPONSES))
@pytest.mark.parametrize("big", [True, False])
def test_triton_kernels_match_the_float64_reference(name: str, big: bool) -> None:
    """Runs interpreted on CPU tensors when there is no GPU (TRITON_INTERPRET=1)."""
    from gpu_ops._triton import events as ke

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed(name, big))
    B = 203
    x, c = grid(B, gen), coarse(3, 29, gen)
    params, r = RESPONSES[name]
    bits = _bits(2, 3, B, 0.15, gen)
    packed = packbits(bits, dim=-1, bitorder="big" if big else "little").to(device)
    ref = dense_ref(x, c, r, bits.double())
    events, counts = ke.compact(packed.reshape(6, -1), B, big)
    assert torch.equal(counts.cpu(), bits.reshape(6, -1).sum(-1))
    assert torch.equal(ke.bit_counts(packed.reshape(6, -1)).cpu(), counts.cpu())
    listed = [events[i, : int(counts[i])].cpu() for i in range(6)]
    rows = bits.reshape(6, -1)
    assert all(torch.equal(e, b.nonzero()[:, 0].int()) for e, b in zip(listed, rows, strict=True))
    st = BandedResampler.from_response(x, c, name, **params)
    out = ke.events_band(packed, big, st.starts.to(device), st.weights.to(device), B).cpu()
    if st.inverse_order is not None:
        out = out.gather(-1, st.inverse_order.expand(2, -1, -1))
    assert_close(out, ref, 1e-5)
    otf = OnTheFlyResampler(x, c, name, **params)
    shape, p = otf.shape, otf.shape.value
    moved, order = (otf.c + shape.shift * p).detach().sort(dim=1)
    inverse = order.argsort(dim=1).expand(2, -1, -1)
    first, last, _ = responses.windows(x, moved, *shape.window(p))
    xd, md = x.to(device), moved.to(device)
    resp = responses.KernelResponse(name, torch.tensor(p))
    out = ke.events_otf(packed, big, xd, md, first.to(device), last.to(device), resp)
    assert_close(out.cpu().gather(-1, inverse), ref, 1e-5)
    got = responses.pieces(name, p)
    if got is not None:
        bounds = piece_bounds(x, moved, got[0]).to(device)
        out = ke.prefix(packed, big, xd, md, bounds, got[1].to(device))
        assert_close(out.cpu().gather(-1, inverse), ref, 1e-5)
