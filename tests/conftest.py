"""Shared test set-up: the ``needs_cuda`` marker and Triton's CPU interpreter."""

from __future__ import annotations

import os

# Triton decides at decoration time whether kernels are interpreted, so this must be set
# before any kernel module is imported. On a host without CUDA the kernels then run on CPU
# tensors (small inputs only).
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "needs_cuda" in item.keywords:
            item.add_marker(skip)
