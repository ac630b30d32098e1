"""Hostile and measuring clients of the hardening benchmark and tests, on raw asyncio sockets.

- :func:`trickle`: N connections trickling request heads a byte at a time (slowloris),
  reconnecting when the server cuts them; also a command (``python -m
  harness.hostile trickle ...``) so the tricklers run in their own process;
- :func:`side_client`: a closed-loop client measuring the latency of real requests meanwhile;
- :func:`upload`, :func:`upload_crowd`: slow uploads of big bodies, many at once;
- :func:`open_loop`: requests at a fixed rate whatever the answers (open loop), each timed
  from when it was due to be sent;
- :class:`Peak`: the peak of a process's resident memory or open files, sampled in a thread.

Raw sockets, not an HTTP library, so the clients cost little CPU beside the server and do
exactly what they say (partial heads, bodies cut short, no retries of their own).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness import wire
from harness.fuzzcases import INFER, ITEM
from harness.loadgen import is_error_body, tree_rss_bytes
from harness.probes import request_bytes
from harness.workload import INPUT_NAME, N_FUNCTIONS, PACKED_LEN, Pool, check

HOST = "127.0.0.1"


def raise_fd_limit() -> int:
    """Raise this process's soft file-descriptor limit to its hard limit; returns it (child
    processes started afterwards inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


@dataclass
class Answer:
    """One HTTP response as read off the socket."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def closes(self) -> bool:
        return "close" in self.headers.get("connection", "").lower()

    def is_json_error(self) -> bool:
        """The body is ``{"error": "<non-empty text>"}``."""
        return is_error_body(self.body)


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """Read one response with a ``Content-Length`` body.

    Raises:
        asyncio.IncompleteReadError, ConnectionError: the server closed first.
    """
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Answer(status, headers, body)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _exchange(
    port: int, conn: Conn | None, request: bytes, *, fresh: bool = False
) -> tuple[Answer, Conn]:
    """``request`` on ``conn`` (a kept-alive connection, or one just opened: ``fresh``) or a
    new one; a kept-alive one the server closed meanwhile (its keep-alive timeout) is
    replaced once, as HTTP clients do. On failure the connection is closed and the error
    raised."""
    for attempt in (1, 2):
        reused = conn is not None and not (fresh and attempt == 1)
        if conn is None:
            conn = await asyncio.open_connection(HOST, port)
        try:
            conn[1].write(request)
            return await read_answer(conn[0]), conn
        except (OSError, asyncio.IncompleteReadError) as e:
            await _close(conn[1])
            conn = None
            stale = isinstance(e, OSError) or not e.partial
            if not (reused and stale and attempt == 1):
                raise
        except BaseException:
            await _close(conn[1])
            raise
    raise AssertionError("unreachable")


# --- one raw exchange ----------------------------------------------------------------------


async def raw_exchange(port: int, data: bytes, *, answer_s: float = 3.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it (or resets
    it, with bytes of ours unread) or ``answer_s`` passes; returns what came."""
    reader, writer = await asyncio.open_connection(HOST, port)
    out = bytearray()
    try:
        writer.write(data)
        async with asyncio.timeout(answer_s):
            while part := await reader.read(65536):
                out += part
    except (TimeoutError, OSError):
        pass
    finally:
        await _close(writer)
    return bytes(out)


@dataclass
class FuzzStats:
    """What a batch of hostile requests got."""

    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    """The first answer's status per request; ``"none"``: no answer (incomplete request)."""
    problems: list[str] = field(default_factory=list)
    """What :func:`harness.fuzzcases.judge_raw` found wrong, with the case's name."""


