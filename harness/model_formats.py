"""A fingerprint MLP written in every model format bitserve serves, for tests and benchmarks.

The model is what a chemist brings: float32 layers over 2048-bit Morgan fingerprints, one
score per molecule. :func:`write_model` writes it as a ``torch.export`` program, an
AOTInductor package, TorchScript or ONNX, with a dynamic batch dimension (or a static one,
a common mistake)::

    module = fingerprint_mlp(hidden=(16,))
    write_model(folder / "model.pt2", "torch_export", module, max_batch=8)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

BITS = 2048
FORMAT_FILES = {
    "torch_export": "model.pt2",
    "aoti": "model.pt2",
    "torchscript": "model.pt",
    "onnx": "model.onnx",
}
"""Each format's file name in a model folder."""


def fingerprint_mlp(hidden: Sequence[int] = (16,), bits: int = BITS, seed: int = 0) -> nn.Module:
    """float32 ``(batch, bits) -> (batch, 1)``: Linear + ReLU per hidden width, then a score."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = bits
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers).eval()


class OutOfRange(nn.Module):
    """A forward that raises on every input it is given here: it looks up row
    ``first bit + 100`` of a 10-row table (an index error in every format).

    The index comes from one bit per item, not a reduction: a pointwise AOTInductor kernel
    over a batch of at most 8 items runs serially and raises (:class:`AbortsInParallel` is
    the one whose kernel aborts the process)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(10, dtype=torch.float32)[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x[:, 0].long() + 100]


class AbortsInParallel(nn.Module):
    """:class:`OutOfRange`'s bad lookup for every bit of every item, summed per item.

    AOTInductor compiles it into a reduction that runs inside an OpenMP parallel region,
    where its failed index check cannot throw: the C++ runtime calls ``std::terminate`` and
    the process that runs it aborts (SIGABRT), at any batch size, when compiled with more
    than one torch thread for inputs of 2048 bits. The other formats raise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(10, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x.long() + 100].sum(1, keepdim=True)


class StaticBatch(nn.Module):
    """TorchScript's form of a static batch: a reshape that hard-codes batch 4."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(4, -1))


def reference(module: nn.Module, bits: np.ndarray) -> np.ndarray:
    """The module's outputs for bool ``bits (batch, n)`` in float64 (weights converted)."""
    with torch.no_grad():
        double = _copy(module).double()
        return double(torch.from_numpy(bits.astype(np.float64))).numpy()


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def export(module: nn.Module, max_batch: int, *, static: bool = False, bits: int = BITS):  # type: ignore[no-untyped-def]
    """``torch.export`` of ``module`` on float32 ``(batch, bits)`` with a dynamic batch
    dimension up to ``max_batch`` (or, ``static``, a batch of 4 only)."""
    example = (torch.zeros(4 if static else 2, bits),)
    shapes = None if static else ({0: torch.export.Dim("batch", min=1, max=max_batch)},)
    return torch.export.export(module, example, dynamic_shapes=shapes)


def write_model(
    path: Path,
    fmt: str,
    module: nn.Module,
    max_batch: int,
    *,
    static: bool = False,
    bits: int = BITS,
) -> Path:
    """Write ``module`` to ``path`` in format ``fmt`` (see :data:`FORMAT_FILES`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # torch's own: TorchScript (and the modules inductor imports) are deprecated, and
        # its pytree code still uses LeafSpec
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)
        return _write(path, fmt, module, max_batch, static=static, bits=bits)


def _write(
    path: Path, fmt: str, module: nn.Module, max_batch: int, *, static: bool, bits: int
) -> Path:
    if fmt == "torchscript":
        scripted = torch.jit.script(StaticBatch(module) if static else module)  # type: ignore[no-untyped-call]
        scripted.save(str(path))
        return path
    if fmt == "onnx":
        example = (torch.zeros(4 if static else 2, bits),)
        dims = None if static else ({0: torch.export.Dim("batch", min=1, max=max_batch)},)
        program = torch.onnx.export(
            module, example, dynamo=True, dynamic_shapes=dims, input_names=["fp"],
            output_names=["score"], verbose=False,
        )  # fmt: skip
        assert program is not None
        program.save(str(path))
        return path
    ep = export(module, max_batch, static=static, bits=bits)
    if fmt == "torch_export":
        torch.export.save(ep, str(path))
    elif fmt == "aoti":
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    else:
        raise ValueError(fmt)
    return path
