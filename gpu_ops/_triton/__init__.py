"""Triton kernels. Importing this package requires ``triton``; callers check first."""

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
