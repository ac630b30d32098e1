"""gpu_ops.resample against a float64 dense einsum on random operators."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_ops import BandedResampler, _resample_cpu, banded_resample
from gpu_ops._reference import (
    banded_resample_reference,
    banded_to_dense,
    dense_response_operator,
)
from tests.common_utils import cpu_and_cuda, needs_triton

RESPONSES: dict[str, tuple[dict[str, float], Callable[[torch.Tensor], torch.Tensor]]] = {
    "gaussian": ({"sigma": 1.5}, lambda d: torch.exp(-0.5 * (d / 1.5) ** 2) * (d.abs() <= 6.0)),
    "boxcar": ({"half_width": 2.5}, lambda d: (d.abs() <= 2.5).double()),
    "triangle": ({"half_width": 3.0}, lambda d: (1 - d.abs() / 3.0).clamp(min=0)),
    "lorentzian": ({"gamma": 0.7}, lambda d: (d.abs() <= 7.0) / (1 + (d / 0.7) ** 2)),
}


def _grid(B: int, gen: torch.Generator) -> torch.Tensor:
    """An uneven sorted fine grid on [0, 100]."""
    return torch.sort(torch.rand(B, generator=gen, dtype=torch.float64) * 100).values


def _coarse(N: int, A: int, gen: torch.Generator) -> torch.Tensor:
    """Unsorted coarse points that reach past both grid edges (clipped windows)."""
    return torch.rand(N, A, generator=gen, dtype=torch.float64) * 120 - 10


def _dense_ref(
    x: torch.Tensor, c: torch.Tensor, r: Callable[[torch.Tensor], torch.Tensor], f: torch.Tensor
) -> torch.Tensor:
    T = dense_response_operator(x, c, r).double()
    return torch.einsum("nab,...nb->...na", T, f.double())


def _assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    # Relative to the output's scale: an isolated near-zero sum cannot meet rtol alone.
    scale = ref.abs().max().clamp(min=1e-12)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=rtol * float(scale))


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("name", sorted(RESPONSES))
@pytest.mark.parametrize("M", [None, 1, 5])
def test_named_responses_match_dense_einsum(device: str, name: str, M: int | None) -> None:
    gen = torch.Generator().manual_seed(hash((name, M)) % 2**31)
    x, c = _grid(400, gen), _coarse(3, 37, gen)
    params, r = RESPONSES[name]
    support = {"gaussian": 4.0, "lorentzian": 10.0}.get(name)
    op = BandedResampler.from_response(x, c, name, support, device=device, **params)
    shape = (3, 400) if M is None else (M, 3, 400)
    f = torch.randn(shape, generator=gen)
    out = op(f.to(device))
    assert out.shape == (*shape[:-1], 37)
    assert out.dtype == torch.float32
    _assert_close(out.cpu(), _dense_ref(x, c, r, f), 1e-5)
    on_the_fly = BandedResampler.from_response(
        x, c, name, support, on_the_fly=True, device=device, **params
    )
    _assert_close(on_the_fly(f.to(device)).cpu(), _dense_ref(x, c, r, f), 1e-5)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, c = _grid(500, gen), _coarse(4, 50, gen)
    params, r = RESPONSES["gaussian"]
    f = torch.rand(3, 4, 500, generator=gen) + 0.5  # positive: relative error is meaningful
    ref = _dense_ref(x, c, r, f)
    for wdtype in (torch.float32, dtype):
        op = BandedResampler.from_response(x, c, "gaussian", dtype=wdtype, device=device, **params)
        out = op(f.to(device, dtype))
        assert out.dtype == dtype
        _assert_close(out.cpu(), ref, 1e-2)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_tabulated_asymmetric_and_callable(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    x, c = _grid(300, gen), _coarse(2, 40, gen)
    xs = torch.tensor([-1.0, 0.0, 0.5, 4.0], dtype=torch.float64)
    ys = torch.tensor([0.2, 1.0, -0.3, 0.6], dtype=torch.float64)

    def table(d: torch.Tensor) -> torch.Tensor:
        i = torch.searchsorted(xs, d.contiguous()).clamp(1, 3)
        v = ys[i - 1] + (ys[i] - ys[i - 1]) * (d - xs[i - 1]) / (xs[i] - xs[i - 1])
        return torch.where((d >= -1) & (d <= 4), v, torch.zeros_like(v))

    f = torch.randn(2, 300, generator=gen)
    op = BandedResampler.from_response(x, c, (xs, ys), device=device)
    _assert_close(op(f.to(device)).cpu(), _dense_ref(x, c, table, f), 1e-5)

    def sinc(d: torch.Tensor) -> torch.Tensor:
        return torch.sinc(d / 2)

    op = BandedResampler.from_response(x, c, sinc, support=5.0, device=device)
    _assert_close(
        op(f.to(device)).cpu(), _dense_ref(x, c, lambda d: sinc(d) * (d.abs() <= 5), f), 1e-5
    )


def test_empty_windows_give_zero() -> None:
    x = torch.linspace(0, 10, 101, dtype=torch.float64)
    c = torch.tensor([[-50.0, 5.0, 60.0]], dtype=torch.float64)
    op = BandedResampler.from_response(x, c, "boxcar", half_width=1.0)
    out = op(torch.ones(1, 101))
    assert out[0, 0] == 0
    assert out[0, 2] == 0
    assert out[0, 1] == 21


@pytest.mark.parametrize("M", [1, 3, 6])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernels_and_torch_path_match_reference(M: int, wdtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(M)
    N, A, B, W = 3, 41, 700, 57
    starts = torch.randint(0, B - W + 1, (N, A), generator=gen, dtype=torch.int32)  # unsorted
    weights = torch.randn(N, A, W, generator=gen).to(wdtype)
    f, g = torch.randn(M, N, B, generator=gen), torch.randn(M, N, A, generator=gen)
    ref_f = f.double().requires_grad_()
    ref_w = weights.double().requires_grad_()
    ref = banded_resample_reference(ref_f, starts, ref_w)
    ref.backward(g.double())
    assert ref_f.grad is not None
    assert ref_w.grad is not None
    lib = _resample_cpu.kernels()
    paths = [
        (
            _resample_cpu.forward_torch(f, starts, weights),
            _resample_cpu.backward_f_torch(g, starts, weights, B),
            _resample_cpu.backward_w_torch(g, f, starts, W),
        )
    ]
    if lib is not None:
        paths.append(
            (
                _resample_cpu.forward_c(lib, f, starts, weights),
                _resample_cpu.backward_f_c(lib, g, starts, weights, B),
                _resample_cpu.backward_w_c(lib, g, f, starts, W),
            )
        )
    for out, grad_f, grad_w in paths:
        _assert_close(out, ref.detach(), 1e-5)
        _assert_close(grad_f, ref_f.grad, 1e-5)
        _assert_close(grad_w, ref_w.grad, 1e-5)


@pytest.mark.parametrize("M", [1, 4, 13, 16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_sorted_transposed_band_matches_reference(M: int, wdtype: torch.dtype) -> None:
    """The register-blocked grad_f kernel (sorted starts): every input block size (8, 4, 1),
    tiles cut by the grid's end and by windows ending/starting inside them, windows at both
    edges, repeated starts."""
    lib = _resample_cpu.kernels()
    if lib is None:
        pytest.skip("no C compiler here: the torch path is tested elsewhere")
    gen = torch.Generator().manual_seed(100 + M)
    N, A, B, W = 3, 50, 1237, 71  # B is a multiple of neither the tile nor the task block
    starts = torch.randint(0, B - W + 1, (N, A), generator=gen, dtype=torch.int32)
    starts[:, :3] = 0
    starts[:, -3:] = B - W
    starts = starts.sort(dim=1).values
    weights = torch.randn(N, A, W, generator=gen).to(wdtype)
    g = torch.randn(M, N, A, generator=gen)
    ref_f = torch.randn(M, N, B, generator=gen, dtype=torch.float64).requires_grad_()
    banded_resample_reference(ref_f, starts, weights.double()).backward(g.double())
    assert ref_f.grad is not None
    out = _resample_cpu.backward_f_c(lib, g, starts, weights, B, sorted_starts=True)
    _assert_close(out, ref_f.grad, 1e-5)
    unsorted = _resample_cpu.backward_f_c(lib, g, starts, weights, B, sorted_starts=False)
    _assert_close(unsorted, ref_f.grad, 1e-5)


def test_functional_form_detects_sorted_starts_on_cpu() -> None:
    gen = torch.Generator().manual_seed(11)
    N, A, B, W = 2, 30, 400, 40
    starts = torch.randint(0, B - W + 1, (N, A), generator=gen, dtype=torch.int32)
    for s in (starts, starts.sort(dim=1).values):
        w = torch.randn(N, A, W, generator=gen, dtype=torch.float64)
        f = torch.randn(3, N, B, generator=gen, requires_grad=True)
        g = torch.randn(3, N, A, generator=gen)
        (banded_resample(f, s, w.float()) * g).sum().backward()
        ref_f = f.detach().double().requires_grad_()
        (banded_resample_reference(ref_f, s, w) * g.double()).sum().backward()
        assert f.grad is not None
        assert ref_f.grad is not None
        _assert_close(f.grad, ref_f.grad, 1e-5)


def test_torch_fallback_without_compiled_kernels(tmp_path: Path) -> None:
    """BITSERVE_CPU_KERNELS=0 and a missing compiler both give the torch path, not a crash."""
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from gpu_ops import _resample_cpu, banded_resample\n"
        "assert _resample_cpu.kernels() is None\n"
        "s = torch.tensor([[0, 2]], dtype=torch.int32)\n"
        "f = torch.arange(6.0).reshape(1, 6).requires_grad_()\n"
        "out = banded_resample(f, s, torch.ones(1, 2, 3))\n"
        "out.sum().backward()\n"
        "print(out.tolist(), f.grad.tolist())\n"
    )
    expected = "[[3.0, 9.0]] [[1.0, 1.0, 2.0, 1.0, 1.0, 0.0]]"
    root = Path(__file__).resolve().parents[2]
    base = {**os.environ, "BITSERVE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(root)}
    envs = [
        {**base, "BITSERVE_CPU_KERNELS": "0"},
        {**base, "CC": str(tmp_path / "no-such-compiler")},
    ]
    for env in envs:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected
    assert "falling back to torch" in done.stderr
    assert not list((tmp_path / "cache").glob("*.so"))


def test_kernel_cache_is_private_and_shared_by_racing_processes(tmp_path: Path) -> None:
    """Several first uses at once: one library per cache key, mode 0o700, no temp leftovers."""
    if _resample_cpu.kernels() is None:
        pytest.skip("no C compiler here")
    cache = tmp_path / "cache"
    code = "from gpu_ops import _resample_cpu; assert _resample_cpu.kernels() is not None"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "BITSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    assert len(list(cache.glob("resample_cpu_*.so"))) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".build-")]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@needs_triton
@pytest.mark.parametrize(("M", "sorted_starts"), [(1, True), (3, False), (20, True), (70, True)])
def test_triton_kernels_match_reference(M: int, sorted_starts: bool) -> None:
    """Runs interpreted on CPU tensors when there is no GPU (TRITON_INTERPRET=1)."""
    from gpu_ops._triton import resample as tr

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(M)
    N, A, B, W = 2, 40, 200, 23
    starts = torch.randint(0, B - W + 1, (N, A), generator=gen, dtype=torch.int32)
    if sorted_starts:
        starts = starts.sort(dim=1).values
    weights, f = torch.randn(N, A, W, generator=gen), torch.randn(M, N, B, generator=gen)
    g = torch.randn(M, N, A, generator=gen)
    ref_f, ref_w = f.double().requires_grad_(), weights.double().requires_grad_()
    ref = banded_resample_reference(ref_f, starts, ref_w)
    ref.backward(g.double())
    assert ref_f.grad is not None
    assert ref_w.grad is not None
    s, w, fd, gd = (t.to(device).contiguous() for t in (starts, weights, f, g))
    _assert_close(tr.forward(fd, s, w).cpu(), ref.detach(), 1e-5)
    _assert_close(tr.backward_f(gd, s, w, B, sorted_starts).cpu(), ref_f.grad, 1e-5)
    _assert_close(tr.backward_w(gd, fd, s, W).cpu(), ref_w.grad, 1e-5)


def test_gradcheck_f_and_weights() -> None:
    gen = torch.Generator().manual_seed(3)
    N, A, B, W = 2, 6, 30, 5
    starts = torch.randint(0, B - W + 1, (N, A), generator=gen, dtype=torch.int32)
    weights = torch.randn(N, A, W, generator=gen, dtype=torch.float64, requires_grad=True)
    f = torch.randn(2, N, B, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f, w: banded_resample(f, starts, w), (f, weights))


@pytest.mark.parametrize("name", ["gaussian", "triangle", "lorentzian"])
def test_gradcheck_on_the_fly_c_and_parameter(name: str) -> None:
    gen = torch.Generator().manual_seed(4)
    x, c = _grid(60, gen), _coarse(2, 5, gen)
    params, _ = RESPONSES[name]
    op = BandedResampler.from_response(x, c, name, on_the_fly=True, dtype=torch.float64, **params)
    f = torch.randn(2, 60, generator=gen, dtype=torch.float64, requires_grad=True)
    param = getattr(op, next(iter(params)))

    out = op(f)
    out.sum().backward()
    assert op.c.grad is not None
    assert param.grad is not None
    assert bool(op.c.grad.abs().sum() > 0)
    inputs = (
        f[None].detach().requires_grad_(),
        op.c.detach().clone().requires_grad_(),
        param.detach().clone().requires_grad_(),
    )
    from gpu_ops._resample_otf import OnTheFlyFunction

    assert op._otf is not None
    spec, support = op._otf
    assert torch.autograd.gradcheck(
        lambda f, c, p: OnTheFlyFunction.apply(f, c, p, op.x, spec, support, torch.float64), inputs
    )


def test_modes_agree_and_work_under_inference_mode() -> None:
    gen = torch.Generator().manual_seed(5)
    x, c = _grid(200, gen), _coarse(2, 30, gen)
    f = torch.randn(4, 2, 200, generator=gen)
    stored = BandedResampler.from_response(x, c, "gaussian", sigma=2.0)
    otf = BandedResampler.from_response(x, c, "gaussian", sigma=2.0, on_the_fly=True)
    with torch.inference_mode():
        a, b = stored(f), otf(f)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored.to_dense(), otf.to_dense(), rtol=1e-6, atol=1e-6)
    assert otf.nbytes < stored.nbytes
    assert otf.band_width == stored.band_width


def test_from_dense_to_dense_round_trip_and_order() -> None:
    gen = torch.Generator().manual_seed(6)
    x, c = _grid(150, gen), _coarse(3, 25, gen)
    T = dense_response_operator(x, c, RESPONSES["triangle"][1]).float()
    op = BandedResampler.from_dense(T)
    torch.testing.assert_close(op.to_dense(), T)
    assert op.band_width == int((T > 0).sum(-1).max())
    f = torch.randn(3, 150, generator=gen)
    _assert_close(op(f), torch.einsum("nab,nb->na", T.double(), f.double()), 1e-5)
    built = BandedResampler.from_response(x, c, "triangle", half_width=3.0)
    torch.testing.assert_close(built.to_dense(), T)


def test_from_dense_names_the_broken_row() -> None:
    T = torch.zeros(2, 3, 10)
    T[1, 2, [2, 3, 6]] = 1.0
    with pytest.raises(ValueError, match=r"row \(n=1, a=2\)"):
        BandedResampler.from_dense(T)
    T[1, 2, 6] = 1e-3
    assert BandedResampler.from_dense(T, tol=1e-2).band_width == 2


@pytest.mark.parametrize("on_the_fly", [False, True])
def test_save_load_round_trip(tmp_path: Path, on_the_fly: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    x, c = _grid(120, gen), _coarse(2, 15, gen)
    op = BandedResampler.from_response(x, c, "lorentzian", 5.0, gamma=1.0, on_the_fly=on_the_fly)
    op.save(tmp_path / "op.safetensors")
    back = BandedResampler.load(tmp_path / "op.safetensors")
    f = torch.randn(3, 2, 120, generator=gen)
    torch.testing.assert_close(back(f), op(f))
    assert back.on_the_fly == on_the_fly
    assert back.nbytes == op.nbytes
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match=r"not a bitserve\.BandedResampler"):
        BandedResampler.load(tmp_path / "bad.safetensors")


def test_weights_gradient_through_module() -> None:
    gen = torch.Generator().manual_seed(8)
    x, c = _grid(100, gen), _coarse(2, 10, gen)
    op = BandedResampler.from_response(x, c, "gaussian", sigma=1.0)
    op.weights.requires_grad_(True)
    f = torch.randn(2, 100, generator=gen)
    g = torch.randn(2, 10, generator=gen)
    (op(f) * g).sum().backward()
    starts, weights = op.band()
    w = weights.detach().double().requires_grad_()
    (banded_resample_reference(f.double(), starts, w) * g.double()).sum().backward()
    assert op.weights.grad is not None
    assert w.grad is not None
    # op.weights is stored in sorted row order: compare through the dense picture.
    dense = banded_to_dense(op.starts, op.weights.grad.double(), 100)
    assert op.inverse_order is not None
    dense = dense.gather(1, op.inverse_order[..., None].expand(-1, -1, 100))
    torch.testing.assert_close(dense, banded_to_dense(starts, w.grad, 100), rtol=1e-5, atol=1e-5)


def test_errors_are_clear() -> None:
    x = torch.linspace(0, 1, 50, dtype=torch.float64)
    c = torch.rand(2, 4, dtype=torch.float64)
    op = BandedResampler.from_response(x, c, "gaussian", sigma=0.05)
    with pytest.raises(ValueError, match=r"shape \(N, B\) or \(M, N, B\) with N=2, B=50"):
        op(torch.zeros(2, 49))
    with pytest.raises(TypeError, match="float32, bfloat16, float16"):
        op(torch.zeros(2, 50, dtype=torch.int32))
    with pytest.raises(ValueError, match="needs `support`"):
        BandedResampler.from_response(x, c, torch.exp)
    with pytest.raises(ValueError, match="unknown response 'gauss'"):
        BandedResampler.from_response(x, c, "gauss", sigma=1.0)
    with pytest.raises(ValueError, match="exactly one parameter sigma"):
        BandedResampler.from_response(x, c, "gaussian", width=1.0)
    with pytest.raises(ValueError, match="x must be sorted"):
        BandedResampler.from_response(x.flip(0), c, "gaussian", sigma=1.0)
    with pytest.raises(ValueError, match=r"starts must lie in \[0, B - W\]"):
        banded_resample(
            torch.zeros(1, 10), torch.tensor([[8]], dtype=torch.int32), torch.ones(1, 1, 3)
        )
    with pytest.raises(TypeError, match="starts must be int32"):
        banded_resample(torch.zeros(1, 10), torch.tensor([[0.0]]), torch.ones(1, 1, 3))


@pytest.mark.needs_cuda
def test_cuda_dispatch_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(9)
    x, c = _grid(3000, gen), _coarse(4, 200, gen)
    op = BandedResampler.from_response(x, c, "gaussian", sigma=0.3)
    f = torch.randn(33, 4, 3000, generator=gen, requires_grad=True)
    out = op(f)
    out.square().sum().backward()
    op_cuda = BandedResampler.from_response(x, c, "gaussian", sigma=0.3, device="cuda")
    fc = f.detach().cuda().requires_grad_()
    out_c = op_cuda(fc)
    out_c.square().sum().backward()
    assert f.grad is not None
    assert fc.grad is not None
    torch.testing.assert_close(out_c.cpu(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fc.grad.cpu(), f.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("on_the_fly", [False, True])
def test_cuda_kernels_run_on_the_tensors_device_not_the_current_one(on_the_fly: bool) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    gen = torch.Generator().manual_seed(12)
    x, c = _grid(500, gen), _coarse(2, 30, gen)
    f = torch.randn(3, 2, 500, generator=gen)
    ref_op = BandedResampler.from_response(x, c, "gaussian", on_the_fly=on_the_fly, sigma=0.5)
    fr = f.clone().requires_grad_()
    ref_op(fr).square().sum().backward()
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    op = BandedResampler.from_response(
        x, c, "gaussian", device=dev, on_the_fly=on_the_fly, sigma=0.5
    )
    fc = f.to(dev).requires_grad_()
    with torch.cuda.device(0):
        out = op(fc)
        out.square().sum().backward()
    assert fc.grad is not None
    assert fr.grad is not None
    torch.testing.assert_close(out.cpu(), ref_op(f).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fc.grad.cpu(), fr.grad, rtol=1e-5, atol=1e-4)


def test_stored_band_is_validated_once_at_construction(tmp_path: Path) -> None:
    starts = torch.tensor([[0, 2, 5], [1, 1, 3]], dtype=torch.int32)
    weights = torch.ones(2, 3, 4)
    inv = torch.tensor([[2, 0, 1], [0, 1, 2]])
    BandedResampler(starts, weights, 10, inverse_order=inv)  # fine
    with pytest.raises(ValueError, match=r"sorted .* along each row; row 1"):
        BandedResampler(torch.tensor([[0, 2, 5], [3, 1, 3]], dtype=torch.int32), weights, 10)
    with pytest.raises(TypeError, match="inverse_order must be an int64"):
        BandedResampler(starts, weights, 10, inverse_order=inv.int())
    with pytest.raises(ValueError, match="shape of starts"):
        BandedResampler(starts, weights, 10, inverse_order=inv[:, :2])
    with pytest.raises(ValueError, match=r"permutation of 0\.\.2"):
        BandedResampler(starts, weights, 10, inverse_order=torch.tensor([[2, 0, 0], [0, 1, 2]]))
    with pytest.raises(ValueError, match="permutation"):
        BandedResampler(starts, weights, 10, inverse_order=torch.tensor([[3, 0, 1], [0, 1, 2]]))
    # A file whose band was tampered with is refused on load, naming the file.
    from safetensors.torch import load_file, save_file

    BandedResampler(starts, weights, 10, inverse_order=inv).save(tmp_path / "op.safetensors")
    tensors = load_file(tmp_path / "op.safetensors")
    tensors["starts"] = tensors["starts"].flip(1).contiguous()
    meta = {"format": "bitserve.BandedResampler", "version": "1", "num_fine": "10",
            "mode": "stored"}  # fmt: skip
    save_file(tensors, tmp_path / "bad.safetensors", metadata=meta)
    with pytest.raises(ValueError, match=r"bad\.safetensors: starts must be sorted"):
        BandedResampler.load(tmp_path / "bad.safetensors")


def test_devices_without_a_kernel_take_the_chunked_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA without Triton (here: the meta device) never builds the (M, N, A, W) gather."""
    from gpu_ops import _reference, _resample_autograd

    def whole(*args: object) -> torch.Tensor:
        raise AssertionError("the reference builds every window at once")

    monkeypatch.setattr(_reference, "banded_resample_reference", whole)
    monkeypatch.setattr(_resample_autograd, "_triton_resample", None)
    f = torch.empty(64, 8, 5000, device="meta", dtype=torch.float16)
    starts = torch.empty(8, 3000, device="meta", dtype=torch.int32)
    weights = torch.empty(8, 3000, 200, device="meta")
    out = _resample_autograd.kernel_forward(f, starts, weights)
    assert out.shape == (64, 8, 3000)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("weights_grad", [False, True])
