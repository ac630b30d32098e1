"""Overload: every request the server has is answered (issue 35's targets).

One ``bitserve serve`` with the built-in demo model; clients on raw asyncio sockets
(``harness.hostile``):

1. the connection cap: 40 clients at once, each sending one whole ``GET /v2/health/live``,
   against ``--max-connections 16``, three rounds: each gets 200 or 503 with Retry-After,
   none a close without a byte;
2. open-loop load at 3x and 4x the capacity (measured just before, closed loop, 32
   clients, under the same conditions) for ``--seconds``, on a quiet host and beside a CPU
   burner (a process spinning on one core), sent by ``--processes`` load-generator
   processes of their own (``harness.openloop``), against the default ``max_connections``
   of 1000 with clients that may open 2000: every request answered 200 or 503, none closed
   without an answer. A request with no answer within ``GIVE_UP_S`` of when it was due
   counts as a timeout, apart from the closes. Beside each row, where its time went: the
   server's CPU and the load generator's, how long the server's event loop waited for a
   CPU, its accept queue, its own time per request (``/metrics``), and how late the client
   wrote.

    python -m benchmarks.bench_overload                 # 45 s a level; writes results/overload.md
    python -m benchmarks.bench_overload --seconds 15    # shorter levels (a shared host)
    python -m benchmarks.bench_overload --smoke         # 2 s a level, prints only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import psutil

from benchmarks._common import markdown_table, quiet_host, report
from harness.hostile import (
    HOST,
    DemoRequests,
    Outcome,
    Peak,
    closed_loop,
    raise_fd_limit,
)
from harness.openloop import accept_backlog, open_loop_procs
from harness.server import BitserveServer, start_server
from harness.workload import Pool

LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
GIVE_UP_S = 30.0


WHERE_HEADERS = [
    "row",
    "load average",
    "server CPU (cores)",
    "load generator CPU (cores)",
    "server CPU a request (ms)",
    "server's event loop: ran / waited for a CPU",
    "accept queue, most",
    "server time p99",
    "client wrote late, p99",
    "unanswered, written at most",
]


def yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


async def _one_live(port: int, start: asyncio.Event) -> str:
    """Connect, wait for the others, send one whole GET: ``"200"``, ``"503+retry"``,
    another status, or ``"closed"`` (no byte before the close)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        await start.wait()
        writer.write(LIVE)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        except (asyncio.IncompleteReadError, ConnectionError):
            return "closed"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    status = head.split(b" ", 2)[1].decode()
    if status == "503" and re.search(rb"(?im)^retry-after: \d+", head):
        return "503+retry"
    return status


async def _cap_round(port: int, clients: int) -> Counter[str]:
    start = asyncio.Event()
    tasks = [asyncio.ensure_future(_one_live(port, start)) for _ in range(clients)]
    await asyncio.sleep(0.5)  # all connected (accepted or in the backlog)
    start.set()
    return Counter(await asyncio.gather(*tasks))


def cap_row(clients: int, cap: int, rounds: int) -> list[Any]:
    with start_server(None, args=["--no-access-log", "--max-connections", str(cap)]) as server:
        totals: Counter[str] = Counter()
        for _ in range(rounds):
            totals += asyncio.run(_cap_round(server.port, clients))
            asyncio.run(asyncio.sleep(1.5))  # the answered connections go idle: evictable
    answered = totals["200"] + totals["503+retry"]
    return [
        f"{clients} clients at once, one GET each, --max-connections {cap}, {rounds} rounds",
        "every client answered: 200 or 503 with Retry-After",
        f"{totals['200']} x 200, {totals['503+retry']} x 503 with Retry-After, "
        f"{totals['closed']} closed without a byte, "
        f"{sum(totals.values()) - answered - totals['closed']} other",
        yes(answered == clients * rounds),
    ]


@contextlib.contextmanager
def cpu_burner(on: bool) -> Iterator[None]:
    """A process spinning on one core for the block's duration (nothing when not ``on``)."""
    if not on:
        yield
        return
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def describe(outs: Sequence[Outcome], seconds: float) -> tuple[str, bool]:
    status = Counter(o.status for o in outs)
    failures = Counter(o.failure for o in outs if o.status == 0)
    unlabelled = sum(o.status == 503 and not o.retry_after for o in outs)
    other = sum(n for s, n in status.items() if s not in (0, 200, 503))
    lat = np.array([o.latency_s for o in outs if o.status in (200, 503)])
    p99 = f"{np.percentile(lat, 99) * 1e3:.0f} ms" if len(lat) else "-"
    text = (
        f"{len(outs):,} requests: {status[200]:,} x 200 ({status[200] / seconds:.0f}/s), "
        f"{status[503]:,} x 503 ({unlabelled} without Retry-After), {other} other; "
        f"no answer: {failures['closed']} closed, {failures['timeout']} timed out "
        f"({GIVE_UP_S:g} s), {failures['connect']} refused; answers' p99 {p99}"
    )
    ok = status[200] + status[503] == len(outs) and unlabelled == 0
    return text, ok


