"""Every ``benchmarks/bench_*.py --smoke`` from one interpreter: what ``make bench-smoke`` runs.

    python -m benchmarks.smoke [--jobs N] [bench_bits bench_search ...]

torch (and numpy, the benchmarks' shared module) are imported once, here; each benchmark then
runs in a child forked from this process (``runpy`` of its module as ``__main__`` with
``--smoke``), so it starts with torch already imported and with nothing another benchmark
changed (thread counts, environment, Ray). Many of the runs mostly wait on the servers and
processes they start, so ``--jobs`` of them run at once (default 2). Each run's output is
printed whole when it ends, then a table of every run's exit status, wall and CPU seconds
(its own and its waited-for children's). Exits 1 when any run fails.
"""

from __future__ import annotations

import argparse
import os
import resource
import runpy
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Run:
    """One benchmark's child process while it runs and once it has ended."""

    name: str
    pid: int
    log: Path
    started: float
    status: int = -1
    wall_s: float = 0.0
    cpu_s: float = 0.0


def names() -> list[str]:
    """Every benchmark's module name, sorted (``bench_bits``, ...)."""
    return sorted(p.stem for p in HERE.glob("bench_*.py"))


def _child(name: str, log: Path) -> None:
    """In the forked child: run ``benchmarks.<name> --smoke`` as ``__main__``; never returns."""
    code = 0
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # An inductor cache of its own (in the run's log folder): runs at once, and CI's tests
    # beside them, compiling the same graph into one cache have packaged a half-written file.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(log.with_suffix(".inductor"))
    try:
        sys.argv = [str(HERE / f"{name}.py"), "--smoke"]
        runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # reported through the exit status and the log
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(name: str, logs: Path) -> Run:
    log = logs / f"{name}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child(name, log)
    return Run(name, pid, log, time.monotonic())


def run_all(selected: Sequence[str], jobs: int, logs: Path) -> list[Run]:
    """Run ``selected`` benchmarks' smoke runs, ``jobs`` at a time; return them as they ended."""
    waiting = list(selected)
    running: dict[int, Run] = {}
    done: list[Run] = []
    while waiting or running:
        while waiting and len(running) < jobs:
            run = _start(waiting.pop(0), logs)
            running[run.pid] = run
        pid, status, usage = os.wait4(-1, 0)
        run = running.pop(pid)
        run.wall_s = time.monotonic() - run.started
        run.cpu_s = usage.ru_utime + usage.ru_stime
        run.status = os.waitstatus_to_exitcode(status)
        done.append(run)
        print(f"===== {run.name} --smoke: exit {run.status} after {run.wall_s:.1f} s =====")
        print(run.log.read_text(errors="replace"), flush=True)
    return done


def table(runs: Sequence[Run]) -> str:
    """A Markdown table of each run's exit status, wall and CPU seconds."""
    lines = ["| benchmark | exit | wall s | CPU s |", "|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: -r.cpu_s):
        lines.append(f"| {r.name} | {r.status} | {r.wall_s:.1f} | {r.cpu_s:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="benchmarks to run (default: every bench_*.py)")
    p.add_argument("--jobs", type=int, default=2, help="smoke runs at once (default 2)")
    args = p.parse_args(argv)
    selected = args.names or names()
    unknown = sorted(set(selected) - set(names()))
    if unknown:
        p.error(f"no such benchmark: {', '.join(unknown)} (there are: {', '.join(names())})")
    # Ray's default wait for its node (60 s) is too short on a busy 2-core machine.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
    # What every benchmark imports, once: the children inherit it.
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import benchmarks._common  # noqa: F401

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as tmp:
        runs = run_all(selected, max(1, args.jobs), Path(tmp))
    self_cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(table(runs))
    failed = [r.name for r in runs if r.status != 0]
    print(
        f"{len(runs)} smoke runs in {time.monotonic() - t0:.1f} s "
        f"({sum(r.cpu_s for r in runs) + self_cpu.ru_utime + self_cpu.ru_stime:.1f} CPU s)"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
