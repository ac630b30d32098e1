"""Triton is imported at the first CUDA call, not with ``gpu_ops``: its registered CUDA
kernels, called here on CPU tensors under ``TRITON_INTERPRET=1``, import it and answer as
NumPy does."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from gpu_ops import _bits_ops, _events_ops, _resample_ops
from gpu_ops._lazy_triton import TritonKernels, triton_kernels
from tests.common_utils import HAS_TRITON, needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_importing_gpu_ops_and_the_server_pipeline_leaves_triton_alone() -> None:
    code = (
        "import sys, gpu_ops, service.models.pipeline, service.models.builder\n"
        "import gpu_ops._bits_ops, gpu_ops._events_ops, gpu_ops._resample_ops\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=300)  # fmt: skip
    assert done.stdout.strip() == "[]", done.stdout


def test_cuda_kernels_are_registered_where_triton_is_installed() -> None:
    for op in (_bits_ops.packbits, _bits_ops.unpackbits, _bits_ops.unpackbits_into,
               _resample_ops.banded_forward, _resample_ops.on_the_fly_forward,
               _events_ops.bit_counts, _events_ops.prefix_forward):  # fmt: skip
        assert ("cuda" in op.kernels) == HAS_TRITON, op.name
    assert (triton_kernels("bits") is None) == (not HAS_TRITON)


@needs_triton
def test_the_first_call_imports_the_kernel_module() -> None:
    kernels = TritonKernels("bits")
    assert "not imported yet" in repr(kernels)
    from gpu_ops._triton import bits

    assert kernels.unpack_into is bits.unpack_into
    assert "imported" in repr(kernels)
    assert "not imported" not in repr(kernels)


@needs_triton
def test_the_registered_cuda_kernels_answer_as_numpy() -> None:
    """The bodies the dispatcher calls for CUDA tensors, through the lazy module (on CPU
    tensors where the interpreter runs them)."""
    rng = np.random.default_rng(0)
    bits = rng.random((3, 21)) < 0.4
    for order in ("big", "little"):
        packed = np.packbits(bits, axis=-1, bitorder=order)
        x = torch.from_numpy(packed).to(DEVICE)
        got = _bits_ops.unpackbits.kernels["cuda"](x, 1, 21, order, torch.float32)
        np.testing.assert_array_equal(got.cpu().numpy(), bits.astype(np.float32))
        again = _bits_ops.packbits.kernels["cuda"](got.to(torch.bool), 1, order)
        np.testing.assert_array_equal(again.cpu().numpy(), packed)
    counts = _events_ops.bit_counts.kernels["cuda"](torch.from_numpy(packed).to(DEVICE))
    np.testing.assert_array_equal(counts.cpu().numpy(), bits.sum(axis=1))
