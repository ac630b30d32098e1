"""What one worker of ``bitserve serve --workers N`` knows of its peers.

The supervisor (:mod:`service.cluster.supervisor`) makes a private run directory (mode 0700) and
hands every worker its path, the worker count, the worker's index and a per-server secret::

    run_dir/
      control.json    what every worker must hold alike (service.cluster.shared_state)
      control.lock    flock: one shared change at a time, server-wide
      ready/w<i>      exists (holding the pid) while worker i is caught up and ready
      ready/w<i>.why  while worker i is caught up but not ready: its pid, then why (which
                      model failed or is loading), for every worker's readiness answer
      w<i>.sock       worker i's private listener, for changes from its peers
      stats/<pid>.json  each worker's statistics, for its peers to add up
      metrics/        PROMETHEUS_MULTIPROC_DIR

A change (:mod:`service.cluster.changes`: a load or unload, a shared-memory registration or
unregistration, new log settings) taken by worker k is applied by k under ``control.lock``,
recorded in ``control.json`` with the next sequence number, and sent to every peer's private
socket as one line of JSON, ``{"secret", "seq", "request_id", "change"}``; the peer applies it
in its own process (it never sends it on) and answers one line, ``{"status": 200}`` or
``{"status": <HTTP status>, "error": <message>}``. k answers once every worker has, naming
each worker that failed. No HTTP request is made between workers: a change is data, whatever
characters its names hold.

A peer that is not listening (starting or restarting) is skipped. A worker starts by loading
the models whose last change was a plain load; then it listens for its peers and, under the
lock, replays every recorded change it has not applied (loads with a config override,
unloads, regions, log settings) before it takes traffic. A peer that listens before k's
change gets k's message; one that takes the lock after it reads k's record.

Readiness: the server is ready when every worker has caught up and its repository is ready
(by its readiness rule, ``--strict-readiness`` included; each keeps ``ready/w<i>`` while it
is, else ``ready/w<i>.why``); the answer says why, naming the model of the first worker that
is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.cluster.changes import Change, LoadModel, UnloadModel
from service.cluster.shared_state import ControlState
from service.errors import ChangeFailed, Relayed, ServiceError, shown_message
from service.observability.request_ids import request_id_var
from service.observability.statistics import Snapshot, merge

__all__ = ["WORKER_HEADER", "Cluster", "PeerAnswer", "WorkerFailed"]

log = logging.getLogger(__name__)

WORKER_HEADER = "x-bitserve-worker"
"""The index of the worker that answered, on every HTTP response (set by uvicorn)."""

Applier = Callable[[Change], Awaitable[Any]]
"""Applies a change in this process (``ControlPlane.apply``)."""

# How long a peer may take to apply a change (a load builds and warms up models).
_FORWARD_TIMEOUT_S = 600.0
_HEARTBEAT_S = 0.25
# The longest message between workers: a change carries at most a control body (1 MiB of
# JSON, a config override), which JSON's escapes can make six times longer.
_MAX_MESSAGE = 8 << 20


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


class WorkerFailed(Relayed):
    """A change failed on one or more peers: the first one's status, every one's message."""


@dataclass(frozen=True)
class PeerAnswer:
    """A peer's answer to a change: 200, or an error's status and message."""

    status: int
    error: str = ""

    def line(self) -> bytes:
        """The answer as one line of JSON."""
        data = {"status": self.status, **({"error": self.error} if self.error else {})}
        return json.dumps(data).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> PeerAnswer:
        """An answer as :meth:`line` wrote it (a malformed one is a 502 saying so)."""
        try:
            data = json.loads(line)
            return cls(int(data["status"]), str(data.get("error", "")))
        except (ValueError, KeyError, TypeError):
            return cls(502, "a malformed answer from the worker")


class Cluster:
    """One worker's view of the server: its peers, the shared record, readiness.

    Args:
        run_dir: the supervisor's run directory.
        index: this worker's index, 0 to ``workers - 1``.
        workers: how many workers the server runs.
        secret: the per-server secret that every message between workers carries.
        statistics: this worker's statistics snapshots (published for its peers to add up).
    """

    def __init__(
        self,
        run_dir: Path,
        index: int,
        workers: int,
        secret: str,
        *,
        statistics: Callable[[], list[Snapshot]] = list,
    ) -> None:
        self.run_dir = run_dir
        self.index = index
        self.workers = workers
        self.control = ControlState(run_dir)
        self._secret = secret.encode()
        self._statistics = statistics
        self._published: list[dict[str, Any]] | None = None
        self._applied: dict[str, int] = {}  # subject -> seq of the change applied here
        self._caught_up = False
        self._apply: Applier | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._parent = os.getppid()

    # --- start-up and leaving ------------------------------------------------------------

    def initial_models(self) -> list[str]:
        """The models to load at start: those whose last change was a plain load.

        The rest of the record (loads with an override, regions, log settings) is replayed
        once the models are loaded (:meth:`start`); unloaded models are not loaded at all.
        """
        _, entries = self.control.read()
        names = []
        for subject, recorded in entries.items():
            change = recorded.change
            if isinstance(change, UnloadModel) or (
                isinstance(change, LoadModel) and change.config is None
            ):
                self._applied[subject] = recorded.seq
            if isinstance(change, LoadModel) and change.config is None:
                names.append(change.name)
        return sorted(names)

    async def start(self, apply: Applier, not_ready_reason: Callable[[], str | None]) -> None:
        """Listen for peers, catch up under the lock, then keep the ready file current.

        Args:
            apply: applies a change in this process (peers' changes and replays).
            not_ready_reason: why this worker's own repository is not ready; None when it is.
        """
        self._apply = apply
        path = socket_path(self.run_dir, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by this index's previous process
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        self._listener = await asyncio.start_unix_server(
            self._serve_peer, sock=sock, limit=_MAX_MESSAGE
        )
        async with self.control.locked():
            await self._catch_up(apply)
        self._caught_up = True
        self._heartbeat = asyncio.create_task(self._beat(not_ready_reason))

    def leave(self) -> None:
        """Not ready any more (the worker is draining); peers skip it from now on."""
        self._caught_up = False
        ready_path(self.run_dir, self.index).unlink(missing_ok=True)
        why_path(self.run_dir, self.index).unlink(missing_ok=True)
        if self._listener is not None:
            self._listener.close()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self.publish_statistics()

    async def _beat(self, not_ready_reason: Callable[[], str | None]) -> None:
        path, why_file = ready_path(self.run_dir, self.index), why_path(self.run_dir, self.index)
        shown: tuple[str | None] | None = None
        while True:
            if os.getppid() != self._parent:  # the supervisor is gone: drain and exit
                log.error("the supervisor exited; worker %d stops", self.index)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self.publish_statistics()
            why = not_ready_reason()
            if (why,) != shown:
                if why is None:
                    _write_atomically(path, str(os.getpid()))
                    why_file.unlink(missing_ok=True)
                else:
                    path.unlink(missing_ok=True)
                    _write_atomically(why_file, f"{os.getpid()}\n{why}")
                shown = (why,)
            await asyncio.sleep(_HEARTBEAT_S)

    async def _catch_up(self, apply: Applier) -> None:
        """Apply every recorded change not applied here yet, in the order they were made."""
        _, entries = self.control.read()
        for subject, recorded in sorted(entries.items(), key=lambda kv: kv[1].seq):
            if self._applied.get(subject) == recorded.seq:
                continue
            outcome = "applied"
            try:
                await apply(recorded.change)
            except ServiceError as e:
                outcome = f"{e.status_code}: {shown_message(e)}"
            self._applied[subject] = recorded.seq
            level = logging.INFO if outcome == "applied" else logging.WARNING
            log.log(level, "caught up: %s %s: %s", recorded.change.kind, subject[:128], outcome)

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

    # --- readiness -----------------------------------------------------------------------

    def not_ready(self) -> list[int]:
        """The workers that are not ready now (this one counts only its catching up: its
        control plane answers for its own models)."""
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
        """Why the server is not ready as far as the workers go (this worker's own models are
        its control plane's to answer for); None when every worker is ready."""
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

    # --- changes -------------------------------------------------------------------------

    async def change(self, change: Change, apply: Applier) -> Any:
        """Apply ``change`` here, record it, and send it to every peer, under the lock.

        A change that fails here is not recorded, and not sent on unless it is a
        :class:`~service.errors.ChangeFailed` (tried and failed: a load whose files are bad,
        whose reason every worker's index should show).

        Returns:
            what applying it here returned.

        Raises:
            ServiceError: it failed here; WorkerFailed: it failed on a peer.
        """
        async with self.control.locked():
            failed_here: ChangeFailed | None = None
            result = None
            seq = None
            try:
                result = await apply(change)
            except ChangeFailed as e:
                failed_here = e
            else:
                seq = self.control.record(change)
                self._applied[change.subject] = seq
            answers = await self.forward(change, seq)
        skipped = [j for j, a in answers if a is None]
        if skipped:
            log.info("%s %s: worker(s) %s not running; they apply it when they start",
                     change.kind, change.subject[:128], skipped)  # fmt: skip
        if failed_here is not None:
            raise failed_here
        failed = [(j, a) for j, a in answers if a is not None and a.status != 200]
        if failed:
            message = "; ".join(f"worker {j}: {a.error}" for j, a in failed)
            log.warning("%s %s failed on %s", change.kind, change.subject[:128], message)
            raise WorkerFailed(failed[0][1].status, message)
        return result

    async def forward(self, change: Change, seq: int | None) -> list[tuple[int, PeerAnswer | None]]:
        """Send a change to every peer; ``(index, answer)``, None for a peer not running."""
        rid = request_id_var.get()
        message = {
            "secret": self._secret.decode(),
            "seq": seq,
            "request_id": None if rid == "-" else rid,  # one id in every worker's log
            "change": change.to_json(),
        }
        line = json.dumps(message).encode() + b"\n"
        peers = [j for j in range(self.workers) if j != self.index]
        return list(await asyncio.gather(*(self._send(j, line) for j in peers)))

    async def _send(self, j: int, line: bytes) -> tuple[int, PeerAnswer | None]:
        path = str(socket_path(self.run_dir, j))
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=_MAX_MESSAGE)
        except OSError:
            return j, None  # not listening: it reads control.json when it starts
        try:
            writer.write(line)
            async with asyncio.timeout(_FORWARD_TIMEOUT_S):
                answer = await reader.readline()
        except TimeoutError:
            return j, PeerAnswer(504, f"no answer within {_FORWARD_TIMEOUT_S:g} s")
        except (OSError, ValueError):
            return j, None  # it died with the change: its successor catches up
        finally:
            writer.close()
        if not answer:
            return j, None  # closed without an answer: it died (or is leaving)
        return j, PeerAnswer.parse(answer)

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One peer's change: apply it here, answer one line."""
        try:
            line = await reader.readline()
            answer = await self._applied_from_peer(line)
            writer.write(answer.line())
            await writer.drain()
        except (OSError, ValueError):  # the peer left, or sent a line past the limit
            pass
        finally:
            writer.close()

    async def _applied_from_peer(self, line: bytes) -> PeerAnswer:
        try:
            message = json.loads(line)
            secret = str(message["secret"]).encode()
            change = Change.from_json(message["change"])
            seq, rid = message.get("seq"), message.get("request_id")
        except (ValueError, KeyError, TypeError) as e:
            return PeerAnswer(400, f"a malformed message from a peer: {type(e).__name__}")
        if not hmac.compare_digest(secret, self._secret):
            return PeerAnswer(401, "a message without this server's secret")
        assert self._apply is not None, "start() the cluster first"
        token = request_id_var.set(rid if isinstance(rid, str) else "-")
        try:
            await self._apply(change)
        except ServiceError as e:
            return PeerAnswer(e.status_code, shown_message(e))
        except Exception:
            log.exception("a peer's change failed: %s %s", change.kind, change.subject[:128])
            return PeerAnswer(500, f"internal error (request id {request_id_var.get()})")
        finally:
            if isinstance(seq, int):
                self._applied[change.subject] = seq
            request_id_var.reset(token)
        return PeerAnswer(200)
