"""A request's lifecycle against real ``bitserve serve`` processes: requests dropped, never
computed, when their client goes away while they are queued (an HTTP connection closed, a
gRPC call cancelled or past its deadline, the Python client's cancelled task or timeout),
counted in ``bitserve_requests_cancelled_total`` and left out of the statistics' success and
fail counts; and priority levels (``parameters.priority``), over REST and gRPC, in one
process and under ``--workers 2``.

The model (``harness.paced.Paced``) computes one request per batch, for as many
rounds as its input asks: a long request holds its worker while short ones queue behind it.
Queues are watched through ``/metrics`` (queue depth, requests in flight), never by sleeping.
A scenario needs its short requests queued before the long one ends: on a machine too busy
for that, it is run again with a hold twice as long (:func:`while_held`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpc_aio
from bitserve_client import AsyncClient, Client, TimeoutException
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from harness.paced import write_paced_model
from harness.server import BitserveServer, start_server

pytestmark = pytest.mark.e2e

MODEL = "paced"
HOLD_S = 3.0
"""How long the request that holds a worker computes (measured: see :func:`long_rounds`)."""
_rounds: dict[int, int] = {}
_tries = itertools.count()
"""Numbers the scenarios' runs: request ids are unique in a server's log."""


class HoldEnded(Exception):
    """A held batch ended before the scenario had queued what it needed behind it."""


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


def batches(server: BitserveServer) -> float:
    """Batches computed (each one request), every worker's, as soon as each ends."""
    return sample(server, "bitserve_batch_size_count", model=MODEL)


def stats(server: BitserveServer) -> dict[str, int]:
    """The statistics extension's counts, once they hold every request computed and none is
    in flight (under ``--workers`` a peer's counts arrive with its next heartbeat)."""

    def read() -> dict[str, int]:
        (entry,) = httpx.get(server.url + f"/v2/models/{MODEL}/stats", timeout=30).json()[
            "model_stats"
        ]
        s = entry["inference_stats"]
        return {
            "success": s["success"]["count"],
            "fail": s["fail"]["count"],
            "inferences": entry["inference_count"],
        }

    out: dict[str, int] = {}

    def settled() -> bool:
        nonlocal out
        out = read()
        return in_flight(server) == 0 and out["inferences"] == batches(server)

    wait_until("the statistics are up to date", settled)
    return out


def long_rounds(server: BitserveServer) -> int:
    """Rounds for a batch of about :data:`HOLD_S` on this machine, from one timed batch of
    50 (a busier machine only holds longer)."""
    if server.port not in _rounds:
        t0 = time.perf_counter()
        assert httpx.post(f"{server.url}/v2/models/{MODEL}/infer", content=body(50)).is_success
        per_round = (time.perf_counter() - t0) / 50
        _rounds[server.port] = max(200, int(HOLD_S / per_round))
    return _rounds[server.port]


