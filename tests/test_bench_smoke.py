"""``python -m benchmarks.smoke`` (what ``make bench-smoke`` and CI run): every benchmark's
``--smoke`` run forked from one interpreter, with a table of each run's exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parents[1]


def test_every_benchmark_file_is_a_smoke_run() -> None:
    files = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert smoke.names() == files
    assert len(files) > 10


def test_a_run_prints_its_output_and_the_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.smoke", "--jobs", "2", "bench_compression"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "===== bench_compression --smoke: exit 0 after" in done.stdout
    assert "| bench_compression | 0 |" in done.stdout
    assert "1 smoke runs in" in done.stdout
    assert "FAILED" not in done.stdout


def test_an_unknown_benchmark_is_refused_by_name() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.smoke", "bench_nothing"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no such benchmark: bench_nothing" in done.stderr
