"""The repository's residency under ``--device-memory-budget`` (mixed into
:class:`service.models.repository.ModelRepository`, which owns every attribute used here).

A READY version is resident (its pipeline on its device, its batcher serving) or evicted (its
handle kept for metadata, its tensors released: ``service.residency.budget.release``). Loads make
room first: the least recently used versions of other models that hold no request are
evicted until the version's bytes fit (an estimate before its build, the measured bytes
after). An evicted version's next request loads it again (:meth:`ResidentVersions.resident`);
concurrent requests wait for that one load, and keep the version busy (never evicted) until
they are queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from service.errors import DeadlineExceeded, ModelNotReady
from service.models.config import ConfigError, ModelConfig
from service.models.handle import ModelHandle
from service.models.layout import VersionSource
from service.models.override import ConfigOverride
from service.models.pipeline import Pipeline
from service.models.response_cache import ResponseCache
from service.observability.metrics import Metrics
from service.residency.budget import (
    Accounting,
    NoRoom,
    Transient,
    budget_bytes,
    release,
    shared_parts,
    trim_host_memory_soon,
)
from service.residency.loading import Plan, Unbuilt, VersionBuilder
from service.residency.sizes import Size

log = logging.getLogger("service.models.repository")

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
ROOM_WAIT_S = 60.0
"""How long a load waits for busy versions to finish so that it fits in the budget."""
_ROOM_POLL_S = 0.002
LOADS_AT_ONCE = 2
"""Builds at once (in parallel threads): loads of different models overlap, but the
temporaries of many builds at once would pass the budget by far."""


@dataclass
class Entry:
    """The state of one model version in the index."""

    state: str
    reason: str = ""
    handle: ModelHandle | None = None
    """READY: the version's handle (resident, or evicted and kept for its metadata)."""
    loading: asyncio.Task[ModelHandle] | None = None
    """Its load on demand in progress: every request for it waits for this one."""
    waiting: int = 0
    """Requests waiting for that load (until each is queued, the version is busy)."""
    shared: dict[Hashable, int] = field(default_factory=dict)
    """Its shared parts as measured at its last load (an index's corpus: key -> bytes)."""


