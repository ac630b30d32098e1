"""deploy/nginx/bitserve.conf: valid for ``nginx -t``, and doing its job for real.

A real nginx (Debian's package; `make system-deps` installs it) runs the deployed site config
with only the replica and listen addresses rewritten to loopback, unprivileged (every path
under a temporary prefix). Two real ``bitserve serve`` processes stand behind it; one is killed
mid-stream, restarted, and must rejoin.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
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
    assert re.search(r"upstream bitserve \{[^}]*\bleast_conn;", SITE.read_text())
    for server in directive("server"):
        if ":" in server:  # upstream servers, not server_name
            assert re.search(r"max_fails=\d+ fail_timeout=\d+s", server), server
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
    copy = loopback_site([40001, 40002], 40000).splitlines()
    changed = [(a.strip(), b.strip()) for a, b in zip(original, copy, strict=True) if a != b]
    assert changed == [
        (
            "server replica-0:8000 max_fails=3 fail_timeout=5s;",
            "server 127.0.0.1:40001 max_fails=3 fail_timeout=5s;",
        ),
        (
            "server replica-1:8000 max_fails=3 fail_timeout=5s;",
            "server 127.0.0.1:40002 max_fails=3 fail_timeout=5s;",
        ),
        ("listen 8080;", "listen 127.0.0.1:40000;"),
    ]


@needs_nginx
def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    assert NGINX is not None
    conf = write_config(tmp_path, [free_port(), free_port()], free_port())
    result = subprocess.run(
        nginx_command(NGINX, tmp_path, conf, "-t"), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


@needs_nginx
def test_nginx_refuses_a_broken_config(tmp_path: Path) -> None:
    # `nginx -t` above must be able to fail.
    assert NGINX is not None
    conf = write_config(tmp_path, [free_port(), free_port()], free_port())
    site = tmp_path / "bitserve.conf"
    site.write_text(site.read_text().replace("least_conn;", "least_connections;"))
    result = subprocess.run(
        nginx_command(NGINX, tmp_path, conf, "-t"), capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "least_connections" in result.stderr


@pytest.mark.e2e
@needs_nginx
def test_nginx_own_errors_are_v2_json(tmp_path: Path) -> None:
    # No replica is running: nginx answers 502 itself, in the V2 error shape.
    assert NGINX is not None
    port = free_port()
    conf = write_config(tmp_path, [free_port(), free_port()], port)
    with running_nginx(NGINX, tmp_path, conf, port) as base:
        response = httpx.post(f"{base}/v2/models/{MODEL}/infer", content=b"{}", timeout=30)
        assert response.status_code == 502
        assert response.headers["content-type"] == "application/json"
        assert "error" in response.json()
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
def test_failover_and_rejoin_behind_nginx(tmp_path: Path, replicas: list[Replica]) -> None:
    assert NGINX is not None
    first, second = replicas
    metadata = httpx.get(f"{first.url}/v2/models/{MODEL}", timeout=30).json()
    input_name = metadata["inputs"][0]["name"]
    output_name = metadata["outputs"][0]["name"]
    inputs = random_inputs(metadata, 8, seed=0)
    # Reference answers, straight from one replica; both serve the same deterministic model.
    with httpx.Client(timeout=60) as direct:
        expected = []
        for x in inputs:
            body, headers = infer_body(input_name, x, "UINT8", output_name)
            r = direct.post(f"{first.url}/v2/models/{MODEL}/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            expected.append(decode_output(r, output_name))
        body, headers = infer_body(input_name, inputs[0], "UINT8", output_name)
        r = direct.post(f"{second.url}/v2/models/{MODEL}/infer", content=body, headers=headers)
        np.testing.assert_array_equal(decode_output(r, output_name), expected[0])

    port = free_port()
    prefix = tmp_path / "nginx"
    conf = write_config(prefix, [first.port, second.port], port)
    with running_nginx(NGINX, prefix, conf, port) as base, httpx.Client(timeout=60) as client:
        url = f"{base}/v2/models/{MODEL}/infer"

        def send(i: int) -> tuple[int, int, npt.NDArray[Any] | str]:
            k = i % len(inputs)
            body, headers = infer_body(input_name, inputs[k], "UINT8", output_name)
            r = client.post(url, content=body, headers={**headers, "X-Request-ID": f"req-{i}"})
            if r.status_code != 200:
                return k, r.status_code, r.text
            assert r.headers.get("X-Request-ID") == f"req-{i}"
            return k, 200, decode_output(r, output_name)

        def check(results: list[tuple[int, int, npt.NDArray[Any] | str]]) -> None:
            for k, status, out in results:
                assert status == 200, out
                assert isinstance(out, np.ndarray)
                np.testing.assert_array_equal(out, expected[k])

        before = [r.successes(MODEL) for r in replicas]
        # 1. Both up: every answer right, and both replicas take part.
        with ThreadPoolExecutor(4) as pool:
            check(list(pool.map(send, range(40))))
        during = [r.successes(MODEL) for r in replicas]
        served = [b - a for a, b in zip(before, during, strict=True)]
        assert sum(served) == 40
        assert min(served) > 0, served

        # 2. A bounded stream; the second replica is SIGKILLed once a third of it is done.
        n, kill_after = 90, 30
        done = threading.Semaphore(0)
        results: list[tuple[int, int, npt.NDArray[Any] | str]] = []
        sent_after_kill = 0
        killed = threading.Event()

        cut: list[int] = []

        def tracked(i: int) -> tuple[int, int, npt.NDArray[Any] | str]:
            nonlocal sent_after_kill
            if killed.is_set():
                sent_after_kill += 1  # under the GIL; only a lower bound is used
            try:
                try:
                    return send(i)
                except httpx.TransportError:
                    # The one thing nginx cannot retry: a response the dying replica had
                    # already begun (status line and headers forwarded, body cut). The client
                    # sees a transport error, never a wrong answer, and retries once, as
                    # bitserve_client does.
                    cut.append(i)
                    return send(i)
            finally:
                done.release()

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(tracked, i) for i in range(n)]
            for _ in range(kill_after):
                done.acquire()
            second.kill()
            killed.set()
            results = [f.result() for f in futures]
        check(results)
        # Only requests in flight on the killed replica at that instant can have been cut.
        assert len(cut) <= 4, cut
        assert all(i < kill_after + 4 for i in cut), cut
        assert second.proc is not None
        assert second.proc.poll() is not None
        survivor = first.successes(MODEL) - during[0]
        # Everything sent after the kill can only have been answered by the survivor.
        assert survivor >= sent_after_kill > 0

        # 3. The killed replica restarts on its port and rejoins (after fail_timeout).
        second.start()
        assert second.successes(MODEL) == 0.0
        # nginx tries it again once fail_timeout (5 s) has passed since its last failure;
        # the restart usually takes longer than that, but do not rely on it (bounded).
        with ThreadPoolExecutor(4) as pool:
            for _ in range(20):
                check(list(pool.map(send, range(20))))
                if second.successes(MODEL) > 0:
                    break
                time.sleep(0.5)
        assert second.successes(MODEL) > 0

        # 4. The image's health check command tells ready from dead on a real replica.
        from .test_dockerfile import healthcheck_command

        command = [sys.executable, *healthcheck_command()[1:]]
        env = {"BITSERVE_PORT": str(second.port), "PATH": "/usr/bin:/bin"}
        assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode == 0
        second.kill()
        assert subprocess.run(command, env=env, capture_output=True, timeout=30).returncode != 0