@dataclass
class Hold:
    """Long requests that keep every worker computing while a scenario queues short ones
    behind them (:func:`hold_every_worker`)."""

    server: BitserveServer
    socks: list[socket.socket]
    batches: float
    """The model's batches before the hold: a batch that ends passes it."""
    suffix: str = ""
    """Of the held requests' ids (``hold<suffix>-<i>``)."""

    def check(self) -> None:
        """:class:`HoldEnded` (the held connections closed) if a batch has ended."""
        if batches(self.server) > self.batches:
            self.release()
            raise HoldEnded("a held batch ended first")

    def wait(self, what: str, check: Callable[[], bool]) -> None:
        """Wait until ``check()`` while the hold lasts (:class:`HoldEnded` if it ends)."""

        def held_check() -> bool:
            self.check()
            return check()

        wait_until(what, held_check)

    def wait_depth(self, what: str, depth: float) -> None:
        """Wait until the queue holds ``depth`` requests while the hold lasts."""
        self.wait(what, lambda: queue_depth(self.server) == depth)

    def queued(self, depth: float) -> bool:
        """Whether the queue holds ``depth`` requests (:class:`HoldEnded` if the hold ended)."""
        self.check()
        return queue_depth(self.server) >= depth

    def release(self) -> None:
        """Close the held connections: their running batches finish, unanswered."""
        close_all(self.socks)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        # Whatever failed, the held connections close now, not while a later test runs.
        self.release()

    def check_unanswered(self) -> None:
        """Once released and logged: :class:`HoldEnded` if a held request was answered (its
        batch ended before its connection closed: it is a success of the server's)."""
        ids = "|".join(re.escape(f"hold{self.suffix}-{i}") for i in range(len(self.socks)))
        pattern = re.compile(rf"\[(?:{ids})\] POST \S+ (\d+) ")
        logged: list[str] = []

        def all_logged() -> bool:
            logged[:] = pattern.findall(self.server.log())
            return len(logged) == len(self.socks)

        wait_until("the held requests are logged", all_logged)
        if "200" in logged:
            raise HoldEnded("a held request was answered")


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def hold_every_worker(server: BitserveServer, suffix: str, workers: int = 1) -> Hold:
    """Long requests on fresh connections until every worker is computing one."""
    hold = Hold(server, [], batches(server), suffix)
    for i in range(40):
        hold.socks.append(raw_request(server, body(long_rounds(server)), f"hold{suffix}-{i}"))
        hold.wait("the request arrived", lambda: in_flight(server) >= len(hold.socks))
        if computing(server) >= workers:
            return hold
    hold.release()
    raise AssertionError(f"{workers} workers never all computed ({computing(server)} did)")


def wait_idle(server: BitserveServer, workers: int) -> None:
    """Wait until every worker's batches have ended, those of requests whose clients went
    away included: until a short request on a fresh connection was answered by each worker
    (a worker computes one batch at a time, in order)."""
    wait_until("no request is in flight", lambda: in_flight(server) == 0, timeout=600)
    answered: set[str] = set()
    for _ in range(100):
        with httpx.Client() as client:  # its own connection: any worker may take it
            r = client.post(f"{server.url}/v2/models/{MODEL}/infer", content=body(1), timeout=600)
        assert r.is_success, r.text
        answered.add(r.headers.get("x-bitserve-worker", "0"))
        if len(answered) >= workers:
            return
    raise AssertionError(f"only workers {answered} answered")


def while_held(server: BitserveServer, scenario: Callable[[str], None], workers: int = 1) -> None:
    """Run ``scenario`` (given a suffix for its request ids, unique to each run); when a held
    batch ended before it had queued its requests, wait for the server to be idle and run it
    again, with holds twice as long."""
    long_rounds(server)  # measured first: its request is no part of what a scenario counts
    for _ in range(4):
        try:
            scenario(f"-{next(_tries)}")
            return
        except HoldEnded:
            _rounds[server.port] = 2 * long_rounds(server)
            wait_idle(server, workers)
    raise AssertionError("held batches kept ending before the requests behind them queued")


def drop_queued_raw_requests(server: BitserveServer, n: int, workers: int = 1) -> None:
    """With every worker computing, queue ``n`` short requests on raw connections, then
    close them all; they must be dropped, never computed."""
    scenario = functools.partial(_drop_queued_raw_requests, server, n, workers)
    while_held(server, scenario, workers)


def _drop_queued_raw_requests(server: BitserveServer, n: int, workers: int, suffix: str) -> None:
    before, counted = stats(server), cancelled(server)
    socks: list[socket.socket] = []
    with hold_every_worker(server, suffix, workers) as hold:
        queued_before = queue_depth(server)
        try:
            for i in range(n):
                socks.append(raw_request(server, body(1), f"gone{suffix}-{i}"))
            hold.wait_depth(f"{n} more are queued", queued_before + n)
        finally:
            close_all(socks)
        # While the hold lasts: under several workers one may hold two long requests, one
        # queued, and a held batch that ended would start it (the depth falls below
        # queued_before): that is HoldEnded, and the scenario runs again.
        hold.wait("they left the queue", lambda: queue_depth(server) == queued_before)
        assert cancelled(server) == counted + n
    # Released: the running batches finish; the held requests still queued are dropped.

    def settled() -> bool:  # each request computed or dropped, once (a running batch ends)
        computed = batches(server) - before["inferences"]
        return computed + cancelled(server) - counted == len(hold.socks) + n

    wait_until("every request was computed or dropped", settled)
    hold.check_unanswered()
    after = stats(server)
    assert after["inferences"] - before["inferences"] <= len(hold.socks)  # running batches
    # Every client went away: none of them is a success or a failure of the server's.
    assert (after["success"], after["fail"]) == (before["success"], before["fail"])
    assert re.search(rf"\[gone{suffix}-0\] POST /v2/models/paced/infer 499 ", server.log())


