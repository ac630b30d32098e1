"""README's "Python client" section is true: every code block in it runs, unchanged except
for the server's address, against a real ``bitserve serve`` of the built-in demo model.

Python blocks run in this process (a fresh namespace each, in a temporary folder, with
``$BITSERVE_URL`` pointing at the server); shell blocks run under ``bash -eu`` with this
environment's ``bitserve-client`` and ``python`` first on ``PATH``. Installation lines
(``pip install``) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.server import BitserveServer, start_server

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_URL = "http://127.0.0.1:8000"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def client_section() -> tuple[int, str]:
    """(first line number, text) of README's "## Python client" up to the next "## "."""
    text = README.read_text()
    start = text.index("\n## Python client\n") + 1
    end = text.index("\n## ", start)
    return text.count("\n", 0, start) + 1, text[start:end]


def blocks(language: str) -> list[Any]:
    first, section = client_section()
    found = []
    for match in _FENCE.finditer(section):
        if match.group(1) != language or match.group(2).startswith("pip install"):
            continue
        line = first + section.count("\n", 0, match.start()) + 1
        found.append(pytest.param(match.group(2), id=f"README.md:{line}"))
    return found


def test_the_section_is_found_and_has_code() -> None:
    _, section = client_section()
    assert section.startswith("## Python client\n")
    assert len(blocks("python")) >= 6
    assert len(blocks("bash")) == 1  # the CLI; the install block is not run


def test_every_public_name_is_in_the_section() -> None:
    import bitserve_client

    _, section = client_section()
    missing = [n for n in bitserve_client.__all__ if n != "__version__" and n not in section]
    assert not missing, f"README's client section does not mention {missing}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BitserveServer]:
    with start_server(log_dir=tmp_path_factory.mktemp("readme-server")) as s:
        yield s


@pytest.fixture
def readme_env(
    server: BitserveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> BitserveServer:
    monkeypatch.setenv("BITSERVE_URL", server.url)
    monkeypatch.delenv("BITSERVE_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    return server


@pytest.mark.parametrize("code", blocks("python"))
def test_python_block_runs(code: str, readme_env: BitserveServer) -> None:
    code = code.replace(DEFAULT_URL, readme_env.url)
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("code", blocks("bash"))
def test_shell_block_runs(code: str, readme_env: BitserveServer) -> None:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    result = subprocess.run(
        ["bash", "-eu", "-c", code.replace(DEFAULT_URL, readme_env.url)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model demo ready: yes" in result.stdout
    assert "wrote resampled to out.npz" in result.stdout
    assert "wrote 48 rows of resampled to resampled.npy" in result.stdout
    assert "requests: 50 ok, 0 failed" in result.stdout
    # `| head` closed stdout early: not a word about it (stderr has bench's progress bar).
    assert "Broken pipe" not in result.stderr
    assert "Traceback" not in result.stderr
