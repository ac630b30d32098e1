"""The Dockerfile and docker-compose.yml, built and run for real on a Docker engine.

The repository's Dockerfile is built unmodified, with ``--build-arg BASE_IMAGE=`` a stand-in
for ``pytorch/pytorch`` made offline from Debian packages (``_standin.py``: these machines
reach no image hub), and run as README's Deployment section runs it: a model repository
written by ``bitserve demo-repo`` mounted read-only at ``/models``. The image must run as
its non-root user, become ready, serve the demo to ``bitserve_client`` with the float64
reference's answers, turn healthy by its own HEALTHCHECK, and on SIGTERM under load answer
every request it had begun and exit 0. Then docker-compose.yml's CPU stack (bitserve and
nginx, the nginx a Debian stand-in for ``nginx:1.28-alpine``) runs on one user-defined
network with every flag the file gives its services (``_compose_run.py``), and serves the
demo through nginx.

An engine is found or started by ``_engine.engine()``; the tests skip only where none can
run, and the skip says why. The first test builds the stand-ins (about four minutes, once
per machine and set of pins) and the image (about a minute).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from bitserve_client import Client, ServerError, TransportError

from harness.probes import metric
from harness.repo_utils import demo_reference
from harness.server import bitserve_command
from tests.e2e.slow_model import write_slow_model

from ._compose_run import run_args
from ._engine import Container, container, docker, engine, network, unique
from ._manifests import ROOT, load_yaml_documents
from ._standin import stand_ins
from .test_dockerfile import dockerfile_user_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

PORT = 8000  # the image's EXPOSE and BITSERVE_PORT


@dataclass(frozen=True)
class Images:
    bitserve: str
    nginx: str


@pytest.fixture(scope="module")
def images() -> Iterator[Images]:
    problem = engine()
    if problem is not None:
        pytest.skip(f"no Docker engine can run here: {problem}")
    base = stand_ins()
    tag = unique("bitserve-test-image")
    # The repository's own Dockerfile and context, as `docker build -t bitserve .` uses them.
    docker("build", "-q", "--build-arg", f"BASE_IMAGE={base.python}", "-t", tag,
           "-f", str(ROOT / "Dockerfile"), str(ROOT), timeout=1200)  # fmt: skip
    try:
        yield Images(tag, base.nginx)
    finally:
        docker("rmi", tag, check=False)


def demo_repository(root: Path) -> Path:
    """``bitserve demo-repo root`` as a user runs it (README: Deployment)."""
    subprocess.run([*bitserve_command(), "demo-repo", str(root)], check=True, timeout=120)
    return root


def wait_ready(box: Container, url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    with Client(url, retries=0, timeout=5) as client:
        while True:
            state = box.inspect()["State"]
            assert state["Running"], f"the container stopped: {state}"
            try:
                if client.is_ready():
                    return
            except TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready within {timeout_s} s"
            time.sleep(0.5)


def wait_healthy(box: Container, timeout_s: float = 300) -> None:
    """Until the engine's health check says healthy (its first run is one interval in)."""
    deadline = time.monotonic() + timeout_s
    while (health := box.health()) != "healthy":
        assert health == "starting", box.inspect()["State"]["Health"]
        assert time.monotonic() < deadline, f"not healthy within {timeout_s} s"
        time.sleep(1)


def check_demo(url: str, seed: int) -> None:
    bits = np.random.default_rng(seed).random((2, 20, 50000)) < 0.01
    with Client(url) as client:
        result = client.infer("demo", {"spikes": bits})
    assert result["resampled"].shape == (2, 20, 500)
    np.testing.assert_allclose(result["resampled"], demo_reference(bits), rtol=1e-4, atol=1e-3)


def slow_answer(url: str, x: int) -> tuple[int, Any]:
    """One request to the slow model (y = float(x)); (status, y or the error)."""
    with Client(url, retries=0, timeout=300) as client:
        try:
            result = client.infer("slow", {"x": np.array([[x]], dtype=np.int32)})
        except ServerError as e:
            return e.status, e.message
        except TransportError as e:
            return 0, repr(e)
    return 200, result["y"]


