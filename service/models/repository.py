"""The model repository: loading, readiness, versions; models are served by their handles.

``ModelRepository`` owns every loaded model version (a :class:`~service.models.pipeline.Pipeline`
resident on its device and a :class:`~service.batching.batcher.Batcher` in front of it) and one
worker thread per device. It alone holds the state of each version (READY, LOADING, UNLOADING,
UNAVAILABLE and why): :meth:`ModelRepository.get` hands out only READY versions' handles, and
a retired version's batcher refuses new requests.

Residency (``--device-memory-budget``, :mod:`service.residency.budget`): a READY version is either
resident (its pipeline on its device, its batcher serving) or evicted (its handle kept for
metadata, its tensors released). At start, models are built until the budget is full; the
rest are listed READY without a build. A load that would pass its device's budget first
evicts the least recently used versions that hold no request. A version not resident stays
READY and listed; its next request (:meth:`ModelRepository.resident`) loads it, and
concurrent requests wait for that one load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.batching.batcher import Batcher
from service.batching.priority import level_limits
from service.errors import InvalidInput, ModelNotFound, ModelNotReady
from service.models.config import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_OPERATOR_BYTES,
    ConfigError,
    ModelConfig,
)
from service.models.devices import DeviceExecutors
from service.models.handle import ModelHandle, Result
from service.models.layout import (
    VersionSource,
    model_versions,
    repository_models,
    valid_model_name,
    valid_version,
)
from service.models.override import ConfigOverride
from service.models.pipeline import Pipeline
from service.models.readiness import readiness_reason, shown_name, unknown_model
from service.models.response_cache import ResponseCache
from service.models.signature import Bound
from service.observability.metrics import Metrics
from service.observability.statistics import Statistics
from service.observability.tracing import BatchTracer, Tracing
from service.residency.budget import (
    Accounting,
)
from service.residency.loading import VersionBuilder
from service.residency.resident_versions import (
    LOADING,
    LOADS_AT_ONCE,
    READY,
    UNAVAILABLE,
    UNLOADING,
    Entry,
    ResidentVersions,
)
from service.residency.sizes import Size
from service.settings import Settings

log = logging.getLogger(__name__)

# CPU batches that take less CPU time than this run on the event loop, not in the device's
# worker thread (see Batcher's inline_below_s). Measured on the tiny model (issue 23), whose
# batches take 100-500 µs in a loaded server: run in the thread, the hop and the GIL's
# hand-offs between the loop and the thread cost more than the batch (--workers 1 at
# concurrency 8: 4,500 req/s inline under 1 ms, 3,100 under the earlier 300 µs, 2,750 always
# in the thread). A batch this short delays the loop's other requests by at most as long.
INLINE_BELOW_S = 1e-3
START_PARALLEL = 4
"""Models whose loads start at once at start."""


class ModelRepository(ResidentVersions):
    """Every model of a repository folder (or the built-in demo), loaded on its device.

    Args:
        root: the repository folder; None serves the built-in model ``demo``.
        metrics: optional metrics sink.
        default_device: the device for configs that say ``device = "auto"``.
        warmup: run a full-size batch through each model at load.
        max_operator_bytes: the most bytes a model's response operator may take once built
            (checked by :func:`service.models.files.load_version`, as ``check-repo`` does).
        max_batch_bytes: the most bytes each of a model's input buffers may take (the same).
        initial_models: the models :meth:`start` loads; None: every model of the repository
            (``--workers``: the set the workers agreed on, see ``service.cluster.peers``).
        strict_readiness: whether a model that failed to load keeps the server not ready
            (see :meth:`not_ready_reason`).
        tracing: the server's tracing (``service.observability.tracing``): the batches of each
        version
            record their spans; None: off.
        budget: ``--device-memory-budget`` parsed (``service.residency.sizes.parse_budget``); None:
            every version stays resident.
        sharers: the worker processes that share a device's budget (``--workers``), by
            device; default 1.
        cache: the server's response cache (``--cache-config``); None: none.
    """

    def __init__(
        self,
        root: Path | None,
        *,
        metrics: Metrics | None = None,
        default_device: str = "auto",
        warmup: bool = True,
        max_operator_bytes: int = DEFAULT_MAX_OPERATOR_BYTES,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        initial_models: list[str] | None = None,
        strict_readiness: bool = True,
        tracing: Tracing | None = None,
        budget: dict[str, Size] | None = None,
        sharers: Callable[[str], int] | None = None,
        cache: ResponseCache | None = None,
    ) -> None:
        self.root = root
        self.cache = cache
        """The response cache; the versions of models that enable it answer from it."""
        self.budget = budget
        self._sharers = sharers or (lambda device: 1)
        self.accounting = Accounting(self._budget_of)
        """The bytes of every resident version (keys: handles) and their order of use."""
        self._overrides: dict[str, ConfigOverride | None] = {}
        self._building = asyncio.Semaphore(LOADS_AT_ONCE)
        self._builder = VersionBuilder(default_device, max_operator_bytes, max_batch_bytes, warmup)
        self.tracing = tracing
        self.strict_readiness = strict_readiness
        self.max_operator_bytes = max_operator_bytes
        self.max_batch_bytes = max_batch_bytes
        self.metrics = metrics
        self.statistics = metrics.statistics if metrics is not None else Statistics()
        """Every version's counts (the metrics' own, so Triton's metrics show them)."""
        self.default_device = default_device
        self.warmup = warmup
        self._initial_models = initial_models
        self._models: dict[str, dict[str, Entry]] = {}
        self._unloaded: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._executors = DeviceExecutors()
        self._memory_devices: dict[str, set[str]] = {}
        self._started = False
        self._closing = False

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        metrics: Metrics,
        *,
        device: str | None = None,
        initial_models: list[str] | None = None,
        tracing: Tracing | None = None,
        sharers: Callable[[str], int] | None = None,
    ) -> ModelRepository:
        """The server's repository as ``settings`` describe it (its folder, warm-up and
        limits): the one way ``serve`` and every ``--workers`` worker build it.

        Args:
            device: the device for ``device = "auto"`` configs (a worker's own GPU);
                None: ``settings.device``.
            initial_models, tracing, sharers: see the class.
        """
        return cls(
            settings.model_repository,
            metrics=metrics,
            default_device=settings.device if device is None else device,
            warmup=settings.warmup,
            max_operator_bytes=settings.max_operator_bytes,
            max_batch_bytes=settings.max_batch_bytes,
            initial_models=initial_models,
            strict_readiness=settings.strict_readiness,
            tracing=tracing,
            budget=settings.budget,
            sharers=sharers,
            cache=ResponseCache(settings.cache_bytes) if settings.cache_bytes else None,
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model (heavy work in threads, off the event loop).

        A model that fails to load is recorded as UNAVAILABLE with the reason; with strict
        readiness the server is then not ready (see :meth:`not_ready_reason`), as in Triton.
        """
        if self._initial_models is not None:
            names = self._initial_models
        else:
            names = repository_models(self.root)
        # Loads of different models run in parallel (a few at once: each builds on the cores);
        # past the budget, each first evicts the least recently loaded.
        gate = asyncio.Semaphore(START_PARALLEL)

        async def load(name: str) -> None:
            async with gate:
                try:
                    if self.budget is not None and self.root is not None:
                        await self._start_within_budget(name)  # past it: listed, not built
                    else:
                        await self.load(name)
                except (InvalidInput, ModelNotFound) as exc:
                    log.error("model %s failed to load: %s", name, exc)

        await asyncio.gather(*(load(name) for name in names))
        self._started = True

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish those in flight (up to ``timeout_s``), free the models."""
        self._closing = True
        await asyncio.gather(*(self._drop(name, timeout_s) for name in list(self._models)))
        self._executors.shutdown()

    @property
    def ready(self) -> bool:
        """Whether the server is ready (see :meth:`not_ready_reason`)."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready, naming the models; None when it is.

        Ready: started, not stopping, and every model not explicitly unloaded is READY; with
        ``strict_readiness`` off, a model whose load failed (UNAVAILABLE) does not count, so
        one bad model does not take a healthy server out of a load balancer (Triton's
        ``--strict-readiness``).
        """
        states = [
            (name, v, e.state, e.reason)
            for name, versions in sorted(self._models.items())
            if name not in self._unloaded
            for v, e in sorted(versions.items(), key=lambda kv: int(kv[0]))
        ]
        return readiness_reason(
            states, started=self._started, closing=self._closing, strict=self.strict_readiness
        )

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: every model version with its state and reason."""
        out: list[dict[str, Any]] = []
        names = set(self._models)
        if self.root is not None and self.root.is_dir():
            names |= set(repository_models(self.root))
        for name in sorted(names):
            versions = self._models.get(name)
            if not versions:
                out.append(
                    {"name": name, "version": "", "state": UNAVAILABLE, "reason": "not loaded"}
                )
                continue
            for v in sorted(versions, key=int):
                e = versions[v]
                row: dict[str, Any] = {
                    "name": name, "version": v, "state": e.state, "reason": e.reason
                }  # fmt: skip
                if self.budget is not None:  # Triton's four keys, and where it is
                    resident = e.handle is not None and e.handle in self.accounting
                    row["resident"] = resident
                    row["resident_bytes"] = self.accounting.bytes_of(e.handle)
                    if e.handle is not None:
                        row["device"] = str(e.handle.pipeline.device)
                out.append(row)
        return out

    # --- lookup ---------------------------------------------------------------------------

    def get(self, name: str, version: str | None = None) -> ModelHandle:
        """The handle of a READY model version (the highest READY one by default).

        Raises:
            ModelNotFound: unknown name or version (including names that could leave the
                repository).
            ModelNotReady: the model (version) exists but is not READY.
        """
        versions = self._models.get(name) if valid_model_name(name) else None
        if not versions:
            raise ModelNotFound(unknown_model(name))
        if version is None or version == "":
            ready = [v for v, e in versions.items() if e.state == READY]
            if not ready:
                reasons = "; ".join(
                    f"version {v} is {e.state}" + (f": {e.reason}" if e.reason else "")
                    for v, e in versions.items()
                )
                raise ModelNotReady(f"model '{name}' is not ready ({reasons})")
            version = max(ready, key=int)
        elif not valid_version(version) or version not in versions:
            raise ModelNotFound(unknown_model(name, version))
        e = versions[version]
        if e.state != READY or e.handle is None:
            why = f": {e.reason}" if e.reason else ""
            raise ModelNotReady(f"model '{name}' version {version} is {e.state}{why}")
        return e.handle

    def ready_handles(self, name: str | None = None) -> list[ModelHandle]:
        """The handles of every READY version (of model ``name``, or of every model), by
        model name and version number.

        Raises:
            ModelNotFound: ``name`` is not a model of the repository.
        """
        if name is not None and (not valid_model_name(name) or not self._models.get(name)):
            raise ModelNotFound(unknown_model(name))
        names = sorted(self._models) if name is None else [name]
        return [
            e.handle
            for n in names
            for _, e in sorted(self._models[n].items(), key=lambda kv: int(kv[0]))
            if e.state == READY and e.handle is not None
        ]

    # --- load / unload --------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def load(self, name: str, override: ConfigOverride | None = None) -> None:
        """(Re)load a model and all its versions from disk.

        The new versions are built first; the old ones keep serving until the swap, then
        drain. If any version fails, nothing is swapped and the error names the problem.
        Under a budget, each version first makes room (evicting the least recently used
        versions of other models that hold no request); one larger than the whole budget
        fails with that reason.

        Args:
            name: the model.
            override: a config override for this load (every version), checked as the
                files are (``service.models.override``); kept for its loads on demand.

        Raises:
            ModelNotFound: no such model (or a name that could leave the repository).
            InvalidInput: its configuration or files are invalid, or it does not fit.
            ModelNotReady: the repository is stopping.
        """
        if self._closing:
            raise ModelNotReady("the server is shutting down")
        if not valid_model_name(name):
            raise ModelNotFound(f"unknown model '{shown_name(name)}'")
        if self.root is None:
            if name != "demo":
                raise ModelNotFound(f"unknown model '{name}' (no repository: only 'demo')")
        elif not (self.root / name).is_dir():
            raise ModelNotFound(f"unknown model '{name}' (no folder {name}/ in the repository)")
        async with self._lock(name):
            old = self._models.get(name, {})
            for e in old.values():
                if e.state != READY:
                    e.state, e.reason = LOADING, ""
            try:
                sources = self._sources(name)
                built = await self._build_within_budget(name, sources, override)
            except ConfigError as exc:
                reason = "; ".join(exc.problems)
                # READY versions keep serving; the others show why the load failed.
                for e in old.values():
                    if e.state != READY:
                        e.state, e.reason = UNAVAILABLE, reason
                if not old:
                    self._models[name] = {"1": Entry(UNAVAILABLE, reason)}
                raise InvalidInput(f"failed to load '{name}': {reason}") from None
            versions = sorted(built, key=int)
            new: dict[str, Entry] = {}
            for v in versions:
                cfg, pipeline, nbytes = built[v]
                handle = self._serve(name, v, cfg, pipeline, versions)
                new[v] = Entry(READY, "", handle)
                self._account(handle, nbytes, new[v])
            self._models[name] = new
            self._overrides[name] = override
            self._unloaded.discard(name)
            await self._retire(name, old)
            self._report_memory(name)
            log.info("model %s loaded: versions %s", name, versions)

    def _serve(
        self, name: str, v: str, cfg: ModelConfig, pipeline: Pipeline, versions: list[str]
    ) -> ModelHandle:
        """A built version's handle, its batcher started."""
        stats = self.statistics.for_version(name, v)
        pipeline.stats = stats
        batcher: Batcher[Bound, Result] = Batcher(
            name,
            pipeline.run,
            max_batch_size=cfg.max_batch_size,
            max_queue_delay_us=cfg.max_queue_delay_us,
            max_queue_size=cfg.max_queue_size,
            queue_timeout_us=cfg.queue_timeout_us,
            executor=self._executors.get(str(pipeline.device)),
            metrics=self.metrics,
            stats=stats,
            inline_below_s=INLINE_BELOW_S if pipeline.device.type == "cpu" else 0.0,
            level_limits=level_limits(cfg.priority_levels, cfg.priority_queue_policy),
            version=v,
            tracer=self._batch_tracer(name, v, pipeline),
        )
        batcher.start()
        cache = self.cache if cfg.response_cache.enable else None
        return ModelHandle(name, v, cfg, pipeline, batcher, versions, stats, cache)

    def _batch_tracer(self, name: str, version: str, pipeline: Pipeline) -> BatchTracer | None:
        if self.tracing is None:
            return None
        return self.tracing.batch_tracer(name, version, lambda: pipeline.last_phases_ns)

    def _sources(self, name: str) -> dict[str, VersionSource] | None:
        if self.root is None:
            return None
        return model_versions(self.root, name)

    def _build_all(
        self,
        name: str,
        sources: dict[str, VersionSource] | None,
        override: ConfigOverride | None = None,
    ) -> dict[str, tuple[ModelConfig, Pipeline]]:
        """Load every version's files and build its pipeline (runs in a worker thread)."""
        return self._builder.build_all(name, sources, override)

    async def _retire(self, name: str, entries: dict[str, Entry], timeout_s: float = 30.0) -> None:
        for e in entries.values():
            e.state = UNLOADING
        handles = [e.handle for e in entries.values() if e.handle is not None]
        await asyncio.gather(*(h.batcher.stop(timeout_s) for h in handles))
        for h in handles:
            self.accounting.remove(h)
            if self.cache is not None:  # its answers go with it (reloaded or unloaded)
                self.cache.drop(h.name, h.version)

    async def unload(self, name: str) -> None:
        """Stop serving a model: refuse new requests, drain in-flight ones, free its memory.

        Raises:
            ModelNotFound: no such model loaded.
        """
        if not valid_model_name(name) or name not in self._models:
            raise ModelNotFound(unknown_model(name))
        async with self._lock(name):
            await self._drop(name)
            self._unloaded.add(name)

    async def _drop(self, name: str, timeout_s: float = 30.0) -> None:
        entries = self._models.get(name, {})
        for e in entries.values():
            e.state = UNLOADING
        await self._retire(name, entries, timeout_s)
        self._models[name] = {v: Entry(UNAVAILABLE, "unloaded") for v in entries}
        self._report_memory(name)
        self.statistics.forget(name)  # as Triton forgets an unloaded model's statistics
        if self.metrics is not None:
            self.metrics.forget_model(name)  # really dropped: no batcher reports for it now

    def _report_memory(self, name: str) -> None:
        if self.metrics is None:
            return
        per_device: dict[str, int] = {}
        for e in self._models.get(name, {}).values():
            if e.handle is not None and e.handle in self.accounting:
                dev = str(e.handle.pipeline.device)
                per_device[dev] = per_device.get(dev, 0) + e.handle.pipeline.device_memory_bytes
        devices = self._memory_devices.setdefault(name, set())
        devices |= set(per_device)
        for dev in devices:  # devices it has left are set to 0, not left stale
            self.metrics.set_device_memory(name, dev, per_device.get(dev, 0))
