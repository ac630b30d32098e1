"""service.cluster.peers and service.cluster.changes in process: the record every worker reaches,
cluster readiness, and changes sent to peers as typed messages over real unix sockets (two apps in
one process), or to stubbed peers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.cluster.changes import (
    Change,
    LoadModel,
    Recorded,
    RegisterRegion,
    UnloadModel,
    UnregisterRegion,
    UpdateLogSettings,
)
from service.cluster.peers import Cluster, PeerAnswer, ready_path, socket_path, why_path
from service.cluster.shared_state import ControlState
from service.server import BitServer
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

pytestmark = pytest.mark.anyio
SECRET = "s3cret-of-this-server"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "ready").mkdir()
    ControlState.create(tmp_path, ["echo", "boom"])
    return tmp_path


class Worker:
    """One in-process 'worker': a fake repository, its app and its cluster view."""

    def __init__(
        self, run_dir: Path, index: int, workers: int = 2, *, grpc: bool = False, **settings: Any
    ) -> None:
        self.repo = FakeRepository()
        self.cluster = Cluster(run_dir, index, workers, SECRET)
        # As a worker process starts: the models to load from disk, then the app.
        self.initial = self.cluster.initial_models()
        self.settings = Settings(access_log=False, allow_client_shm=True, **settings)
        self.server = BitServer(self.settings, self.repo, grpc=grpc, cluster=self.cluster)
        self.app = self.server.rest_app()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[httpx.AsyncClient]:
        """A client of the app, the server started (which joins the peers: it listens on its
        unix socket and catches up)."""
        async with self.server.running():
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
                yield c


def mark_ready(run_dir: Path, index: int, pid: int | None = None) -> None:
    ready_path(run_dir, index).write_text(str(pid or os.getpid()))


# --- changes and the record ----------------------------------------------------------------

EVERY_KIND: list[Change] = [
    LoadModel("m"),
    LoadModel("m\x00\n\u00e9\ud800", '{"max_batch_size": 2}'),
    UnloadModel("m"),
    RegisterRegion("r", "/key", 8, 16),
    UnregisterRegion("r"),
    UnregisterRegion(),
    UpdateLogSettings({"log_info": False, "log_verbose_level": 1}),
]


@pytest.mark.parametrize("change", EVERY_KIND, ids=lambda c: c.kind)
def test_changes_travel_as_json_whatever_their_names_hold(change: Change) -> None:
    line = json.dumps(change.to_json())
    assert line.isascii()
    assert "\n" not in line
    assert Change.from_json(json.loads(line)) == change


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"name": "m"},
        {"kind": "format_disk", "name": "m"},
        {"kind": "load", "name": "m", "extra": 1},
        {"kind": "unload"},
    ],
)
def test_a_malformed_change_is_refused(data: object) -> None:
    with pytest.raises(ValueError, match="change"):
        Change.from_json(data)


def test_the_record_holds_the_state_to_reach(run_dir: Path) -> None:
    state = ControlState(run_dir)
    seq, entries = state.read()
    assert seq == 0
    assert entries == {
        "echo": Recorded(0, LoadModel("echo")),
        "boom": Recorded(0, LoadModel("boom")),
    }
    assert state.record(LoadModel("echo", "{}")) == 1
    assert state.record(UnloadModel("boom")) == 2
    state.record(UpdateLogSettings({"log_info": False}))
    state.record(UpdateLogSettings({"log_verbose_level": 1}))
    for name in ("a", "b", "c"):
        state.record(RegisterRegion(name, f"/{name}", 0, 8))
    state.record(UnregisterRegion("b"))
    seq, entries = state.read()
    assert seq == 8
    assert entries["echo"] == Recorded(1, LoadModel("echo", "{}"))  # each model's last change
    assert entries["boom"] == Recorded(2, UnloadModel("boom"))
    # Log updates are partial: the record holds every setting changed so far.
    assert entries["@logging"] == Recorded(
        4, UpdateLogSettings({"log_info": False, "log_verbose_level": 1})
    )
    # Only the regions registered now: a worker that starts later has none to unregister.
    assert sorted(s for s in entries if s.startswith("@shm/")) == ["@shm/a", "@shm/c"]
    state.record(UnregisterRegion())
    state.record(RegisterRegion("d", "/d", 0, 8))
    _, entries = state.read()
    assert sorted(s for s in entries if s.startswith("@shm/")) == ["@shm/d"]


async def test_the_lock_is_server_wide(run_dir: Path) -> None:
    # Two workers' views of the same run directory: flock on separate open files excludes.
    a, b = ControlState(run_dir), ControlState(run_dir)
    order: list[str] = []
    held = asyncio.Event()

    async def first() -> None:
        async with a.locked():
            order.append("a in")
            held.set()
            await asyncio.sleep(0.2)
            order.append("a out")

    async def second() -> None:
        await held.wait()
        async with b.locked():
            order.append("b in")

    await asyncio.gather(first(), second())
    assert order == ["a in", "a out", "b in"]


# --- start-up and catching up ----------------------------------------------------------------


def test_initial_models_are_the_plain_loads(run_dir: Path) -> None:
    state = ControlState(run_dir)
    state.record(UnloadModel("boom"))
    state.record(LoadModel("busy", "{}"))
    w = Worker(run_dir, 1)
    assert w.initial == ["echo"]  # boom was unloaded; busy needs its override replayed


async def test_a_starting_worker_replays_the_record_before_it_takes_traffic(
    run_dir: Path, tmp_path: Path
) -> None:
    obj = shared_memory.SharedMemory(create=True, size=64)
    try:
        state = ControlState(run_dir)
        state.record(LoadModel("busy", '{"max_batch_size": 2}'))
        state.record(UnloadModel("echo"))
        state.record(RegisterRegion("in", "/" + obj.name.lstrip("/"), 0, 64))
        state.record(UpdateLogSettings({"log_verbose_level": 1}))
        w = Worker(run_dir, 1)
        assert w.initial == ["boom"]  # echo was unloaded: never loaded, nothing to replay
        async with w.running() as c:  # the lifespan's start-up ends after the replay
            assert w.repo.loaded == ["busy"]
            assert w.repo.overrides[0] is not None
            assert w.repo.unloaded == []
            regions = (await c.get("/v2/systemsharedmemory/status")).json()
            assert [r["name"] for r in regions] == ["in"]
            assert (await c.get("/v2/logging")).json()["log_verbose_level"] == 1
            # Once caught up, this worker counts as ready (its own part of readiness).
            assert w.cluster.not_ready() == [0]
        assert not ready_path(run_dir, 1).exists()  # left on shutdown
    finally:
        obj.close()
        obj.unlink()


async def test_readiness_needs_every_worker(run_dir: Path) -> None:
    w = Worker(run_dir, 0, workers=3)
    async with w.running() as c:
        r = await c.get("/v2/health/ready")
        assert r.status_code == 503
        assert r.json() == {
            "error": "server is not ready: worker(s) 1, 2 of 3 are starting or catching up"
        }
        mark_ready(run_dir, 1)
        mark_ready(run_dir, 2, pid=2**22 + 12345)  # a file left by a dead process
        assert "worker(s) 2 of 3" in (await c.get("/v2/health/ready")).json()["error"]
        # A worker that is caught up but not ready says why, for every worker to answer.
        why = "server is not ready: model 'm' failed to load"
        why_path(run_dir, 2).write_text(f"{os.getpid()}\n{why}")
        assert (await c.get("/v2/health/ready")).json() == {"error": f"{why} (worker 2 of 3)"}
        why_path(run_dir, 2).unlink()
        mark_ready(run_dir, 2)
        r = await c.get("/v2/health/ready")
        assert (r.status_code, r.json()) == (200, {"ready": True})
        assert "x-request-id" in r.headers
        # This worker's own models still count.
        w.repo.is_ready = False
        assert (await c.get("/v2/health/ready")).json() == {
            "error": "server is not ready: loading models"
        }
        assert (await c.get("/v2/health/live")).status_code == 200
        w.repo.is_ready = True
        w.app.state.control.begin_stop()  # draining: not ready, and out of the peers' set
        assert "worker(s) 0 of 3" in (await c.get("/v2/health/ready")).json()["error"]
        assert not await _listening(run_dir, 0)


async def _listening(run_dir: Path, index: int) -> bool:
    try:
        _, writer = await asyncio.open_unix_connection(str(socket_path(run_dir, index)))
    except OSError:
        return False
    writer.close()
    return True


# --- changes reach every worker ---------------------------------------------------------------


async def test_changes_reach_a_peer_over_its_unix_socket(run_dir: Path) -> None:
    a, b = Worker(run_dir, 0), Worker(run_dir, 1)
    async with b.running() as cb, a.running() as c:
        r = await c.post("/v2/repository/models/echo/unload", headers={"X-Request-ID": "r-1"})
        assert (r.status_code, r.json()) == (200, {})
        assert a.repo.unloaded == b.repo.unloaded == ["echo"]
        r = await c.post(
            "/v2/repository/models/echo/load",
            json={"parameters": {"config": '{"max_batch_size": 4}'}},
        )
        assert r.status_code == 200
        assert a.repo.loaded == b.repo.loaded == ["echo"]
        assert b.repo.overrides[0] is not None
        assert b.repo.overrides[0].patch is not None
        # Recorded, and noted as applied by both: a restarted peer would not replay them.
        seq, entries = ControlState(run_dir).read()
        assert (seq, entries["echo"].change) == (2, LoadModel("echo", '{"max_batch_size": 4}'))
        assert a.cluster._applied["echo"] == b.cluster._applied["echo"] == 2
        # Log settings and their answer: every setting, as the worker that took it has them.
        r = await c.post("/v2/logging", json={"log_verbose_level": 1})
        assert r.json()["log_verbose_level"] == 1
        assert (await cb.get("/v2/logging")).json()["log_verbose_level"] == 1
        await c.post("/v2/logging", json={"log_verbose_level": 0})
        # An unknown model is a failed load (Triton's 400, "failed to load"): not recorded.
        r = await c.post("/v2/repository/models/nope/load")
        assert r.status_code == 400
        assert r.json()["error"].startswith("failed to load 'nope'")
        assert ControlState(run_dir).read()[0] == 4


async def test_shared_memory_reaches_every_worker(run_dir: Path) -> None:
    obj = shared_memory.SharedMemory(create=True, size=64)
    key = "/" + obj.name.lstrip("/")
    a, b = Worker(run_dir, 0), Worker(run_dir, 1)
    try:
        async with b.running() as cb, a.running() as c:
            body = {"key": key, "offset": 0, "byte_size": 64}
            for region in ("r1", "r2"):
                r = await c.post(f"/v2/systemsharedmemory/region/{region}/register", json=body)
                assert r.status_code == 200
            status = (await cb.get("/v2/systemsharedmemory/status")).json()
            assert [s["name"] for s in status] == ["r1", "r2"]
            # A second registration of a name is refused where it was taken: nothing sent.
            r = await c.post("/v2/systemsharedmemory/region/r1/register", json=body)
            assert r.status_code == 400
            assert "already in manager" in r.json()["error"]
            assert (await c.post("/v2/systemsharedmemory/region/r1/unregister")).status_code == 200
            status = (await cb.get("/v2/systemsharedmemory/status")).json()
            assert [s["name"] for s in status] == ["r2"]
            assert (await c.post("/v2/systemsharedmemory/unregister")).status_code == 200
            assert (await cb.get("/v2/systemsharedmemory/status")).json() == []
    finally:
        obj.close()
        obj.unlink()


# As a client puts them in a path: percent-encoded control characters, a byte that is not
# UTF-8, non-ASCII text, a dot segment, and a name far past every limit.
HOSTILE_NAMES = ["%00", "%01", "%0a", "%0d%0ax", "%7f", "%ff", "%e9t%C3%A9", "%2e%2e", "d" * 10_000]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=lambda n: n[:12])
async def test_hostile_names_are_4xx_with_peers(run_dir: Path, name: str) -> None:
    # What crashed the HTTP replay (httpx.InvalidURL in the forward): a name is data now.
    a, b = Worker(run_dir, 0), Worker(run_dir, 1)
    async with b.running(), a.running() as c:
        for method, path, body in (
            ("POST", f"/v2/repository/models/{name}/load", None),
            ("POST", f"/v2/repository/models/{name}/unload", None),
            (
                "POST",
                f"/v2/systemsharedmemory/region/{name}/register",
                {"key": "/k", "byte_size": 1},
            ),
            ("POST", f"/v2/systemsharedmemory/region/{name}/unregister", None),
            ("GET", f"/v2/systemsharedmemory/region/{name}/status", None),
            ("POST", "/v2/logging", {name: True}),
        ):
            r = await c.request(method, path, json=body)
            assert r.status_code < 500, (path[:60], r.status_code, r.text[:200])
            assert r.status_code == 200 or set(r.json()) == {"error"}
            assert len(r.content) < 2000  # the name is never echoed whole
    assert a.repo.loaded == b.repo.loaded == []
    assert ControlState(run_dir).read()[0] == 0  # nothing was recorded


async def test_a_peer_that_is_not_running_is_skipped(run_dir: Path) -> None:
    # Worker 1 never listens: the change is recorded for it to catch up when it starts.
    a = Worker(run_dir, 0)
    async with a.running() as c:
        r = await c.post("/v2/repository/models/boom/unload")
        assert r.status_code == 200
    assert ControlState(run_dir).read()[1]["boom"].change == UnloadModel("boom")


class StubPeers:
    """Stands in for ``Cluster.forward``: canned answers, and what was asked."""

    def __init__(self, answers: list[tuple[int, PeerAnswer | None]]) -> None:
        self.answers = answers
        self.calls: list[tuple[Change, int | None]] = []

    async def __call__(self, change: Change, seq: int | None) -> list[tuple[int, Any]]:
        self.calls.append((change, seq))
        return self.answers


def stub(w: Worker, monkeypatch: pytest.MonkeyPatch) -> StubPeers:
    peers = StubPeers([])
    monkeypatch.setattr(w.cluster, "forward", peers)
    return peers


@pytest.fixture
def stubbed(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Worker, StubPeers]:
    w = Worker(run_dir, 0, workers=3)
    return w, stub(w, monkeypatch)


async def test_a_failure_on_a_peer_is_reported(stubbed: tuple[Worker, StubPeers]) -> None:
    w, peers = stubbed
    peers.answers = [(1, PeerAnswer(400, "failed to load 'echo': out of memory")), (2, None)]
    async with w.running() as c:
        r = await c.post("/v2/repository/models/echo/load")
    assert r.status_code == 400
    assert r.json() == {"error": "worker 1: failed to load 'echo': out of memory"}
    assert w.repo.loaded == ["echo"]  # applied here, and recorded: a restart retries it
    assert peers.calls == [(LoadModel("echo"), 1)]


async def test_several_failures_and_timeouts_are_all_named(
    stubbed: tuple[Worker, StubPeers],
) -> None:
    w, peers = stubbed
    peers.answers = [
        (1, PeerAnswer(504, "no answer within 600 s")),
        (2, PeerAnswer(503, "the server is shutting down")),
    ]
    async with w.running() as c:
        r = await c.post("/v2/repository/models/echo/unload")
    assert r.status_code == 504
    assert r.json()["error"] == (
        "worker 1: no answer within 600 s; worker 2: the server is shutting down"
    )


async def test_what_changed_nothing_here_is_not_sent(stubbed: tuple[Worker, StubPeers]) -> None:
    w, peers = stubbed
    w.repo.broken["busy"] = "operator.safetensors: not found"
    async with w.running() as c:
        assert (await c.post("/v2/repository/models/nope/unload")).status_code == 404
        assert (await c.post("/v2/repository/models/nope/load")).status_code == 400
        r = await c.post("/v2/repository/models/echo/load", content=b"{not json")
        assert r.status_code == 400
        r = await c.post("/v2/repository/models/echo/load", json={"parameters": {"config": "{bad"}})
        assert r.json()["error"].startswith("failed to load 'echo': config override: not JSON")
        assert (await c.post("/v2/logging", json={"log_file": "/tmp/x"})).status_code == 400
        assert (await c.post("/v2/logging", json={})).status_code == 200  # nothing to change
        assert (await c.post("/v2/systemsharedmemory/region/r/unregister")).status_code == 200
        assert (await c.post("/v2/systemsharedmemory/unregister")).status_code == 200
        # A load that was tried and failed is sent on (every index shows why), unrecorded.
        r = await c.post("/v2/repository/models/busy/load")
        assert r.json() == {"error": "failed to load 'busy': operator.safetensors: not found"}
    assert peers.calls == [(UnregisterRegion(None), 1), (LoadModel("busy"), None)]
    assert ControlState(w.cluster.run_dir).read()[0] == 1


async def test_auth_is_checked_before_anything_is_sent(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = Worker(run_dir, 0, auth_token="tok")
    peers = stub(w, monkeypatch)
    async with w.running() as c:
        assert (await c.post("/v2/repository/models/echo/unload")).status_code == 401
        ok = await c.post(
            "/v2/repository/models/echo/unload", headers={"Authorization": "Bearer tok"}
        )
        assert ok.status_code == 200
    assert len(peers.calls) == 1
    assert ControlState(run_dir).read()[0] == 1


async def test_a_slow_control_body_times_out_and_changes_nothing(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = Worker(run_dir, 0, body_timeout_s=0.2)
    peers = stub(w, monkeypatch)

    async def trickle() -> AsyncIterator[bytes]:
        yield b"{"
        await asyncio.sleep(5)
        yield b"}"

    async with w.running() as c:
        r = await c.post("/v2/repository/models/echo/load", content=trickle())
    assert r.status_code == 408
    assert peers.calls == []
    assert w.repo.loaded == []


async def eventually(probe: Any, expected: object, timeout_s: float = 10.0) -> bool:
    """Whether ``await probe()`` gives ``expected`` within ``timeout_s`` (a heartbeat's
    change shows within a beat)."""
    async with asyncio.timeout(timeout_s):
        while await probe() != expected:
            await asyncio.sleep(0.05)
    return True


async def raw_message(run_dir: Path, index: int, line: bytes) -> PeerAnswer:
    reader, writer = await asyncio.open_unix_connection(str(socket_path(run_dir, index)))
    writer.write(line)
    answer = await reader.readline()
    writer.close()
    return PeerAnswer.parse(answer)


async def test_a_peer_message_needs_the_secret_and_a_change(run_dir: Path) -> None:
    b = Worker(run_dir, 1)
    change = UnloadModel("echo").to_json()
    async with b.running():
        for message, status in (
            ({"secret": "guess", "seq": 9, "change": change}, 401),
            ({"secret": SECRET, "change": {"kind": "format_disk"}}, 400),
            ({"secret": SECRET}, 400),
        ):
            line = json.dumps(message).encode() + b"\n"
            assert (await raw_message(run_dir, 1, line)).status == status
        assert (await raw_message(run_dir, 1, b"not json\n")).status == 400
        assert b.repo.unloaded == []
        ok = {"secret": SECRET, "seq": 7, "request_id": "r-9", "change": change}
        assert await raw_message(run_dir, 1, json.dumps(ok).encode() + b"\n") == PeerAnswer(200)
        assert b.repo.unloaded == ["echo"]
        assert b.cluster._applied["echo"] == 7  # a catch-up will not replay it
        bad = {"secret": SECRET, "seq": 8, "change": UnloadModel("nope").to_json()}
        answer = await raw_message(run_dir, 1, json.dumps(bad).encode() + b"\n")
        assert answer.status == 404
        assert "unknown model" in answer.error


async def test_grpc_changes_take_the_same_path(run_dir: Path) -> None:
    import tritonclient.grpc.aio as tgrpc

    from harness.server import free_port

    a, b = Worker(run_dir, 0, grpc=True, grpc_port=free_port()), Worker(run_dir, 1)
    async with b.running(), a.running():
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{a.settings.grpc_port}")
        try:
            await client.unload_model("echo")
            await client.load_model("boom", config='{"max_batch_size": 2}')
            await client.update_log_settings({"log_verbose_level": 1})
            assert await eventually(client.is_server_ready, True)
            b.repo.is_ready = False  # worker 1's heartbeat takes its ready file away
            assert await eventually(client.is_server_ready, False)
        finally:
            await client.close()
    assert b.repo.unloaded == ["echo"]
    assert b.repo.loaded == ["boom"]
    assert ControlState(run_dir).read()[1]["@logging"].change == UpdateLogSettings(
        {"log_verbose_level": 1}
    )
