"""A request's lifecycle against real ``bitserve serve`` processes: requests dropped, never
computed, when their client goes away while they are queued (an HTTP connection closed, a
gRPC call cancelled or past its deadline, the Python client's cancelled task or timeout),
counted in ``bitserve_requests_cancelled_total`` and left out of the statistics' success and
fail counts; and priority levels (``parameters.priority``), over REST and gRPC, in one
process and under ``--workers 2``.

The model (``tests.e2e.slow_model.Paced``) computes one request per batch, for as many
rounds as its input asks: a long request holds its worker while short ones queue behind it.
Queues are watched through ``/metrics`` (queue depth, requests in flight), never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpc_aio
from bitserve_client import AsyncClient, Client, TimeoutException
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.e2e.conftest import BitserveServer, start_server
from tests.e2e.slow_model import write_paced_model

pytestmark = pytest.mark.e2e

MODEL = "paced"
LONG = 700
"""Rounds of the request that holds a worker: about a second on an idle 2-core machine."""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paced_model(
        tmp_path_factory.mktemp("repo"),
        MODEL,
        max_queue_size=256,
        priority_levels=2,
        default_priority_level=2,
    )


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[BitserveServer]:
    with start_server(repo) as s:
        yield s


def body(rounds: int, priority: int | None = None) -> bytes:
    """A JSON V2 request for ``rounds`` rounds (at ``priority``, if given)."""
    request: dict[str, object] = {
        "inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 1], "data": [rounds]}]
    }
    if priority is not None:
        request["parameters"] = {"priority": priority}
    return json.dumps(request).encode()


def raw_request(server: BitserveServer, data: bytes, request_id: str = "") -> socket.socket:
    """Send one infer request on a fresh connection and leave it open (unread)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    rid = f"X-Request-ID: {request_id}\r\n" if request_id else ""
    head = (
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n{rid}"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def metrics(server: BitserveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(server: BitserveServer, name: str, **labels: str) -> float:
    return metrics(server).get((name, tuple(sorted(labels.items()))), 0.0)


def queue_depth(server: BitserveServer) -> float:
    return sample(server, "bitserve_queue_depth", model=MODEL)


def in_flight(server: BitserveServer) -> float:
    return sample(server, "bitserve_in_flight_requests")


def cancelled(server: BitserveServer) -> float:
    return sample(server, "bitserve_requests_cancelled_total", model=MODEL, version="1")


def wait_until(what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


def computing(server: BitserveServer) -> float:
    """Requests in a running batch (one per worker at most: a batch is one request)."""
    m = metrics(server)
    depth = m.get(("bitserve_queue_depth", (("model", MODEL),)), 0.0)
    return m.get(("bitserve_in_flight_requests", ()), 0.0) - depth


def stats(server: BitserveServer) -> dict[str, int]:
    (entry,) = httpx.get(server.url + f"/v2/models/{MODEL}/stats", timeout=30).json()["model_stats"]
    s = entry["inference_stats"]
    return {
        "success": s["success"]["count"],
        "fail": s["fail"]["count"],
        "inferences": entry["inference_count"],
    }


def hold_every_worker(server: BitserveServer, workers: int = 1) -> list[socket.socket]:
    """Long requests on fresh connections until every worker is computing one."""
    held = []
    for _ in range(40):
        held.append(raw_request(server, body(LONG), f"hold-{len(held)}"))
        wait_until("the request arrived", lambda: in_flight(server) >= len(held))
        if computing(server) >= workers:
            return held
    raise AssertionError(f"{workers} workers never all computed ({computing(server)} did)")


def drop_queued_raw_requests(server: BitserveServer, n: int, workers: int = 1) -> None:
    """With every worker computing, queue ``n`` short requests on raw connections, then
    close them all; they must be dropped, never computed."""
    before, counted = stats(server), cancelled(server)
    held = hold_every_worker(server, workers)
    queued_before = queue_depth(server)
    socks = [raw_request(server, body(1), f"gone-{i}") for i in range(n)]
    wait_until(f"{n} more are queued", lambda: queue_depth(server) == queued_before + n)
    for s in socks:
        s.close()
    wait_until("they left the queue", lambda: queue_depth(server) == queued_before)
    assert cancelled(server) == counted + n
    for s in held:  # the running batches finish; the held requests still queued are dropped
        s.close()

    def settled() -> bool:  # each request computed or dropped, once (a running batch ends)
        computed = stats(server)["inferences"] - before["inferences"]
        return computed + cancelled(server) - counted == len(held) + n

    wait_until("every request was computed or dropped", settled)
    after = stats(server)
    assert after["inferences"] - before["inferences"] <= len(held)  # only running batches
    # Every client went away: none of them is a success or a failure of the server's.
    assert (after["success"], after["fail"]) == (before["success"], before["fail"])
    assert re.search(r"\[gone-0\] POST /v2/models/paced/infer 499 ", server.log())


def test_closed_http_connections_drop_their_queued_requests(server: BitserveServer) -> None:
    drop_queued_raw_requests(server, 6)


def test_cancelled_and_expired_grpc_calls_drop_their_queued_requests(
    server: BitserveServer,
) -> None:
    before, counted = stats(server), cancelled(server)
    held = hold_every_worker(server)
    x = grpcclient.InferInput("x", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[1]], np.int32))

    # A deadline that passes while the call is queued.
    client = grpcclient.InferenceServerClient(server.grpc_target)
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [x], client_timeout=0.5)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    wait_until("the expired call is counted", lambda: cancelled(server) == counted + 1)

    # A call its client cancels while it is queued (grpc.aio, as asyncio code cancels it).
    async def cancel_one() -> None:
        aio = grpc_aio.InferenceServerClient(server.grpc_target)
        try:
            task = asyncio.ensure_future(aio.infer(MODEL, [x]))
            while queue_depth(server) < 1:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await aio.close()

    asyncio.run(cancel_one())
    wait_until("the cancelled call is counted", lambda: cancelled(server) == counted + 2)
    assert queue_depth(server) == 0
    for s in held:
        s.close()
    wait_until("the held batch ended", lambda: stats(server)["inferences"] > before["inferences"])
    after = stats(server)
    assert after["inferences"] - before["inferences"] == 1  # the held request alone
    assert (after["success"], after["fail"]) == (before["success"], before["fail"])


