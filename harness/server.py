"""A real ``bitserve serve`` process on a free 127.0.0.1 port, for the tests and the benchmarks
(and the commands of the programs they run).

    from harness.server import start_server

    with start_server(repository=None) as server:        # the built-in demo model
        httpx.get(server.url + "/v2/health/ready")
        tritonclient.http.InferenceServerClient(server.host_port)

Each server's output goes to a log file whose tail is included in the failure message if it
does not become ready.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.probes import metric

ROOT = Path(__file__).resolve().parents[1]


# How long a server may take to become ready: seconds on an idle machine, minutes on a
# loaded 2-core one (a deadline, never a measure: a test waits for readiness, then asserts).
STARTUP_S = 300.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bitserve_command() -> list[str]:
    """The ``bitserve`` console script of this interpreter's environment (or ``-m``)."""
    script = Path(sys.executable).with_name("bitserve")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "service.cli"]


@dataclass
class BitserveServer:
    """A running ``bitserve serve`` process.

    Attributes:
        process: the child process.
        port: its TCP port on 127.0.0.1.
        log_path: where its stdout and stderr go.
    """

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    args: list[str] = field(default_factory=list)
    grpc_port: int = 0
    """Its gRPC port on 127.0.0.1 (0: gRPC off)."""

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def host_port(self) -> str:
        """``127.0.0.1:PORT``, the form ``tritonclient.http`` takes."""
        return f"127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        """``127.0.0.1:GRPC_PORT``, the form ``tritonclient.grpc`` takes."""
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        """Everything the server has written so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_S, path: str = "/v2/health/ready") -> None:
        """Poll ``path`` until 200; fail with the log tail if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"bitserve exited with {self.process.returncode} before becoming ready:\n"
                    + self.log()[-4000:]
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"bitserve not ready after {timeout}s:\n" + self.log()[-4000:])

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit (SIGKILL after ``timeout``); return the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


@contextlib.contextmanager
def start_server(
    repository: Path | None = None,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = STARTUP_S,
    log_dir: Path | None = None,
    ready: bool = True,
) -> Iterator[BitserveServer]:
    """Start ``bitserve serve`` on a free loopback port, wait until ready, stop it afterwards.

    Args:
        repository: a model repository folder; None serves the built-in demo model.
        args: extra ``bitserve serve`` flags (e.g. ``["--auth-token", "t"]``).
        env: extra environment variables (e.g. ``{"BITSERVE_MAX_BODY_BYTES": "1024"}``).
            gRPC gets a free port of its own unless ``args`` or ``env`` choose one (never
            the default 8001, which other servers on the machine may hold).
        timeout: seconds to wait for readiness.
        log_dir: where the log file goes (a temporary folder by default).
        ready: wait for ``/v2/health/ready``; False waits for ``/v2/health/live`` only (a
            repository with a model that fails to load is never ready).

    Yields:
        the running server; it is stopped with SIGTERM (then SIGKILL) on exit.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("BITSERVE_")}
    # One process unless a test asks for workers (the default, auto, depends on the host):
    # these tests watch the server process itself (its threads, memory, exit status).
    child_env["BITSERVE_WORKERS"] = "1"
    # The server picks its own kernels; the test-only CPU interpreter would only slow it.
    child_env.pop("TRITON_INTERPRET", None)
    child_env.update(env or {})
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="bitserve-e2e-"))
    attempts = 3
    for attempt in range(attempts):
        port = free_port()
        cmd = [*bitserve_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
        if repository is not None:
            cmd += ["--model-repository", str(repository)]
        grpc_port = _chosen_grpc_port(args, child_env)
        if grpc_port is None:
            grpc_port = free_port()
            cmd += ["--grpc-port", str(grpc_port)]
        cmd += list(args)
        log_path = log_dir / f"bitserve-{port}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env)
        server = BitserveServer(proc, port, log_path, cmd, grpc_port)
        try:
            server.wait_ready(timeout, "/v2/health/ready" if ready else "/v2/health/live")
        except RuntimeError:
            server.terminate(10)
            # Another process may have taken the port between free_port() and bind().
            if "address already in use" in server.log() and attempt + 1 < attempts:
                continue
            raise
        try:
            yield server
        finally:
            server.terminate()
        return


def wait_begun(
    url: str,
    count: int,
    model: str,
    headers: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> None:
    """Until the server has begun ``count`` requests of ``model``: in flight or answered.

    What the server has begun is what a graceful stop promises to answer; a request merely
    sent (its bytes in the socket, unread) is not, whatever the time since it was sent. Read
    off ``/metrics`` (every worker's): the in-flight gauge (any model: call this while only
    ``model``'s requests are in flight) plus ``model``'s answered requests.
    """
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
        begun = metric(text, "bitserve_in_flight_requests", 0.0)
        begun += metric(text, "bitserve_requests_total", 0.0, model=model)
        if begun >= count:
            return
        assert time.monotonic() < deadline, f"{count - begun:.0f} {model} requests never arrived"
        time.sleep(0.05)


def terminate_under_load(
    server: BitserveServer,
    client: Callable[[int], None],
    clients: int,
    stop: threading.Event,
    timeout: float,
    until: Callable[[], bool] | None = None,
) -> tuple[int, float, float]:
    """Run ``client(k)`` in ``clients`` threads, SIGTERM ``server`` once ``until()`` holds (or
    2 s in), then set ``stop``.

    The wait only puts the signal under load: which of the clients' requests the server had
    begun by then is timing, so a test asserts the drain on requests it saw begun
    (:func:`wait_begun`) and, of the load, on those answered before the signal.

    Returns the exit code and the ``time.monotonic()`` of the signal and of the exit; the
    clients' exceptions are raised here.
    """
    with ThreadPoolExecutor(clients) as ex:
        futures = [ex.submit(client, k) for k in range(clients)]
        if until is None:
            time.sleep(2.0)
        deadline = time.monotonic() + 120
        while until is not None and not until():
            assert time.monotonic() < deadline, "the load never got going"
            time.sleep(0.05)
        t_term = time.monotonic()
        code = server.terminate(timeout=timeout)
        t_exit = time.monotonic()
        stop.set()
        for f in futures:
            f.result()
    return code, t_term, t_exit


def _chosen_grpc_port(args: Sequence[str], env: Mapping[str, str]) -> int | None:
    """The gRPC port ``args`` (``--grpc-port N``) or ``env`` choose, else None."""
    for i, a in enumerate(args):
        if a == "--grpc-port" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--grpc-port="):
            return int(a.split("=", 1)[1])
    value = env.get("BITSERVE_GRPC_PORT")
    return int(value) if value else None


_WORKER_STARTED = re.compile(r"worker (\d+) started: pid (\d+)")


def worker_pids_in(log: str) -> dict[int, int]:
    """Each worker index's current pid, from a ``--workers`` supervisor's log (info level)."""
    return {int(i): int(pid) for i, pid in _WORKER_STARTED.findall(log)}


def perf_analyzer() -> list[str] | None:
    """The command that runs Triton's perf_analyzer here, or None when there is none."""
    env = os.environ.get("PERF_ANALYZER")
    if env:
        return [env]
    found = shutil.which("perf_analyzer")
    if found:
        return [found]
    script = ROOT.parent / "shared" / "tools" / "perf-analyzer.sh"
    if script.is_file():
        return ["bash", str(script)]
    return None


@dataclass
class _Baseline:
    """What a shared server's control plane said right after it became ready."""

    ready: dict[str, dict[str, object]]
    """Each READY model's configuration (``GET /v2/models/{name}/config``)."""
    logging: dict[str, object]
    trace: dict[str, object]


class ServerPool:
    """Servers shared by a test session: one per repository, flags and environment.

    ``get`` starts a server the first time a (repository, args, env) is asked for and returns
    the same process afterwards. ``reset`` puts a server back as it was when it became ready,
    through its control plane: models loaded or unloaded since are unloaded or loaded again
    (and a model whose configuration a load changed is loaded again from its files), the log
    and the global trace settings restored. A server that died, or that the reset could not
    put back, is stopped; the next ``get`` starts a fresh one. Statistics and metrics only
    grow: a test on a shared server asserts on differences, or takes a server of its own.
    """

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._stack = contextlib.ExitStack()
        self._servers: dict[tuple[object, ...], tuple[BitserveServer, _Baseline]] = {}
        self._exits: dict[tuple[object, ...], contextlib.ExitStack] = {}

    def get(
        self,
        repository: Path | None = None,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> BitserveServer:
        """The session's server of ``repository`` with ``args`` and ``env`` (started once)."""
        key = (
            None if repository is None else str(Path(repository).resolve()),
            tuple(args),
            tuple(sorted((env or {}).items())),
        )
        held = self._servers.get(key)
        if held is not None and held[0].process.poll() is None:
            return held[0]
        self._drop(key)
        stack = contextlib.ExitStack()
        server = stack.enter_context(
            start_server(repository, args=args, env=env, log_dir=self._log_dir)
        )
        self._exits[key] = stack
        self._servers[key] = (server, _baseline(server))
        return server

    def reset(self, server: BitserveServer) -> None:
        """Put ``server`` back as it became ready, or stop it (the next ``get`` starts anew)."""
        for key, (held, baseline) in list(self._servers.items()):
            if held is server:
                if server.process.poll() is not None or not _restore(server, baseline):
                    self._drop(key)
                return

    def close(self) -> None:
        """Stop every server."""
        for key in list(self._servers):
            self._drop(key)

    def _drop(self, key: tuple[object, ...]) -> None:
        self._servers.pop(key, None)
        stack = self._exits.pop(key, None)
        if stack is not None:
            stack.close()


def _control(server: BitserveServer, method: str, path: str, body: object = None) -> Any:
    """One control-plane call; its JSON answer (an error status raises)."""
    r = httpx.request(method, server.url + path, json=body, timeout=120.0)
    r.raise_for_status()
    return r.json() if r.content else None


def _baseline(server: BitserveServer) -> _Baseline:
    index = _control(server, "POST", "/v2/repository/index", {})
    ready = {
        str(m["name"]): _control(server, "GET", f"/v2/models/{m['name']}/config")
        for m in index
        if m.get("state") == "READY"
    }
    logging = dict(_control(server, "GET", "/v2/logging"))
    return _Baseline(ready, logging, dict(_control(server, "GET", "/v2/trace/setting")))


def _restore(server: BitserveServer, want: _Baseline) -> bool:
    """Load, unload and set through the control plane until ``server`` is as ``want``; whether
    it is now (False: it could not be put back)."""
    try:
        now = _baseline(server)
        for name in set(now.ready) - set(want.ready):
            _control(server, "POST", f"/v2/repository/models/{name}/unload", {})
        for name, config in want.ready.items():
            if now.ready.get(name) != config:
                _control(server, "POST", f"/v2/repository/models/{name}/load", {})
        changed = {k: v for k, v in want.logging.items() if now.logging.get(k) != v}
        if changed:
            _control(server, "POST", "/v2/logging", changed)
        changed = {k: v for k, v in want.trace.items() if now.trace.get(k) != v}
        if changed:
            _control(server, "POST", "/v2/trace/setting", changed)
        return _baseline(server) == want
    except (httpx.HTTPError, ValueError, TypeError, KeyError):
        return False
