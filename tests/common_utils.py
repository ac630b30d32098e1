"""Helpers shared by the test modules (after torchvision's ``test/common_utils.py``)."""

from __future__ import annotations

from typing import Any

import pytest

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def cpu_and_cuda() -> tuple[Any, ...]:
    """Device parameters: ``"cpu"`` always, ``"cuda"`` marked ``needs_cuda``."""
    return ("cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda))