def test_input_is_saved_for_backward_only_for_the_weight_gradient(weights_grad: bool) -> None:
    gen = torch.Generator().manual_seed(13)
    N, A, B, W = 2, 9, 50, 5
    starts = torch.randint(0, B - W + 1, (N, A), generator=gen, dtype=torch.int32)
    weights = torch.randn(N, A, W, generator=gen).requires_grad_(weights_grad)
    f = torch.randn(4, N, B, generator=gen, requires_grad=True)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = banded_resample(f, starts, weights)
    assert ((4, N, B) in saved) == weights_grad
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    ref_f = f.detach().double().requires_grad_()
    ref_w = weights.detach().double().requires_grad_(weights_grad)
    banded_resample_reference(ref_f, starts, ref_w).backward(g.double())
    assert f.grad is not None
    assert ref_f.grad is not None
    _assert_close(f.grad, ref_f.grad, 1e-5)
    if weights_grad:
        assert weights.grad is not None
        assert ref_w.grad is not None
        _assert_close(weights.grad, ref_w.grad, 1e-5)


@pytest.mark.parametrize("cast", ["to", "half"])
def test_on_the_fly_module_keeps_its_geometry_precise_under_dtype_casts(cast: str) -> None:
    gen = torch.Generator().manual_seed(14)
    x, c = _grid(400, gen), _coarse(2, 25, gen)
    op = BandedResampler.from_response(x, c, "gaussian", on_the_fly=True, sigma=0.3)
    f = torch.randn(2, 400, generator=gen).to(torch.bfloat16)
    before = op(f)
    cast_op = op.to(torch.bfloat16) if cast == "to" else op.half()
    assert cast_op.x.dtype == torch.float64
    assert cast_op.c.dtype == torch.float32
    assert isinstance(cast_op.c, torch.nn.Parameter)
    torch.testing.assert_close(cast_op(f), before, rtol=0, atol=0)
    stored = BandedResampler.from_response(x, c, "gaussian", sigma=0.3).half()
    assert stored.weights.dtype == torch.float16  # stored weights do follow the cast


