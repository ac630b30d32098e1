"""``bitserve serve --workers 2``: real worker processes under the supervisor.

Both workers answer, correctly; ``/metrics`` on either adds up both; readiness waits for
every worker; repository loads and unloads reach every worker; a SIGKILLed worker is
restarted, logged, and comes back with its peers' model set; SIGTERM under load drains every
worker and the server exits 0. Which worker answered is in each response's
``X-Bitserve-Worker``; a new connection is handed by the kernel to whichever worker accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from harness.probes import metric
from harness.server import (
    STARTUP_S,
    BitserveServer,
    bitserve_command,
    free_port,
    start_server,
    terminate_under_load,
    wait_begun,
    worker_pids_in,
)
from tests.e2e.slow_model import slow_request, write_slow_model
from tests.e2e.test_server import L, N, reference, write_models

pytestmark = pytest.mark.e2e

WORKERS = ("0", "1")


def worker_pids(server: BitserveServer) -> dict[int, int]:
    """Each worker index's current pid, from the supervisor's log."""
    return worker_pids_in(server.log())


def on_worker(
    url: str, worker: str, method: str, path: str, tries: int = 200, **kwargs: object
) -> httpx.Response:
    """Send a request on fresh connections until worker ``worker`` answers it."""
    for _ in range(tries):
        with httpx.Client(timeout=60) as client:  # a new connection: any worker may take it
            r = client.request(method, url + path, **kwargs)  # type: ignore[arg-type]
        if r.headers["x-bitserve-worker"] == worker:
            return r
    raise AssertionError(f"worker {worker} never answered {method} {path} in {tries} tries")


def infer_request(bits: npt.NDArray[np.bool_]) -> tuple[bytes, dict[str, str]]:
    """A V2 binary request for model ``tri``: (m, N, L) bits packed, binary output."""
    raw = np.packbits(bits, axis=-1).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "bits",
                    "datatype": "UINT8",
                    "shape": [bits.shape[0], N, (L + 7) // 8],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "out", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header))}


def answer_of(r: httpx.Response) -> npt.NDArray[np.float32]:
    n = int(r.headers["Inference-Header-Content-Length"])
    (out,) = json.loads(r.content[:n])["outputs"]
    return np.frombuffer(r.content[n:], dtype=np.float32).reshape(out["shape"])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_models(tmp_path_factory.mktemp("repo"), tri=(8, 20_000), other=(8, 0))


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[BitserveServer]:
    with start_server(repo, args=["--workers", "2"]) as s:
        yield s


def test_both_workers_answer_correctly_and_metrics_add_up(
    server: BitserveServer, repo: Path
) -> None:
    def success_count(text: str) -> float:
        return metric(text, "bitserve_requests_total", 0.0, model="tri", outcome="success")

    before = success_count(httpx.get(server.url + "/metrics", timeout=10).text)
    rng = np.random.default_rng(0)
    served: Counter[str] = Counter()
    sent = 0
    while set(served) != set(WORKERS) or sent < 12:
        assert sent < 200, f"one worker took every connection: {served}"
        bits = rng.random((2, N, L)) < 0.3
        body, headers = infer_request(bits)
        with httpx.Client(timeout=60) as client:
            r = client.post(server.url + "/v2/models/tri/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(answer_of(r), reference(repo, "tri", bits), rtol=1e-5, atol=1e-4)
        served[r.headers["x-bitserve-worker"]] += 1
        sent += 1
    # Each worker counted only what it served; /metrics on either shows the sum of both.
    for w in WORKERS:
        text = on_worker(server.url, w, "GET", "/metrics").text
        assert success_count(text) - before == sent, (w, served)
        latency = metric(text, "bitserve_request_latency_seconds_count", model="tri")
        assert latency >= sent
        assert metric(text, "bitserve_in_flight_requests") == 0
        # Both workers hold the model: device memory is the sum of both copies.
        memory = metric(text, "bitserve_device_memory_bytes", model="tri", device="cpu")
        assert memory > 0


def ready_models(url: str, worker: str) -> dict[str, str]:
    index = on_worker(url, worker, "POST", "/v2/repository/index").json()
    return {m["name"]: m["state"] for m in index}


def control(url: str, model: str, action: str, **kwargs: object) -> httpx.Response:
    """One repository change, sent once (to whichever worker takes the connection)."""
    path = f"/v2/repository/models/{model}/{action}"
    return httpx.post(url + path, timeout=120, **kwargs)  # type: ignore[arg-type]


def test_load_and_unload_reach_every_worker(server: BitserveServer, repo: Path) -> None:
    r = control(server.url, "other", "unload")
    assert r.status_code == 200, r.text
    # Whichever worker took it, both have applied it before the answer came.
    for w in WORKERS:
        assert ready_models(server.url, w) == {"tri": "READY", "other": "UNAVAILABLE"}, w
        assert on_worker(server.url, w, "GET", "/v2/models/other/ready").status_code == 503
    r = control(server.url, "other", "load", headers={"X-Request-ID": "load-everywhere-1"})
    assert r.status_code == 200, r.text
    for w in WORKERS:
        assert ready_models(server.url, w) == {"tri": "READY", "other": "READY"}, w
    # The forwarded change carries the caller's request id into every worker's log.
    logged = re.findall(r"w(\d) \[load-everywhere-1\] model other loaded", server.log())
    assert sorted(logged) == ["0", "1"]

    # A failure is reported; READY versions keep serving on every worker.
    config = repo / "other" / "1" / "config.toml"
    good = config.read_text()
    config.write_text(good.replace('response = "triangle"', 'response = "no-such-response"'))
    try:
        r = control(server.url, "other", "load")
        assert r.status_code == 400
        assert "failed to load" in r.json()["error"]
        for w in WORKERS:
            assert ready_models(server.url, w) == {"tri": "READY", "other": "READY"}, w
    finally:
        config.write_text(good)
    # An unknown model changes nothing: a failed load (Triton's 400) on every worker.
    r = control(server.url, "nope", "load")
    assert r.status_code == 400
    assert "failed to load 'nope'" in r.json()["error"]


def test_killed_worker_is_restarted_with_the_same_models(server: BitserveServer) -> None:
    r = control(server.url, "other", "unload")
    assert r.status_code == 200, r.text

    def get(path: str) -> httpx.Response:
        # A connection the kernel queued on the dying worker's socket is reset (that is
        # SO_REUSEPORT's price: see service/cluster/supervisor.py); a client retries it.
        for _ in range(20):
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(server.url + path, timeout=10)
            time.sleep(0.05)
        raise AssertionError(f"GET {path} failed 20 times")

    def memory() -> float:
        text = get("/metrics").text
        return metric(text, "bitserve_device_memory_bytes", model="tri", device="cpu")

    both = memory()  # two workers' copies of 'tri'
    victim = worker_pids(server)[1]
    os.kill(victim, signal.SIGKILL)
    # Worker 0 answers every probe now: readiness says who is missing, and the device memory
    # gauge (summed over the live workers) has lost the dead worker's share.
    deadline = time.monotonic() + 30
    while True:
        r = get("/v2/health/ready")
        if r.status_code == 503:
            assert "worker(s) 1 of 2" in r.json()["error"]
            break
        assert time.monotonic() < deadline, "readiness never noticed the dead worker"
        time.sleep(0.05)
    while memory() != both / 2:
        assert time.monotonic() < deadline, (memory(), both)
        time.sleep(0.05)
    server.wait_ready()
    assert memory() == both
    assert f"worker 1 (pid {victim}) was killed by signal 9; restarting it" in server.log()
    assert worker_pids(server)[1] != victim
    # The new worker 1 serves what its peer serves: 'other' stays unloaded.
    for w in WORKERS:
        assert on_worker(server.url, w, "GET", "/v2/models/tri/ready").status_code == 200
        assert on_worker(server.url, w, "GET", "/v2/models/other/ready").status_code != 200
    r = control(server.url, "other", "load")
    assert r.status_code == 200, r.text
    for w in WORKERS:
        assert on_worker(server.url, w, "GET", "/v2/models/other/ready").status_code == 200


def test_readiness_waits_for_every_worker(repo: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BITSERVE_", "TRITON_"))}
    cmd = [*bitserve_command(), "serve", "--port", str(port), "--workers", "2",
           "--grpc-port", "0", "--model-repository", str(repo)]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = BitserveServer(proc, port, log_path, cmd)
    try:
        # Freeze worker 1 as soon as it is started: worker 0 alone becomes ready.
        deadline = time.monotonic() + 120
        while 1 not in worker_pids(server):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.01)
        frozen = worker_pids(server)[1]
        os.kill(frozen, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + STARTUP_S
            while "w0 [-] Application startup complete" not in server.log():
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.1)
            for _ in range(10):
                r = httpx.get(server.url + "/v2/health/ready", timeout=10)
                assert r.status_code == 503, r.text
                assert r.headers["x-bitserve-worker"] == "0"
                assert "worker(s) 1 of 2" in r.json()["error"]
                assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200
                time.sleep(0.1)
        finally:
            os.kill(frozen, signal.SIGCONT)
        server.wait_ready()
        # Worker 1 reports ready to the gateway a moment before its startup line reaches the
        # shared log file: wait for the line rather than read the log once.
        deadline = time.monotonic() + 30
        while "w1 [-] Application startup complete" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
    finally:
        # Stopped either way; its exit status is checked only when the test got this far
        # (an assert here would hide the failure that ended the test early).
        code = server.terminate()
    assert code == 0, server.log()[-3000:]


def test_sigterm_under_load_drains_every_worker_and_exits_0(repo: Path, tmp_path: Path) -> None:
    # The module's models plus a slow one: requests that are surely in flight at the signal.
    repo = write_slow_model(Path(shutil.copytree(repo, tmp_path / "repo")), rounds=None)
    grace_s = 60  # far beyond the slow requests' seconds, on a loaded machine too
    with start_server(
        repo,
        args=["--workers", "2"],
        env={"BITSERVE_GRACEFUL_SHUTDOWN_S": str(grace_s)},
        log_dir=tmp_path,
    ) as server:
        run_dir = re.search(r"run directory (\S+)", server.log())
        assert run_dir, server.log()
        assert Path(run_dir.group(1)).is_dir()
        rng = np.random.default_rng(1)
        items = [rng.random((1, N, L)) < 0.3 for _ in range(4)]
        expected = [reference(repo, "tri", b) for b in items]
        log: list[tuple[float, str, str]] = []  # (end, outcome, worker)
        stop = threading.Event()
        url = server.url + "/v2/models/tri/infer"
        # Eight keep-alive connections (as the single-server drain test), opened until both
        # workers hold some: the kernel hands each new connection to one worker.
        clients: list[httpx.Client] = []
        holders: set[str] = set()
        while len(clients) < 8 or holders != set(WORKERS):
            assert len(clients) < 64, "every connection went to one worker"
            c = httpx.Client(timeout=60)
            body, headers = infer_request(items[0])
            r = c.post(url, content=body, headers=headers)
            assert r.status_code == 200, r.text
            holders.add(r.headers["x-bitserve-worker"])
            clients.append(c)

        def client(k: int) -> None:
            body, headers = infer_request(items[k % 4])
            c = clients[k]
            while not stop.is_set():
                try:
                    r = c.post(url, content=body, headers=headers)
                except httpx.HTTPError as e:
                    log.append((time.monotonic(), f"transport {type(e).__name__}", ""))
                    time.sleep(0.05)
                    continue
                outcome = str(r.status_code)
                if r.status_code == 200 and not np.allclose(
                    answer_of(r), expected[k % 4], rtol=1e-5, atol=1e-4
                ):
                    outcome = "wrong"
                log.append((time.monotonic(), outcome, r.headers.get("x-bitserve-worker", "")))

        # Four slow requests (each seconds of compute), all begun by the server before the
        # load starts and the signal comes: the drain must answer every one of them.
        slow = ThreadPoolExecutor(4)
        answers = [slow.submit(slow_request, server.url, 200 + x) for x in range(4)]
        wait_begun(server.url, 4, "slow")
        code, t_term, t_exit = terminate_under_load(
            server,
            client,
            len(clients),
            stop,
            timeout=grace_s + 20,
            until=lambda: {w for _, o, w in log if o == "200"} == set(WORKERS),
        )
        for c in clients:
            c.close()
        slow_answers = [a.result() for a in answers]
        slow.shutdown()
    text = server.log()
    # What was answered before the signal, and everything else.
    before = [(o, w) for t1, o, w in log if t1 < t_term]
    after = [o for t1, o, _ in log if t1 >= t_term]
    print(f"before SIGTERM {len(before)}: {Counter(before)}; after {len(after)}: {set(after)}")
    assert code == 0, text[-3000:]
    assert t_exit - t_term < grace_s + 5
    assert {w for _, w in before} == set(WORKERS), "both workers were serving"
    assert {o for o, _ in before} == {"200"}, text[-3000:]
    # Every request the server had begun was answered, right, by whichever worker had it.
    assert slow_answers == [(200, [[200.0 + x]]) for x in range(4)], slow_answers
    assert all(o in {"200", "503"} or o.startswith("transport") for o in after), after
    for w in WORKERS:
        assert f"w{w} [-] Application shutdown complete" in text
    assert "received SIGTERM: draining 2 workers" in text
    assert not Path(run_dir.group(1)).exists(), "the run directory is removed at exit"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/v2/health/live", timeout=2)


def test_shared_memory_log_settings_and_statistics_are_the_whole_servers(
    repo: Path, tmp_path: Path
) -> None:
    from multiprocessing import shared_memory

    rng = np.random.default_rng(3)
    bits = rng.random((1, N, L)) < 0.3
    packed = np.packbits(bits, axis=-1)
    region = shared_memory.SharedMemory(create=True, size=packed.nbytes)
    try:
        np.ndarray(packed.shape, np.uint8, buffer=region.buf)[...] = packed
        with start_server(
            repo, args=["--workers", "2", "--allow-client-shm"], log_dir=tmp_path
        ) as s:
            # One registration, taken by one worker, serves requests on both.
            key = "/" + region.name.lstrip("/")
            body = {"key": key, "offset": 0, "byte_size": packed.nbytes}
            r = httpx.post(
                s.url + "/v2/systemsharedmemory/region/in0/register", json=body, timeout=60
            )
            assert r.status_code == 200, r.text
            request = {
                "inputs": [
                    {
                        "name": "bits",
                        "datatype": "UINT8",
                        "shape": list(packed.shape),
                        "parameters": {
                            "shared_memory_region": "in0",
                            "shared_memory_byte_size": packed.nbytes,
                        },
                    }
                ],
                "outputs": [{"name": "out"}],
            }
            want = reference(repo, "tri", bits).reshape(-1)
            served: Counter[str] = Counter()
            while set(served) != set(WORKERS):  # new connections until both have answered
                assert sum(served.values()) < 200, f"one worker took every connection: {served}"
                with httpx.Client(timeout=60) as client:
                    r = client.post(s.url + "/v2/models/tri/infer", json=request)
                assert r.status_code == 200, r.text
                got = np.array(r.json()["outputs"][0]["data"], np.float32)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
                served[r.headers["x-bitserve-worker"]] += 1
            # A log setting changed through one worker holds on both.
            r = httpx.post(s.url + "/v2/logging", json={"log_verbose_level": 1}, timeout=60)
            assert r.status_code == 200, r.text
            for w in WORKERS:
                got = on_worker(s.url, w, "GET", "/v2/logging").json()
                assert got["log_verbose_level"] == 1, w
            # Statistics on either worker count exactly the requests both served. A worker
            # adds its peers' counts as they last published them (every heartbeat, 0.25 s),
            # so each worker's sum reaches the total within a heartbeat and never passes it.
            total = sum(served.values())
            for w in WORKERS:
                deadline = time.monotonic() + 30
                while True:
                    stats = on_worker(s.url, w, "GET", "/v2/models/tri/stats").json()
                    (entry,) = stats["model_stats"]
                    counted = entry["inference_stats"]["success"]["count"]
                    assert counted <= total, (w, served, entry)
                    if counted == total:
                        break
                    assert time.monotonic() < deadline, (w, served, entry)
                    time.sleep(0.1)
                assert entry["inference_count"] == total, (w, served, entry)
            # Unregistering every region reaches both: neither serves from it any more.
            r = httpx.post(s.url + "/v2/systemsharedmemory/unregister", timeout=60)
            assert r.status_code == 200, r.text
            for w in WORKERS:
                r = on_worker(s.url, w, "POST", "/v2/models/tri/infer", json=request)
                assert r.status_code == 400, (w, r.text)
                assert "in0" in r.json()["error"]
    finally:
        region.close()
        region.unlink()


def test_every_worker_applies_the_size_limits(tmp_path: Path) -> None:
    # Each worker builds its repository from the server's settings: a flag's limit holds in
    # every worker, as in one process. Input buffers: max_batch_size x N x L float32 bytes.
    limit = 8 * N * L * 4
    repo = write_models(tmp_path / "repo", big=(16, 0), small=(8, 0))
    args = ["--workers", "2", "--max-batch-bytes", str(limit)]
    with start_server(repo, args=args, ready=False, log_dir=tmp_path) as server:
        seen: dict[str, dict[str, dict[str, str]]] = {}
        for _ in range(50):  # a new connection each: the kernel spreads them over the workers
            r = httpx.post(server.url + "/v2/repository/index", timeout=30)
            seen[r.headers["X-Bitserve-Worker"]] = {e["name"]: e for e in r.json()}
            if set(seen) == set(WORKERS):
                break
    assert set(seen) == set(WORKERS), seen
    for index in seen.values():
        assert index["small"]["state"] == "READY"
        assert index["big"]["state"] == "UNAVAILABLE"
        assert (
            f"needs a device buffer of {2 * limit:,} bytes, more than max_batch_bytes ({limit:,})"
        ) in index["big"]["reason"]


def test_device_memory_budget_per_worker(tmp_path: Path) -> None:
    """``--workers 2 --device-memory-budget``: each worker keeps its share (one model of
    three here), evicts and loads on demand on its own; every answer is right, every model
    stays READY on both, and the control plane's unload and load still reach both."""
    import asyncio

    from service.models.repository import ModelRepository
    from service.residency.sizes import parse_budget

    root = write_models(tmp_path / "repo", a=(8, 0), b=(8, 0), c=(8, 0))

    async def one_model_bytes() -> int:
        repo = ModelRepository(root, warmup=False, budget=parse_budget("1GiB"),
                               initial_models=["a"])  # fmt: skip
        await repo.start()
        size = int(repo.index()[0]["resident_bytes"])
        await repo.stop()
        return size

    size = asyncio.run(one_model_bytes())
    budget = 3 * size  # 1.5 models per worker
    args = ["--workers", "2", "--device-memory-budget", str(budget)]
    rng = np.random.default_rng(1)
    with start_server(root, args=args, log_dir=tmp_path) as server:
        served: Counter[str] = Counter()
        for k in range(24):
            name = "abc"[k % 3]
            bits = rng.random((2, N, L)) < 0.3
            body, headers = infer_request(bits)
            with httpx.Client(timeout=60) as client:
                r = client.post(f"{server.url}/v2/models/{name}/infer", content=body,
                                headers=headers)  # fmt: skip
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(answer_of(r), reference(root, name, bits), rtol=1e-5,
                                       atol=1e-4)  # fmt: skip
            served[r.headers["x-bitserve-worker"]] += 1
        assert httpx.get(server.url + "/v2/health/ready", timeout=10).status_code == 200
        for w in WORKERS:
            index = on_worker(server.url, w, "POST", "/v2/repository/index").json()
            assert {m["state"] for m in index} == {"READY"}, index
            resident = [m for m in index if m["resident"]]
            assert len(resident) <= 1, index  # its share holds one model
            assert sum(m["resident_bytes"] for m in index) <= budget // 2
        text = on_worker(server.url, "0", "GET", "/metrics").text
        assert metric(text, "bitserve_device_memory_budget_bytes", device="cpu") == budget
        evictions = sum(metric(text, "bitserve_model_evictions_total", 0.0, model=m) for m in "abc")
        assert evictions >= len(served)  # every worker that served evicted
        r = control(server.url, "c", "unload")
        assert r.status_code == 200, r.text
        for w in WORKERS:
            assert ready_models(server.url, w) == {"a": "READY", "b": "READY", "c": "UNAVAILABLE"}
        assert control(server.url, "c", "load").status_code == 200
        for w in WORKERS:
            assert ready_models(server.url, w) == {"a": "READY", "b": "READY", "c": "READY"}
