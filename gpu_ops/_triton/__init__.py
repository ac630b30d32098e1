"""Triton kernels. Importing a kernel module requires ``triton``; this package itself does not.

The ops import their kernel module in a ``try`` (``None`` without Triton) and dispatch with
:func:`use_triton`, the one rule for every op.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from types import ModuleType

import torch


def use_triton(t: torch.Tensor, kernels: ModuleType | None) -> bool:
    """Whether ``t`` goes to the Triton ``kernels``: a CUDA tensor, and Triton imported.

    Args:
        t: the op's input tensor; CPU (and other) tensors take the CPU/torch paths.
        kernels: the op's kernel module, or ``None`` when Triton could not be imported.
    """
    return kernels is not None and t.device.type == "cuda"


def on_device(t: torch.Tensor) -> AbstractContextManager[object]:
    """Make ``t``'s CUDA device the current one for a launch (a no-op for CPU tensors).

    Triton launches on the current device and its current stream: without this, tensors on
    cuda:1 while cuda:0 is current would be run in the wrong context.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
