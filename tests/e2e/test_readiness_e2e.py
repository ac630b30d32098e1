"""Honest readiness (issue 19): one model that fails to load, with and without strictness.

With ``--strict-readiness`` (the default, as in Triton) the server is not ready and says
which model failed and why; with ``--no-strict-readiness`` it is ready once every model is
READY or has failed, so one bad model does not take a healthy server out of a load balancer.
Both with one process and with ``--workers 2``.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from harness.server import BitserveServer, start_server
from tests.service.test_hostile_repos import model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("readiness") / "repo"
    model(root / "good")
    model(root / "bad")
    (root / "bad" / "op.safetensors").write_bytes(b"\0" * 16)  # not a safetensors file
    return root


def _wait_for(server: BitserveServer, status: int, timeout: float = 120.0) -> httpx.Response:
    """``/v2/health/ready`` once it answers ``status`` with every worker started (the models
    load after start; the worker that answers may have loaded while a peer still starts)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(server.url + "/v2/health/ready", timeout=10)
        index = httpx.post(server.url + "/v2/repository/index", json={}, timeout=10).json()
        loaded = all(e["state"] in ("READY", "UNAVAILABLE") for e in index)
        starting = r.status_code == 503 and "starting or catching up" in r.json()["error"]
        if (r.status_code == status and loaded and not starting) or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_strict_readiness_names_the_failed_model(repo: Path, workers: str) -> None:
    with start_server(repo, args=["--workers", workers], ready=False) as server:
        r = _wait_for(server, 503)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error.startswith(
            "server is not ready: model 'bad' version 1 failed to load; serve with "
            "--no-strict-readiness to be ready without it: repo/bad/config.toml: "
            "operator.file: not a readable safetensors file: SafetensorError: "
        ), error
        if workers == "2":  # the worker that answers, or its peer, names it alike
            assert "worker(s)" not in error
        good = httpx.get(server.url + "/v2/models/good/ready", timeout=10)
        assert good.status_code == 200


@pytest.mark.parametrize("workers", ["1", "2"])
def test_no_strict_readiness_is_ready_without_the_failed_model(repo: Path, workers: str) -> None:
    # The flag, and (one worker) its environment variable.
    flag = ["--no-strict-readiness"] if workers == "2" else []
    env = {"BITSERVE_STRICT_READINESS": "false"} if workers == "1" else {}
    with start_server(repo, args=["--workers", workers, *flag], env=env) as server:
        assert httpx.get(server.url + "/v2/health/ready", timeout=10).status_code == 200
        bad = httpx.get(server.url + "/v2/models/bad/ready", timeout=10)
        assert bad.status_code == 503
        assert "not a readable safetensors file" in bad.json()["error"]
