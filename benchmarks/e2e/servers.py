"""The servers the end-to-end benchmark compares, how to install, start and stop each one.

Every server is a separate process bound to 127.0.0.1 on a free port. bitserve and the
hand-written baseline run from the main ``.venv``; MLServer and KServe each get their own venv
under ``benchmarks/e2e/.venvs/`` (created on first use; ``torch==2.13.0`` is pinned in the same
pip command so pip never pulls another torch). All servers import the shared workload with the
repository root on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.server import free_port
from harness.wire import Format
from harness.workload import MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / "benchmarks" / "e2e" / ".venvs"
TORCH_PIN = "torch==2.13.0"
DEMO_MODEL = "demo"
"""bitserve serves its built-in demo model, which is this workload (same seed and sizes)."""


@dataclass(frozen=True)
class Server:
    """One server program: where it lives and how it is started."""

    name: str
    venv_packages: tuple[str, ...] = ()
    """Packages of its own venv; empty = the main venv (the interpreter running this)."""
    health_path: str = "/v2/health/ready"
    infer_path: str = f"/v2/models/{MODEL_NAME}/infer"
    extra_env: dict[str, str] = field(default_factory=dict)

    def python(self) -> Path:
        """The interpreter that runs this server."""
        if not self.venv_packages:
            return Path(sys.executable)
        return VENVS / self.name / "bin" / "python"

    def command(self, port: int, workdir: Path, grpc_port: int = 0) -> list[str]:
        """The argv that starts the server on ``port`` (files it needs go to ``workdir``);
        bitserve's gRPC goes on ``grpc_port`` (0: off)."""
        py = str(self.python())
        if self.name == "bitserve":
            return [
                py, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--grpc-port", str(grpc_port),
            ]  # fmt: skip
        if self.name == "baseline":
            return [py, "-m", "benchmarks.e2e.peers.baseline_app", "--port", str(port)]
        if self.name == "kserve":
            return [py, "-m", "benchmarks.e2e.peers.kserve_server", "--port", str(port)]
        if self.name == "mlserver":
            write_mlserver_settings(workdir, port, free_port(), free_port())
            return [str(self.python().parent / "mlserver"), "start", str(workdir)]
        raise ValueError(f"unknown server {self.name!r}")


BITSERVE = Server(
    "bitserve",
    infer_path=f"/v2/models/{DEMO_MODEL}/infer",
)
BASELINE = Server("baseline", health_path="/health", infer_path="/predict")
MLSERVER = Server("mlserver", venv_packages=("mlserver", "numpy"))
KSERVE = Server("kserve", venv_packages=("kserve", "numpy"))


@dataclass(frozen=True)
class Peer:
    """One row of the benchmark: a server spoken to in one wire format."""

    label: str
    server: Server
    fmt: Format


PEERS: tuple[Peer, ...] = (
    Peer("bitserve packed UINT8 (binary)", BITSERVE, "packed"),
    Peer("bitserve packed UINT8 (gRPC)", BITSERVE, "grpc"),
    Peer("bitserve packed UINT8 (raw binary form)", BITSERVE, "v2raw"),
    Peer("bitserve BOOL (binary)", BITSERVE, "bool"),
    Peer("bitserve BOOL (JSON)", BITSERVE, "json"),
    Peer("hand-written FastAPI + packbits", BASELINE, "raw"),
    Peer("MLServer BOOL (JSON)", MLSERVER, "json"),
    Peer("KServe BOOL (binary)", KSERVE, "bool"),
    Peer("KServe BOOL (JSON)", KSERVE, "json"),
)
SMOKE_PEERS: tuple[Peer, ...] = (PEERS[0], PEERS[1], PEERS[5])


def write_mlserver_settings(folder: Path, port: int, grpc_port: int, metrics_port: int) -> None:
    """Write MLServer's ``settings.json`` and ``model-settings.json`` into ``folder``.

    ``parallel_workers = 0``: with the uvloop that ``pip install mlserver`` brings today (0.22
    and later) MLServer's default ``parallel_workers = 1`` crashes at start. 0 runs inference
    in the server process itself (no worker process, no IPC of the 6 MB JSON-decoded tensors).
    """
    settings = {
        "host": "127.0.0.1",
        "http_port": port,
        "grpc_port": grpc_port,
        "metrics_port": metrics_port,
        "parallel_workers": 0,
        "debug": False,
    }
    (folder / "settings.json").write_text(json.dumps(settings))
    model = {
        "name": MODEL_NAME,
        "implementation": "benchmarks.e2e.peers.mlserver_runtime.ResampleRuntime",
    }
    (folder / "model-settings.json").write_text(json.dumps(model))


def ensure_venv(server: Server, log: Path) -> None:
    """Create ``server``'s venv with its packages (and the pinned torch) unless it exists."""
    if not server.venv_packages:
        return
    stamp = VENVS / server.name / ".installed"
    if stamp.exists():
        return
    venv = VENVS / server.name
    print(f"installing {server.name} into {venv} (minutes, once)", flush=True)
    with log.open("ab") as out:
        subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=out
        )
        # torch is pinned in the same command so that pip can never pull another build.
        pip = [str(venv / "bin" / "pip"), "install", "-q", TORCH_PIN, *server.venv_packages]
        subprocess.run(pip, check=True, stdout=out, stderr=out)
    stamp.write_text(" ".join(server.venv_packages) + "\n")


def package_version(server: Server, package: str) -> str:
    """``package``'s installed version in ``server``'s interpreter."""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    out = subprocess.run([str(server.python()), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "?"


@dataclass
class Running:
    """A started server: its process, base URL and log file."""

    server: Server
    proc: subprocess.Popen[bytes]
    base_url: str
    log: Path
    grpc_target: str = ""
    """``127.0.0.1:PORT`` of bitserve's gRPC service."""

    @property
    def infer_url(self) -> str:
        return self.base_url + self.server.infer_path


@contextlib.contextmanager
def running(server: Server, workdir: Path, *, start_timeout_s: float = 120.0) -> Iterator[Running]:
    """Start ``server`` on a free loopback port, wait until healthy, stop it on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    grpc_port = free_port()
    log = workdir / f"{server.name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **server.extra_env}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            server.command(port, workdir, grpc_port),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run = Running(server, proc, f"http://127.0.0.1:{port}", log, f"127.0.0.1:{grpc_port}")
    try:
        _wait_healthy(run, start_timeout_s)
        yield run
    finally:
        stop(proc)


def _wait_healthy(run: Running, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    url = run.base_url + run.server.health_path
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            tail = run.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{run.server.name} exited with {run.proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"{run.server.name} not healthy at {url} after {timeout_s} s")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
