"""End-to-end fixtures: real ``bitserve serve`` processes (``harness.server``, which any test
package and the benchmarks import): ``server_factory`` (start servers with any repository,
flags and environment; all of them are stopped at the end of the test), for a test that needs
a process of its own. A test that only needs a server takes tests/conftest.py's
``shared_server`` (one process per repository, flags and environment for the whole session,
put back through the control plane after each test) or ``demo_server`` (its demo model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.server import BitserveServer, start_server


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., BitserveServer]]:
    """Start servers with :func:`start_server`'s arguments; all are stopped after the test."""
    stack = contextlib.ExitStack()

    def start(repository: Path | None = None, **kwargs: object) -> BitserveServer:
        kwargs.setdefault("log_dir", tmp_path)
        return stack.enter_context(start_server(repository, **kwargs))  # type: ignore[arg-type]

    with stack:
        yield start
