"""Triton's perf_analyzer (C++) against a real ``bitserve serve`` of Triton's "simple" model,
with system shared memory and with ``--collect-metrics``: it must run and print its
server-side section, which it builds from the statistics extension. Skipped where
perf_analyzer is not installed (``PERF_ANALYZER``, ``perf_analyzer`` on PATH, or
``../shared/tools/perf-analyzer.sh``, see ``benchmarks.overhead.perf``)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.server import BitserveServer, perf_analyzer, start_server
from tests.e2e.triton_simple import write_simple

pytestmark = pytest.mark.e2e

COMMAND = perf_analyzer()
# Short windows and a loose stability bound: this checks that it works, not how fast.
QUICK = ["-p", "400", "--max-trials", "6", "--stability-percentage", "999"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BitserveServer]:
    if COMMAND is None:
        pytest.skip("perf_analyzer is not installed")
    repo = tmp_path_factory.mktemp("pa-repo")
    write_simple(repo)
    logs = tmp_path_factory.mktemp("pa-logs")
    with start_server(repo, args=["--allow-client-shm", "--no-access-log"], log_dir=logs) as s:
        yield s


def run(server: BitserveServer, *flags: str, protocol: str = "http") -> str:
    assert COMMAND is not None
    url = server.host_port if protocol == "http" else server.grpc_target
    cmd = [*COMMAND, "-m", "simple", "-u", url, "-i", protocol, *QUICK, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path.cwd())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def server_section(out: str) -> dict[str, int]:
    """The counts of perf_analyzer's server-side section (from the statistics extension)."""
    assert "Server: " in out, out[-4000:]
    counts = {
        key: int(value)
        for key, value in re.findall(
            r"(Inference count|Execution count|Successful request count): (\d+)", out
        )
    }
    assert set(counts) == {"Inference count", "Execution count", "Successful request count"}
    assert re.search(
        r"Avg request latency: \d+ usec \(overhead \d+ usec \+ queue \d+ usec \+ compute input "
        r"\d+ usec \+ compute infer \d+ usec \+ compute output \d+ usec\)",
        out,
    ), out[-4000:]
    return counts


def test_perf_analyzer_with_system_shared_memory(server: BitserveServer) -> None:
    out = run(server, "--concurrency-range", "2", "--shared-memory", "system")
    counts = server_section(out)
    assert counts["Successful request count"] > 0
    assert counts["Inference count"] >= counts["Execution count"] > 0
    log = server.log()
    for region in ("INPUT0_0_0", "INPUT1_0_0", "OUTPUT0", "OUTPUT1"):
        assert f"shared memory region '{region}' registered" in log, region


def test_perf_analyzer_collects_metrics(server: BitserveServer) -> None:
    out = run(
        server,
        "--concurrency-range",
        "1",
        "--collect-metrics",
        "--metrics-url",
        f"{server.host_port}/metrics",
        "--metrics-interval",
        "200",
    )
    assert server_section(out)["Successful request count"] > 0
    assert "Server Prometheus Metrics" in out


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
def test_perf_analyzer_over_grpc(server: BitserveServer, streaming: bool) -> None:
    flags = ["--concurrency-range", "2"] + (["--streaming"] if streaming else [])
    counts = server_section(run(server, *flags, protocol="grpc"))
    # ModelStatistics over gRPC: the same counts as REST's (perf_analyzer takes the
    # difference over its own windows, so a count is positive only if gRPC calls were counted).
    assert counts["Successful request count"] > 0
    assert counts["Inference count"] >= counts["Execution count"] > 0