def test_closed_http_connections_drop_their_queued_requests(server: BitserveServer) -> None:
    drop_queued_raw_requests(server, 6)


def held_batch_alone(server: BitserveServer, before: dict[str, int], hold: Hold) -> None:
    """Release ``hold``; once its batch has ended, it alone was computed, and no request was a
    success or a failure of the server's."""
    hold.release()
    wait_until("the held batch ended", lambda: batches(server) > before["inferences"])
    hold.check_unanswered()
    after = stats(server)
    assert after["inferences"] - before["inferences"] == 1
    assert (after["success"], after["fail"]) == (before["success"], before["fail"])


async def cancel_when_queued(hold: Hold, call: Coroutine[Any, Any, object]) -> None:
    """Start ``call``, and cancel it once it is queued: it must end cancelled."""
    task = asyncio.ensure_future(call)
    try:
        while not hold.queued(1):
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(outcome, asyncio.CancelledError), outcome


def test_cancelled_and_expired_grpc_calls_drop_their_queued_requests(
    server: BitserveServer,
) -> None:
    x = grpcclient.InferInput("x", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[1]], np.int32))

    # A call its client cancels while it is queued (grpc.aio, as asyncio code cancels it).
    async def cancel_one(hold: Hold) -> None:
        aio = grpc_aio.InferenceServerClient(server.grpc_target)
        try:
            await cancel_when_queued(hold, aio.infer(MODEL, [x]))
        finally:
            await aio.close()

    def scenario(suffix: str) -> None:
        before, counted = stats(server), cancelled(server)
        with hold_every_worker(server, suffix) as hold:
            # A deadline that passes while the call is queued.
            with grpcclient.InferenceServerClient(server.grpc_target) as client:
                try:
                    client.infer(MODEL, [x], client_timeout=0.5)
                    status = "OK"
                except InferenceServerException as e:
                    status = str(e.status())
            hold.wait("the expired call is counted", lambda: cancelled(server) == counted + 1)
            assert status == "StatusCode.DEADLINE_EXCEEDED"
            asyncio.run(cancel_one(hold))
            hold.wait("the cancelled call is counted", lambda: cancelled(server) == counted + 2)
            assert queue_depth(server) == 0
            held_batch_alone(server, before, hold)

    while_held(server, scenario)


def test_the_python_client_cancels_on_task_cancel_and_timeout(server: BitserveServer) -> None:
    x = np.array([[1]], np.int32)

    async def cancel_one(hold: Hold) -> None:
        async with AsyncClient(server.url, retries=0) as client:
            await client.model_spec(MODEL)
            await cancel_when_queued(hold, client.infer(MODEL, {"x": x}))

    def scenario(suffix: str) -> None:
        before, counted = stats(server), cancelled(server)
        with hold_every_worker(server, suffix) as hold:
            asyncio.run(cancel_one(hold))
            hold.wait("the cancelled request is counted", lambda: cancelled(server) == counted + 1)
            with Client(server.url, retries=0) as client:
                try:
                    client.infer(MODEL, {"x": x}, timeout=0.5)
                    timed_out = False
                except TimeoutException:
                    timed_out = True
            hold.wait("the timed-out request is counted", lambda: cancelled(server) == counted + 2)
            assert timed_out
            held_batch_alone(server, before, hold)

    while_held(server, scenario)


