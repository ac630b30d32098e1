"""The client's page, docs/client.md, is true: it names every public name, and its CLI block
prints what it says, against the session's ``bitserve serve`` of the demo model.

The page's Python blocks run in tests/test_docs.py (with every other page's); the CLI block
is marked ``<!-- run by tests/clients/test_readme.py -->`` there and runs here, under
``bash -eu`` with this environment's ``bitserve-client`` and ``python`` first on ``PATH``,
because its output is checked line by line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.server import BitserveServer

pytestmark = pytest.mark.e2e

PAGE = Path(__file__).resolve().parents[2] / "docs" / "client.md"
DEFAULT_URL = "http://127.0.0.1:8000"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def cli_block() -> str:
    """The page's one shell block run by this test (the CLI section's)."""
    text = PAGE.read_text()
    found = [
        m.group(2)
        for m in _FENCE.finditer(text)
        if m.group(1) == "bash"
        and text[: m.start()].rstrip("\n").endswith("<!-- run by tests/clients/test_readme.py -->")
    ]
    assert len(found) == 1, found
    return found[0]


def test_every_public_name_is_on_the_page() -> None:
    import bitserve_client

    text = PAGE.read_text()
    missing = [n for n in bitserve_client.__all__ if n != "__version__" and n not in text]
    assert not missing, f"docs/client.md does not mention {missing}"


def test_cli_block_runs(demo_server: BitserveServer, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "BITSERVE_TOKEN"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["BITSERVE_URL"] = demo_server.url
    result = subprocess.run(
        ["bash", "-eu", "-c", cli_block().replace(DEFAULT_URL, demo_server.url)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
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
