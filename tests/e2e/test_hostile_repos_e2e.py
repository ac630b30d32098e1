"""A hostile repository against real ``bitserve check-repo`` and ``bitserve serve`` processes.

The in-process cases (every kind, one at a time) are ``tests/service/test_hostile_repos.py``;
here several hostile models share one repository with a good one, ``BITSERVE_MAX_OPERATOR_BYTES``
is set in the environment of both commands, and the verdicts are read from the server's
repository index over HTTP.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from harness.server import bitserve_command, start_server
from tests.service.test_hostile_repos import CASES, config, model, tensors

pytestmark = pytest.mark.e2e

HOSTILE = ["symlinked-config", "i64-x", "support-1e12", "corrupt-safetensors", "not-utf8",
           "deep-nesting", "sigma-inf", "symlink-loop"]  # fmt: skip
# "big": a valid operator of 3 x 50 x (40 float32 weights + an int32 start) = 24,600 bytes,
# over the limit below; "good" takes 3 x 5 x (W + 1) x 4 bytes, far under it.
LIMIT = 20_000


def test_check_repo_and_serve_agree_over_http(tmp_path: Path) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    outside.mkdir()
    model(repo / "good")
    model(repo / "big", config(extra="support = 1e6"), tensors(a=50))
    for i, case in enumerate(HOSTILE):
        CASES[case](repo / case, outside / str(i))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BITSERVE_")}
    env["BITSERVE_MAX_OPERATOR_BYTES"] = str(LIMIT)
    check = subprocess.run(
        [*bitserve_command(), "check-repo", str(repo)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert check.returncode == 1, check.stderr
    assert "Traceback" not in check.stderr + check.stdout
    refused = {line.split("/")[1].split(":")[0] for line in check.stderr.splitlines()[:-1]}
    assert refused == {*HOSTILE, "big"}, check.stderr

    with start_server(repo, env={"BITSERVE_MAX_OPERATOR_BYTES": str(LIMIT)}, ready=False,
                      log_dir=tmp_path) as server:  # fmt: skip
        index = httpx.post(server.url + "/v2/repository/index", timeout=30).json()
        ready = httpx.get(server.url + "/v2/health/ready", timeout=30)
        body = {"inputs": [{"name": "bits", "datatype": "BOOL", "shape": [1, 3, 40],
                            "data": np.ones(120, dtype=bool).tolist()}]}  # fmt: skip
        r = httpx.post(server.url + "/v2/models/good/infer", json=body, timeout=30)
    states = {e["name"]: e["state"] for e in index}
    assert {n for n, s in states.items() if s != "READY"} == refused
    assert states["good"] == "READY"
    assert ready.status_code == 503  # strict readiness: some models failed to load
    assert r.status_code == 200, r.text
    reasons = {e["name"]: e["reason"] for e in index}
    assert "max_operator_bytes = 20000 bytes" in reasons["big"]
    assert "needs floating point" in reasons["i64-x"]
    assert str(tmp_path) not in "".join(reasons.values())
