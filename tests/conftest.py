"""Shared test set-up: the ``needs_cuda`` marker, Triton's CPU interpreter, anyio on asyncio,
hypothesis's profile."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis times its own input generation (HealthCheck.too_slow), and a loaded machine slows
# it (seen: one input in 59 s for the schemathesis test): a timing, not a property of the code
# under test. Tests that set their own suppress_health_check list it there too.
settings.register_profile("bitserve", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("bitserve")

if TYPE_CHECKING:
    from harness.server import BitserveServer

# The client tests also run in a venv without torch (see `make client-isolated`).
try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - only in the client-only venv
    HAS_CUDA = False

# Triton decides at decoration time whether kernels are interpreted, so this must be set
# before any kernel module is imported. On a host without CUDA the kernels then run on CPU
# tensors (small inputs only).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def anyio_backend() -> str:
    """``@pytest.mark.anyio`` tests run on asyncio (the server's loop), never trio."""
    return "asyncio"


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BitserveServer]:
    """One ``bitserve serve`` of the built-in demo model, shared by the whole session.

    For tests that only call it and leave it as they found it (a model unloaded is loaded
    again); a test that changes its settings, kills it or watches its process starts its own
    (tests/e2e's ``server_factory``).
    """
    from harness.server import start_server  # not in the client-only venv's imports

    with start_server(log_dir=tmp_path_factory.mktemp("demo-server")) as server:
        yield server


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "needs_cuda" in item.keywords:
            item.add_marker(skip)
