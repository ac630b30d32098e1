"""deploy/nginx/bitserve.conf: valid for ``nginx -t``, and doing its job for real.

A real nginx (Debian's package; `make system-deps` installs it) runs the deployed site config
with only the upstream and listen addresses rewritten to loopback, unprivileged (every path
under a temporary prefix). One real ``bitserve serve --workers 2`` stands behind it, as in
docker-compose; one of its workers is killed mid-stream, restarted by the supervisor, and must
serve again; then the supervisor itself is killed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import psutil
import pytest

from service.settings import Settings

from ._nginx import (
    SITE,
    loopback_site,
    nginx_binary,
    nginx_command,
    running_nginx,
    upstream_servers,
    write_config,
)
from ._replicas import Replica, decode_output, free_port, infer_body

NGINX = nginx_binary()
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (make system-deps)")
MODEL = "demo"


def directive(name: str) -> list[str]:
    return re.findall(rf"^\s*{name}\s+([^;]+);", SITE.read_text(), re.MULTILINE)


def size_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", text).groups()  # type: ignore[union-attr]
    return int(number) << {"": 0, "k": 10, "m": 20, "g": 30}[unit.lower()]


def test_directives_the_deployment_relies_on() -> None:
    # One service, listed twice (a retry's second path), never taken out of rotation.
    servers = [line for line in directive("server") if ":" in line]  # not server_name
    assert servers == ["bitserve:8000 max_fails=0"] * 2
    assert upstream_servers() == ["bitserve:8000"] * 2
    # Connections turn over, so a restarted worker gets its share back.
    assert directive("keepalive_time") == ["10s"]
    (next_upstream,) = directive("proxy_next_upstream")
    assert set(next_upstream.split()) == {
        "error",
        "timeout",
        "http_502",
        "http_503",
        "non_idempotent",
    }
    assert int(directive("proxy_next_upstream_tries")[0]) >= len(upstream_servers())
    # Same body limit as the server's default.
    (limit,) = directive("client_max_body_size")
    assert size_bytes(limit) == Settings.model_fields["max_body_bytes"].default


def test_loopback_copy_changes_only_addresses() -> None:
    original = SITE.read_text().splitlines()
    copy = loopback_site([40001, 40001], 40000).splitlines()
    changed = [(a.strip(), b.strip()) for a, b in zip(original, copy, strict=True) if a != b]
    assert changed == [
        ("server bitserve:8000 max_fails=0;", "server 127.0.0.1:40001 max_fails=0;"),
        ("server bitserve:8000 max_fails=0;", "server 127.0.0.1:40001 max_fails=0;"),
        ("listen 8080;", "listen 127.0.0.1:40000;"),
    ]


@needs_nginx
def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    assert NGINX is not None
    port = free_port()
    conf = write_config(tmp_path, [port, port], free_port())
    result = subprocess.run(
        nginx_command(NGINX, tmp_path, conf, "-t"), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


@needs_nginx
def test_nginx_refuses_a_broken_config(tmp_path: Path) -> None:
    # `nginx -t` above must be able to fail.
    assert NGINX is not None
    port = free_port()
    conf = write_config(tmp_path, [port, port], free_port())
    site = tmp_path / "bitserve.conf"
    site.write_text(site.read_text().replace("max_fails=0;", "max_fails=none;", 1))
    result = subprocess.run(
        nginx_command(NGINX, tmp_path, conf, "-t"), capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "max_fails=none" in result.stderr


@pytest.mark.e2e
@needs_nginx
def test_nginx_own_errors_are_v2_json(tmp_path: Path) -> None:
    # bitserve is not running: nginx answers itself, in the V2 error shape, with a 503 and
    # Retry-After that V2 clients retry (not a bare 502).
    assert NGINX is not None
    port, upstream = free_port(), free_port()
    conf = write_config(tmp_path, [upstream, upstream], port)
    with running_nginx(NGINX, tmp_path, conf, port) as base:
        response = httpx.post(f"{base}/v2/models/{MODEL}/infer", content=b"{}", timeout=30)
        assert response.status_code == 503
        assert response.headers["content-type"] == "application/json"
        assert response.headers["retry-after"] == "1"
        assert "not running or restarting" in response.json()["error"]
        # A body over the limit is refused from its Content-Length, before it is sent.
        limit = Settings.model_fields["max_body_bytes"].default
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {limit + 1}\r\nConnection: close\r\n\r\n".encode()
            )
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), head
        assert b'"error"' in body


def random_inputs(metadata: dict[str, Any], n: int, seed: int) -> list[npt.NDArray[np.uint8]]:
    """``n`` random bit-packed inputs of the model's wire shape, batch 1."""
    (spec,) = metadata["inputs"]
    assert spec["datatype"] == "UINT8"
    shape = [1, *spec["shape"][1:]]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=shape, dtype=np.uint8) for _ in range(n)]