def test_functional_form_without_validation_reads_no_values() -> None:
    """validate=False: no host sync. Meta tensors have no values, so any read would raise."""
    f = torch.empty(3, 2, 100, device="meta")
    starts = torch.empty(2, 7, dtype=torch.int32, device="meta")
    weights = torch.empty(2, 7, 5, device="meta")
    assert banded_resample(f, starts, weights, validate=False).shape == (3, 2, 7)
    with pytest.raises((RuntimeError, NotImplementedError)):
        banded_resample(f, starts, weights)  # validate=True reads min/max and sortedness
    with pytest.raises(ValueError, match="band width W=5"):
        banded_resample(f[..., :4], starts, weights, validate=False)  # shapes: always checked
    # Same values and gradients as the validated call on real tensors (sorted rows too).
    gen = torch.Generator().manual_seed(15)
    s = torch.randint(0, 96, (2, 7), generator=gen, dtype=torch.int32).sort(dim=1).values
    w = torch.randn(2, 7, 5, generator=gen)
    x = torch.randn(3, 2, 100, generator=gen)
    grads = []
    for validate in (True, False):
        xv = x.clone().requires_grad_()
        out = banded_resample(xv, s, w, validate=validate)
        out.sum().backward()
        grads.append((out.detach(), xv.grad))
    torch.testing.assert_close(grads[0], grads[1])


def test_functional_form_names_a_non_tensor_input() -> None:
    with pytest.raises(TypeError, match=r"f must be a torch\.Tensor, got list"):
        banded_resample([[0.0]], torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"weights must be a torch\.Tensor, got list"):
        banded_resample(torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int32), [[[1.0]]])  # type: ignore[arg-type]
