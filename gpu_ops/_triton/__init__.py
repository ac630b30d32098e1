"""Triton kernels. Importing a kernel module requires ``triton``; this package itself does not.

The op modules (``gpu_ops._bits_ops``, ``gpu_ops._resample_ops``, ``gpu_ops._events_ops``)
register them as the ops' CUDA kernels when Triton is installed and import them at the first
CUDA call (``gpu_ops._lazy_triton``); without Triton, CUDA tensors take the torch kernels.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch


def on_device(t: torch.Tensor) -> AbstractContextManager[object]:
    """Make ``t``'s CUDA device the current one for a launch (a no-op for CPU tensors).

    Triton launches on the current device and its current stream: without this, tensors on
    cuda:1 while cuda:0 is current would be run in the wrong context.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