class ResidentVersions:
    """Residency of the repository's versions (see the module docstring)."""

    # The repository's, used here.
    budget: dict[str, Size] | None
    accounting: Accounting
    metrics: Metrics | None
    cache: ResponseCache | None
    _models: dict[str, dict[str, Entry]]
    _overrides: dict[str, ConfigOverride | None]
    _sharers: Callable[[str], int]
    _builder: VersionBuilder
    _building: asyncio.Semaphore
    _closing: bool

    def _lock(self, name: str) -> asyncio.Lock:
        raise NotImplementedError

    def _sources(self, name: str) -> dict[str, VersionSource] | None:
        raise NotImplementedError

    def _build_all(
        self,
        name: str,
        sources: dict[str, VersionSource] | None,
        override: ConfigOverride | None = None,
    ) -> dict[str, tuple[ModelConfig, Pipeline]]:
        raise NotImplementedError

    def _serve(
        self, name: str, v: str, cfg: ModelConfig, pipeline: Pipeline, versions: list[str]
    ) -> ModelHandle:
        raise NotImplementedError

    def _report_memory(self, name: str) -> None:
        raise NotImplementedError

    async def _start_within_budget(self, name: str) -> None:
        """Load ``name`` at start under a budget: built if its versions fit in what is left
        of their devices' budgets, else listed READY but not built (:class:`Unbuilt`), to
        load on its first request. Decided with the build slot held, so the loads running
        are accounted (a version not measured yet at least as large as the largest resident
        one on its device). A failure is recorded (UNAVAILABLE) and logged, as by
        :meth:`load`."""
        async with self._lock(name):
            if self._closing:
                return
            async with self._building:
                try:
                    sources = self._sources(name)
                    unbuilt = None
                    if sources is not None:
                        unbuilt = await asyncio.to_thread(self._builder.unbuilt, sources, None)
                    if unbuilt is not None and self._full(unbuilt):
                        await self._list_unbuilt(name, unbuilt, sources or {})
                        return
                    built = await self._build_room_made(name, sources, None, at_start=True)
                except ConfigError as exc:
                    reason = "; ".join(exc.problems)
                    self._models[name] = {"1": Entry(UNAVAILABLE, reason)}
                    log.error("model %s failed to load: %s", name, reason)
                    return
            versions = sorted(built, key=int)
            self._models[name] = {}
            for v in versions:
                cfg, pipeline, nbytes = built[v]
                handle = self._serve(name, v, cfg, pipeline, versions)
                self._models[name][v] = entry = Entry(READY, "", handle)
                self._account(handle, nbytes, entry)
            self._overrides[name] = None
            self._report_memory(name)
            log.info("model %s loaded: versions %s", name, versions)

    def _full(self, unbuilt: dict[str, tuple[ModelConfig, str, int]]) -> bool:
        """Whether the versions of ``unbuilt`` would pass a budget left as it is, each
        guessed as large as the largest version resident on its device (the size of a
        version's files says little of what it holds once built: an operator's band is
        computed, an index's corpus prepared; the first version on a device is built to
        find out)."""
        need: dict[str, int] = {}
        for _, device, _ in unbuilt.values():
            need[device] = need.get(device, 0) + self.accounting.typical(device)
        for device, nbytes in need.items():
            budget = self.accounting.budget(device)
            if budget is None:
                continue
            typical = self.accounting.typical(device)  # builds reserved with less, as much
            running = sum(max(typical - b, 0) for b in self.accounting.loading(device))
            if self.accounting.used(device) + running + nbytes > budget:
                return True
        return False

    async def _list_unbuilt(
        self,
        name: str,
        unbuilt: dict[str, tuple[ModelConfig, str, int]],
        sources: dict[str, VersionSource],
    ) -> None:
        """List ``name``'s versions READY and not resident, built on their first request."""
        versions = sorted(unbuilt, key=int)
        entries: dict[str, Entry] = {}
        for v in versions:
            cfg, device, _ = unbuilt[v]
            stand_in = Unbuilt(name, cfg, device, sources[v].source)
            handle = self._serve(name, v, cfg, stand_in, versions)
            await handle.batcher.stop()
            entries[v] = Entry(READY, "", handle)
        self._models[name] = entries
        self._overrides[name] = None
        self._report_memory(name)
        log.info("model %s listed, not loaded (the device memory budget is full): versions %s",
                 name, versions)  # fmt: skip

    def _budget_of(self, device: str) -> int | None:
        if self.budget is None:
            return None
        nbytes = budget_bytes(self.budget, device, sharers=self._sharers(device))
        if nbytes is not None and self.metrics is not None:
            self.metrics.device_memory_budget.labels(device).set(nbytes)
        return nbytes

    def use(self, handle: ModelHandle) -> bool:
        """Whether ``handle``'s version is resident (then counted as used now: the last to be
        evicted). The data plane asks this of every request's version."""
        accounting = self.accounting
        if handle in accounting:
            accounting.touch(handle)
            return True
        return False

    async def resident(self, handle: ModelHandle, timeout_s: float | None = None) -> ModelHandle:
        """The resident handle of ``handle``'s version: itself, or after its load on demand
        (one load, however many requests wait for it).

        Args:
            handle: a handle :meth:`get` gave (evicted, or replaced by a reload since).
            timeout_s: the most seconds to wait for the load (the request's deadline or its
                model's ``queue_timeout_us``); None: as long as it takes.

        Raises:
            ModelNotReady: the version was unloaded, or its load failed (the reason).
            DeadlineExceeded: the load took longer than ``timeout_s`` (it goes on).
        """
        e = self._models.get(handle.name, {}).get(handle.version)
        if e is None or e.state != READY or e.handle is None:
            raise ModelNotReady(f"model '{handle.name}' version {handle.version} is not ready")
        if self.use(e.handle):
            return e.handle
        if e.loading is None:
            e.loading = asyncio.get_running_loop().create_task(
                self._load_evicted(handle.name, handle.version, e)
            )
            e.loading.add_done_callback(_retrieved)
        if self.metrics is not None:
            self.metrics.load_waits.labels(handle.name).inc()
        e.waiting += 1  # until it resumes, and is queued in the same turn
        try:
            return await asyncio.wait_for(asyncio.shield(e.loading), timeout_s)
        except TimeoutError:
            raise DeadlineExceeded(
                f"model '{handle.name}' version {handle.version} was still loading after "
                f"{timeout_s:g} s (its request's timeout or queue_timeout_us)"
            ) from None
        finally:
            e.waiting -= 1

    async def _load_evicted(self, name: str, v: str, e: Entry) -> ModelHandle:
        """Load an evicted version again (its model's lock held: not with a reload or an
        unload of it); its entry's handle becomes the new one."""
        try:
            async with self._lock(name):
                now = self._models.get(name, {}).get(v)
                if now is None or now.state != READY or now.handle is None:
                    raise ModelNotReady(f"model '{name}' version {v} was unloaded")
                if now.handle in self.accounting:  # a reload meanwhile made it resident
                    return now.handle
                e = now
                assert e.handle is not None
                try:
                    sources = self._sources(name)
                    if sources is not None and v not in sources:
                        raise ConfigError([f"{name}/{v}: the version's folder is gone"])
                    one = None if sources is None else {v: sources[v]}
                    built = await self._build_within_budget(name, one, self._overrides.get(name))
                except ConfigError as exc:
                    reason = "; ".join(exc.problems)
                    e.reason = f"its last load on demand failed: {reason}"
                    raise ModelNotReady(
                        f"model '{name}' version {v} failed to load: {reason}"
                    ) from None
                cfg, pipeline, nbytes = built[v]
                handle = self._serve(name, v, cfg, pipeline, e.handle.versions)
                self._account(handle, nbytes, e)
                e.handle, e.reason = handle, ""
                self._report_memory(name)
                return handle
        finally:
            e.loading = None

    def _account(self, handle: ModelHandle, nbytes: int, entry: Entry) -> None:
        """A resident version's bytes, the most recently used; busy (never evicted) while
        it has requests queued or running, or waiting for its load to resume. Its shared
        parts (an index's corpus) are accounted apart, once per device."""
        own, shared = _split(handle.pipeline, nbytes)
        entry.shared = shared
        self.accounting.reserve(
            handle,
            str(handle.pipeline.device),
            own,
            pinned=handle.cfg.pinned,
            busy=lambda: entry.waiting > 0 or not handle.batcher.idle,
            shared=shared,
        )

    async def _build_within_budget(
        self,
        name: str,
        sources: dict[str, VersionSource] | None,
        override: ConfigOverride | None,
    ) -> dict[str, tuple[ModelConfig, Pipeline, int]]:
        """Every version of ``sources`` built (:meth:`_build_all`, in a thread), each with
        the bytes it holds, after making room for it on its device.

        Room is made for an estimate (the bytes measured at its last load, else its files'
        size) before the build, and again for the measured bytes after; the estimates are
        accounted only while the build runs (whatever it raises).

        Raises:
            ConfigError: a version failed to build, or does not fit in its budget.
        """
        async with self._building:
            return await self._build_room_made(name, sources, override)

    async def _build_room_made(
        self,
        name: str,
        sources: dict[str, VersionSource] | None,
        override: ConfigOverride | None,
        *,
        at_start: bool = False,
    ) -> dict[str, tuple[ModelConfig, Pipeline, int]]:
        plans = await asyncio.to_thread(self._plan, name, sources, override)
        tokens: list[Hashable] = []
        t0 = time.perf_counter()
        try:
            for device, estimate, shared in plans:
                budget = self.accounting.budget(device)
                if at_start or estimate == _GUESS:  # as large as the largest (see _full)
                    estimate = self.accounting.typical(device)
                estimate = estimate if budget is None else min(estimate, budget)
                try:
                    await self._make_room(device, estimate, shared, name=name)
                except ConfigError:
                    estimate, shared = 0, {}  # an estimate: the measured bytes decide below
                token: Hashable = _Loading(name)
                self.accounting.reserve(
                    token, device, estimate, pinned=True, busy=_always, shared=shared
                )
                tokens.append(token)
            built = await asyncio.to_thread(self._build_measured, name, sources, override)
        finally:
            for token in tokens:
                self.accounting.remove(token)
        where = "<built-in demo>"
        try:
            for v, (_, pipe, nbytes) in built.items():
                where = sources[v].source if sources is not None else where
                device = str(pipe.device)
                self.accounting.check_fits(device, nbytes)
                await self._make_room(device, *_split(pipe, nbytes), name=name)
        except (NoRoom, ConfigError) as exc:
            for _, pipe, _ in built.values():
                release(pipe)
            problems = exc.problems if isinstance(exc, ConfigError) else [str(exc)]
            raise ConfigError([f"{where}: does not fit: {p}" for p in problems]) from None
        if self.metrics is not None:
            self.metrics.loads.labels(name).inc(len(built))
            self.metrics.load_seconds.labels(name).observe(time.perf_counter() - t0)
        return built

    def _plan(
        self, name: str, sources: dict[str, VersionSource] | None, override: ConfigOverride | None
    ) -> list[Plan]:
        """``(device, estimated bytes of its own, shared parts)`` of each version to build
        (none without a budget)."""
        if self.budget is None:
            return []

        def known(v: str) -> Plan | None:
            e = self._models.get(name, {}).get(v)
            if e is None or e.handle is None:
                return None
            pipe = e.handle.pipeline
            if isinstance(pipe, Unbuilt):  # listed at start, never measured
                return str(pipe.device), _GUESS, {}
            own = max(pipe.device_memory_bytes - sum(e.shared.values()), 0)
            return str(pipe.device), own, dict(e.shared)

        return self._builder.plan(sources, override, known)

    def _build_measured(
        self,
        name: str,
        sources: dict[str, VersionSource] | None,
        override: ConfigOverride | None,
    ) -> dict[str, tuple[ModelConfig, Pipeline, int]]:
        """:meth:`_build_all` with each pipeline's measured bytes."""
        return self._builder.measured(lambda: self._build_all(name, sources, override))

    async def _make_room(
        self, device: str, nbytes: int, shared: dict[Hashable, int] | None = None, *, name: str
    ) -> None:
        """Evict the least recently used versions (of other models) that hold no request
        until ``nbytes`` more (and the ``shared`` parts not resident yet) fit on ``device``,
        waiting up to :data:`ROOM_WAIT_S` for busy ones to finish.

        Raises:
            ConfigError: ``nbytes`` is more than the budget, or no room came in time.
        """
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            try:
                victims = self.accounting.victims(
                    device,
                    nbytes,
                    spare=lambda k: getattr(k, "name", None) == name,
                    shared=shared,
                )
            except NoRoom as exc:
                if exc.permanent or time.monotonic() > deadline or self._closing:
                    raise ConfigError([str(exc)]) from None
                await asyncio.sleep(_ROOM_POLL_S)
                continue
            if not victims:
                return
            for key in victims:  # now: no other load may choose them too
                self.accounting.remove(key)
            await asyncio.gather(*(self._evict(v) for v in victims))

    async def _evict(self, key: Hashable) -> None:
        """Free an evicted version (no longer accounted): it stays READY and listed."""
        if not isinstance(key, ModelHandle):
            return
        log.info("model %s version %s evicted", key.name, key.version)
        if self.metrics is not None:
            self.metrics.evictions.labels(key.name).inc()
        if self.cache is not None:
            self.cache.drop(key.name, key.version)
        await key.batcher.stop()
        release(key.pipeline)
        if key.pipeline.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            trim_host_memory_soon()
        self._report_memory(key.name)


_GUESS = -1
"""The estimate of a version never built (listed at start): guessed as large as the largest
resident version on its device (its files' size says little, see ``_full``)."""


class _Loading(Transient):
    """The accounting key of a build in progress (never evicted)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _split(pipeline: Pipeline, nbytes: int) -> tuple[int, dict[Hashable, int]]:
    """A built version's ``nbytes``: its own, and its shared parts (``shared_parts``)."""
    shared = shared_parts(pipeline)
    return max(nbytes - sum(shared.values()), 0), shared


def _always() -> bool:
    return True


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A load on demand whose waiters all gave up: its error is logged, not left unread."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a load on demand failed: %s", task.exception())
