"""``control.json``: the state every worker of ``bitserve serve --workers N`` must reach.

The file lives in the supervisor's run directory (see :mod:`service.cluster.peers`). It holds, by
subject, the changes (:mod:`service.cluster.changes`) that make that state: each model's last load
or unload, each region registered now, the log settings changed so far; each with the number of
the change, from a server-wide sequence. The supervisor writes the set of models a single
server would load at start (sequence 0); the worker that takes a change records it under
``control.lock``, a ``flock`` that also keeps changes from interleaving across workers; a
worker that starts loads the model set and replays the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from service.cluster.changes import Change, LoadModel, Recorded

__all__ = ["ControlState"]


class ControlState:
    """``control.json``, shared by the workers through the run directory.

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
        state._write(0, {name: Recorded(0, LoadModel(name)) for name in names})
        state._lock_path.touch(mode=0o600)
        return state

    def read(self) -> tuple[int, dict[str, Recorded]]:
        """The last sequence number and the record, by subject."""
        raw = json.loads(self.path.read_text())
        entries = {
            subject: Recorded(int(e["seq"]), Change.from_json(e["change"]))
            for subject, e in raw["entries"].items()
        }
        return int(raw["seq"]), entries

    def _write(self, seq: int, entries: dict[str, Recorded]) -> None:
        tmp = self.path.with_suffix(".tmp")
        recorded = {s: {"seq": e.seq, "change": e.change.to_json()} for s, e in entries.items()}
        data = {"seq": seq, "entries": recorded}
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half

    def record(self, change: Change) -> int:
        """Record a change (hold :meth:`locked`); return its number."""
        seq, entries = self.read()
        seq += 1
        change.record(entries, seq)
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
