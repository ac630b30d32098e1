"""Dockerfile and .dockerignore, checked without a Docker engine.

The instructions are parsed (continuations joined, comments dropped) and checked against the
rest of the project: the base image's torch version against the Makefile's torch pin, the
build context (after .dockerignore) against what COPY needs, the health check command run
for real against a local HTTP server.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._manifests import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs in order."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends in a continuation"
    out = []
    for line in lines:
        op, _, args = line.partition(" ")
        out.append((op.upper(), args.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    """Instructions grouped by build stage (each starts with FROM)."""
    out: list[list[tuple[str, str]]] = []
    for op, args in instructions():
        if op == "FROM":
            out.append([])
        if out:
            out[-1].append((op, args))
    return out


def arg_default(name: str) -> str:
    for op, args in instructions():
        if op == "ARG" and args.startswith(f"{name}="):
            return args.split("=", 1)[1]
    raise AssertionError(f"no ARG {name}")


def dockerfile_user_id() -> int:
    """The numeric user id the runtime image runs as."""
    return int(arg_default("UID"))


def test_multi_stage_build_on_the_pinned_torch_image() -> None:
    froms = [args for op, args in instructions() if op == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE} AS runtime"]
    image = arg_default("BASE_IMAGE")
    repo, tag = image.split(":")
    assert repo == "pytorch/pytorch"
    # pytorch/pytorch tags read <torch>-cuda<X.Y>-cudnn<N>-runtime.
    match = re.fullmatch(r"(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn(\d+)-runtime", tag)
    assert match, tag
    pin = re.search(r"^TORCH_PIN \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin, "Makefile has no TORCH_PIN"
    assert match.group(1) == pin.group(1), "BASE_IMAGE must track the Makefile's torch pin"


def test_package_installed_with_the_server_and_tracing_extras_without_replacing_torch() -> None:
    build = stages()[0]
    runs = " ".join(args for op, args in build if op == "RUN")
    assert "--system-site-packages" in runs
    (install,) = [a for op, a in build if op == "RUN" and " install " in a]
    assert '".[server,tracing]"' in install  # traces on when the OTEL_* variables ask
    assert "--constraint /tmp/image-constraints.txt" in install
    assert not re.search(r"install[^&]*\btorch\b", runs), "torch must come from the image"
    # The constraints file pins exactly what the image brings.
    assert "torch" in runs
    assert "triton" in runs


def test_runtime_stage_runs_bitserve_as_a_non_root_user() -> None:
    runtime = dict(reversed(stages()[-1]))  # first occurrence of each instruction
    user = [a for op, a in stages()[-1] if op == "USER"][-1]
    assert user not in {"root", "0"}
    assert "--uid ${UID}" in runtime["RUN"]
    assert dockerfile_user_id() >= 1000
    assert json.loads(runtime["ENTRYPOINT"]) == ["bitserve"]
    assert json.loads(runtime["CMD"]) == ["serve", "--model-repository", "/models"]
    assert json.loads(runtime["VOLUME"]) == ["/models"]
    env = runtime["ENV"]
    port = re.search(r"BITSERVE_PORT=(\d+)", env)
    assert port
    assert runtime["EXPOSE"] == port.group(1)
    assert "BITSERVE_HOST=0.0.0.0" in env


def healthcheck_command() -> list[str]:
    (args,) = [a for op, a in stages()[-1] if op == "HEALTHCHECK"]
    cmd = args[args.index("CMD ") + 4 :]
    command = json.loads(cmd)
    assert isinstance(command, list)
    return [str(c) for c in command]


class _Health(http.server.BaseHTTPRequestHandler):
    ready = True

    def do_GET(self) -> None:
        ok = self.path == "/v2/health/ready" and type(self).ready
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_Health]]]:
    handler = type("Handler", (_Health,), {"ready": True})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_healthcheck_command_follows_readiness(
    health_server: tuple[int, type[_Health]], tmp_path: Path
) -> None:
    port, handler = health_server
    command = healthcheck_command()
    assert command[0] == "python"  # the image's python; no curl in the image
    run = [sys.executable, *command[1:]]
    env = {"BITSERVE_PORT": str(port), "PATH": "/usr/bin:/bin"}

    def status() -> int:
        return subprocess.run(run, env=env, capture_output=True, timeout=30).returncode

    assert status() == 0
    handler.ready = False
    assert status() != 0
    # Nothing listening: unhealthy too.
    env["BITSERVE_PORT"] = "1"
    assert status() != 0


def dockerignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (relative, POSIX) out of the context.

    Enough of Docker's rules for this file: a pattern matches the path or one of its parent
    folders; ``**/`` matches any number of folders; no ``!`` exceptions are used.
    """
    assert not any(p.startswith("!") for p in patterns), "extend ignored() for ! patterns"
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(
                prefix.split("/")[-1], pattern[3:]
            ):
                return True
    return False


def test_dockerignore_keeps_what_the_build_copies_and_drops_the_rest() -> None:
    patterns = dockerignore_patterns()
    copies = [a for op, a in stages()[0] if op == "COPY"]
    sources = [s for a in copies for s in a.split()[:-1]]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored(source, patterns), f"{source} is copied but .dockerignore drops it"
    # What the wheel is built from (pyproject's packages and readme) is all copied.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert {*packages, pyproject["project"]["readme"], "pyproject.toml"} <= set(sources)
    for heavy in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/conftest.py",
        "benchmarks/results/x.md",
        "service/__pycache__/app.cpython-311.pyc",
        ".pytest_cache/v",
        ".mypy_cache/3.11",
        "clients/python/pyproject.toml",
        "models/demo/config.toml",
    ):
        assert ignored(heavy, patterns), heavy
    assert not ignored("service/rest/app.py", patterns)
    assert not ignored("gpu_ops/_triton/__init__.py", patterns)
