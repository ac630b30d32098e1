"""The control plane: the server's state changes and readiness, for every transport.

Beside the data plane (:mod:`service.dataplane`, which answers inference and reads model
state), the control plane owns what changes the server: loading and unloading models (Triton's
model repository extension), registering and unregistering system shared memory, the log
settings, the trace settings (Triton's trace extension), and whether the server is ready.
REST's routes and gRPC's RPCs call it directly; neither it nor the changes know HTTP or gRPC.

Every change is checked first (a bad name, key or setting is refused here and changes
nothing), then made a typed :class:`service.cluster.changes.Change` and applied. Under ``--workers``
the cluster (:mod:`service.cluster.peers`) applies it here, records it and sends it to the other
workers, who apply it with :meth:`ControlPlane.apply`; a worker that starts late replays the
record the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from service.cluster.changes import (
    Change,
    LoadModel,
    RegisterRegion,
    UnloadModel,
    UnregisterRegion,
    UpdateLogSettings,
    UpdateTraceSettings,
)
from service.errors import ChangeFailed, InvalidInput, ModelNotFound
from service.models.config import ConfigError
from service.models.override import load_parameters, parse_override
from service.observability.log_settings import LogSettings
from service.observability.trace_settings import TraceSettings
from service.shared_memory import CudaSharedMemory, SystemSharedMemory
from service.text import safe_text

if TYPE_CHECKING:
    from service.cluster.peers import Cluster
    from service.dataplane import Repository

log = logging.getLogger(__name__)


class ControlPlane:
    """The server's state changes and readiness.

    Args:
        repository: the model repository (the only owner of model state).
        shared_memory: the clients' system shared memory regions, or None when client shared
            memory is disabled (the data plane reads the same regions).
        log_level: the starting log level (``--log-level``), for the logging extension.
        cluster: this worker's view of its peers under ``--workers``; None in one process.
        trace_settings: the trace settings (``service.observability.trace_settings``); default:
        those of a
            server that does not trace.
    """

    def __init__(
        self,
        repository: Repository,
        *,
        shared_memory: SystemSharedMemory | None = None,
        log_level: str = "info",
        cluster: Cluster | None = None,
        trace_settings: TraceSettings | None = None,
    ) -> None:
        self.repository = repository
        self.tracing = trace_settings or TraceSettings.off(
            "this server was started without tracing"
        )
        self.shared_memory = shared_memory
        self.cuda_shared_memory = CudaSharedMemory(shared_memory)
        self.logging = LogSettings(log_level)
        self.cluster = cluster
        self.models_changed: Callable[[], None] | None = None
        """Called after every load and unload applied in this process (the server process
        settles its heap then: ``service.observability.heap``)."""
        # One applier per kind of change: what applying it means in this process.
        self._appliers: dict[type[Change], Callable[[Any], Awaitable[Any]]] = {
            LoadModel: self._load,
            UnloadModel: self._unload,
            RegisterRegion: self._register,
            UnregisterRegion: self._unregister,
            UpdateLogSettings: self._update_logging,
            UpdateTraceSettings: self._update_tracing,
        }

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the models; under ``--workers``, then join the peers and catch up."""
        self.logging.attach()  # uvicorn has made the log handlers by now
        await self.repository.start()
        if self.cluster is not None:
            await self.cluster.start(self.apply, self.repository.not_ready_reason)

    def begin_stop(self) -> None:
        """Not ready from now on (the server is draining); peers stop sending changes."""
        if self.cluster is not None:
            self.cluster.leave()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the requests in flight (up to ``timeout_s``), free the models and regions."""
        self.begin_stop()
        await self.repository.stop(timeout_s=timeout_s)
        if self.shared_memory is not None:
            self.shared_memory.close()

    # --- readiness ------------------------------------------------------------------------

    def not_ready(self) -> str | None:
        """Why the server is not ready, naming the models; None when it is: the repository
        is ready by its readiness rule (``--strict-readiness``) and, under ``--workers``,
        every worker has started, caught up and is ready."""
        if self.cluster is not None:
            why = self.cluster.not_ready_message()
            if why is not None:
                return why
        return self.repository.not_ready_reason()

    def ready(self) -> bool:
        """Whether the server is ready (see :meth:`not_ready`)."""
        return self.not_ready() is None

    # --- changes --------------------------------------------------------------------------

    async def change(self, change: Change) -> Any:
        """Apply a checked change here and, under ``--workers``, on every worker.

        Returns:
            what applying it here returned.

        Raises:
            ServiceError: it failed here, or on a peer (``service.cluster.peers.WorkerFailed``).
        """
        if self.cluster is None:
            return await self.apply(change)
        return await self.cluster.change(change, self.apply)

    async def apply(self, change: Change) -> Any:
        """Apply a change in this process only (a peer's, or one replayed from the record)."""
        try:
            return await self._appliers[type(change)](change)
        finally:
            if self.models_changed is not None and isinstance(change, LoadModel | UnloadModel):
                self.models_changed()

    # --- the model repository -------------------------------------------------------------

    def repository_index(self, ready: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index (only the READY versions when ``ready``)."""
        index = self.repository.index()
        return [m for m in index if m.get("state") == "READY"] if ready else index

    async def load(self, name: str, request: Mapping[str, Any] | None = None) -> None:
        """(Re)load a model, with Triton's config override if the request carries one.

        Args:
            name: the model.
            request: the V2 load request (``{"parameters": {"config": "<JSON>"}}``, see
                ``service.models.override``), for this load only.

        Raises:
            InvalidInput: no such model, a malformed request or override, or a model that
                fails to load (the message starts ``failed to load``, as Triton's).
            ModelNotReady: the server is stopping.
        """
        config = load_parameters(name, request or {})
        if config is not None:
            try:  # checked before anything changes (it is parsed again where it is applied)
                parse_override(config, name)
            except ConfigError as exc:
                raise InvalidInput(f"{_failed(name)}: {'; '.join(exc.problems)}") from None
        await self.change(LoadModel(name, config))

    async def unload(self, name: str) -> None:
        """Unload a model.

        Raises:
            ModelNotFound: no such model loaded.
        """
        await self.change(UnloadModel(name))

    async def _load(self, change: LoadModel) -> None:
        name = change.name
        try:
            override = None if change.config is None else parse_override(change.config, name)
            await self.repository.load(name, override)
        except ConfigError as exc:
            raise InvalidInput(f"{_failed(name)}: {'; '.join(exc.problems)}") from None
        except ModelNotFound as exc:
            raise InvalidInput(f"{_failed(name)}: {exc.message}") from None
        except InvalidInput as exc:  # the repository tried: the index says why, everywhere
            raise ChangeFailed(exc.message) from None

    async def _unload(self, change: UnloadModel) -> None:
        await self.repository.unload(change.name)

    # --- shared memory --------------------------------------------------------------------

    def _system_shm(self) -> SystemSharedMemory:
        if self.shared_memory is None:
            raise InvalidInput(
                "client shared memory is disabled on this server; start it with "
                "--allow-client-shm (BITSERVE_ALLOW_CLIENT_SHM=true) to use it"
            )
        return self.shared_memory

    async def register_system_shared_memory(
        self, name: object, key: object, offset: object, byte_size: object
    ) -> None:
        """Register a region: ``byte_size`` bytes at ``offset`` of the POSIX object ``key``
        (Triton's ``{key, offset, byte_size}``).

        Raises:
            InvalidInput: disabled, or a bad or unusable region (the message names it).
        """
        checked = self._system_shm().check(name, key, offset, byte_size)
        await self.change(RegisterRegion(*checked))

    async def unregister_system_shared_memory(self, name: str | None = None) -> None:
        """Unregister a region (None: all of them); an unknown name is no error.

        Raises:
            InvalidInput: client shared memory is disabled.
        """
        shm = self._system_shm()
        if name is not None and name not in shm:
            return  # not registered here, so on no worker: nothing changes anywhere
        await self.change(UnregisterRegion(name))

    def system_shared_memory_status(self, name: str | None = None) -> list[dict[str, Any]]:
        """The registered regions (one, or all; none when disabled).

        Raises:
            NotFound: no region ``name``.
        """
        if self.shared_memory is None:
            return self.cuda_shared_memory.status(name)  # [] or "not found"
        return self.shared_memory.status(name)

    def register_cuda_shared_memory(self, name: str) -> None:
        """Refused: CUDA shared memory is not supported (InvalidInput)."""
        self.cuda_shared_memory.register(name)

    def unregister_cuda_shared_memory(self, name: str | None = None) -> None:
        """Nothing to unregister (no CUDA region is ever registered)."""
        self.cuda_shared_memory.unregister(name)

    def cuda_shared_memory_status(self, name: str | None = None) -> list[dict[str, Any]]:
        """``[]``; a named region is not found.

        Raises:
            NotFound: always for a name.
        """
        return self.cuda_shared_memory.status(name)

    async def _register(self, change: RegisterRegion) -> None:
        shm = self._system_shm()
        shm.register(change.name, change.key, change.offset, change.byte_size)
        shown = shm.status(change.name)[0]
        log.info("shared memory region '%s' registered: %s", change.name, shown)

    async def _unregister(self, change: UnregisterRegion) -> None:
        self._system_shm().unregister(change.name)
        shown = "(all)" if change.name is None else f"'{safe_text(change.name, 128)}'"
        log.info("shared memory region %s unregistered", shown)

    # --- logging --------------------------------------------------------------------------

    def log_settings(self) -> dict[str, Any]:
        """Triton's logging extension: the log settings."""
        return self.logging.get()

    async def update_log_settings(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change log settings (all or nothing); returns them all.

        Raises:
            InvalidInput: an unknown setting or a bad value (see
            ``service.observability.log_settings``).
        """
        given = self.logging.check(changes)
        if not given:
            return self.logging.get()
        result: dict[str, Any] = await self.change(UpdateLogSettings(given))
        return result

    async def _update_logging(self, change: UpdateLogSettings) -> dict[str, Any]:
        return self.logging.update(change.settings)

    # --- tracing --------------------------------------------------------------------------

    def trace_settings(self, model: str | None = None) -> dict[str, Any]:
        """Triton's trace extension: the trace settings of ``model`` (None: the global ones).

        Raises:
            ModelNotFound: no such model. ModelNotReady: it is not ready.
        """
        if model is not None:
            self.repository.get(model)
        return self.tracing.get(model)

    async def update_trace_settings(
        self, model: str | None, changes: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Change trace settings (all or nothing, on every worker; ``null`` clears one);
        returns those of ``model`` (None: the global ones).

        Raises:
            InvalidInput: an unknown setting or a bad value
            (``service.observability.trace_settings``). ModelNotFound: no such model. ModelNotReady:
            it is not ready.
        """
        if model is not None:
            self.repository.get(model)
        given = self.tracing.check(changes)
        if not given:
            return self.tracing.get(model)
        result: dict[str, Any] = await self.change(UpdateTraceSettings(model, given))
        return result

    async def _update_tracing(self, change: UpdateTraceSettings) -> dict[str, Any]:
        return self.tracing.update(change.model, change.settings)


def _failed(name: str) -> str:
    """The start of a load's error: Triton's clients match on ``failed to load``."""
    return f"failed to load '{safe_text(name, 128)}'"
