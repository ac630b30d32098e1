"""What one worker of ``bitserve serve --workers N`` knows of its peers.

The supervisor (:mod:`service.workers`) makes a private run directory (mode 0700) and hands
every worker its path, the worker count, the worker's index and a per-server secret::

    run_dir/
      control.json    what every worker must hold alike (service.control)
      control.lock    flock: one shared change at a time, server-wide
      ready/w<i>      exists (holding the pid) while worker i is caught up and ready
      ready/w<i>.why  while worker i is caught up but not ready: its pid, then why (which
                      model failed or is loading), for every worker's readiness answer
      w<i>.sock       worker i's private listener, for requests from its peers
      stats/<pid>.json  each worker's statistics, for its peers to add up
      metrics/        PROMETHEUS_MULTIPROC_DIR

A shared change (``POST /v2/repository/models/{m}/load|unload``, a system shared-memory
registration or unregistration, ``POST /v2/logging``) taken by worker k is applied by k,
recorded in ``control.json`` with the next sequence number, and forwarded unchanged (body and
headers) to every peer's private socket with the secret in ``X-Bitserve-Peer``, which tells
the peer to apply it locally and not forward it again. k
answers once every worker has, reporting any failure. A peer that is not listening (starting
or restarting) is skipped: when it starts it loads the set in ``control.json``, and once it
listens it re-reads the file under the lock and replays what changed meanwhile (a peer that
listens before k's forward gets the forward; one that listens after reads k's record).

Readiness: ``/v2/health/ready`` answers 503 on every worker until every worker has caught up
and its repository is ready (by its readiness rule, ``--strict-readiness`` included); the
answer says why, naming the model of the first worker that is not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.control import ControlEntry, ControlState
from service.errors import ServiceError
from service.protocol.response import dumps
from service.rest.bodies import CONTROL_BODY_BYTES, read_body
from service.statistics import Snapshot, merge

__all__ = ["PEER_HEADER", "WORKER_HEADER", "Cluster", "ClusterMiddleware"]

log = logging.getLogger(__name__)

PEER_HEADER = "x-bitserve-peer"
"""Carries the server's secret on requests one worker forwards to another."""
SEQ_HEADER = "x-bitserve-control-seq"
"""The ``control.json`` sequence number a forwarded change was recorded under."""
WORKER_HEADER = "x-bitserve-worker"
"""The index of the worker that answered, on every response (set by uvicorn)."""

# The routes that change what every worker must hold alike, and the control.json key of each.
_CONTROL_ROUTES = (
    (re.compile(r"/v2/repository/models/([^/]+)/(load|unload)"), "{0}"),
    (re.compile(r"/v2/systemsharedmemory/region/([^/]+)/(register|unregister)"), "@shm/{0}"),
    (re.compile(r"/v2/systemsharedmemory/(unregister)"), "@shm/*"),
    (re.compile(r"/v2/(logging)"), "@logging"),
)
_CONTROL_PREFIXES = ("/v2/repository/models/", "/v2/systemsharedmemory/", "/v2/logging")


def control_target(path: str) -> tuple[str, str] | None:
    """``(key, action)`` of a POST to ``path`` that changes shared state, else None."""
    for pattern, key in _CONTROL_ROUTES:
        m = pattern.fullmatch(path)
        if m is not None:
            groups = m.groups()
            return key.format(*groups[:-1]), groups[-1]
    return None


# Headers that describe one hop, not the request: never forwarded to a peer.
_HOP_HEADERS = frozenset(
    {
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"te",
        b"upgrade",
        b"expect",
        PEER_HEADER.encode(),
        SEQ_HEADER.encode(),
    }
)
# How long a peer may take to apply a forwarded change (a load builds and warms up models).
_FORWARD_TIMEOUT_S = 600.0
_HEARTBEAT_S = 0.25


def socket_path(run_dir: Path, index: int) -> Path:
    """Worker ``index``'s private listener."""
    return run_dir / f"w{index}.sock"


def ready_path(run_dir: Path, index: int) -> Path:
    """The file that exists while worker ``index`` is ready."""
    return run_dir / "ready" / f"w{index}"


def why_path(run_dir: Path, index: int) -> Path:
    """The file that says why worker ``index`` is not ready (while it is caught up)."""
    return run_dir / "ready" / f"w{index}.why"


def _write_atomically(path: Path, text: str) -> None:
    """A reader never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class _Answer:
    """A response captured from the local application or a peer."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def error(self) -> str:
        try:
            message = json.loads(self.body)["error"]
        except (ValueError, KeyError, TypeError):
            message = self.body[:200].decode("utf-8", "replace")
        return str(message)