@pytest.mark.e2e
@needs_nginx
def test_a_dying_worker_is_invisible_behind_nginx(tmp_path: Path, server: Replica) -> None:
    assert NGINX is not None
    metadata = httpx.get(f"{server.url}/v2/models/{MODEL}", timeout=30).json()
    input_name = metadata["inputs"][0]["name"]
    output_name = metadata["outputs"][0]["name"]
    inputs = random_inputs(metadata, 8, seed=0)
    # Reference answers, straight from the server (any worker: the model is deterministic).
    with httpx.Client(timeout=60) as direct:
        expected = []
        for x in inputs:
            body, headers = infer_body(input_name, x, "UINT8", output_name)
            r = direct.post(f"{server.url}/v2/models/{MODEL}/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            expected.append(decode_output(r, output_name))

    port = free_port()
    prefix = tmp_path / "nginx"
    conf = write_config(prefix, [server.port, server.port], port)
    with running_nginx(NGINX, prefix, conf, port) as base, httpx.Client(timeout=60) as client:
        url = f"{base}/v2/models/{MODEL}/infer"
        workers: Counter[str] = Counter()

        def send(i: int) -> tuple[int, int, npt.NDArray[Any] | str]:
            k = i % len(inputs)
            body, headers = infer_body(input_name, inputs[k], "UINT8", output_name)
            r = client.post(url, content=body, headers={**headers, "X-Request-ID": f"req-{i}"})
            if r.status_code != 200:
                return k, r.status_code, r.text
            assert r.headers.get("X-Request-ID") == f"req-{i}"
            workers[r.headers["X-Bitserve-Worker"]] += 1
            return k, 200, decode_output(r, output_name)

        def check(results: list[tuple[int, int, npt.NDArray[Any] | str]]) -> None:
            for k, status, out in results:
                assert status == 200, out
                assert isinstance(out, np.ndarray)
                np.testing.assert_array_equal(out, expected[k])

        before = server.successes(MODEL)
        # 1. Every answer right, and both workers take part. nginx keeps its few upstream
        # connections alive and the kernel hashes each to a worker, so all of them can land
        # on one (the kernel promises no spread); they live at most keepalive_time (10 s),
        # and new ones are hashed afresh: rounds go on until both workers have answered.
        sent = 0
        deadline = time.monotonic() + 120
        with ThreadPoolExecutor(8) as pool:
            while set(workers) != {"0", "1"}:
                assert time.monotonic() < deadline, f"one worker took every connection: {workers}"
                check(list(pool.map(send, range(sent, sent + 40))))
                sent += 40
                time.sleep(0.5)
        assert server.successes(MODEL) - before == sent  # /metrics counts both workers

        # 2. A bounded stream; worker 1 is SIGKILLed once a third of it is done. What may
        # fail, and only once: a request in flight on worker 1 (its response had begun:
        # nginx cannot retry it, the client sees a cut connection) and a request whose both
        # tries met nginx's kept-alive connections to the dead worker before nginx read their
        # close (503 + Retry-After). Which requests start in that window, between the kill
        # and nginx's next look at its connections, is timing; so the stream is held back
        # from the kill until one probe has gone through nginx after the worker was gone
        # (nginx reads every close queued before the probe arrived), and the requests that
        # may fail are exactly those in flight at the kill. The client retries each once
        # after the window, as bitserve_client does, and every retry must succeed.
        n, kill_after = 90, 30
        done = threading.Semaphore(0)
        gate = threading.Event()  # set: requests may start
        gate.set()
        lock = threading.Lock()
        in_flight: set[int] = set()
        cut: list[int] = []
        statuses: dict[int, int] = {}  # of the requests that failed once: 0 (cut) or 503

        def tracked(i: int) -> tuple[int, int, npt.NDArray[Any] | str]:
            while True:
                gate.wait()
                with lock:
                    if gate.is_set():
                        in_flight.add(i)
                        break
            try:
                try:
                    answer = send(i)
                except httpx.TransportError:
                    answer = (i % len(inputs), 0, "cut")
            finally:
                with lock:
                    in_flight.discard(i)
                done.release()
            if answer[1] in (0, 503):
                cut.append(i)
                statuses[i] = answer[1]
                gate.wait()
                return send(i)
            return answer

        victim = server.worker_pids()[1]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(tracked, i) for i in range(n)]
            for _ in range(kill_after):
                done.acquire()
            with lock:
                gate.clear()
                exposed = set(in_flight)
            os.kill(victim, signal.SIGKILL)
            wait_gone(victim)
            probe(url, send)
            gate.set()
            results = [f.result() for f in futures]
        check(results)
        # Never a cut connection outside the window. A 503 (an answer, with Retry-After) may
        # come later on a busy host: nginx's tries can all meet the replacement worker while
        # it is still starting (seen in CI at load 10+).
        late = {i: statuses[i] for i in cut if i not in exposed}
        assert all(status == 503 for status in late.values()), (late, exposed)

        # 3. The supervisor restarts worker 1 (same port, same models) and it serves again.
        deadline = time.monotonic() + 120
        while server.worker_pids()[1] == victim or not ready(server):
            assert time.monotonic() < deadline, server.log.read_text()[-3000:]
            time.sleep(0.2)
        assert f"worker 1 (pid {victim}) was killed by signal 9" in server.log.read_text()
        # nginx's connections opened while worker 1 was down all go to worker 0; they live
        # at most keepalive_time (10 s), and new ones are hashed over both workers again.
        workers.clear()
        deadline = time.monotonic() + 120
        with ThreadPoolExecutor(4) as pool:
            while not workers["1"]:
                assert time.monotonic() < deadline, workers
                check(list(pool.map(send, range(20))))
                time.sleep(0.2)

    # 4. The image's health check command tells ready from gone on the real server; a killed
    # supervisor's workers notice and stop too (nothing is left serving).
    from .test_dockerfile import healthcheck_command

    command = [sys.executable, *healthcheck_command()[1:]]
    env = {"BITSERVE_PORT": str(server.port), "PATH": "/usr/bin:/bin"}
    assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode == 0
    pids = list(server.worker_pids().values())
    server.kill()
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, "workers outlived their supervisor"
        time.sleep(0.2)
    assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode != 0


def wait_gone(pid: int) -> None:
    """Until ``pid`` has exited (a zombie counts: its sockets are closed)."""
    deadline = time.monotonic() + 60
    while psutil.pid_exists(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        assert time.monotonic() < deadline, f"pid {pid} outlived SIGKILL"
        time.sleep(0.01)


def probe(url: str, send: Callable[[int], tuple[int, int, object]]) -> None:
    """Send requests through nginx until one is answered 200.

    A try that fails meets (and so removes) a kept-alive connection to a dead worker; once
    one request has been answered, nginx has read every close that came before it.
    """
    for attempt in range(20):
        with contextlib.suppress(httpx.TransportError):
            if send(1_000_000 + attempt)[1] == 200:
                return
    raise AssertionError(f"nothing went through {url} in 20 tries")


def ready(server: Replica) -> bool:
    try:
        return httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
