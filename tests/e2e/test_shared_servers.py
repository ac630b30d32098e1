"""The session's shared servers (``harness.server.ServerPool``): one process per repository,
flags and environment, put back through the control plane after each test, and replaced
when a test leaves it dead."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from harness.server import BitserveServer, ServerPool

pytestmark = pytest.mark.e2e


def _state(server: BitserveServer) -> tuple[dict[str, str], dict[str, object]]:
    index = httpx.post(server.url + "/v2/repository/index", json={}, timeout=60).json()
    logging = httpx.get(server.url + "/v2/logging", timeout=60).json()
    return {m["name"]: m["state"] for m in index}, logging


def test_a_changed_server_is_put_back_and_a_dead_one_replaced(tmp_path: Path) -> None:
    pool = ServerPool(tmp_path)
    try:
        server = pool.get()
        assert pool.get() is server  # same repository, flags and environment: same process
        before = _state(server)
        assert before[0] == {"demo": "READY"}

        # What a test may do through the control plane: unload, change the log settings.
        httpx.post(server.url + "/v2/repository/models/demo/unload", json={}, timeout=60)
        flipped = not before[1]["log_info"]
        httpx.post(server.url + "/v2/logging", json={"log_info": flipped}, timeout=60)
        assert _state(server) == ({"demo": "UNAVAILABLE"}, {**before[1], "log_info": flipped})

        pool.reset(server)
        assert pool.get() is server
        assert server.process.poll() is None
        assert _state(server) == before

        # A test that kills its server: the next get starts a fresh one.
        server.terminate()
        pool.reset(server)
        fresh = pool.get()
        assert fresh is not server
        assert fresh.process.poll() is None
        assert _state(fresh) == before
    finally:
        pool.close()
    assert fresh.process.poll() is not None
