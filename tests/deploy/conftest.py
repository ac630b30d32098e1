"""One real ``bitserve serve --workers 2`` (demo model, CPU) shared by the deploy e2e tests:
what docker-compose runs behind nginx and Prometheus scrapes, one service with its workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._replicas import Replica, free_port


@pytest.fixture(scope="session")
def server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    log = tmp_path_factory.mktemp("server") / "bitserve.log"
    # Info level: the supervisor's lines (worker pids, restarts); no access lines.
    env = {"BITSERVE_WORKERS": "2", "BITSERVE_LOG_LEVEL": "info", "BITSERVE_ACCESS_LOG": "false"}
    server = Replica(port=free_port(), log=log, env=env)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(server_process: Replica) -> Replica:
    """The server, running (started again, same port, if a previous test stopped it)."""
    if server_process.proc is None or server_process.proc.poll() is not None:
        server_process.start()
    return server_process


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The container tests last: CI builds their stand-in base images in the background
    (``make standin-images``), and the later they start, the less of that build they wait
    for. The relative order of every other test is kept."""
    last = [item for item in items if item.nodeid.startswith("tests/deploy/test_container.py")]
    if last:
        keep = [item for item in items if item not in last]
        items[:] = keep + last
