"""Two real ``bitserve serve`` replicas (demo model, CPU) shared by the deploy e2e tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ._replicas import Replica, free_port


def _start_all(replicas: list[Replica]) -> None:
    # In parallel: each spends most of its start-up importing torch and warming up.
    errors: list[BaseException] = []

    def run(r: Replica) -> None:
        try:
            r.start()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def replica_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("replicas")
    pool = [Replica(port=free_port(), log=logs / f"replica{i}.log") for i in range(2)]
    try:
        _start_all(pool)
        yield pool
    finally:
        for r in pool:
            r.stop()


@pytest.fixture
def replicas(replica_pool: list[Replica]) -> list[Replica]:
    """Both replicas, running (one a previous test killed is started again, same port)."""
    _start_all([r for r in replica_pool if r.proc is None or r.proc.poll() is not None])
    return replica_pool
