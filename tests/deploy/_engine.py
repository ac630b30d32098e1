"""A Docker engine for the container tests: found, or started, and driven through its CLI.

Where ``docker info`` answers, that engine is used. Where it does not, and Debian's
``dockerd`` is installed and this process is root (CI, the development machines), one is
started in the background and left running (its log: ``/tmp/bitserve-dockerd.log``). Only
where neither works do the container tests skip, and :func:`engine` says why.

Builds use Docker's classic builder (``DOCKER_BUILDKIT=0``): BuildKit would fetch the
Dockerfile's ``# syntax=docker/dockerfile:1`` front end from the image hub, which these
machines cannot reach; the classic builder reads the same file (the line is a comment to it).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOCKERD_LOG = Path("/tmp/bitserve-dockerd.log")
_STARTED: list[subprocess.Popen[bytes]] = []  # the dockerd this process started
_START_LOCK = Path("/tmp/bitserve-dockerd.lock")
_ENV = {**os.environ, "DOCKER_BUILDKIT": "0"}


def docker(
    *args: str, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``docker ARGS``; raise with its output if it fails and ``check``."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, env=_ENV, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done


def _answers() -> str | None:
    """None if an engine answers ``docker info``, else what the client said."""
    try:
        done = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 30 s"
    return None if done.returncode == 0 else (done.stderr.strip() or done.stdout.strip())


def engine() -> str | None:
    """Make sure an engine answers; return None, or why none can run here."""
    if shutil.which("docker") is None:
        return "no Docker client on PATH (make system-deps installs Debian's docker.io)"
    problem = _answers()
    if problem is None:
        return None
    dockerd = shutil.which("dockerd") or shutil.which("/usr/sbin/dockerd")
    if dockerd is None:
        return f"no Docker engine answers ({problem}) and dockerd is not installed"
    if os.geteuid() != 0:
        return f"no Docker engine answers ({problem}) and only root starts dockerd here"
    with _START_LOCK.open("w") as lock:  # one starter at a time among the test sessions
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers() is None:
            return None
        with DOCKERD_LOG.open("ab") as log:
            proc = subprocess.Popen(
                [dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        # dockerd outlives the test session on purpose (the next session reuses it): hold
        # the Popen for the life of the process, so that its collection does not warn
        # (ResourceWarning, an error under the suite's filterwarnings) while tests run.
        _STARTED.append(proc)
        deadline = time.monotonic() + 60
        while (problem := _answers()) is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = DOCKERD_LOG.read_text(errors="replace")[-2000:]
                return f"dockerd did not start ({problem}); its log ends:\n{tail}"
            time.sleep(0.5)
    return None


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def unique(prefix: str) -> str:
    """A name no other test session uses (containers, networks and tags are machine-wide)."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@contextmanager
def network() -> Iterator[str]:
    """A user-defined bridge network (name resolution between containers), removed after."""
    name = unique("bitserve-test-net")
    docker("network", "create", name)
    try:
        yield name
    finally:
        docker("network", "rm", name, check=False)


@dataclass
class Container:
    """One container started by :func:`container`."""

    name: str

    def inspect(self) -> dict[str, Any]:
        data = json.loads(docker("inspect", self.name).stdout)
        assert isinstance(data, list)
        return dict(data[0])

    def port(self, private: int) -> int:
        """The loopback port the engine published ``private`` on."""
        out = docker("port", self.name, f"{private}/tcp").stdout.split()
        return int(out[0].rsplit(":", 1)[1])

    def url(self, private: int) -> str:
        return f"http://127.0.0.1:{self.port(private)}"

    def logs(self) -> str:
        done = docker("logs", self.name, check=False)
        return done.stdout + done.stderr

    def exec(self, *command: str) -> str:
        return docker("exec", self.name, *command).stdout

    def health(self) -> str:
        """The HEALTHCHECK's verdict: ``starting``, ``healthy`` or ``unhealthy``."""
        return str(self.inspect()["State"]["Health"]["Status"])

    def wait_exit(self, timeout: float) -> int:
        """Block until the container exits; its exit code."""
        return int(docker("wait", self.name, timeout=timeout).stdout.strip())


@contextmanager
def container(
    image: str, run_args: Sequence[str], command: Sequence[str] = ()
) -> Iterator[Container]:
    """``docker run -d`` a uniquely named container; remove it (and print its log) after."""
    name = unique("bitserve-test")
    docker("run", "-d", "--name", name, *run_args, image, *command)
    box = Container(name)
    try:
        yield box
    finally:
        print(f"--- log of {name} ({image}) ---\n{box.logs()[-6000:]}")
        docker("rm", "-f", "-v", name, check=False)