def test_image_runs_as_its_user_serves_turns_healthy_and_drains_on_sigterm(
    images: Images, tmp_path: Path
) -> None:
    # One container's life, as README's Deployment section runs it (one start: each costs
    # seconds of loading): a repository from `bitserve demo-repo`, plus a slow model.
    models = write_slow_model(demo_repository(tmp_path / "models"), rounds=None)
    # A drain deadline far beyond the slow requests' few seconds, on a loaded machine too.
    # Two workers, as `auto` gives one GPU: the supervisor passes the SIGTERM on and every
    # worker drains (`auto` on a host of 2 cores or fewer is one worker in PID 1 itself).
    run = ["-p", f"127.0.0.1::{PORT}", "-v", f"{models}:/models:ro",
           "-e", "BITSERVE_GRACEFUL_SHUTDOWN_S=120", "-e", "BITSERVE_WORKERS=2"]  # fmt: skip
    with container(images.bitserve, run) as box:
        url = box.url(PORT)
        wait_ready(box, url)
        # 1. Every process of the container (the supervisor and its workers) is the image's
        # user, not root.
        uid = dockerfile_user_id()
        assert box.inspect()["Config"]["User"] == "bitserve"
        assert box.exec("id", "-u").strip() == str(uid)
        status = box.exec("sh", "-c", "grep -h '^Uid:' /proc/[0-9]*/status")
        uids = {line.split()[1] for line in status.splitlines()}
        assert uids == {str(uid)}, status
        # 2. The demo, through the Python client, against the float64 reference, on the C
        # kernels built in the container (pytorch's CUDA runtime images bring gcc, for
        # Triton's launchers): no fallback to the torch code paths.
        check_demo(url, seed=8)
        built = box.exec("sh", "-c", "ls /home/bitserve/.cache/bitserve")
        assert re.search(r"\.so$", built, re.M), built
        assert "no C compiler found" not in box.logs()
        # 3. Healthy by the image's own HEALTHCHECK (its first run is one interval in).
        wait_healthy(box)

        bits = np.random.default_rng(3).random((1, 20, 50000)) < 0.01
        want = demo_reference(bits)

        def begun() -> float:
            text = httpx.get(url + "/metrics", timeout=30).text
            done = metric(text, "bitserve_requests_total", 0.0, model="slow")
            return metric(text, "bitserve_in_flight_requests") + done

        # 4. SIGTERM under load. Three slow requests, each seconds of compute: the server
        # has begun all three (in flight, or answered) before anything else is sent.
        slow = ThreadPoolExecutor(3)
        answers = [slow.submit(slow_answer, url, 300 + x) for x in range(3)]
        deadline = time.monotonic() + 120
        while begun() < 3:
            assert time.monotonic() < deadline, "the slow requests never arrived"
            time.sleep(0.05)
        # Load: four clients without retries, each sending the demo back to back.
        stop = threading.Event()
        log: list[tuple[float, float, str]] = []  # (start, end, outcome)

        def load() -> None:
            with Client(url, retries=0, timeout=120) as client:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        out = client.infer("demo", {"spikes": bits})["resampled"]
                        ok = np.allclose(out, want, rtol=1e-4, atol=1e-3)
                        outcome = "200" if ok else "wrong"
                    except ServerError as e:
                        outcome = str(e.status)
                    except TransportError as e:
                        outcome = f"transport {type(e).__name__}"
                    log.append((t0, time.monotonic(), outcome))

        with ThreadPoolExecutor(4) as pool:
            loaders = [pool.submit(load) for _ in range(4)]
            deadline = time.monotonic() + 120
            while sum(o == "200" for *_, o in log) < 8:
                assert time.monotonic() < deadline, log
                time.sleep(0.05)
            # SIGTERM to PID 1 (bitserve, exec form), as `docker stop` sends it.
            t_term = time.monotonic()
            docker("kill", "--signal", "TERM", box.name)
            code = box.wait_exit(timeout=300)
            stop.set()
            for f in loaders:
                f.result()
        results = [a.result() for a in answers]
        slow.shutdown()
        logs = box.logs()
    assert code == 0, logs[-3000:]
    # Every request the server had begun was answered, right.
    assert [status for status, _ in results] == [200, 200, 200], results
    for x, (_, y) in enumerate(results):
        np.testing.assert_array_equal(y, [[300.0 + x]])
    # Load answered before the signal: all right; around and after it: an answer, a 503
    # (draining) or a refused or closed connection, never a wrong answer.
    assert {o for _, t1, o in log if t1 < t_term} == {"200"}, log
    assert all(o in ("200", "503") or o.startswith("transport") for *_, o in log), log
    assert re.search(r"received SIGTERM: draining \d+ workers", logs), logs[-3000:]
    assert "all workers stopped" in logs


def test_compose_stack_serves_through_nginx_on_one_network(images: Images, tmp_path: Path) -> None:
    (compose,) = load_yaml_documents(ROOT / "docker-compose.yml")
    services = compose["services"]
    models = demo_repository(tmp_path / "models")
    with network() as net:
        server_args = run_args("bitserve-cpu", services["bitserve-cpu"], network=net,
                               sources={"./models": models})  # fmt: skip
        nginx_args = run_args("nginx", services["nginx"], network=net)
        # bitserve first: nginx resolves its upstream name when it starts.
        with (
            container(images.bitserve, server_args) as server,
            container(images.nginx, nginx_args) as nginx,
        ):
            url = nginx.url(8080)
            wait_ready(server, url)
            check_demo(url, seed=9)
            r = httpx.get(url + "/v2/health/ready", headers={"X-Request-ID": "compose-1"})
            assert r.status_code == 200
            assert r.headers["X-Request-ID"] == "compose-1"  # nginx passed it, bitserve echoed
            # bitserve's own answer (one worker or several: --workers auto picks by cores)
            assert r.json() == {"ready": True}
            # The file's read-only root file system and tmpfs mounts are what it ran with.
            state = server.inspect()["HostConfig"]
            assert state["ReadonlyRootfs"] is True
            assert set(state["Tmpfs"]) == set(services["bitserve-cpu"]["tmpfs"])
            # Both health checks of the file pass: bitserve's readiness, nginx's own.
            wait_healthy(server)
            wait_healthy(nginx)