def histogram_quantile(text: str, name: str, q: float) -> tuple[float, int]:
    """The upper bound of the bucket holding quantile ``q`` of histogram ``name`` in
    Prometheus ``text`` (inf past the last bucket), and its count."""
    buckets = sorted(
        (float(le), float(v))
        for le, v in re.findall(rf'{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)', text)
    )
    total = buckets[-1][1] if buckets else 0.0
    for le, cumulative in buckets:
        if cumulative >= q * total:
            return le, int(total)
    return math.inf, int(total)


@dataclass
class Where:
    """Where the time of one open-loop row went, seen from both ends."""

    load: float
    """The host's 1-minute load average when the row began."""
    server_cores: float
    """The server's CPU seconds per second of the row."""
    client_cores: float
    """The load generator's CPU seconds per second of the row."""
    server_ms: float
    """The server's CPU milliseconds per request (answered or not)."""
    loop_ran: float
    """The share of the row's time the server's event loop thread ran on a CPU."""
    loop_waited: float
    """The share of the row's time it was ready to run but waited for a CPU (starved)."""
    backlog: int
    """Most connections waiting in the kernel for the server to accept them."""
    server_p99_s: float
    """The bucket bound of the 99th percentile of the server's own time per request, from
    its head to its answer (``bitserve_request_latency_seconds``)."""
    written_late_s: float
    """99th percentile of how late the client wrote its requests (its own lag and its wait
    for a connection)."""
    unanswered_written_s: float
    """Of the requests without an answer, the latest the client wrote one (nan: none)."""

    def cells(self) -> list[str]:
        p99 = "> 10 s" if math.isinf(self.server_p99_s) else f"<= {self.server_p99_s:g} s"
        unanswered = self.unanswered_written_s
        late = "-" if math.isnan(unanswered) else f"{unanswered:.1f} s"
        return [
            f"{self.load:.1f}",
            f"{self.server_cores:.2f}",
            f"{self.client_cores:.2f}",
            f"{self.server_ms:.2f}",
            f"{self.loop_ran:.0%} / {self.loop_waited:.0%}",
            f"{self.backlog:,}",
            p99,
            f"{self.written_late_s:.1f} s",
            late,
        ]


def open_loop_row(
    server: BitserveServer, rate: float, seconds: float, processes: int
) -> tuple[list[Outcome], Where]:
    """One open-loop level from worker processes, with what the server saw meanwhile."""
    load = os.getloadavg()[0]
    proc = psutil.Process(server.process.pid)
    before = httpx.get(server.url + "/metrics").text
    cpu0 = t0 = 0.0
    sched0 = (0.0, 0.0)

    def started() -> None:
        nonlocal cpu0, t0, sched0
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
        sched0 = loop_schedstat(server.process.pid)

    with Peak(accept_backlog(server.port), every_s=0.1) as backlog:
        run = open_loop_procs(
            server.port,
            rate,
            seconds,
            processes=processes,
            give_up_s=GIVE_UP_S,
            max_connections=2000,  # past the server's cap of 1000
            started=started,
        )
    wall = time.perf_counter() - t0
    cores = (sum(proc.cpu_times()[:2]) - cpu0) / wall
    sched1 = loop_schedstat(server.process.pid)
    ran, waited = ((b - a) / wall for a, b in zip(sched0, sched1, strict=True))
    outs = run.outcomes
    after = httpx.get(server.url + "/metrics").text
    name = "bitserve_request_latency_seconds"
    delta = _delta_histogram(after, before, name)
    written = [o.sent_s for o in outs if o.sent_s >= 0]
    unanswered = [o.sent_s for o in outs if o.status == 0 and o.sent_s >= 0]
    where = Where(
        load,
        cores,
        run.cpu_s / wall,
        cores * wall * 1e3 / max(len(outs), 1),
        ran,
        waited,
        backlog.peak,
        histogram_quantile(delta, name, 0.99)[0],
        float(np.percentile(written, 99)) if written else math.nan,
        max(unanswered) if unanswered else math.nan,
    )
    return outs, where


def loop_schedstat(pid: int) -> tuple[float, float]:
    """Seconds process ``pid``'s main thread (the server's event loop) has run on a CPU and
    waited on a run queue for one (Linux ``schedstat``; zeros elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            ran, waited, _ = f.read().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(ran) / 1e9, int(waited) / 1e9


def _delta_histogram(after: str, before: str, name: str) -> str:
    """Histogram ``name``'s buckets in ``after`` less those in ``before`` (same text form)."""
    pattern = rf"^{name}_bucket{{([^}}]*)}} (\S+)$"
    old = dict(re.findall(pattern, before, re.M))
    lines = [
        f"{name}_bucket{{{labels}}} {float(v) - float(old.get(labels, 0)):g}"
        for labels, v in re.findall(pattern, after, re.M)
    ]
    return "\n".join(lines)


