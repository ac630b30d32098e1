"""The torch operators behind gpu_ops (``torch.ops.bitserve.*``): registration, ``opcheck``,
gradcheck, the default (torch) kernels, ``torch.compile(fullgraph=True)`` and ``torch.export``.

torchvision tests its ``torch.ops.torchvision.*`` the same way: one sample set per op, run
through ``torch.library.opcheck`` on every device (CUDA variants carry ``needs_cuda``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpu_ops
from gpu_ops import (
    BandedResampler,
    OnTheFlyResampler,
    _bits_c,
    _bits_ops,
    _events_ops,
    _lattice,
    _resample_c,
    _resample_ops,
    responses,
)
from gpu_ops._events_torch import piece_bounds
from gpu_ops._reference import banded_resample_reference, unpackbits_reference
from tests.common_utils import HAS_TRITON, cpu_and_cuda
from tests.gpu_ops.resample_cases import PARAMS, assert_close, coarse, grid

OPS = {
    "packbits": _bits_ops.packbits,
    "unpackbits": _bits_ops.unpackbits,
    "unpackbits_into": _bits_ops.unpackbits_into,
    "banded_forward": _resample_ops.banded_forward,
    "banded_backward_f": _resample_ops.banded_backward_f,
    "banded_backward_w": _resample_ops.banded_backward_w,
    "on_the_fly_forward": _resample_ops.on_the_fly_forward,
    "on_the_fly_backward_f": _resample_ops.on_the_fly_backward_f,
    "on_the_fly_backward_c_param": _resample_ops.on_the_fly_backward_c_param,
    "bit_counts": _events_ops.bit_counts,
    "events_band_forward": _events_ops.events_band_forward,
    "banded_bits_forward": _events_ops.banded_bits_forward,
    "events_otf_forward": _events_ops.events_otf_forward,
    "prefix_forward": _events_ops.prefix_forward,
    "events_lattice_forward": _events_ops.events_lattice_forward,
}
Case = tuple[str, tuple[Any, ...]]


def _band(N: int, A: int, B: int, W: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, B - W + 1, (N, A), generator=gen, dtype=torch.int32).sort(1).values


def _cases(device: str) -> Iterator[Case]:
    """(op name, args) samples on ``device``, covering dtypes, strides and grad needs."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.rand(3, 5, 17, generator=gen) > 0.5
    yield "packbits", (bits.to(device), 2, "big")
    yield "packbits", (torch.randint(-3, 3, (9, 4), generator=gen).to(device).t(), 1, "little")
    packed = torch.randint(0, 256, (3, 4, 5), generator=gen, dtype=torch.uint8).to(device)
    yield "unpackbits", (packed, 2, 37, "big", torch.float32)
    yield "unpackbits", (packed.transpose(0, 1), 1, 29, "little", torch.bool)
    yield "unpackbits", (packed, 0, 30, "big", torch.bfloat16)  # zero padding past 8n = 24
    buf = torch.full((6, 4, 40), 7.0, device=device)
    yield "unpackbits_into", (packed, 2, "little", buf[1:4])
    N, A, B, W = 3, 11, 60, 7
    starts = _band(N, A, B, W, gen).to(device)
    for dtype in (torch.float32, torch.float64):
        f = torch.randn(2, N, B, generator=gen, dtype=dtype).to(device).requires_grad_()
        w = torch.randn(N, A, W, generator=gen, dtype=dtype).to(device).requires_grad_()
        g = torch.randn(2, N, A, generator=gen, dtype=dtype).to(device)
        yield "banded_forward", (f, starts, w, True)
        yield "banded_backward_f", (g, starts, w.detach(), B, True)
        yield "banded_backward_w", (g, f.detach(), starts, W)
    wb = torch.randn(N, A, W, generator=gen).to(device, torch.bfloat16)
    yield "banded_forward", (torch.randn(4, N, B, generator=gen).to(device), starts, wb, False)
    x, c = grid(B, gen).to(device), (coarse(N, A, gen) * 0.6).to(device)
    for name, params in PARAMS.items():
        (value,) = params.values()
        for dtype in (torch.float32, torch.float64):
            cd = c.to(dtype, copy=True).requires_grad_()
            p = torch.tensor(value * 3, dtype=dtype, device=device, requires_grad=True)
            f = torch.randn(2, N, B, generator=gen, dtype=dtype).to(device).requires_grad_()
            g = torch.randn(2, N, A, generator=gen, dtype=dtype).to(device)
            common = (x, cd.detach(), p.detach(), name, None)
            yield "on_the_fly_forward", (f, x, cd, p, name, None)
            yield "on_the_fly_backward_f", (g, *common, B)
            yield "on_the_fly_backward_c_param", (g, f.detach(), *common)
    # A table (2, K) for the parameter: no gradient of its own (c and f have theirs).
    xs = torch.tensor([-4.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    ys = torch.tensor([0.2, 1.0, 0.4, 0.1], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        table = torch.stack([xs, ys]).to(device, dtype)
        cd = c.to(dtype, copy=True).requires_grad_()
        f = torch.randn(2, N, B, generator=gen, dtype=dtype).to(device).requires_grad_()
        g = torch.randn(2, N, A, generator=gen, dtype=dtype).to(device)
        common = (x, cd.detach(), table, "tabulated", None)
        yield "on_the_fly_forward", (f, x, cd, table, "tabulated", None)
        yield "on_the_fly_backward_f", (g, *common, B)
        yield "on_the_fly_backward_c_param", (g, f.detach(), *common)
    # The event path on a lattice: tables (T, step, J), rows' tables, both walks.
    lx = torch.arange(B, dtype=torch.float64, device=device) * 0.5
    lc = (torch.arange(A, dtype=torch.float64, device=device) * 2.5 + 0.1).expand(N, A)
    first = torch.searchsorted(lx, lc - 3.0)
    last = torch.searchsorted(lx, lc + 3.0, side="right")
    gauss = responses.KernelResponse("gaussian", torch.tensor(1.0))
    lat = _lattice.find(lx, lc.contiguous(), first, last, gauss, (-3.0, 3.0))
    assert lat is not None
    lbits = torch.randint(0, 256, (2, N, (B + 7) // 8), generator=gen, dtype=torch.uint8)
    for walk in (False, True):
        args = (lbits.to(device), first, last, lat.tables, lat.tid, lat.jmin, walk, B, walk)
        yield "events_lattice_forward", args
    # The bit-input paths: no autograd (the input is bits), every bit order and dtype.
    bits = torch.randint(0, 256, (2, N, (B + 7) // 8), generator=gen, dtype=torch.uint8)
    bits = bits.to(device)
    yield "bit_counts", (bits.reshape(2 * N, -1),)
    for dtype in (torch.float32, torch.float64):
        w = torch.randn(N, A, W, generator=gen, dtype=dtype).to(device)
        yield "events_band_forward", (bits, starts, w, B, True)
        yield "banded_bits_forward", (bits, starts, w, B, dtype == torch.float32)
        yield "events_band_forward", (bits, starts, w, B, False)
        c_sorted = c.sort(dim=1).values.contiguous()
        for name, params in PARAMS.items():
            (value,) = params.values()
            p = torch.tensor(value * 3, dtype=dtype, device=device)
            first, last, _ = responses.windows(
                x, c_sorted, *responses.named(name).window(value * 3, None)
            )
            big = dtype == torch.float32
            yield "events_otf_forward", (bits, x, c_sorted, first, last, p, name, big)
            if name == "gaussian":  # a table on the events, in the same windows' dtype
                table = torch.stack([xs, ys]).to(device, dtype)
                first, last, _ = responses.windows(x, c_sorted, -4.0, 3.0)
                args = (bits, x, c_sorted, first, last, table, "tabulated", big)
                yield "events_otf_forward", args
            got = responses.pieces(name, value * 3)
            if got is not None:
                bounds = piece_bounds(x, c_sorted, got[0].to(device))
                coef = got[1].to(device=device, dtype=dtype)
                yield "prefix_forward", (bits, x, c_sorted, bounds, coef, not big)


@pytest.mark.slow  # fresh processes and C builds: `make test` runs it, `make test-unit` not
@pytest.mark.parametrize("device", cpu_and_cuda())
def test_opcheck_every_op(device: str) -> None:
    """Schema, fake (meta) kernels, autograd registration and aot dispatch, per sample."""
    seen = set()
    for name, args in _cases(device):
        torch.library.opcheck(OPS[name].overload, args)
        seen.add(name)
    assert seen == set(OPS)


def test_kernels_are_registered_per_device() -> None:
    for name in OPS:
        qual = f"bitserve::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta"), name
        # The op's own body: every device without a kernel of its own.
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CompositeExplicitAutograd")
        # The lattice is the CPU's way to the event path (on CUDA the event kernel evaluates
        # the response per event): its CUDA tensors take the op's own torch body.
        # The band from bits: its CUDA tensors unpack, then take banded_forward's Triton kernel.
        cuda = HAS_TRITON and name not in ("events_lattice_forward", "banded_bits_forward")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA") == cuda, name


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_cpu_kernels_are_built_where_a_compiler_is() -> None:
    """Otherwise every CPU test above would pass on the torch kernels alone."""
    assert _resample_c.kernels() is not None
    assert _bits_c.kernels() is not None


def _run(name: str, args: tuple[Any, ...], kernel: Any = None) -> Any:
    """The op on copies of ``args``, dispatched by device, or through ``kernel`` itself."""
    args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = (kernel or OPS[name])(*args)
    return args[-1] if name == "unpackbits_into" else out


def test_default_kernels_match_the_cpu_kernels() -> None:
    """The torch body of each op (what CUDA without Triton and other devices run) against the
    CPU kernels (compiled C where built), on every sample."""
    for name, args in _cases("cpu"):
        fast = _run(name, args)
        slow = _run(name, args, OPS[name].kernels[None])
        fast = fast if isinstance(fast, tuple) else (fast,)
        slow = slow if isinstance(slow, tuple) else (slow,)
        for a, b in zip(fast, slow, strict=True):
            assert a.dtype == b.dtype
            if a.is_floating_point():
                assert_close(a, b, 1e-5)
            else:
                assert torch.equal(a, b), name


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_gradcheck_stored_band_op(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    N, A, B, W = 2, 6, 30, 5
    starts = _band(N, A, B, W, gen).to(device)
    w = torch.randn(N, A, W, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    f = torch.randn(2, N, B, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    for sorted_starts in (True, False):
        assert torch.autograd.gradcheck(
            lambda f, w, s=sorted_starts: OPS["banded_forward"](f, starts, w, s), (f, w)
        )


# --- torch.compile and torch.export of a model that unpacks bits and resamples ---------------

N, B, A = 3, 203, 17  # B not a multiple of 8: the last byte is padded


class Unpack(nn.Module):
    """packed (M, N, ceil(B / 8)) uint8 -> resampled (M, N, A) float32, then a sum over N."""

    def __init__(self, resampler: nn.Module) -> None:
        super().__init__()
        self.resampler = resampler

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        f = gpu_ops.unpackbits(packed.to(torch.uint8), dim=-1, count=B, dtype=torch.float32)
        out: torch.Tensor = self.resampler(f).sum(1)
        return out


def _model(kind: str) -> Unpack:
    gen = torch.Generator().manual_seed(7)
    x, c = grid(B, gen), coarse(N, A, gen)
    cls = BandedResampler if kind == "stored" else OnTheFlyResampler
    return Unpack(cls.from_response(x, c, "gaussian", sigma=2.0))


def _packed(M: int, seed: int) -> torch.Tensor:
    bits = torch.rand(M, N, B, generator=torch.Generator().manual_seed(seed)) < 0.3
    return gpu_ops.packbits(bits, dim=-1)


# Inductor imports a torch module that still decorates with torch.jit.script_method: torch's
# own deprecation, raised once at that import (pytest turns warnings into errors).
INDUCTOR_IMPORT_WARNING = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"


@pytest.mark.slow
@pytest.mark.filterwarnings(INDUCTOR_IMPORT_WARNING)
@pytest.mark.parametrize("kind", ["stored", "on_the_fly"])
def test_compile_fullgraph_unpacks_and_resamples_like_eager(kind: str) -> None:
    """Inductor, fullgraph=True (a graph break would raise); forward and the backward."""
    torch._dynamo.reset()
    model = _model(kind)
    compiled = torch.compile(model, fullgraph=True)
    for M in (2, 5):
        packed = _packed(M, M)
        eager = model(packed)
        got = compiled(packed)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        bits = unpackbits_reference(packed, -1, B, "big", torch.float64)
        starts, weights = model.resampler.band()
        ref = banded_resample_reference(bits, starts, weights.double()).sum(1)
        assert_close(got, ref, 1e-5)
    if kind == "on_the_fly":
        model.requires_grad_()  # c and sigma: frozen unless asked
        grads = []
        for fn in (model, compiled):
            model.zero_grad()
            fn(packed).square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert len(grads[0]) == 2  # c and sigma
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_compile_unpack_into_a_buffer_slice() -> None:
    """The mutating op (out=) is functionalised by AOT autograd: same bytes as eager."""
    torch._dynamo.reset()

    def step(packed: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        gpu_ops.unpackbits(packed, dim=-1, count=B, dtype=torch.float32, out=buf[1:3])
        return buf.sum(-1)

    packed = _packed(2, 11)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a, b = torch.zeros(4, N, B), torch.zeros(4, N, B)
    torch.testing.assert_close(compiled(packed, a), step(packed, b))
    assert torch.equal(a, b)


def _export(kind: str, path: Path) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(_model(kind), (_packed(2, 1),), dynamic_shapes={"packed": {0: batch}})
    torch.export.save(ep, str(path))
    return ep


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stored", "on_the_fly"])
def test_export_round_trip(tmp_path: Path, kind: str) -> None:
    ep = _export(kind, tmp_path / "model.pt2")
    code = ep.graph_module.code
    assert "torch.ops.bitserve.unpackbits.default" in code
    resample = "banded_forward" if kind == "stored" else "on_the_fly_forward"
    assert f"torch.ops.bitserve.{resample}.default" in code
    loaded = torch.export.load(str(tmp_path / "model.pt2")).module()
    for M in (1, 7):
        packed = _packed(M, 100 + M)
        torch.testing.assert_close(loaded(packed), _model(kind)(packed), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_exported_program_loads_in_a_fresh_process_once_gpu_ops_is_imported(
    tmp_path: Path,
) -> None:
    """What the server does: ``import gpu_ops`` registers the ops, then ``torch.export.load``."""
    _export("stored", tmp_path / "model.pt2")
    packed = _packed(3, 5)
    torch.save(packed, tmp_path / "packed.pt")  # our own tensor file, read back below
    expected = _model("stored")(packed)
    root = Path(__file__).resolve().parents[2]
    code = (
        "import json, sys, torch\n"
        "with_ops = sys.argv[1] == '1'\n"
        "if with_ops:\n"
        "    import gpu_ops\n"
        f"packed = torch.load({str(tmp_path / 'packed.pt')!r}, weights_only=True)\n"
        f"ep = torch.export.load({str(tmp_path / 'model.pt2')!r})\n"
        "print(json.dumps(ep.module()(packed).tolist()))\n"
    )

    def run(with_ops: bool) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, "1" if with_ops else "0"],
            capture_output=True, text=True, timeout=300, cwd=root,
        )  # fmt: skip

    done = run(True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.tensor(json.loads(done.stdout))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    missing = run(False)
    assert missing.returncode != 0
    assert "bitserve" in missing.stderr
