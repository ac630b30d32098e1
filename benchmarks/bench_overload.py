"""Overload: every request the server has is answered (issue 35's targets).

One ``bitserve serve`` with the built-in demo model; clients on raw asyncio sockets in this
process (``harness.hostile``):

1. the connection cap: 40 clients at once, each sending one whole ``GET /v2/health/live``,
   against ``--max-connections 16``, three rounds: each gets 200 or 503 with Retry-After,
   none a close without a byte;
2. open-loop load at 3x and 4x the capacity (measured first, closed loop, 32 clients) for
   ``--seconds``, on a quiet host and beside a CPU burner (a process spinning on one core),
   against the default ``max_connections`` of 1000 with clients that may open 2000: every
   request answered 200 or 503, none closed without an answer. A request with no answer
   within ``GIVE_UP_S`` of when it was due counts as a timeout, apart from the closes (on a
   starved host the client's own lag is part of that time).

    python -m benchmarks.bench_overload                 # 45 s a level; writes results/overload.md
    python -m benchmarks.bench_overload --seconds 15    # shorter levels (a shared host)
    python -m benchmarks.bench_overload --smoke         # 2 s a level, prints only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from benchmarks._common import markdown_table, quiet_host, report
from harness.hostile import (
    HOST,
    DemoRequests,
    Outcome,
    closed_loop,
    open_loop,
    raise_fd_limit,
)
from harness.server import start_server
from harness.workload import Pool

LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
GIVE_UP_S = 30.0


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
    lag = np.percentile([o.lag_s for o in outs], 99) * 1e3 if outs else 0.0
    text = (
        f"{len(outs):,} requests: {status[200]:,} x 200 ({status[200] / seconds:.0f}/s), "
        f"{status[503]:,} x 503 ({unlabelled} without Retry-After), {other} other; "
        f"no answer: {failures['closed']} closed, {failures['timeout']} timed out "
        f"({GIVE_UP_S:g} s), {failures['connect']} refused; answers' p99 {p99}; the client "
        "started requests up "
        f"to {lag:.0f} ms late (p99)"
    )
    ok = status[200] + status[503] == len(outs) and unlabelled == 0
    return text, ok


def overload_rows(seconds: float, levels: Sequence[float], capacity_s: float) -> list[list[Any]]:
    demo = DemoRequests(Pool.make(8))
    requests = demo.requests("demo")
    rows: list[list[Any]] = []
    with start_server(None, args=["--no-access-log"]) as server:
        asyncio.run(closed_loop(server.port, requests, 32, capacity_s / 2))  # warm-up
        capacity = asyncio.run(closed_loop(server.port, requests, 32, capacity_s))
        print(f"capacity {capacity:.0f} req/s (closed loop, 32 clients)")
        for burner in (False, True):
            for level in levels:
                rate = level * capacity
                with cpu_burner(burner):
                    outs = asyncio.run(
                        open_loop(
                            server.port,
                            requests,
                            rate,
                            seconds,
                            check=demo.right,
                            give_up_s=GIVE_UP_S,
                            max_connections=2000,  # past the server's cap of 1000
                        )
                    )
                text, ok = describe(outs, seconds)
                wrong = sum(o.wrong for o in outs)
                host = "beside a CPU burner" if burner else "no burner"
                rows.append(
                    [
                        f"open loop {level:g}x capacity ({rate:.0f} req/s offered, capacity "
                        f"{capacity:.0f}) for {seconds:g} s, {host}",
                        "every request answered: 200 or 503 with Retry-After",
                        f"{text}; {wrong} wrong answers",
                        yes(ok and wrong == 0),
                    ]
                )
                print(rows[-1][0], "->", rows[-1][2])
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 s a level; print only, write nothing")
    p.add_argument("--seconds", type=float, default=45.0, help="seconds per open-loop level")
    p.add_argument("--device", action="append", default=None, help="(unused: the demo on cpu)")
    args = p.parse_args(argv)
    seconds = 2.0 if args.smoke else args.seconds
    fd_limit = raise_fd_limit()
    quiet, how = quiet_host(wait_s=0 if args.smoke else 60)
    rows = [cap_row(40, 16, 1 if args.smoke else 3)]
    print(rows[0][2])
    rows += overload_rows(seconds, (3.0, 4.0), 1.0 if args.smoke else 5.0)
    table = markdown_table(["test", "target", "measured", "met"], rows)
    body = f"""
One `bitserve serve` (the built-in demo model; default settings but for
`--max-connections 16` in the first row); clients on raw asyncio sockets in the benchmark's
process (file-descriptor limit {fd_limit}), each open-loop request on an idle keep-alive
connection or a new one (a kept-alive connection the server closed is replaced once, as
HTTP clients do). {how}.
{"Smoke run: tiny sizes." if args.smoke else ""}

{table}
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
