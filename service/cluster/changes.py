"""Typed changes of what every worker of a server must hold alike.

A change is a small frozen dataclass: loading or unloading a model, registering or
unregistering a system shared-memory region, changing the log settings. The control plane
(:class:`service.controlplane.ControlPlane`) checks a request, makes it a change, and applies
it; under ``--workers`` the cluster (:mod:`service.cluster.peers`) records the change in
``control.json`` and sends it to the other workers as JSON (``{"kind": ..., fields}``), never
as an HTTP request, so a name with any character in it travels as data.

The record holds the state a worker that starts late must reach, not the history: each change
says how it updates the record (:meth:`Change.record`), keyed by :attr:`Change.subject`:

- a model's name: its last load (with the config override it carried) or unload;
- ``@shm/<region>``: a region registered now (unregistering removes it; unregistering every
  region removes them all);
- ``@logging``: every log setting changed so far, merged;
- ``@trace`` and ``@trace/<model>``: the trace settings given now, globally or for a model
  (a cleared one is left out: a worker that starts late has it at its start value).

To add a kind of change: a subclass here with its ``kind``, its ``subject`` and, if it is
not simply the latest of its subject, its ``record``; and its applier in ``ControlPlane``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "Change",
    "LoadModel",
    "Recorded",
    "RegisterRegion",
    "UnloadModel",
    "UnregisterRegion",
    "UpdateLogSettings",
    "UpdateTraceSettings",
]

_SHM = "@shm/"


@dataclass(frozen=True)
class Recorded:
    """A change as ``control.json`` holds it: the change and its server-wide number."""

    seq: int
    change: Change


@dataclass(frozen=True)
class Change:
    """One change of shared state (subclasses: the kinds)."""

    kind: ClassVar[str] = ""
    _kinds: ClassVar[dict[str, type[Change]]] = {}

    def __init_subclass__(cls, *, kind: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind:
            cls.kind = kind
            Change._kinds[kind] = cls

    @property
    def subject(self) -> str:
        """What the change is about: its key in the record."""
        raise NotImplementedError

    def record(self, entries: dict[str, Recorded], seq: int) -> None:
        """Update the record ``entries`` with this change, numbered ``seq``."""
        entries[self.subject] = Recorded(seq, self)

    def to_json(self) -> dict[str, Any]:
        """The change as a JSON object: ``{"kind": ..., <fields>}``."""
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @staticmethod
    def from_json(data: object) -> Change:
        """The change a JSON object describes (as :meth:`to_json` wrote it).

        Raises:
            ValueError: not an object of a known kind with exactly its fields.
        """
        if not isinstance(data, dict):
            raise ValueError("a change must be a JSON object")
        cls = Change._kinds.get(data.get("kind"))  # type: ignore[arg-type]
        if cls is None:
            raise ValueError(f"unknown kind of change {str(data.get('kind'))[:40]!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in data.items() if k != "kind"}
        if set(given) != names:
            raise ValueError(f"a '{cls.kind}' change has the fields {sorted(names)}")
        return cls(**given)


@dataclass(frozen=True)
class LoadModel(Change, kind="load"):
    """(Re)load model ``name``, with Triton's config override (a JSON string) if given."""

    name: str
    config: str | None = None

    @property
    def subject(self) -> str:
        return self.name


@dataclass(frozen=True)
class UnloadModel(Change, kind="unload"):
    """Stop serving model ``name``."""

    name: str

    @property
    def subject(self) -> str:
        return self.name


@dataclass(frozen=True)
class RegisterRegion(Change, kind="shm_register"):
    """Register system shared-memory region ``name``: ``byte_size`` bytes at ``offset`` of
    the POSIX object ``key`` (checked before the change is made)."""

    name: str
    key: str
    offset: int
    byte_size: int

    @property
    def subject(self) -> str:
        return _SHM + self.name


@dataclass(frozen=True)
class UnregisterRegion(Change, kind="shm_unregister"):
    """Unregister region ``name`` (None: every region)."""

    name: str | None = None

    @property
    def subject(self) -> str:
        return _SHM + ("*" if self.name is None else self.name)

    def record(self, entries: dict[str, Recorded], seq: int) -> None:
        # A worker that starts later has no region to unregister: the record keeps only the
        # regions registered now.
        for subject in [s for s in entries if s.startswith(_SHM)]:
            if self.name is None or subject == self.subject:
                del entries[subject]


@dataclass(frozen=True)
class UpdateLogSettings(Change, kind="logging"):
    """Change the log settings given (Triton's names; checked before the change is made)."""

    settings: dict[str, Any]

    @property
    def subject(self) -> str:
        return "@logging"

    def record(self, entries: dict[str, Recorded], seq: int) -> None:
        before = entries.get(self.subject)
        merged: dict[str, Any] = {}
        if before is not None and isinstance(before.change, UpdateLogSettings):
            merged.update(before.change.settings)  # a partial update keeps the earlier ones
        merged.update(self.settings)
        entries[self.subject] = Recorded(seq, UpdateLogSettings(merged))


@dataclass(frozen=True)
class UpdateTraceSettings(Change, kind="trace"):
    """Change the trace settings given (Triton's names, checked and typed by
    ``service.observability.trace_settings.TraceSettings.check``; None clears one) of ``model``, or
    the global ones (None)."""

    model: str | None
    settings: dict[str, Any]

    @property
    def subject(self) -> str:
        return "@trace" if self.model is None else f"@trace/{self.model}"

    def record(self, entries: dict[str, Recorded], seq: int) -> None:
        before = entries.get(self.subject)
        merged: dict[str, Any] = {}
        if before is not None and isinstance(before.change, UpdateTraceSettings):
            merged.update(before.change.settings)
        merged.update(self.settings)
        given = {k: v for k, v in merged.items() if v is not None}
        entries[self.subject] = Recorded(seq, UpdateTraceSettings(self.model, given))
