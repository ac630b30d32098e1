"""``control.json``: the state every worker of ``bitserve serve --workers N`` shares.

The file lives in the supervisor's run directory (see :mod:`service.cluster`). It maps each
model to its last repository change (load or unload, with the request body a load carried),
each shared-memory region to its last registration (key ``@shm/<region>``; an unregistration
of every region, ``@shm/*``, drops them all), and ``@logging`` to the log settings changed so
far (one JSON object, each change merged in), numbered by a server-wide sequence. The
supervisor writes the set a single server would load at start (sequence 0); the worker that
takes a change records it under ``control.lock``, a ``flock`` that also keeps changes from
interleaving across workers; a worker that starts loads the model set and replays the rest.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["ControlEntry", "ControlState"]

# Headers a recorded change keeps, so that a replay means what the original request meant.
_REPLAYED_HEADERS = ("content-type", "content-encoding")


@dataclass(frozen=True)
class ControlEntry:
    """The last repository change of one model, as the server recorded it.

    Attributes:
        action: ``load`` or ``unload`` (``register``, ``unregister``, ``update`` for the
            other keys).
        seq: the server-wide sequence number of the change (0: the set loaded at start).
        body: the request body, base64 (empty for a plain load or an unload).
        headers: the request's ``Content-Type``/``Content-Encoding``, if it had them.
        path: the route that replays the change (empty: a model's load or unload route).
    """

    action: str
    seq: int
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    path: str = ""

    def route(self, key: str) -> str:
        """The path a replay of this change posts to."""
        return self.path or f"/v2/repository/models/{key}/{self.action}"


class ControlState:
    """``control.json``: the model set, shared by the workers through the run directory.

    Args:
        run_dir: the run directory.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "control.json"
        self._lock_path = run_dir / "control.lock"
        self._local = asyncio.Lock()  # flock is per open file: one holder per process too

    @classmethod
    def create(cls, run_dir: Path, names: Iterable[str]) -> ControlState:
        """Write the state a server starts with: every model in ``names`` loaded (seq 0)."""
        state = cls(run_dir)
        state._write(0, {name: ControlEntry("load", 0) for name in names})
        state._lock_path.touch(mode=0o600)
        return state

    def read(self) -> tuple[int, dict[str, ControlEntry]]:
        """The last sequence number and every model's last change."""
        raw = json.loads(self.path.read_text())
        entries = {name: ControlEntry(**e) for name, e in raw["models"].items()}
        return int(raw["seq"]), entries

    def _write(self, seq: int, entries: dict[str, ControlEntry]) -> None:
        tmp = self.path.with_suffix(".tmp")
        data = {"seq": seq, "models": {n: asdict(e) for n, e in entries.items()}}
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half

    def record(
        self, key: str, action: str, body: bytes, headers: dict[str, str], *, path: str = ""
    ) -> int:
        """Record a change of ``key`` (a model name, ``@shm/<region>``, ``@shm/*`` or
        ``@logging``) made through ``path`` (hold :meth:`locked`); return its number."""
        seq, entries = self.read()
        seq += 1
        if key == "@shm/*":  # every region unregistered: their registrations are history
            entries = {k: e for k, e in entries.items() if not k.startswith("@shm/")}
        if key == "@logging" and key in entries:  # a partial update: keep the earlier ones
            with contextlib.suppress(ValueError, TypeError):
                before = json.loads(base64.b64decode(entries[key].body))
                body = json.dumps({**before, **json.loads(body)}).encode()
        kept = {k: v for k, v in headers.items() if k in _REPLAYED_HEADERS}
        entries[key] = ControlEntry(action, seq, base64.b64encode(body).decode(), kept, path)
        self._write(seq, entries)
        return seq

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        """Hold the server-wide lock (polled, so a cancelled waiter leaves nothing behind)."""
        async with self._local:
            fd = os.open(self._lock_path, os.O_RDWR)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        await asyncio.sleep(0.02)
                yield
            finally:
                os.close(fd)  # releases the flock (it dies with the process too)