def completion_order(server: BitserveServer, ids: list[str]) -> list[str]:
    """The ids in the order the server finished them (its access log's order)."""
    pattern = re.compile(r"\[(" + "|".join(map(re.escape, ids)) + r")\] (?:POST|gRPC) ")
    found: list[str] = []

    def all_logged() -> bool:
        found[:] = pattern.findall(server.log())
        return set(found) == set(ids)

    wait_until("every request is logged", all_logged)
    return sorted(ids, key=found.index)


def test_higher_priority_requests_pass_the_queue_over_rest(server: BitserveServer) -> None:
    while_held(server, lambda suffix: rest_priority_run(server, suffix))
    r = httpx.post(server.url + f"/v2/models/{MODEL}/infer", content=body(1, -1), timeout=60)
    assert r.status_code == 400
    assert "parameter 'priority' must be an integer" in r.json()["error"]


def rest_priority_run(server: BitserveServer, suffix: str) -> None:
    """Long request first, then lows and highs over REST, each on its own connection."""
    hold = hold_every_worker(server, suffix)
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
    try:
        for i, (rid, priority) in enumerate(order):
            threads.append(threading.Thread(target=send, args=(rid + suffix, priority)))
            threads[-1].start()
            hold.wait_depth(f"{rid} is queued", i + 1)
    finally:
        hold.release()
        for t in threads:
            t.join()
    assert set(results.values()) == {200}
    # Level 1 first, FIFO within a level; 0, none and 9 (past priority_levels) are level 2.
    ids = [rid + suffix for rid, _ in order]
    expected = ["high-0", "high-1", "low-0", "low-1", "low-2", "low-3"]
    assert completion_order(server, ids) == [rid + suffix for rid in expected]


def grpc_priority_run(server: BitserveServer, suffix: str) -> None:
    """On one gRPC channel (so one worker), long request first, then lows and highs."""
    client = grpcclient.InferenceServerClient(server.grpc_target)
    done: dict[str, object] = {}

    def request(rounds: int) -> list[grpcclient.InferInput]:
        x = grpcclient.InferInput("x", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[rounds]], np.int32))
        return [x]

    def callback(rid: str) -> Callable[[object, object], None]:
        return lambda result, error: done.__setitem__(rid, error or result)

    hold = Hold(server, [], batches(server))
    long = request(long_rounds(server))
    client.async_infer(MODEL, long, callback("hold"), headers={"x-request-id": "hold" + suffix})
    order = [("g-low-0", 0), ("g-high-0", 1), ("g-low-1", 2), ("g-high-1", 1)]
    sent = 1  # the long request; the calls made before a hold ended are answered too
    try:
        hold.wait("the long request computes", lambda: computing(server) == 1)
        for i, (rid, priority) in enumerate(order):
            headers = {"x-request-id": rid + suffix}
            client.async_infer(MODEL, request(5), callback(rid), priority=priority, headers=headers)
            sent += 1
            hold.wait_depth(f"{rid} is queued", i + 1)
    finally:
        wait_until("every call is answered", lambda: len(done) == sent, timeout=600)
        client.close()
    assert not any(isinstance(v, InferenceServerException) for v in done.values()), done
    ids = [rid + suffix for rid, _ in order]
    expected = ["g-high-0", "g-high-1", "g-low-0", "g-low-1"]
    assert completion_order(server, ids) == [rid + suffix for rid in expected]


def test_higher_priority_requests_pass_the_queue_over_grpc(server: BitserveServer) -> None:
    while_held(server, lambda suffix: grpc_priority_run(server, suffix))


def test_config_reports_the_priority_levels(server: BitserveServer) -> None:
    config = httpx.get(server.url + f"/v2/models/{MODEL}/config", timeout=30).json()
    batching = config["dynamic_batching"]
    assert (batching["priority_levels"], batching["default_priority_level"]) == (2, 2)
    assert batching["priority_queue_policy"] == {}


def test_under_two_workers(repo: Path, tmp_path: Path) -> None:
    with start_server(repo, args=["--workers", "2"], log_dir=tmp_path) as s:
        drop_queued_raw_requests(s, 6, workers=2)
        while_held(s, functools.partial(grpc_priority_run, s), workers=2)
