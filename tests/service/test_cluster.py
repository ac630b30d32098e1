"""service.cluster in process: the shared model set, cluster readiness, and repository
changes fanned out to peers (two apps on real unix sockets, or a stubbed peer)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from service.cluster import PEER_HEADER, SEQ_HEADER, Cluster, _Answer, ready_path
from service.control import ControlEntry, ControlState
from service.rest.app import create_app
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

    def __init__(self, run_dir: Path, index: int, workers: int = 2, token: str | None = None):
        self.repo = FakeRepository()
        self.cluster = Cluster(
            run_dir,
            index,
            workers,
            SECRET,
            not_ready_reason=lambda: None if self.repo.ready else "not ready",
            auth_token=token,
            max_body_bytes=1024,
        )
        # As a worker process starts: the models to load from disk, then the app.
        self.initial = self.cluster.initial_models()
        settings = Settings(access_log=False, auth_token=token)
        self.app = create_app(settings, self.repo)
        self.cluster.install(self.app)

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[httpx.AsyncClient]:
        """A client of the app, inside its lifespan run through the whole ASGI stack (as
        uvicorn runs it: the cluster middleware takes part)."""
        incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        task = asyncio.create_task(self.app(scope, incoming.get, outgoing.put))
        await incoming.put({"type": "lifespan.startup"})
        assert (await outgoing.get())["type"] == "lifespan.startup.complete"
        try:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
                yield c
        finally:
            await incoming.put({"type": "lifespan.shutdown"})
            assert (await outgoing.get())["type"] == "lifespan.shutdown.complete"
            await task

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Serve the app on its private unix socket (as the worker process does)."""
        sock = self.cluster.private_socket()
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            yield
        finally:
            server.should_exit = True
            await task


def mark_ready(run_dir: Path, index: int, pid: int | None = None) -> None:
    ready_path(run_dir, index).write_text(str(pid or os.getpid()))


def test_control_state_records_changes_in_order(run_dir: Path) -> None:
    state = ControlState(run_dir)
    seq, entries = state.read()
    assert seq == 0
    assert entries == {"echo": ControlEntry("load", 0), "boom": ControlEntry("load", 0)}
    headers = {"content-type": "application/json", "authorization": "Bearer x", "x-other": "y"}
    assert state.record("echo", "load", b'{"parameters": {}}', headers) == 1
    assert state.record("boom", "unload", b"", {}) == 2
    seq, entries = state.read()
    assert seq == 2
    # Only what changes the meaning of the body is kept: never a token.
    assert entries["echo"] == ControlEntry(
        "load",
        1,
        base64.b64encode(b'{"parameters": {}}').decode(),
        {"content-type": "application/json"},
    )
    assert entries["boom"] == ControlEntry("unload", 2)


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


def test_initial_models_are_the_plain_loads(run_dir: Path) -> None:
    state = ControlState(run_dir)
    state.record("boom", "unload", b"", {})
    state.record("busy", "load", b'{"parameters": {"config": "{}"}}', {})
    w = Worker(run_dir, 1)
    # 'busy' carried a body: it is replayed through the app, not loaded from disk.
    assert w.initial == ["echo"]


async def test_loads_with_a_body_are_replayed_before_the_worker_takes_traffic(
    run_dir: Path,
) -> None:
    ControlState(run_dir).record("busy", "load", b'{"parameters": {"config": "{}"}}', {})
    w = Worker(run_dir, 1)
    assert w.initial == ["boom", "echo"]
    assert w.repo.loaded == []
    async with w.client():  # the lifespan's startup is complete only after the replay
        assert w.repo.loaded == ["busy"]


async def test_catch_up_replays_what_this_worker_missed_in_order(run_dir: Path) -> None:
    w = Worker(run_dir, 1, token="tok")
    state = ControlState(run_dir)
    state.record("busy", "load", b'{"parameters": {"config": "{}"}}', {})
    state.record("echo", "unload", b"", {})
    state.record("busy", "unload", b"", {})
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and "/repository/" in scope["path"]:
            body = (await receive())["body"]
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            seen.append((scope["method"], scope["path"], headers, body))
        await inner(scope, receive, send)

    inner = w.app
    w.cluster._app = spy
    async with w.client():
        await w.cluster.catch_up()
        await w.cluster.catch_up()  # nothing new: nothing replayed twice
    # 'busy' was loaded then unloaded after 'echo': only the last change of each, in order.
    assert [p for _, p, _, _ in seen] == [
        "/v2/repository/models/echo/unload",
        "/v2/repository/models/busy/unload",
    ]
    for _, _, headers, _ in seen:
        assert headers[PEER_HEADER] == SECRET
        assert headers["authorization"] == "Bearer tok"
    assert w.repo.unloaded == ["echo", "busy"]