async def send_all(
    port: int,
    cases: Sequence[tuple[str, bytes]],
    judge: Callable[[bytes], str | None],
    *,
    concurrency: int = 8,
    answer_s: float = 3.0,
) -> FuzzStats:
    """Send each ``(name, request)`` on its own connection, ``concurrency`` at a time, and
    judge each answer."""
    stats = FuzzStats()
    todo = iter(cases)

    async def worker() -> None:
        for name, data in todo:
            try:
                answer = await raw_exchange(port, data, answer_s=answer_s)
            except OSError as e:
                stats.problems.append(f"{name}: could not connect: {e!r}")
                continue
            stats.sent += 1
            stats.statuses[answer[9:12].decode("latin-1") if answer else "none"] += 1
            problem = judge(answer)
            if problem is not None:
                stats.problems.append(f"{name} {data[:120]!r}: {problem}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats


# --- slowloris ------------------------------------------------------------------------------


@dataclass
class TrickleStats:
    """What the tricklers saw."""

    connections: int
    """Tricklers."""
    connects: int = 0
    """Connections opened (first ones and reconnections)."""
    connect_errors: int = 0
    cut_408: int = 0
    """Connections the server closed after a 408 (part of a head had come)."""
    cut_silent: int = 0
    """Connections the server closed without an answer."""
    cut_reset: int = 0
    """Connections reset before an answer was read (the server closed with bytes unread)."""
    cut_other: Counter[int] = field(default_factory=Counter)
    """Closed after another status (none expected)."""
    most_open: int = 0
    """Most tricklers connected at one time."""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cut_other"] = {str(k): v for k, v in self.cut_other.items()}
        return d


async def trickle(
    port: int,
    connections: int,
    seconds: float,
    *,
    interval_s: float = 1.0,
    ramp_s: float = 2.0,
    path: str = INFER,
) -> TrickleStats:
    """``connections`` clients that each send a partial request head, then one more byte every
    ``interval_s``, for ``seconds``; a client cut off by the server reconnects after
    ``interval_s`` (as slowloris tools do). They start spread over ``ramp_s``."""
    stats = TrickleStats(connections)
    deadline = time.monotonic() + seconds
    open_now = 0

    async def one(i: int) -> None:
        nonlocal open_now
        await asyncio.sleep(ramp_s * i / connections)
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection(HOST, port)
            except OSError:
                stats.connect_errors += 1
                await asyncio.sleep(interval_s)
                continue
            stats.connects += 1
            open_now += 1
            stats.most_open = max(stats.most_open, open_now)
            answer = b""
            reset = False
            try:
                writer.write(f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nX-Slow-{i}: ".encode())
                while time.monotonic() < deadline:
                    try:
                        part = await asyncio.wait_for(reader.read(4096), interval_s)
                    except TimeoutError:
                        writer.write(b"a")
                        continue
                    if not part:
                        break
                    answer += part
            except OSError:
                reset = True
            finally:
                open_now -= 1
                await _close(writer)
            if time.monotonic() >= deadline:
                break
            if not answer:
                if reset:
                    stats.cut_reset += 1
                else:
                    stats.cut_silent += 1
            elif answer.startswith(b"HTTP/1.1 408"):
                stats.cut_408 += 1
            else:
                stats.cut_other[int(answer[9:12] or b"0")] += 1
            await asyncio.sleep(interval_s)

    await asyncio.gather(*(one(i) for i in range(connections)))
    return stats


# --- a client measuring latency meanwhile ---------------------------------------------------


@dataclass
class SideStats:
    """Latencies of a closed-loop client's requests."""

    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    """By status; ``"transport"`` for a connection that failed or closed without an answer."""


async def side_client(
    port: int,
    request: bytes,
    seconds: float,
    *,
    pause_s: float = 0.05,
    check: Callable[[Answer], bool] | None = None,
    timeout_s: float = 30.0,
) -> SideStats:
    """Send ``request`` on one keep-alive connection (reopened when the server closes it),
    one at a time with ``pause_s`` between, for ``seconds``; time each from send to answer,
    connecting included. ``check`` says whether a 200 is right (a wrong one is counted as
    ``"wrong"``)."""
    stats = SideStats()
    deadline = time.monotonic() + seconds
    conn: Conn | None = None
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            answer, conn = await asyncio.wait_for(_exchange(port, conn, request), timeout_s)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            stats.statuses["transport"] += 1
            conn = None
            continue
        stats.latencies_s.append(time.perf_counter() - t0)
        ok = answer.status != 200 or check is None or check(answer)
        stats.statuses[str(answer.status) if ok else "wrong"] += 1
        if answer.closes:
            await _close(conn[1])
            conn = None
        await asyncio.sleep(pause_s)
    if conn is not None:
        await _close(conn[1])
    return stats


# --- big uploads ----------------------------------------------------------------------------


class DemoRequests:
    """Requests for the demo model (one packed item each, from a pool with float64
    references) and the check of their answers."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.bodies = [wire.encode("packed", item) for item in pool.items]

    def requests(self, model: str = "demo") -> list[bytes]:
        """One keep-alive request per pool item, to ``model``."""
        return [
            request_bytes(f"/v2/models/{model}/infer", b.content, b.headers, close=False)
            for b in self.bodies
        ]

    def right(self, i: int, answer: Answer) -> bool:
        """Whether ``answer`` (a 200) is the reference answer to request ``i`` (cycled)."""
        got = wire.decode("packed", answer.headers, answer.body)[0].astype(np.float64)
        return check(got, self.pool.expected[i % len(self.bodies)]) is None


@dataclass
class UploadResult:
    """How one upload ended."""

    status: int
    """The answer's status; 0: none (the connection closed or failed first)."""
    sent: int
    """Body bytes sent before the answer came (or the upload ended)."""
    retry_after: bool = False
    json_error: bool = False


async def upload(
    port: int,
    path: str,
    headers: dict[str, str],
    prefix: bytes,
    filler: int,
    *,
    rate_bps: float,
    chunked: bool = False,
    chunk: int = 64 << 10,
    timeout_s: float = 120.0,
) -> UploadResult:
    """POST a body of ``prefix`` then ``filler`` zero bytes at about ``rate_bps``, with a
    ``Content-Length`` or ``chunked``; stop sending when the server answers (a refused
    upload is not finished)."""
    size = len(prefix) + filler
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(size)}
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}"]
    lines += [f"{k}: {v}" for k, v in {**headers, **framing}.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    reader, writer = await asyncio.open_connection(HOST, port)
    sent = 0
    answered: asyncio.Task[Answer] = asyncio.ensure_future(read_answer(reader))
    try:
        writer.write(head)
        zeros = bytes(chunk)
        t0 = time.perf_counter()
        while sent < size and not answered.done():
            n = min(chunk, size - sent)
            data = zeros[:n] if sent >= len(prefix) else (prefix[sent:] + zeros)[:n]
            writer.write(b"%x\r\n%b\r\n" % (n, data) if chunked else data)
            await writer.drain()
            sent += n
            ahead = sent / rate_bps - (time.perf_counter() - t0)
            if ahead > 0:
                await asyncio.wait({answered}, timeout=ahead)
        if chunked and not answered.done():
            writer.write(b"0\r\n\r\n")
        answer = await asyncio.wait_for(answered, timeout_s)
    except (OSError, asyncio.IncompleteReadError, TimeoutError):
        return UploadResult(0, sent)
    finally:
        answered.cancel()
        await _close(writer)
    retry = "retry-after" in answer.headers
    return UploadResult(answer.status, sent, retry, answer.is_json_error())


async def closed_loop(
    port: int, requests: Sequence[bytes], concurrency: int, seconds: float
) -> float:
    """Requests per second answered 200 by ``concurrency`` clients sending ``requests``
    (cycled) back to back on keep-alive connections for ``seconds``: the server's capacity
    when ``concurrency`` covers its batch."""
    done = 0
    deadline = time.monotonic() + seconds

    async def client(k: int) -> None:
        nonlocal done
        conn: Conn | None = None
        i = k
        while time.monotonic() < deadline:
            answer, conn = await _exchange(port, conn, requests[i % len(requests)])
            done += answer.status == 200
            i += concurrency
        if conn is not None:
            await _close(conn[1])

    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    return done / (time.monotonic() - t0)


async def upload_crowd(
    port: int,
    uploads: int,
    size: int,
    *,
    rate_bps: float,
    seconds: float,
    chunked: bool = False,
    retry_s: float = 1.0,
) -> list[UploadResult]:
    """``uploads`` clients each uploading a demo request of about ``size`` bytes (a batch too
    big for the model: a body read whole is answered 400) at ``rate_bps``, again and again
    for ``seconds``, waiting ``retry_s`` after each 503."""
    items = size // ITEM
    filler = items * ITEM
    spec = {"name": INPUT_NAME, "datatype": "UINT8", "shape": [items, N_FUNCTIONS, PACKED_LEN]}
    header = json.dumps({"inputs": [{**spec, "parameters": {"binary_data_size": filler}}]})
    headers = {"Inference-Header-Content-Length": str(len(header))}
    results: list[UploadResult] = []

    async def uploader() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            r = await upload(
                port,
                INFER,
                headers,
                header.encode(),
                filler,
                rate_bps=rate_bps,
                chunked=chunked,
            )
            results.append(r)
            if r.status == 503:
                await asyncio.sleep(retry_s)

    await asyncio.gather(*(uploader() for _ in range(uploads)))
    return results


# --- open loop ------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One open-loop request: its status (0: no answer in time, or the connection failed)
    and its latency from when it was due to be sent."""

    status: int
    latency_s: float
    lag_s: float
    """How late the client itself started it (a busy client's share of the latency)."""
    retry_after: bool = False
    json_error: bool = True
    wrong: bool = False
    failure: str = ""
    """Why there is no answer (status 0): ``closed`` (the connection closed or reset with no
    answer), ``timeout`` (none within ``give_up_s``), ``connect`` (no connection)."""
    index: int = -1
    """Which request it was (its number in the schedule)."""
    sent_s: float = -1.0
    """When the client wrote it, from when it was due (its wait for a connection of its
    pool, and for the connection, included); -1: never written."""
    fresh: bool = False
    """Sent on a new connection (not a kept-alive one)."""


async def open_loop(
    port: int,
    requests: Sequence[bytes],
    rate: float,
    seconds: float,
    *,
    give_up_s: float = 10.0,
    check: Callable[[int, Answer], bool] | None = None,
    max_connections: int = 500,
    tag: str | None = None,
    delay_s: float = 0.0,
) -> list[Outcome]:
    """Send ``requests`` (cycled) at ``rate`` per second for ``seconds``, each on an idle
    keep-alive connection or a new one, whatever the answers so far. ``check(i, answer)``
    says whether the 200 to ``requests[i]`` is right. At most ``max_connections`` are open
    (below the server's cap, as a client's pool would be): a request due when all are busy
    waits for one, and that wait counts in its latency. With a ``tag``, request ``i``
    carries ``X-Request-ID: <tag>-<i>`` (the server's access log names it). The first is due
    ``delay_s`` from now."""
    idle: list[Conn] = []
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    pool = asyncio.Semaphore(max_connections)

    heads = [r.partition(b"\r\n\r\n") for r in requests]

    def request(i: int) -> bytes:
        if tag is None:
            return requests[i % len(requests)]
        head, _, body = heads[i % len(heads)]
        return b"%b\r\nX-Request-ID: %b-%d\r\n\r\n%b" % (head, tag.encode(), i, body)

    async def one(i: int, due: float) -> None:
        lag = loop.time() - due
        sent = -1.0
        fresh = False
        conn: Conn | None = None
        try:
            async with asyncio.timeout_at(due + give_up_s), pool:
                conn = idle.pop() if idle else None
                fresh = conn is None
                if conn is None:
                    conn = await asyncio.open_connection(HOST, port)
                sent = loop.time() - due
                answer, conn = await _exchange(port, conn, request(i), fresh=fresh)
                if not answer.closes:
                    idle.append(conn)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            failure = (
                "timeout"
                if isinstance(e, TimeoutError)
                else "connect"
                if isinstance(e, ConnectionRefusedError)
                else "closed"
            )
            latency = loop.time() - due
            outcomes.append(
                Outcome(0, latency, lag, failure=failure, index=i, sent_s=sent, fresh=fresh)
            )
            return
        latency = loop.time() - due
        wrong = answer.status == 200 and check is not None and not check(i, answer)
        outcomes.append(
            Outcome(
                answer.status,
                latency,
                lag,
                "retry-after" in answer.headers,
                answer.status == 200 or answer.is_json_error(),
                wrong,
                index=i,
                sent_s=sent,
                fresh=fresh,
            )
        )
        if answer.closes:
            await _close(conn[1])

    start = loop.time() + 0.05 + delay_s
    total = int(rate * seconds)
    for i in range(total):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(one(i, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    for _, writer in idle:
        await _close(writer)
    return outcomes


# --- memory ---------------------------------------------------------------------------------


class Peak:
    """The peak of ``measure()`` (a process's resident bytes, its open files...), sampled
    every ``every_s`` in a thread from ``with`` to its end; ``start`` is the first sample."""

    def __init__(self, measure: Callable[[], int], every_s: float = 0.05) -> None:
        self.measure = measure
        self.every_s = every_s
        self.start = self.peak = measure()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, self.measure())

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self.peak = max(self.peak, self.measure())


def rss_of(pid: int) -> Callable[[], int]:
    """Resident bytes of process ``pid`` and its children, for :class:`Peak`."""
    return lambda: tree_rss_bytes(pid)


def open_files_of(pid: int) -> Callable[[], int]:
    """Open file descriptors of process ``pid`` (sockets included), for :class:`Peak`."""
    return lambda: len(os.listdir(f"/proc/{pid}/fd"))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tricklers in their own process; prints JSON stats")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trickle")
    t.add_argument("--port", type=int, required=True)
    t.add_argument("--connections", type=int, required=True)
    t.add_argument("--seconds", type=float, required=True)
    t.add_argument("--interval-s", type=float, default=1.0)
    t.add_argument("--ramp-s", type=float, default=2.0)
    args = p.parse_args(argv)
    raise_fd_limit()
    stats = asyncio.run(
        trickle(
            args.port,
            args.connections,
            args.seconds,
            interval_s=args.interval_s,
            ramp_s=args.ramp_s,
        )
    )
    print(json.dumps(stats.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
