"""The test tiers' pytest-xdist units (tests/conftest.py): one per module, all of tests/ray one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")

# A pytest run of its own, in two worker processes: `make test` runs it, `make test-unit` not.
pytestmark = pytest.mark.slow


def test_a_modules_tests_share_a_worker_and_its_fixtures_are_built_once(tmp_path: Path) -> None:
    """A real pytest-xdist run, under this repository's conftest, of two modules of six tests
    each: every test of a module runs in one worker, and its module fixture is built once
    (pytest-xdist's own loadgroup had every test a unit of its own under pytest 9)."""
    root = Path(__file__).resolve().parents[1]
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((root / "tests" / "conftest.py").read_text())
    for name in ("a", "b"):
        (tests / f"test_{name}.py").write_text(
            textwrap.dedent(f"""
            import os
            import pytest

            @pytest.fixture(scope="module")
            def built():
                with open({str(tmp_path / "built.txt")!r}, "a") as f:
                    f.write("{name}\\n")

            @pytest.mark.parametrize("i", range(6))
            def test_it(built, i):
                with open({str(tmp_path / "ran.txt")!r}, "a") as f:
                    f.write("{name} " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
            """)
        )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    ran = (tmp_path / "ran.txt").read_text().split("\n")
    workers = {m: {line.split()[1] for line in ran if line.startswith(m + " ")} for m in "ab"}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert sorted((tmp_path / "built.txt").read_text().split()) == ["a", "b"]
