"""The device memory budget: what a model version holds, how much each device may hold.

``--device-memory-budget`` says how many bytes of each device's memory the resident model
versions may hold (``service.models.repository`` keeps them within it, evicting the least recently
used). This module has the pieces that know nothing of models:

- :func:`budget_bytes`: one device's bytes of the setting (``service.residency.sizes``), shared
among
  the worker processes on that device;
- :func:`held_bytes`: the bytes of the tensors an object holds (a pipeline of any kind: its
  operator bands, model weights, corpus, staging buffers), each storage counted once;
- :func:`release`: drop those tensors, so an evicted pipeline's memory returns to its device;
- :func:`shared_parts`: what a pipeline shares with others (an index's corpus, one copy per
  content and device however many versions name it), counted once per device;
- :class:`Accounting`: the bytes each device's resident versions hold and which versions
  to evict, least recently used first, to make room.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from service.residency.sizes import Size


def device_total_bytes(device: str) -> int:
    """The memory of ``device``: a GPU's own, or the host's physical memory for ``cpu``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def budget_bytes(
    budget: dict[str, Size], device: str, *, sharers: int = 1, total: int | None = None
) -> int | None:
    """One process's budget on ``device``: the size given for it (``cuda:N``, then ``cuda``,
    then the one for all), divided by the ``sharers`` worker processes on that device; None:
    no budget (every version stays resident, as without the setting)."""
    dev = torch.device(device)
    size = budget.get(str(dev)) or budget.get(dev.type) or budget.get("")
    if size is None:
        return None
    whole = size.of(device_total_bytes(device) if total is None else total)
    return whole // max(sharers, 1)


def held_bytes(obj: Any) -> int:
    """The bytes of every tensor ``obj`` holds, found through its attributes, modules,
    lists, tuples and dicts (each storage once, however many views share it).

    Generic on purpose: an operator band, a model's weights, an index's corpus and a pinned
    staging buffer are all tensors reachable from the pipeline that holds them.
    """
    seen_storages: set[tuple[str, int]] = set()
    total = 0
    for t in _tensors(obj):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. a sparse or meta tensor
            continue
        if storage.device.type == "meta":
            continue
        key = (str(storage.device), storage.data_ptr())
        if key in seen_storages:
            continue
        seen_storages.add(key)
        total += storage.nbytes()
    return total


def _tensors(obj: Any, depth: int = 12) -> Iterable[torch.Tensor]:
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if id(o) in seen or d > depth or o is None:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            yield o
            continue
        if isinstance(o, torch.nn.Module):
            yield from o.parameters()
            yield from o.buffers()
            stack.extend((v, d + 1) for v in vars(o).values() if not _plain(v))
            continue
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values() if not _plain(v))
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend((v, d + 1) for v in o if not _plain(v))
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not callable(o):
            stack.extend((v, d + 1) for v in vars(o).values() if not _plain(v))
        elif hasattr(o, "__slots__") and not isinstance(o, type):
            for slot in getattr(o, "__slots__", ()):
                v = getattr(o, slot, None)
                if not _plain(v):
                    stack.append((v, d + 1))


def _plain(v: Any) -> bool:
    return isinstance(v, str | bytes | int | float | bool | torch.device | torch.dtype)


def shared_parts(obj: Any) -> dict[Hashable, int]:
    """What ``obj`` (a pipeline) holds in common with others: ``{key: bytes}`` of each
    attribute that says it is shared (a ``shared_key`` attribute, and its ``nbytes``: an
    index's resident corpus, one per content and device). :class:`Accounting` counts each
    key once per device, however many resident versions hold it."""
    out: dict[Hashable, int] = {}
    for value in vars(obj).values():
        key = getattr(value, "shared_key", None)
        if key is not None:
            out[key] = int(getattr(value, "nbytes", 0))
    return out