async def test_readiness_needs_every_worker(run_dir: Path) -> None:
    w = Worker(run_dir, 0, workers=3)
    async with w.client() as c:
        r = await c.get("/v2/health/ready")
        assert r.status_code == 503
        assert r.json() == {
            "error": "server is not ready: worker(s) 0, 1, 2 of 3 are starting or catching up"
        }
        w.cluster._caught_up = True
        mark_ready(run_dir, 1)
        r = await c.get("/v2/health/ready")
        assert "worker(s) 2 of 3" in r.json()["error"]
        mark_ready(run_dir, 2, pid=2**22 + 12345)  # a file left by a dead process
        assert (await c.get("/v2/health/ready")).status_code == 503
        mark_ready(run_dir, 2)
        r = await c.get("/v2/health/ready")
        assert (r.status_code, r.json()) == (200, {"ready": True})
        assert "x-request-id" in r.headers  # answered inside the request-id middleware
        # This worker's own models still count (the app's own check).
        w.repo.is_ready = False
        assert (await c.get("/v2/health/ready")).status_code == 503
        # Liveness is per process, as before.
        assert (await c.get("/v2/health/live")).status_code == 200


async def test_changes_reach_a_peer_over_its_unix_socket(run_dir: Path) -> None:
    a, b = Worker(run_dir, 0), Worker(run_dir, 1)
    async with a.client() as c, b.client(), b.serving():
        r = await c.post("/v2/repository/models/echo/unload", headers={"X-Request-ID": "r-1"})
        assert (r.status_code, r.json()) == (200, {})
        assert a.repo.unloaded == b.repo.unloaded == ["echo"]
        r = await c.post("/v2/repository/models/echo/load", content=b'{"parameters": {}}')
        assert r.status_code == 200
        assert a.repo.loaded == b.repo.loaded == ["echo"]
        # Recorded, and noted as applied by both: a restarted peer would not replay them.
        seq, entries = ControlState(run_dir).read()
        assert (seq, entries["echo"].action) == (2, "load")
        assert a.cluster._applied["echo"] == b.cluster._applied["echo"] == 2
        # An unknown model is a failed load (Triton's 400, "failed to load"): not recorded.
        r = await c.post("/v2/repository/models/nope/load")
        assert r.status_code == 400
        assert "failed to load" in r.json()["error"]
        assert ControlState(run_dir).read()[0] == 2
    # The peer got the body and the request id; a peer's request is not forwarded again.
    async with b.client() as c:
        r = await c.post(
            "/v2/repository/models/boom/unload", headers={PEER_HEADER: SECRET, SEQ_HEADER: "7"}
        )
        assert r.status_code == 200
        assert b.cluster._applied["boom"] == 7
        assert a.repo.unloaded == ["echo"]  # a was not asked


async def test_a_peer_that_is_not_running_is_skipped(run_dir: Path) -> None:
    # Worker 1 never listens: the change is recorded for it to catch up when it starts.
    a = Worker(run_dir, 0)
    async with a.client() as c:
        r = await c.post("/v2/repository/models/boom/unload")
        assert r.status_code == 200
    assert ControlState(run_dir).read()[1]["boom"].action == "unload"


class StubPeers:
    """Stands in for ``Cluster.forward``: canned answers, and what was asked."""

    def __init__(self, answers: list[tuple[int, _Answer | None]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, bytes, int | None]] = []

    async def __call__(
        self, path: str, body: bytes, headers: Any, seq: int | None, rid: Any = None
    ) -> list[tuple[int, _Answer | None]]:
        self.calls.append((path, body, seq))
        return self.answers


@pytest.fixture
def stubbed(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Worker, StubPeers]:
    w = Worker(run_dir, 0, workers=3)
    peers = StubPeers([])
    monkeypatch.setattr(w.cluster, "forward", peers)
    return w, peers


async def post_answered(
    stubbed: tuple[Worker, StubPeers], path: str, *answers: tuple[int, int, bytes]
) -> httpx.Response:
    """POST ``path`` to the stubbed worker, its peers answering ``(worker, status, body)``."""
    w, peers = stubbed
    peers.answers = [(i, _Answer(status, [], body)) for i, status, body in answers]
    async with w.client() as c:
        return await c.post(path)


async def test_a_failure_on_a_peer_is_reported(stubbed: tuple[Worker, StubPeers]) -> None:
    w, peers = stubbed
    oom = b'{"error": "model \'echo\' failed to load: out of memory"}'
    r = await post_answered(
        stubbed, "/v2/repository/models/echo/load", (1, 400, oom), (2, 200, b"{}")
    )
    assert r.status_code == 400
    assert r.json() == {"error": "worker 1: model 'echo' failed to load: out of memory"}
    assert w.repo.loaded == ["echo"]  # applied here, and recorded: a restart retries it
    assert peers.calls == [("/v2/repository/models/echo/load", b"", 1)]


