"""How often does each end-to-end test fail when the suite runs again and again under load?

``python -m benchmarks.flakes run --label before --runs 20 [--burners 2] [--only PATH] [--smoke]``
``python -m benchmarks.flakes table before after [before2 after2 ...]``  (writes ``flakes.md``)

``run`` runs the end-to-end tests (``-m e2e``) and the deployment tests (``tests/deploy``)
``--runs`` times, each run in its own pytest process, in the test order pytest collects.
Each run holds the shared CPU lock (``flock -s /tmp/bitserve-cpu.lock``, as every test run
on the shared development machines does) and, only while it holds it, starts ``--burners``
busy-looping processes, so the tests meet the CPU contention that a loaded CI machine gives
them; between runs the lock is free, so others' benchmarks can take it. Each run's outcome
per test (from pytest's JUnit XML) is added to ``benchmarks/results/flakes-<label>.json``
(kept between invocations: a loop can be stopped and resumed). ``--only`` runs those test
files or ids instead (one pytest process). ``table`` writes the failure
counts of two labels side by side, with each failing test's first message. Not part of
``make bench`` (it takes an hour or more); run it when the end-to-end tests change.
``--smoke`` runs one run of one small deployment test file and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, markdown_table

ROOT = Path(__file__).resolve().parent.parent
LOCK = "/tmp/bitserve-cpu.lock"
# Two pytest processes per run: every end-to-end test, and every deployment test (the
# schema and config checks among them, which are not marked e2e).
SELECTIONS = (["tests", "-m", "e2e", "--ignore=tests/deploy"], ["tests/deploy"])
SMOKE_SELECTION = (["tests/deploy/test_nginx.py"],)
COMMON = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider"]


def burn(parent: int) -> None:
    """Spin until killed, or until ``parent`` is gone: one core's worth of CPU contention."""
    while os.getppid() == parent:
        for _ in range(1_000_000):
            pass


@contextmanager
def burners(n: int) -> Iterator[None]:
    """``n`` busy-looping processes for the duration of the block."""
    procs = [
        multiprocessing.Process(target=burn, args=(os.getpid(),), daemon=True) for _ in range(n)
    ]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


def outcomes(junit: Path) -> dict[str, dict[str, str]]:
    """``{test id: {"outcome": passed|failed|error|skipped, "message": ...}}`` of one
    JUnit XML report."""
    out: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        name = f"{file}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").strip()
        previous = out.get(name)
        # A test that passed and then errored in teardown counts as an error.
        if previous is None or previous["outcome"] in ("passed", "skipped"):
            out[name] = {"outcome": outcome, "message": message[:300]}
    return out


def one_run(selections: Sequence[list[str]], n_burners: int) -> dict[str, Any]:
    """One run of every selection, under load; called with the shared lock held."""
    results: dict[str, dict[str, str]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bitserve-flakes-") as tmp, burners(n_burners):
        for i, selection in enumerate(selections):
            junit = Path(tmp) / f"{i}.xml"
            cmd = [sys.executable, "-m", "pytest", *selection, *COMMON]
            cmd += ["-o", "junit_family=xunit1", f"--junitxml={junit}"]
            subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, check=False)
            if junit.exists():
                results.update(outcomes(junit))
    return {"seconds": round(time.monotonic() - t0, 1), "tests": results}


def run(label: str, runs: int, n_burners: int, smoke: bool, only: list[str]) -> None:
    path = RESULTS / f"flakes-{label}.json"
    history: list[dict[str, Any]] = []
    if path.exists() and not smoke:
        history = json.loads(path.read_text())["runs"]
    selections = SMOKE_SELECTION if smoke else ((only,) if only else SELECTIONS)
    for _ in range(1 if smoke else runs - len(history)):
        # The lock for this one run only: flock around a child that does the run.
        cmd = ["flock", "-s", LOCK, sys.executable, "-m", "benchmarks.flakes", "_one"]
        cmd += ["--burners", str(n_burners), "--smoke" if smoke else "--full"]
        cmd += [a for path_or_id in only for a in ("--only", path_or_id)]
        done = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        result = json.loads(done.stdout.splitlines()[-1])
        failed = sorted(k for k, v in result["tests"].items() if v["outcome"] in FAILING)
        print(f"run {len(history) + 1}: {len(result['tests'])} tests in "
              f"{result['seconds']} s, failed: {failed or 'none'}", flush=True)  # fmt: skip
        history.append(result)
        if not smoke:
            meta = {"label": label, "burners": n_burners, "selections": selections}
            path.write_text(json.dumps({**meta, "runs": history}, indent=1) + "\n")