class Cluster:
    """One worker's view of the server: its peers, the shared model set, readiness.

    Args:
        run_dir: the supervisor's run directory.
        index: this worker's index, 0 to ``workers - 1``.
        workers: how many workers the server runs.
        secret: the per-server secret that marks a request as forwarded by a peer.
        not_ready_reason: why this worker's own repository is not ready; None when it is.
        statistics: this worker's statistics snapshots (published for its peers to add up).
        auth_token: the server's bearer token, for the changes this worker replays itself.
        max_body_bytes: the largest control request body accepted (as the routes accept).
        body_timeout_s: the most seconds a control request body may take to arrive.
    """

    def __init__(
        self,
        run_dir: Path,
        index: int,
        workers: int,
        secret: str,
        *,
        not_ready_reason: Callable[[], str | None],
        statistics: Callable[[], list[Snapshot]] = list,
        auth_token: str | None = None,
        max_body_bytes: int = CONTROL_BODY_BYTES,
        body_timeout_s: float | None = 60.0,
    ) -> None:
        self.run_dir = run_dir
        self.index = index
        self.workers = workers
        self.control = ControlState(run_dir)
        self._secret = secret
        self._not_ready_reason = not_ready_reason
        self._statistics = statistics
        self._published: list[dict[str, Any]] | None = None
        self._auth_token = auth_token
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._applied: dict[str, int] = {}  # model -> seq of the change applied here
        self._caught_up = False
        self._app: ASGIApp | None = None
        self._parent = os.getppid()

    # --- start-up ------------------------------------------------------------------------

    def initial_models(self) -> list[str]:
        """The models to load at start: those whose last change was a plain load.

        Loads that carried a body are replayed once the application runs (:meth:`catch_up`);
        unloaded models are not loaded at all.
        """
        _, entries = self.control.read()
        names = []
        for name, entry in entries.items():
            if name.startswith("@"):
                continue  # shared memory and log settings: replayed once the app runs
            if entry.action == "unload" or not entry.body:
                self._applied[name] = entry.seq
            if entry.action == "load" and not entry.body:
                names.append(name)
        return sorted(names)

    def install(self, app: Any) -> None:
        """Put :class:`ClusterMiddleware` into a Starlette/FastAPI ``app``, innermost of the
        user middleware (request ids and access logs still cover what it answers)."""
        from starlette.middleware import Middleware

        app.user_middleware.append(Middleware(ClusterMiddleware, cluster=self))
        self._app = app

    def private_socket(self) -> socket.socket:
        """This worker's private listener, bound but not listening: peers are refused until
        the server starts serving it (and so know to skip this worker)."""
        path = socket_path(self.run_dir, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by this index's previous process
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        return sock

    async def run(self) -> None:
        """Once listening: catch up under the lock, then keep the ready file current."""
        async with self.control.locked():
            await self.catch_up()
        self._caught_up = True
        path, why_file = ready_path(self.run_dir, self.index), why_path(self.run_dir, self.index)
        shown: tuple[str | None] | None = None
        while True:
            if os.getppid() != self._parent:  # the supervisor is gone: drain and exit
                log.error("the supervisor exited; worker %d stops", self.index)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self.publish_statistics()
            why = self._not_ready_reason()
            if (why,) != shown:
                if why is None:
                    _write_atomically(path, str(os.getpid()))
                    why_file.unlink(missing_ok=True)
                else:
                    path.unlink(missing_ok=True)
                    _write_atomically(why_file, f"{os.getpid()}\n{why}")
                shown = (why,)
            await asyncio.sleep(_HEARTBEAT_S)

    def leave(self) -> None:
        """Not ready any more (the worker is draining)."""
        self._caught_up = False
        ready_path(self.run_dir, self.index).unlink(missing_ok=True)
        why_path(self.run_dir, self.index).unlink(missing_ok=True)
        self.publish_statistics()

    # --- statistics ----------------------------------------------------------------------

    def publish_statistics(self) -> None:
        """Write this worker's statistics to ``stats/<pid>.json`` when they changed (every
        heartbeat: a peer's sum is at most that old). Files of workers that died stay, so
        the server's counts never go backwards (as its Prometheus counters do not)."""
        snaps = [s.to_dict() for s in self._statistics()]
        if snaps == self._published:
            return
        folder = self.run_dir / "stats"
        folder.mkdir(exist_ok=True)
        tmp = folder / f"{os.getpid()}.tmp"
        tmp.write_text(json.dumps(snaps))
        os.replace(tmp, folder / f"{os.getpid()}.json")
        self._published = snaps

    def statistics(self) -> list[Snapshot]:
        """The whole server's statistics: this worker's live counts plus every other worker's
        (live or dead) as last published, added up per model version."""
        own = f"{os.getpid()}.json"
        snaps = list(self._statistics())
        for path in sorted((self.run_dir / "stats").glob("*.json")):
            if path.name == own:
                continue
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                snaps += [Snapshot.from_dict(d) for d in json.loads(path.read_text())]
        return merge(snaps)

    async def catch_up(self) -> None:
        """Replay, through this worker's own application, every recorded change it has not
        applied yet (in the order they were made)."""
        _, entries = self.control.read()
        for name, entry in sorted(entries.items(), key=lambda kv: kv[1].seq):
            if self._applied.get(name) == entry.seq:
                continue
            answer = await self._replay(name, entry)
            self._applied[name] = entry.seq
            level = logging.INFO if answer.status == 200 else logging.WARNING
            log.log(level, "caught up: %s %s -> %d", entry.action, name, answer.status)

    async def _replay(self, name: str, entry: ControlEntry) -> _Answer:
        assert self._app is not None, "install() the cluster into the application first"
        headers = {**entry.headers, PEER_HEADER: self._secret, SEQ_HEADER: str(entry.seq)}
        if self._auth_token:
            headers["authorization"] = f"Bearer {self._auth_token}"
        transport = httpx.ASGITransport(app=self._app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            r = await client.post(
                entry.route(name),
                content=base64.b64decode(entry.body),
                headers=headers,
                timeout=None,
            )
        return _Answer(r.status_code, [], r.content)

    # --- readiness -----------------------------------------------------------------------

    def not_ready(self) -> list[int]:
        """The workers that are not ready now (this one counts only its catching up: the
        application itself answers for its models)."""
        missing = []
        for j in range(self.workers):
            if j == self.index:
                if not self._caught_up:
                    missing.append(j)
                continue
            try:
                pid = int(ready_path(self.run_dir, j).read_text())
                os.kill(pid, 0)  # the supervisor removes the file of a dead worker; be sure
            except (OSError, ValueError):
                missing.append(j)
        return missing

    def not_ready_message(self) -> str | None:
        """Why the server is not ready as far as the peers go (this worker's own models are
        the application's to answer for); None when every peer is ready."""
        missing = self.not_ready()
        if not missing:
            return None
        for j in missing:
            try:
                pid, why = why_path(self.run_dir, j).read_text().split("\n", 1)
                os.kill(int(pid), 0)  # not a dead worker's last word
            except (OSError, ValueError):
                continue
            return f"{why} (worker {j} of {self.workers})"
        shown = ", ".join(map(str, missing))
        return (
            f"server is not ready: worker(s) {shown} of {self.workers} are starting or catching up"
        )

    # --- repository changes --------------------------------------------------------------

    def is_peer(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[bool, int | None]:
        """Whether a request was forwarded by a peer (right secret), and its sequence number."""
        secret = seq = None
        for k, v in headers:
            if k == PEER_HEADER.encode():
                secret = v
            elif k == SEQ_HEADER.encode():
                seq = v
        if secret is None or not hmac.compare_digest(secret, self._secret.encode()):
            return False, None
        return True, int(seq) if seq is not None and seq.isdigit() else None

    def applied(self, name: str, seq: int) -> None:
        """Note that the change ``seq`` of ``name`` was applied here."""
        self._applied[name] = seq

    async def forward(
        self,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        seq: int | None,
        request_id: str | None = None,
    ) -> list[tuple[int, _Answer | None]]:
        """Send a change to every peer; ``(index, answer)``, None for a peer not running."""
        sent = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        sent = [(k, v) for k, v in sent if k.encode() not in _HOP_HEADERS]
        if request_id and not any(k.lower() == "x-request-id" for k, _ in sent):
            sent.append(("x-request-id", request_id))  # one id in every worker's log
        sent.append((PEER_HEADER, self._secret))
        if seq is not None:
            sent.append((SEQ_HEADER, str(seq)))

        async def one(j: int) -> tuple[int, _Answer | None]:
            transport = httpx.AsyncHTTPTransport(uds=str(socket_path(self.run_dir, j)))
            try:
                async with httpx.AsyncClient(transport=transport, base_url="http://peer") as c:
                    r = await c.post(path, content=body, headers=sent, timeout=_FORWARD_TIMEOUT_S)
            except httpx.ConnectError:
                return j, None  # not listening: it reads control.json when it starts
            except httpx.TimeoutException:
                msg = dumps({"error": f"no answer within {_FORWARD_TIMEOUT_S:g} s"})
                return j, _Answer(504, [], msg)
            except httpx.TransportError:
                return j, None  # it died with the request: its successor catches up
            return j, _Answer(r.status_code, [], r.content)

        peers = [j for j in range(self.workers) if j != self.index]
        return list(await asyncio.gather(*(one(j) for j in peers)))


class ClusterMiddleware:
    """Cluster-wide readiness and repository changes, in front of one worker's routes.

    Args:
        app: the wrapped ASGI application.
        cluster: this worker's :class:`Cluster`.
    """

    def __init__(self, app: ASGIApp, *, cluster: Cluster) -> None:
        self.app = app
        self.cluster = cluster

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == "/v2/health/ready":
                message = self.cluster.not_ready_message()
                if message is not None:
                    await _send(send, _Answer(503, [], dumps({"error": message})))
                    return
            elif (
                path.startswith(_CONTROL_PREFIXES)  # cheap test first: infer is hot
                and scope["method"] == "POST"
                and (target := control_target(path)) is not None
            ):
                await self._control(scope, receive, send, *target)
                return
        elif scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
            return
        await self.app(scope, receive, send)

    def _lifespan_send(self, send: Send) -> Send:
        async def send_(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                # Models loaded with a body are replayed before the worker takes traffic.
                await self.cluster.catch_up()
            await send(message)

        return send_

    async def _control(
        self, scope: Scope, receive: Receive, send: Send, name: str, action: str
    ) -> None:
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", ()))
        from_peer, seq = self.cluster.is_peer(headers)
        if from_peer:
            answer = await self._local(scope, receive)
            if seq is not None:
                self.cluster.applied(name, seq)
            await _send(send, answer)
            return
        try:  # bounded as the routes bound it, before it is held for every worker
            body = bytes(
                await read_body(
                    receive,
                    declared=None,
                    limit=self.cluster.max_body_bytes,
                    timeout_s=self.cluster.body_timeout_s,
                )
            )
        except ServiceError as e:  # too big, too slow, or the client left: nothing applied
            await _send(send, _Answer(e.status_code, [], dumps({"error": e.message})))
            return
        async with self.cluster.control.locked():
            local = await self._local(scope, _replay_receive(body))
            # 200: applied; 400: the repository tried and failed (peers will fail the same
            # way, but their index should say so too). Anything else (auth, unknown model,
            # shutting down) changed nothing here and is not forwarded.
            if local.status not in (200, 400):
                await _send(send, local)
                return
            seq = None
            if local.status == 200:
                plain = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
                seq = self.cluster.control.record(name, action, body, plain, path=scope["path"])
                self.cluster.applied(name, seq)
            rid = scope.get("state", {}).get("request_id")
            answers = await self.cluster.forward(scope["path"], body, headers, seq, rid)
        failed = [(j, a) for j, a in answers if a is not None and a.status != 200]
        skipped = [j for j, a in answers if a is None]
        if skipped:
            log.info("%s %s: worker(s) %s not running; they apply it when they start",
                     action, name, skipped)  # fmt: skip
        if local.status != 200 or not failed:
            await _send(send, local)
            return
        message = "; ".join(f"worker {j}: {a.error()}" for j, a in failed)
        log.warning("%s %s failed on %s", action, name, message)
        await _send(send, _Answer(failed[0][1].status, [], dumps({"error": message})))

    async def _local(self, scope: Scope, receive: Receive) -> _Answer:
        answer = _Answer(500, [], b"")
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                answer.headers = list(message.get("headers", ()))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        answer.body = b"".join(chunks)
        return answer


def _replay_receive(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # like a client that is still connected
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _send(send: Send, answer: _Answer) -> None:
    """Send a captured or made-up answer (its content headers rebuilt for its body)."""
    kept = [(k, v) for k, v in answer.headers if k.lower() != b"content-length"]
    if not any(k.lower() == b"content-type" for k, _ in kept):
        kept.append((b"content-type", b"application/json"))
    kept.append((b"content-length", b"%d" % len(answer.body)))
    await send({"type": "http.response.start", "status": answer.status, "headers": kept})
    await send({"type": "http.response.body", "body": answer.body})