def release(obj: Any) -> None:
    """Drop what ``obj`` (an evicted pipeline) holds on its device: every attribute through
    which :func:`held_bytes` finds a tensor is set to None. The object is unusable after,
    but keeps its plain attributes (its device, its output shapes) for metadata."""
    for key, value in list(vars(obj).items()):
        if not _plain(value) and any(True for _ in _tensors(value)):
            setattr(obj, key, None)


def trim_host_memory() -> None:
    """Give the host memory freed by an eviction back to the system (glibc's
    ``malloc_trim``: freed blocks of a few MB would otherwise stay in the process's heap,
    which only grows); nothing elsewhere."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


class _Trimmer:
    """:func:`trim_host_memory` in a background thread, one run at a time: asked while a run
    goes on, it runs once more after it (however many asked meanwhile)."""

    def __init__(self, trim: Callable[[], None]) -> None:
        self._trim = trim
        self._lock = threading.Lock()
        self._wanted = False
        self._running = False
        self.runs = 0

    def soon(self) -> None:
        with self._lock:
            self._wanted = True
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._loop, name="malloc-trim", daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._wanted:
                    self._running = False
                    return
                self._wanted = False
            try:
                self._trim()
            finally:
                self.runs += 1


_TRIMMER = _Trimmer(lambda: trim_host_memory())


def trim_host_memory_soon() -> None:
    """:func:`trim_host_memory`, in a background thread, off the caller's path (a load on
    demand, an eviction): in a server with a few hundred MB of heap a trim takes tens of
    milliseconds, which a cold request no longer waits for; the memory it gives back is
    given back a little later."""
    _TRIMMER.soon()


class NoRoom(Exception):
    """A version cannot be made resident: the reason says why (larger than the budget, or
    every other version is pinned or busy).

    Attributes:
        permanent: it can never fit (larger than the budget, or than what is not pinned).
    """

    def __init__(self, reason: str, *, permanent: bool) -> None:
        super().__init__(reason)
        self.permanent = permanent


class Transient:
    """A key accounted only for a while (a build in progress): reserved as pinned, but not
    counted as pinned for good."""


@dataclass
class _Resident:
    device: str
    nbytes: int
    """Its own bytes (its shared parts apart)."""
    pinned: bool
    busy: Callable[[], bool]
    shared: dict[Hashable, int]
    """Parts it holds in common with other versions (``shared_parts``), by key: bytes."""


class Accounting:
    """The bytes each device's resident versions hold, and their order of last use.

    Keys are the repository's (``(model, version)``); a key is accounted from
    :meth:`reserve` (before its load, with an estimate) to :meth:`remove` (after its
    eviction, unload or failed load). A key's bytes are its own plus its shared parts
    (:func:`shared_parts`); a shared part is counted once per device while any resident key
    holds it, and is freed only with the last of them.

    Args:
        budgets: a device's budget in bytes, or None for no budget (called once per device).
    """

    def __init__(self, budgets: Callable[[str], int | None]) -> None:
        self._budget_of = budgets
        self._budgets: dict[str, int | None] = {}
        self._lru: OrderedDict[Hashable, _Resident] = OrderedDict()

    def budget(self, device: str) -> int | None:
        """The budget of ``device`` in bytes; None: unbounded."""
        if device not in self._budgets:
            self._budgets[device] = self._budget_of(device)
        return self._budgets[device]

    def used(self, device: str) -> int:
        """The bytes accounted on ``device`` (resident versions and loads in progress; each
        shared part once)."""
        own = sum(r.nbytes for r in self._lru.values() if r.device == device)
        return own + sum(self._shared_on(device).values())

    def _shared_on(self, device: str) -> dict[Hashable, int]:
        """The shared parts resident on ``device``: key -> bytes."""
        out: dict[Hashable, int] = {}
        for r in self._lru.values():
            if r.device == device and r.shared:
                out.update(r.shared)
        return out

    def loading(self, device: str) -> list[int]:
        """The bytes reserved on ``device`` for each build in progress (its estimate)."""
        return [
            r.nbytes
            for k, r in self._lru.items()
            if r.device == device and isinstance(k, Transient)
        ]

    def typical(self, device: str) -> int:
        """The most bytes one resident version holds on ``device`` (0: none is): what a
        version not built yet is guessed to need when the size of its files says less."""
        return max(
            (r.nbytes + sum(r.shared.values()) for k, r in self._lru.items()
             if r.device == device and not isinstance(k, Transient)),
            default=0,
        )  # fmt: skip

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def bytes_of(self, key: Hashable) -> int:
        """The bytes accounted for ``key`` (0 when it is not)."""
        r = self._lru.get(key)
        return 0 if r is None else r.nbytes + sum(r.shared.values())

    def touch(self, key: Hashable) -> None:
        """``key`` was just used: the last to be evicted."""
        if key in self._lru:
            self._lru.move_to_end(key)

    def check_fits(self, device: str, nbytes: int) -> None:
        """Raise :class:`NoRoom` (permanent) when ``nbytes`` can never fit on ``device``."""
        budget = self.budget(device)
        if budget is not None and nbytes > budget:
            raise NoRoom(
                f"it needs {nbytes:,} bytes on {device}, more than the device memory budget "
                f"of {budget:,} bytes",
                permanent=True,
            )

    def victims(
        self,
        device: str,
        nbytes: int,
        *,
        spare: Callable[[Hashable], bool] = lambda k: False,
        shared: dict[Hashable, int] | None = None,
    ) -> list[Hashable]:
        """The versions to evict, least recently used first, so that ``nbytes`` more (and
        the ``shared`` parts not resident yet) fit on ``device`` (none needed: empty).
        Pinned and busy versions, and those ``spare`` says, are never chosen; evicting a
        version frees a shared part only with its last holder (the new version, holding
        ``shared``, keeps its parts).

        Raises:
            NoRoom: ``nbytes`` is more than the whole budget or than its unpinned part
                (permanent), or cannot fit now (busy versions; the reason names which).
        """
        budget = self.budget(device)
        if budget is None:
            return []
        shared = shared or {}
        self.check_fits(device, nbytes + sum(shared.values()))
        resident_shared = self._shared_on(device)
        nbytes += sum(b for k, b in shared.items() if k not in resident_shared)
        holders: dict[Hashable, int] = dict.fromkeys(shared, 1)  # the new version's
        for r in self._lru.values():
            if r.device == device:
                for k in r.shared:
                    holders[k] = holders.get(k, 0) + 1
        free = budget - self.used(device)
        out: list[Hashable] = []
        pinned = 0
        for key, r in self._lru.items():
            if r.device != device:
                continue
            if r.pinned and not isinstance(key, Transient):
                pinned += r.nbytes
            if free >= nbytes or r.pinned or spare(key) or r.busy():
                continue
            out.append(key)
            free += r.nbytes
            for k, b in r.shared.items():
                holders[k] -= 1
                if holders[k] == 0:  # its last holder goes: the part is freed with it
                    free += b
        if free < nbytes:
            permanent = nbytes > budget - pinned
            why = f"{pinned:,} bytes pinned" if permanent else "the others are busy"
            raise NoRoom(
                f"it needs {nbytes:,} bytes on {device} and only {free:,} of the budget's "
                f"{budget:,} are free or can be freed ({why})",
                permanent=permanent,
            )
        return out

    def reserve(
        self,
        key: Hashable,
        device: str,
        nbytes: int,
        *,
        pinned: bool,
        busy: Callable[[], bool],
        shared: dict[Hashable, int] | None = None,
    ) -> None:
        """Account ``nbytes`` of its own and its ``shared`` parts (each counted once per
        device, see the class) for ``key`` on ``device`` (again: replaced), the most
        recent."""
        self._lru[key] = _Resident(device, nbytes, pinned, busy, dict(shared or {}))
        self._lru.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        """``key`` holds nothing now."""
        self._lru.pop(key, None)

    def order(self) -> list[Hashable]:
        """The accounted keys, least recently used first."""
        return list(self._lru)
