"""service.observability.heap: long-lived objects frozen out of the collector, garbage still
freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from service.observability import heap


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test session as it was


def test_settle_freezes_what_lives() -> None:
    kept = _Node()
    heap.settle()
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(kept)
    # A full collection no longer visits the frozen objects: the count of objects it sees
    # is far below what is frozen.
    assert len(gc.get_objects(generation=2)) < gc.get_freeze_count()


def test_a_frozen_cycle_that_became_garbage_is_freed_by_the_next_settle() -> None:
    node = _Node()
    gone = weakref.ref(node)
    heap.settle()  # node is frozen now
    del node
    gc.collect()
    assert gone() is not None  # frozen: the collector does not see the cycle
    heap.settle()  # a model unloaded: the next change's settle frees it
    assert gone() is None


def test_garbage_made_before_settle_is_not_frozen() -> None:
    node = _Node()
    gone = weakref.ref(node)
    del node
    heap.settle()
    assert gone() is None


def test_the_server_process_settles_after_start_and_after_each_load_or_unload() -> None:
    """``bitserve serve``'s server (``service.server.BitServer.run``) over the fake repository:
    frozen once started, and again after a load and an unload (not after other changes)."""
    import asyncio
    import socket
    import threading
    import time

    from service.cluster.changes import LoadModel, UnloadModel, UpdateLogSettings
    from service.server import BitServer
    from service.settings import Settings
    from tests.service.app_fakes import FakeRepository

    gc.unfreeze()
    settings = Settings(access_log=False, log_level="warning", grpc_port=0)
    server = BitServer(settings, FakeRepository())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(
        target=server.run, args=(None,), kwargs={"sockets": [sock]}, daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 10
    control = server.control
    while control.models_changed is None:  # set once the start-up is over
        assert thread.is_alive(), "the server stopped"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        assert control.models_changed is heap.settle
        while gc.get_freeze_count() == 0:  # the settle right after
            assert time.monotonic() < deadline, "nothing was frozen"
            time.sleep(0.01)
        calls: list[str] = []
        control.models_changed = lambda: calls.append("settled")
        name = next(iter(server.repository.models))  # type: ignore[attr-defined]
        for change in (LoadModel(name, None), UpdateLogSettings({}), UnloadModel(name)):
            asyncio.run(control.apply(change))
        assert calls == ["settled", "settled"]
    finally:
        assert server.http is not None
        server.http.should_exit = True
        thread.join(10)
        sock.close()
