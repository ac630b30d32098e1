"""Faults against a real ``bitserve serve`` process on loopback.

Clients that vanish mid-request, mid-queue or mid-response; clients that dribble their headers
or body; SIGTERM under load; a batch whose compute raises. After each: nothing stuck in the
queue, nothing in flight, no growth in threads or memory, and correct answers again.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch

from harness import wire
from harness.loadgen import run_level, tree_rss_bytes
from harness.probes import (
    http_status,
    infer_ok,
    raw_request,
    request_bytes,
    wait_idle,
    write_repository,
)
from harness.server import BitserveServer, terminate_under_load, wait_begun
from harness.workload import N_FINE, N_FUNCTIONS, Pool, check
from service.models.demo import write_demo_repository
from tests.e2e.slow_model import slow_request, write_slow_model

pytestmark = pytest.mark.e2e

INFER = "/v2/models/demo/infer"


@pytest.fixture(scope="module")
def pool() -> Pool:
    return Pool.make(2)


def _abuse(server: BitserveServer, pool: Pool, rounds: int) -> None:
    """Clients that disconnect mid-request, while queued/computing, and mid-response."""
    body = wire.encode("packed", pool.items[0])
    full = request_bytes(INFER, body.content, body.headers)
    json_body = wire.encode("json", pool.items[1])
    full_json = request_bytes(INFER, json_body.content, json_body.headers)
    for _ in range(rounds):
        # Headers and half the body, then gone.
        raw_request(server.port, full[: len(full) // 2], read=False)
        # The whole request, gone before the answer (it is queued or computing by then).
        raw_request(server.port, full, read=False)
        # Gone after the first bytes of a large (JSON) answer.
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(full_json)
            s.recv(100)


def test_disconnecting_clients_leak_nothing(
    shared_server: Callable[..., BitserveServer], pool: Pool
) -> None:
    server = shared_server()  # the session's demo server: no fresh process needed
    proc = psutil.Process(server.process.pid)
    _abuse(server, pool, rounds=3)  # warm-up: thread pools and buffers reach their size
    wait_idle(server.url)
    infer_ok(server.url, "demo", pool)
    threads0, rss0 = proc.num_threads(), tree_rss_bytes(proc.pid)

    _abuse(server, pool, rounds=8)
    wait_idle(server.url)
    infer_ok(server.url, "demo", pool)
    threads1, rss1 = proc.num_threads(), tree_rss_bytes(proc.pid)
    print(f"threads {threads0} -> {threads1}, RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
    assert threads1 <= threads0 + 2, "threads pile up after disconnects"
    assert rss1 < rss0 * 1.05, "memory grows with each disconnect"


def test_slow_dribbling_clients_get_answers_and_block_nobody(
    shared_server: Callable[..., BitserveServer], pool: Pool
) -> None:
    server = shared_server()  # the session's demo server: no fresh process needed
    body = wire.encode("packed", pool.items[0])
    full = request_bytes(INFER, body.content, body.headers)
    head_end = full.index(b"\r\n\r\n") + 4
    head, payload = full[:head_end], full[head_end:]
    # Headers 16 bytes at a time, then the body in 20 pieces: about 3 s in all.
    chunks = [head[i : i + 16] for i in range(0, len(head), 16)]
    step = -(-len(payload) // 20)
    chunks += [payload[i : i + step] for i in range(0, len(payload), step)]

    answers: dict[int, bytes] = {}

    def dribble(i: int) -> None:
        answers[i] = raw_request(server.port, chunks, pause_s=3.0 / len(chunks))

    slow = [threading.Thread(target=dribble, args=(i,)) for i in range(4)]
    for t in slow:
        t.start()
    # Meanwhile normal clients are served.
    normal = asyncio.run(run_level(server.url + INFER, "packed", pool, 4, seconds=2.0))
    for t in slow:
        t.join(60)
    assert normal.errors == 0, normal.first_problem
    assert normal.ok > 0
    for i in range(4):
        raw = answers[i]
        assert http_status(raw) == 200, raw[:300]
        head_len = raw.index(b"\r\n\r\n") + 4
        headers = dict(
            line.split(": ", 1) for line in raw[:head_len].decode().split("\r\n")[1:] if line
        )
        lowered = {k.lower(): v for k, v in headers.items()}
        answer = wire.decode("packed", lowered, raw[head_len:])
        assert check(answer[0].astype(np.float64), pool.expected[0]) is None
    wait_idle(server.url)


def test_sigterm_under_load_drains_and_exits(
    server_factory: Callable[..., BitserveServer], pool: Pool, tmp_path: Path
) -> None:
    grace_s = 60  # far beyond the slow requests' seconds, on a loaded machine too
    # The demo, plus a slow model: requests that are surely in flight at the signal.
    repo = write_slow_model(write_demo_repository(tmp_path / "repo").parent, rounds=None)
    server = server_factory(repo, env={"BITSERVE_GRACEFUL_SHUTDOWN_S": str(grace_s)})
    url = server.url + INFER
    bodies = [wire.encode("packed", item) for item in pool.items]
    log: list[tuple[float, float, str]] = []  # (start, end, outcome)
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                b = bodies[k % len(bodies)]
                t0 = time.monotonic()
                try:
                    r = c.post(url, content=b.content, headers=b.headers)
                except httpx.HTTPError as e:
                    log.append((t0, time.monotonic(), f"transport {type(e).__name__}"))
                    time.sleep(0.05)
                    continue
                outcome = str(r.status_code)
                if r.status_code == 200:
                    ans = wire.decode("packed", r.headers, r.content)
                    if check(ans[0].astype(np.float64), pool.expected[k % len(bodies)]):
                        outcome = "wrong"
                log.append((t0, time.monotonic(), outcome))

    # Four slow requests, all begun by the server before the load starts and the signal
    # comes: the drain must answer every one of them.
    slow = ThreadPoolExecutor(4)
    answers = [slow.submit(slow_request, server.url, 200 + x) for x in range(4)]
    wait_begun(server.url, 4, "slow")
    code, t_term, t_exit = terminate_under_load(
        server, client, 8, stop, timeout=grace_s + 20, until=lambda: len(log) >= 8
    )
    slow_answers = [a.result() for a in answers]
    slow.shutdown()

    # What was answered before the signal, and everything else.
    before = [o for t0, t1, o in log if t1 < t_term]
    after = [o for t0, t1, o in log if t1 >= t_term]
    print(f"before SIGTERM {len(before)}: {set(before)}; after {len(after)}: {set(after)}")
    # service.server owns SIGTERM: after a complete graceful shutdown the process exits 0.
    assert code == 0, server.log()[-3000:]
    assert "Application shutdown complete" in server.log()
    assert t_exit - t_term < grace_s + 5
    assert before, "no load before SIGTERM"
    assert set(before) == {"200"}, server.log()[-3000:]
    # Every request the server had begun was answered, right.
    assert slow_answers == [(200, [[200.0 + x]]) for x in range(4)], slow_answers
    # Afterwards: answered, refused with 503, or the connection refused/closed. Never a 500.
    assert all(o in {"200", "503"} or o.startswith("transport") for o in after), after
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/v2/health/live", timeout=2)


def _raising_model(path: Path) -> Path:
    """A ``torch.export`` program that raises when the operator's output exceeds 200.

    Random items (10% ones) give at most ~60; an all-ones item gives ~313 (the Gaussian's
    sum), so all-ones is the trigger.
    """

    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._assert_async(x.amax() < 200.0, "trigger value seen")
            return x * 1.0

    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(
        Boom(), (torch.zeros(2, N_FUNCTIONS, 500),), dynamic_shapes={"x": {0: batch}}
    )
    torch.export.save(ep, str(path))
    return path


def test_failing_batch_fails_only_its_requests(
    server_factory: Callable[..., BitserveServer], pool: Pool, tmp_path: Path
) -> None:
    # One request per batch, so the trigger's batch holds only the trigger.
    repo = write_repository(
        tmp_path / "repo",
        max_batch_size=1,
        max_queue_size=64,
        model_file=_raising_model(tmp_path / "boom.pt2"),
    )
    server = server_factory(repo)
    url = server.url + INFER
    trigger = wire.encode("packed", np.ones((N_FUNCTIONS, N_FINE), dtype=bool))
    good = wire.encode("packed", pool.items[0])

    def post(b: wire.Body) -> httpx.Response:
        return httpx.post(url, content=b.content, headers=b.headers, timeout=60)

    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(post, trigger if i == 3 else good) for i in range(8)]
        answers = [f.result() for f in futures]
    bad = answers.pop(3)
    assert bad.status_code == 500, bad.text
    error = json.loads(bad.content)["error"]
    assert isinstance(error, str)
    assert error
    assert "Traceback" not in bad.text
    for r in answers:
        assert r.status_code == 200, r.text
        ans = wire.decode("packed", r.headers, r.content)
        assert check(ans[0].astype(np.float64), pool.expected[0]) is None
    # The model keeps serving, and fails the trigger again the same way.
    infer_ok(server.url, "demo", pool)
    assert post(trigger).status_code == 500
    wait_idle(server.url)
