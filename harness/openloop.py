"""Open-loop load from processes of its own: the load generator is never the server's
neighbour in one event loop, nor one process that a busy host starves alone.

:func:`open_loop_procs` starts ``processes`` workers (``python -m harness.openloop``), each
sending its share of the schedule with :func:`harness.hostile.open_loop` (worker ``k`` of
``n`` sends requests ``k, k + n, k + 2n, ...`` of one schedule at ``rate``, all from one
start time), and gathers their :class:`~harness.hostile.Outcome` lists. Each request
carries ``X-Request-ID: w<k>-<j>`` (the server's access log names it), each worker checks
the 200s it gets against the pool's float64 references.

    python -m harness.openloop --port 8000 --rate 300 --seconds 10
    # prints "ready", reads its start time (epoch seconds) on stdin, prints its outcomes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.hostile import Answer, DemoRequests, Outcome, open_loop, raise_fd_limit
from harness.workload import Pool

POOL_SIZE = 8
_FIELDS = [f.name for f in dataclasses.fields(Outcome)]


@dataclass
class LoadRun:
    """What the workers of one open-loop run saw and spent."""

    outcomes: list[Outcome] = field(default_factory=list)
    cpu_s: float = 0.0
    """CPU seconds the workers took from the schedule's start to their last outcome."""


def accept_backlog(port: int) -> Callable[[], int]:
    """Connections waiting in the kernel to be accepted by the server listening on
    127.0.0.1:``port`` (the listening socket's receive queue in ``/proc/net/tcp``; Linux; 0
    elsewhere), for :class:`harness.hostile.Peak`."""
    local = f"0100007F:{port:04X}"

    def measure() -> int:
        try:
            lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
        except OSError:
            return 0
        for line in lines:
            f = line.split()
            if f[1] == local and f[3] == "0A":  # LISTEN
                return int(f[4].split(":")[1], 16)
        return 0

    return measure


def worker_id(k: int) -> str:
    """Worker ``k``'s request-id prefix."""
    return f"w{k}"


def open_loop_procs(
    port: int,
    rate: float,
    seconds: float,
    *,
    processes: int = 2,
    give_up_s: float = 30.0,
    max_connections: int = 2000,
    model: str = "demo",
    started: Callable[[], None] | None = None,
) -> LoadRun:
    """Open-loop load on the demo model at ``rate`` requests per second for ``seconds``,
    sent by ``processes`` worker processes (``max_connections`` open at most, all workers
    together); their outcomes, each with its index in the whole schedule, and their CPU
    time. The schedule
    starts once every worker is ready (imported, its requests built); ``started`` is called
    then."""
    cmd = [sys.executable, "-m", "harness.openloop", "--port", str(port), "--model", model]
    cmd += ["--rate", repr(rate), "--seconds", repr(seconds), "--give-up-s", repr(give_up_s)]
    cmd += ["--processes", str(processes)]
    cmd += ["--max-connections", str(max(1, max_connections // processes))]
    workers = [
        subprocess.Popen(
            [*cmd, "--worker", str(k)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for k in range(processes)
    ]
    try:
        for w in workers:
            assert w.stdout is not None
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("an open-loop worker failed to start")
        start = time.time() + 0.2
        for w in workers:
            assert w.stdin is not None
            w.stdin.write(f"{start!r}\n")
            w.stdin.close()
        if started is not None:
            started()
        run = LoadRun()
        for k, w in enumerate(workers):
            assert w.stdout is not None
            out = w.stdout.read()
            if w.wait(timeout=60):
                raise RuntimeError(f"open-loop worker {k} failed ({w.returncode})")
            got = json.loads(out)
            run.cpu_s += got["cpu_s"]
            for row in got["outcomes"]:
                o = Outcome(**dict(zip(_FIELDS, row, strict=True)))
                o.index = o.index * processes + k
                run.outcomes.append(o)
        return run
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
            for pipe in (w.stdin, w.stdout):
                if pipe is not None:
                    pipe.close()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _work(args: argparse.Namespace) -> tuple[list[Outcome], float]:
    """This worker's share of the schedule: its outcomes and the CPU seconds it took."""
    demo = DemoRequests(Pool.make(POOL_SIZE))
    requests = demo.requests(args.model)
    n, k = args.processes, args.worker
    # Request j of this worker is request j * n + k of the schedule (its pool item too).
    mine = [requests[(j * n + k) % len(requests)] for j in range(len(requests))]

    def right(j: int, answer: Answer) -> bool:
        return demo.right(j * n + k, answer)

    print("ready", flush=True)
    start = float(sys.stdin.readline())
    delay = start + k / args.rate - time.time()
    cpu0 = _cpu_s()
    outcomes = asyncio.run(
        open_loop(
            args.port,
            mine,
            args.rate / n,
            args.seconds,
            give_up_s=args.give_up_s,
            check=right,
            max_connections=args.max_connections,
            tag=worker_id(k),
            delay_s=max(0.0, delay),
        )
    )
    return outcomes, _cpu_s() - cpu0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one open-loop worker; prints its outcomes (JSON)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="demo")
    p.add_argument("--rate", type=float, required=True, help="requests/s, all workers")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--give-up-s", type=float, default=30.0)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--max-connections", type=int, default=1000)
    args = p.parse_args(argv)
    raise_fd_limit()
    with contextlib.suppress(ImportError):  # the cheaper loop, when installed
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    outcomes, cpu_s = _work(args)
    rows = [dataclasses.astuple(o) for o in outcomes]
    print(json.dumps({"cpu_s": cpu_s, "outcomes": rows}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