FAILING = ("failed", "error")


def counts(label: str) -> tuple[int, dict[str, int], dict[str, str], float]:
    """Runs, failures per test, each failing test's first message, median run seconds."""
    data = json.loads((RESULTS / f"flakes-{label}.json").read_text())
    failures: dict[str, int] = {}
    first: dict[str, str] = {}
    for result in data["runs"]:
        for name, entry in result["tests"].items():
            if entry["outcome"] in FAILING:
                failures[name] = failures.get(name, 0) + 1
                first.setdefault(name, entry["message"])
    seconds = sorted(r["seconds"] for r in data["runs"])
    return len(data["runs"]), failures, first, seconds[len(seconds) // 2] if seconds else 0.0


def table(before: str, after: str) -> str:
    n_before, f_before, m_before, s_before = counts(before)
    n_after, f_after, m_after, s_after = counts(after)
    rows = []
    for name in sorted({*f_before, *f_after}):
        message = m_before.get(name) or m_after.get(name, "")
        rows.append(
            [
                f"`{name}`",
                f"{f_before.get(name, 0)}/{n_before}",
                f"{f_after.get(name, 0)}/{n_after}",
                message.replace("|", "\\|").replace("\n", " ")[:160],
            ]
        )
    if not rows:
        rows.append(["(none)", f"0/{n_before}", f"0/{n_after}", ""])
    header = ["test", f"failed: {before}", f"failed: {after}", "first failure message"]
    return (
        f"Runs: {before} {n_before} (median {s_before:.0f} s a run), "
        f"{after} {n_after} (median {s_after:.0f} s a run).\n\n" + markdown_table(header, rows)
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the tests repeatedly under load")
    r.add_argument("--label", required=True)
    r.add_argument("--runs", type=int, default=20)
    r.add_argument("--burners", type=int, default=2)
    r.add_argument("--smoke", action="store_true")
    r.add_argument("--only", action="append", default=[], help="a test file or id (repeat)")
    one = sub.add_parser("_one", help=argparse.SUPPRESS)
    one.add_argument("--burners", type=int, default=2)
    one.add_argument("--smoke", action="store_true")
    one.add_argument("--full", action="store_true")
    one.add_argument("--only", action="append", default=[])
    t = sub.add_parser("table", help="write benchmarks/results/flakes.md")
    t.add_argument("labels", nargs="+", help="pairs of labels: before after [before after ...]")
    args = p.parse_args(argv)
    if args.command == "_one":
        # Stopped (SIGTERM): the burners and the test run end with it.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        selections = SMOKE_SELECTION if args.smoke else ((args.only,) if args.only else SELECTIONS)
        print(json.dumps(one_run(selections, args.burners)))
    elif args.command == "run":
        run(args.label, args.runs, args.burners, args.smoke, args.only)
    else:
        if len(args.labels) % 2:
            p.error("table takes labels in pairs: before after")
        pairs = list(zip(args.labels[::2], args.labels[1::2], strict=True))
        text = "\n".join(f"## {b} / {a}\n\n{table(b, a)}\n" for b, a in pairs)
        print(text)
        (RESULTS / "flakes.md").write_text(FLAKES_HEADER + text)


FLAKES_HEADER = """# Flaky tests: failures per test over repeated runs under CPU load

`python -m benchmarks.flakes run --label L --runs N [--only PATH ...]`, then `python -m
benchmarks.flakes table before after ...`. Each run: the selected tests (by default every
end-to-end test, `-m e2e`, and every deployment test), in pytest's order, beside
`--burners` busy-looping processes on the 2-core machine, holding the shared CPU lock. Only
tests that failed at least once are listed.

"""


if __name__ == "__main__":
    main()