def test_the_python_client_cancels_on_task_cancel_and_timeout(server: BitserveServer) -> None:
    before, counted = stats(server), cancelled(server)
    held = hold_every_worker(server)
    x = np.array([[1]], np.int32)

    async def cancel_one() -> None:
        async with AsyncClient(server.url, retries=0) as client:
            await client.model_spec(MODEL)
            task = asyncio.ensure_future(client.infer(MODEL, {"x": x}))
            while queue_depth(server) < 1:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancel_one())
    wait_until("the cancelled request is counted", lambda: cancelled(server) == counted + 1)
    with Client(server.url, retries=0) as client, pytest.raises(TimeoutException):
        client.infer(MODEL, {"x": x}, timeout=0.5)
    wait_until("the timed-out request is counted", lambda: cancelled(server) == counted + 2)
    for s in held:
        s.close()
    wait_until("the held batch ended", lambda: stats(server)["inferences"] > before["inferences"])
    assert stats(server)["inferences"] - before["inferences"] == 1


def completion_order(server: BitserveServer, ids: list[str]) -> list[str]:
    """The ids in the order the server finished them (its access log's order)."""
    found = re.findall(r"\[(" + "|".join(map(re.escape, ids)) + r")\] (?:POST|gRPC) ", server.log())
    return sorted(ids, key=found.index)


def test_higher_priority_requests_pass_the_queue_over_rest(server: BitserveServer) -> None:
    held = hold_every_worker(server)
    results: dict[str, int] = {}

    def send(rid: str, priority: int | None) -> None:
        r = httpx.post(
            server.url + f"/v2/models/{MODEL}/infer",
            content=body(5, priority),
            headers={"X-Request-ID": rid},
            timeout=120,
        )
        results[rid] = r.status_code

    order = [
        ("low-0", None),
        ("low-1", 2),
        ("low-2", 0),
        ("high-0", 1),
        ("low-3", 9),
        ("high-1", 1),
    ]
    threads = []
    for i, (rid, priority) in enumerate(order):
        threads.append(threading.Thread(target=send, args=(rid, priority)))
        threads[-1].start()
        wait_until(f"{rid} is queued", lambda i=i: queue_depth(server) == i + 1)
    for s in held:
        s.close()
    for t in threads:
        t.join()
    assert set(results.values()) == {200}
    # Level 1 first, FIFO within a level; 0, none and 9 (past priority_levels) are level 2.
    ids = [rid for rid, _ in order]
    assert completion_order(server, ids) == [
        "high-0", "high-1", "low-0", "low-1", "low-2", "low-3"
    ]  # fmt: skip
    r = httpx.post(server.url + f"/v2/models/{MODEL}/infer", content=body(1, -1), timeout=60)
    assert r.status_code == 400
    assert "parameter 'priority' must be an integer" in r.json()["error"]


def grpc_priority_run(server: BitserveServer, workers: int = 1) -> None:
    """On one gRPC channel (so one worker), long request first, then lows and highs."""
    client = grpcclient.InferenceServerClient(server.grpc_target)
    done: dict[str, object] = {}

    def request(rounds: int) -> list[grpcclient.InferInput]:
        x = grpcclient.InferInput("x", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[rounds]], np.int32))
        return [x]

    def callback(rid: str) -> Callable[[object, object], None]:
        return lambda result, error: done.__setitem__(rid, error or result)

    client.async_infer(MODEL, request(LONG), callback("hold"), headers={"x-request-id": "hold"})
    wait_until("the long request computes", lambda: computing(server) == 1)
    order = [("g-low-0", 0), ("g-high-0", 1), ("g-low-1", 2), ("g-high-1", 1)]
    for i, (rid, priority) in enumerate(order):
        client.async_infer(
            MODEL, request(5), callback(rid), priority=priority, headers={"x-request-id": rid}
        )
        wait_until(f"{rid} is queued", lambda i=i: queue_depth(server) == i + 1)
    wait_until("every call is answered", lambda: len(done) == 5)
    assert not any(isinstance(v, InferenceServerException) for v in done.values()), done
    assert completion_order(server, [rid for rid, _ in order]) == [
        "g-high-0", "g-high-1", "g-low-0", "g-low-1"
    ]  # fmt: skip
    client.close()


def test_higher_priority_requests_pass_the_queue_over_grpc(server: BitserveServer) -> None:
    grpc_priority_run(server)


def test_config_reports_the_priority_levels(server: BitserveServer) -> None:
    config = httpx.get(server.url + f"/v2/models/{MODEL}/config", timeout=30).json()
    batching = config["dynamic_batching"]
    assert (batching["priority_levels"], batching["default_priority_level"]) == (2, 2)
    assert batching["priority_queue_policy"] == {}


def test_under_two_workers(repo: Path, tmp_path: Path) -> None:
    with start_server(repo, args=["--workers", "2"], log_dir=tmp_path) as s:
        drop_queued_raw_requests(s, 6, workers=2)
        grpc_priority_run(s, workers=2)
