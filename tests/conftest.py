"""Shared test set-up: the ``needs_cuda`` marker, Triton's CPU interpreter, anyio on asyncio,
hypothesis's profile, the session's shared servers (``server_pool``, ``shared_server``,
``demo_server``)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis times its own input generation (HealthCheck.too_slow), and a loaded machine slows
# it (seen: one input in 59 s for the schemathesis test): a timing, not a property of the code
# under test. Tests that set their own suppress_health_check list it there too.
settings.register_profile("bitserve", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("bitserve")

if TYPE_CHECKING:
    from harness.server import BitserveServer, ServerPool

# The client tests also run in a venv without torch (see `make client-isolated`).
try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - only in the client-only venv
    HAS_CUDA = False

# Each test process (each pytest-xdist worker) compiles into an inductor cache of its own:
# processes compiling the same graph into one cache at once have packaged a half-written file
# (CI: an AOTInductor package whose wrapper_metadata.json was empty). Removed at exit.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="bitserve-test-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)

# Triton decides at decoration time whether kernels are interpreted, so this must be set
# before any kernel module is imported. On a host without CUDA the kernels then run on CPU
# tensors (small inputs only).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Ray's default wait for its node to start (60 s) is too short on a busy 2-core machine
# (tests/ray and the `bitserve score` processes they start): a deadline, never a measure.
os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
# Ray Serve's controller kills a proxy not ready within 5 s (seen in CI: serve.start() failed
# with the proxy "killed by ray.kill ... before it started running"); deadlines, not measures.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")


@pytest.fixture
def anyio_backend() -> str:
    """``@pytest.mark.anyio`` tests run on asyncio (the server's loop), never trio."""
    return "asyncio"


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """The session's shared ``bitserve serve`` processes (``harness.server.ServerPool``): one
    per repository, flags and environment, each started on first use (one per pytest-xdist
    worker) and stopped at the end of the session."""
    from harness.server import ServerPool  # not in the client-only venv's imports

    pool = ServerPool(tmp_path_factory.mktemp("shared-servers"))
    yield pool
    pool.close()


@pytest.fixture
def shared_server(server_pool: ServerPool) -> Iterator[Callable[..., BitserveServer]]:
    """``shared_server(repository=None, args=(), env=None)``: the session's server of that
    repository, flags and environment, put back as it became ready after the test (models
    loaded and unloaded, log and trace settings, through the control plane).

    For tests that need a server but not a fresh process: a test that kills it, watches its
    process from the start (threads, memory, exit status) or asserts exact statistics takes
    one of its own (tests/e2e's ``server_factory``).
    """
    used: list[BitserveServer] = []

    def get(repository: Path | None = None, **kwargs: Any) -> BitserveServer:
        server = server_pool.get(repository, **kwargs)
        used.append(server)
        return server

    yield get
    for server in used:
        server_pool.reset(server)


@pytest.fixture
def demo_server(shared_server: Callable[..., BitserveServer]) -> BitserveServer:
    """The session's ``bitserve serve`` of the built-in demo model with the default flags (the
    docs', the client's and the end-to-end tests share it), put back after each test."""
    return shared_server()


_SERVER_LOGGERS = ("service", "gpu_ops", "uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture(autouse=True)
def _logging_put_back() -> Iterator[None]:
    """Put the server's loggers back as each test found them: a server run in process applies
    its log settings (``log_level="warning"`` sets the ``service`` logger's level), which would
    hide records from a later test's ``caplog`` in the same worker, whatever the order."""
    saved = [
        (lg, lg.level, lg.propagate, lg.disabled, list(lg.handlers))
        for lg in map(logging.getLogger, _SERVER_LOGGERS)
    ]
    yield
    for lg, level, propagate, disabled, handlers in saved:
        lg.setLevel(level)
        lg.propagate, lg.disabled, lg.handlers = propagate, disabled, handlers


def _group(nodeid: str) -> str:
    """A test's pytest-xdist group: its module, or all of tests/ray as one."""
    path = nodeid.split("::", 1)[0].split("@", 1)[0]
    return "ray" if path.startswith("tests/ray/") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by :func:`_group`, read from each test's id.

    pytest-xdist's own loadgroup reads the ``xdist_group`` marks in each worker and appends
    the group to the test's id (``item._nodeid``), which pytest 9 no longer reads (a node's
    id is ``item._id``): every test became a unit of its own, and a module's fixtures
    (servers, compiled packages) were built in each worker that ran one of its tests (the
    formats tests' three times: 500 s of CI; pytest-dev/pytest-xdist#1386, open). The same
    units, found here from the ids.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ModuleGroups(config, log)


def _turn(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return 2 if path.startswith("tests/ray/") else 1 if path.endswith("test_container.py") else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-xdist (`make test`: --dist loadgroup): a module's tests run in one worker, so its
    # module fixtures (servers included) start once; every Ray test runs in the same worker,
    # since two Ray clusters starting at once on one machine time out.
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item.nodeid)))
    # The end-to-end tier hands out groups in this order (`make test`: --no-loadscope-reorder):
    # the container tests (they wait for the stand-in images CI builds meanwhile) and Ray's
    # last. Ray's first was tried: its node start-up (a fixed 30 s deadline in Ray) and Serve's
    # proxy (60 s) timed out while the other groups started their servers.
    items.sort(key=_turn)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "needs_cuda" in item.keywords:
            item.add_marker(skip)