def overload_rows(
    seconds: float, levels: Sequence[float], capacity_s: float, processes: int
) -> tuple[list[list[Any]], list[list[Any]]]:
    """The open-loop rows and their where-the-time-went rows. The capacity is measured
    under each row's conditions (beside the burner for its rows), just before them."""
    demo = DemoRequests(Pool.make(8))
    requests = demo.requests("demo")
    rows: list[list[Any]] = []
    where: list[list[Any]] = []
    with start_server(None, args=["--no-access-log"]) as server:
        asyncio.run(closed_loop(server.port, requests, 32, capacity_s / 2))  # warm-up
        for burner in (False, True):
            host = "beside a CPU burner" if burner else "no burner"
            with cpu_burner(burner):
                capacity = asyncio.run(closed_loop(server.port, requests, 32, capacity_s))
                print(f"capacity {capacity:.0f} req/s (closed loop, 32 clients), {host}")
                for level in levels:
                    rate = level * capacity
                    outs, seen = open_loop_row(server, rate, seconds, processes)
                    text, ok = describe(outs, seconds)
                    wrong = sum(o.wrong for o in outs)
                    name = (
                        f"open loop {level:g}x capacity ({rate:.0f} req/s offered, capacity "
                        f"{capacity:.0f}) for {seconds:g} s, {host}"
                    )
                    rows.append(
                        [
                            name,
                            "every request answered: 200 or 503 with Retry-After",
                            f"{text}; {wrong} wrong answers",
                            yes(ok and wrong == 0),
                        ]
                    )
                    where.append([f"{level:g}x, {host}", *seen.cells()])
                    print(rows[-1][0], "->", rows[-1][2], "|", " | ".join(where[-1][1:]))
    return rows, where


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 s a level; print only, write nothing")
    p.add_argument("--seconds", type=float, default=45.0, help="seconds per open-loop level")
    p.add_argument("--processes", type=int, default=2, help="load-generator processes")
    p.add_argument("--device", action="append", default=None, help="(unused: the demo on cpu)")
    args = p.parse_args(argv)
    seconds = 2.0 if args.smoke else args.seconds
    fd_limit = raise_fd_limit()
    quiet, how = quiet_host(wait_s=0 if args.smoke else 60)
    rows = [cap_row(40, 16, 1 if args.smoke else 3)]
    print(rows[0][2])
    more, where = overload_rows(seconds, (3.0, 4.0), 1.0 if args.smoke else 5.0, args.processes)
    rows += more
    table = markdown_table(["test", "target", "measured", "met"], rows)
    where_table = markdown_table(WHERE_HEADERS, where)
    body = f"""
One `bitserve serve` (the built-in demo model; default settings but for
`--max-connections 16` in the first row). The 40 clients of the first row are raw asyncio
sockets in the benchmark's process; the open-loop load comes from {args.processes} processes
of its own (`harness.openloop`, raw sockets on uvloop, file-descriptor limit {fd_limit}),
each request on an idle keep-alive connection or a new one (a kept-alive connection the
server closed is replaced once, as HTTP clients do), at most 2000 open against the server's
default cap of 1000. The capacity is measured (closed loop, 32 clients, in the benchmark's
process) just before the rows it scales, under their conditions: beside the burner for the
burner's rows. {how}.
{"Smoke run: tiny sizes." if args.smoke else ""}

{table}

Where the time went, per open-loop row, seen from both ends: the host's load average as the
row began; the server process's CPU and the load generator's (cores: CPU seconds per
second, from the first request to the last answer or give-up; the host has {os.cpu_count()}),
and the server's CPU time per request of the row; the share of the row's time the server's
event loop thread ran, and the share it was ready to run but waited for a CPU (`/proc`
schedstat: the rest it slept, with nothing to do); the most connections
waiting in the kernel's accept queue for the server (`/proc/net/tcp`); the server's own
time per request from its head to its answer (99th percentile, as a bucket bound of
`bitserve_request_latency_seconds`); how late the client wrote its requests (99th
percentile: its own lag and its wait for a free connection); and of the requests left
without an answer, the latest the client wrote one (when that is small, they were written
in time and waited at the server's door: in the accept queue or a socket's buffer, unread).

{where_table}
"""
    report(
        "overload",
        "bitserve under overload: every request answered",
        body,
        smoke=args.smoke,
        devices=["cpu"],
    )
    del quiet


if __name__ == "__main__":
    main()