async def test_several_failures_and_timeouts_are_all_named(
    stubbed: tuple[Worker, StubPeers],
) -> None:
    r = await post_answered(
        stubbed,
        "/v2/repository/models/echo/unload",
        (1, 504, b'{"error": "no answer within 600 s"}'),
        (2, 503, b"Service Unavailable"),
    )
    assert r.status_code == 504
    assert r.json()["error"] == "worker 1: no answer within 600 s; worker 2: Service Unavailable"


async def test_what_changed_nothing_here_is_not_forwarded(
    stubbed: tuple[Worker, StubPeers],
) -> None:
    w, peers = stubbed
    async with w.client() as c:
        assert (await c.post("/v2/repository/models/nope/unload")).status_code == 404
        # A request that claims to come from a peer with the wrong secret is an outsider's.
        r = await c.post("/v2/repository/models/echo/unload", headers={PEER_HEADER: "guess"})
        assert r.status_code == 200
        assert (await c.post("/v2/repository/models/echo/unload", content=b"x" * 2000)).json() == {
            "error": "request body exceeds the limit of 1024 bytes"
        }
    assert [call[0] for call in peers.calls] == ["/v2/repository/models/echo/unload"]


async def test_a_slow_control_body_times_out_and_changes_nothing(
    stubbed: tuple[Worker, StubPeers],
) -> None:
    # The middleware reads a body whole before it replays it to every worker: it is bounded
    # in time as the routes bound it (body_timeout_s), so a trickling client holds nothing.
    w, peers = stubbed
    w.cluster.body_timeout_s = 0.2

    async def trickle() -> AsyncIterator[bytes]:
        yield b"{"
        await asyncio.sleep(5)
        yield b"}"

    async with w.client() as c:
        r = await c.post("/v2/repository/models/echo/unload", content=trickle())
    assert r.status_code == 408
    assert r.json() == {"error": "the request body did not arrive within 0.2 s (body timeout)"}
    assert peers.calls == []


async def test_auth_is_checked_before_anything_is_forwarded(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = Worker(run_dir, 0, token="tok")
    peers = StubPeers([])
    monkeypatch.setattr(w.cluster, "forward", peers)
    async with w.client() as c:
        assert (await c.post("/v2/repository/models/echo/unload")).status_code == 401
        ok = await c.post(
            "/v2/repository/models/echo/unload", headers={"Authorization": "Bearer tok"}
        )
        assert ok.status_code == 200
    assert len(peers.calls) == 1
    assert ControlState(run_dir).read()[0] == 1


async def test_a_change_whose_client_left_mid_body_is_not_applied(
    stubbed: tuple[Worker, StubPeers],
) -> None:
    w, peers = stubbed
    messages = [
        {"type": "http.request", "body": b'{"parame', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v2/repository/models/echo/load",
        "raw_path": b"/v2/repository/models/echo/load",
        "query_string": b"",
        "headers": [(b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    async with w.client():
        await w.app(scope, receive, send)
    assert w.repo.loaded == []
    assert peers.calls == []
    assert ControlState(w.cluster.run_dir).read()[0] == 0


def test_shared_memory_and_log_settings_are_recorded_for_replay(run_dir: Path) -> None:
    from service.cluster import control_target

    assert control_target("/v2/repository/models/m/load") == ("m", "load")
    assert control_target("/v2/systemsharedmemory/region/r1/register") == ("@shm/r1", "register")
    assert control_target("/v2/systemsharedmemory/unregister") == ("@shm/*", "unregister")
    assert control_target("/v2/logging") == ("@logging", "logging")
    assert control_target("/v2/models/m/infer") is None
    state = ControlState(run_dir)
    shm = "/v2/systemsharedmemory/region/{}/register"
    state.record("@shm/a", "register", b'{"key": "/a"}', {}, path=shm.format("a"))
    state.record("@logging", "logging", b'{"log_info": false}', {}, path="/v2/logging")
    state.record("@logging", "logging", b'{"log_verbose_level": 1}', {}, path="/v2/logging")
    _, entries = state.read()
    assert entries["@shm/a"].route("@shm/a") == "/v2/systemsharedmemory/region/a/register"
    # Log updates are partial: the recorded body is every change so far.
    merged = json.loads(base64.b64decode(entries["@logging"].body))
    assert merged == {"log_info": False, "log_verbose_level": 1}
    # Unregistering every region drops the registrations (a fresh worker has none to replay).
    state.record("@shm/*", "unregister", b"", {}, path="/v2/systemsharedmemory/unregister")
    state.record("@shm/b", "register", b'{"key": "/b"}', {}, path=shm.format("b"))
    _, entries = state.read()
    assert sorted(k for k in entries if k.startswith("@shm/")) == ["@shm/*", "@shm/b"]
    assert entries["@shm/*"].seq < entries["@shm/b"].seq  # replayed in this order
