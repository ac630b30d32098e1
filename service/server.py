"""The server, assembled in one place: the model repository, the two planes, the transports
(REST and gRPC as equals) and the drain; it owns the signals.

:class:`BitServer` builds the repository (unless given one), the
:class:`~service.dataplane.DataPlane` and the :class:`~service.controlplane.ControlPlane`
once, and hands both to each transport: ``service.rest.app.create_app`` for HTTP and
:class:`service.grpc.server.GrpcServer` for gRPC. Neither transport builds, starts or stops
the other, so gRPC runs (and is tested) without FastAPI.

The order of a ``bitserve serve`` process (:meth:`BitServer.run`):

1. load the models (and, under ``--workers``, join the peers and catch up): no port listens
   yet, so no client meets a server that is not ready;
2. gRPC starts, then HTTP binds (uvicorn, with no lifespan work of its own);
3. on SIGTERM or SIGINT both transports stop taking requests at once and the control plane
   answers not ready; in-flight HTTP requests and gRPC calls get ``graceful_shutdown_s`` to
   finish (a second SIGINT cuts HTTP's wait short);
4. the repository stops (finishing what the batchers hold), spans still held go out, and the
   process exits 0 after a SIGTERM drain, 130 after SIGINT, 1 if it never served
   (:func:`exit_process`: no interpreter teardown after the drain).

Imports nothing of FastAPI, uvicorn or grpcio at module level: each transport is imported
where it is built.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from service.controlplane import ControlPlane
from service.dataplane import DataPlane, Repository
from service.models.repository import ModelRepository
from service.observability import heap
from service.observability.metrics import Metrics
from service.observability.tracing import Tracing, settings_without_tracing
from service.settings import Settings
from service.shared_memory import SystemSharedMemory

if TYPE_CHECKING:
    from service.cluster.peers import Cluster
    from service.grpc.server import GrpcServer
    from service.rest.app import BitserveApp
    from service.rest.server import HttpServer

__all__ = ["BitServer", "in_process_app"]

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that drain the server."""


class BitServer:
    """One server process's parts: repository, data plane, control plane, transports.

    Args:
        settings: the server settings.
        repository: the model repository; by default a
            ``service.models.repository.ModelRepository`` over ``settings.model_repository`` (the
            built-in demo when that is unset), created here, loaded by :meth:`start`.
        metrics: the metrics registry shared with ``repository``; a new one by default.
        tracing: OpenTelemetry tracing (a repository passed in must have been given the
            same); None: no traces, and the trace extension answers level OFF.
        cluster: this worker's peers under ``--workers`` (``service.cluster.peers``): changes
            reach every worker, and readiness waits for them all.
        grpc: serve gRPC on ``settings.grpc_port`` (unless that is 0).
        grpc_shared_port: the gRPC port is shared with other worker processes
            (``SO_REUSEPORT``, as ``--workers`` shares the HTTP port).
    """

    def __init__(
        self,
        settings: Settings,
        repository: Repository | None = None,
        *,
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
        cluster: Cluster | None = None,
        grpc: bool = True,
        grpc_shared_port: bool = False,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.tracing = tracing
        if repository is None:
            repository = ModelRepository.from_settings(settings, self.metrics, tracing=tracing)
        self.repository: Repository = repository
        shm = SystemSharedMemory(settings.max_shm_regions) if settings.allow_client_shm else None
        self.dataplane = DataPlane(repository, self.metrics, shared_memory=shm, tracing=tracing)
        self.control = ControlPlane(
            repository,
            shared_memory=shm,
            log_level=settings.log_level,
            cluster=cluster,
            trace_settings=tracing.settings if tracing else settings_without_tracing(os.environ),
        )
        self.grpc: GrpcServer | None = None
        """The gRPC transport (None when ``grpc`` is off or ``grpc_port`` is 0)."""
        if grpc and settings.grpc_port:
            from service.grpc.server import GrpcServer  # grpcio only where gRPC is served

            self.grpc = GrpcServer(
                self.dataplane, self.control, settings, shared_port=grpc_shared_port
            )
        self.http: HttpServer | None = None
        """The HTTP transport's uvicorn server, once :meth:`run` has made it."""
        self._app: BitserveApp | None = None

    def rest_app(
        self, lifespan: Callable[[Any], AbstractAsyncContextManager[None]] | None = None
    ) -> BitserveApp:
        """The REST transport's ASGI application over this server's planes (made once).

        Args:
            lifespan: the application's own start-up and shut-down, for an application
                served without :meth:`run` (:func:`in_process_app`); :meth:`run` starts and
                stops the planes itself.
        """
        if self._app is None:
            from service.rest.app import create_app

            self._app = create_app(
                self.settings, self.dataplane, self.control, self.metrics, lifespan=lifespan
            )
        return self._app

    # --- the lifecycle, transports as equals -----------------------------------------------

    async def start(self) -> None:
        """Load the models (and join the peers), then start gRPC. HTTP is started by its
        own server (:meth:`run`), or not at all (in-process use)."""
        await self.control.start()
        log.info("repository started: %s", [m.get("name") for m in self.repository.index()])
        if self.grpc is not None:
            await self.grpc.start()

    def begin_stop(self) -> None:
        """The drain begins: gRPC refuses new calls, peers stop sending changes, readiness
        answers no (HTTP's server stops accepting on its own, see :meth:`run`)."""
        if self.grpc is not None:
            self.grpc.begin_stop()
        self.control.begin_stop()

    async def stop(self) -> None:
        """After HTTP's drain: gRPC's calls in flight finish, then the repository stops and
        the spans still held go out."""
        self.begin_stop()
        if self.grpc is not None:
            await self.grpc.stop()
        await self.control.stop(timeout_s=self.settings.graceful_shutdown_s)
        log.info("repository stopped")
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[BitServer]:
        """:meth:`start` ... :meth:`stop` around the block (in-process use: tests, Ray)."""
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """:meth:`running` as an ASGI lifespan (``contextlib.asynccontextmanager``-wrapped
        by :func:`in_process_app`)."""
        async with self.running():
            yield

    # --- a `bitserve serve` process --------------------------------------------------------

    def run(
        self,
        log_config: dict[str, Any] | None,
        *,
        sockets: list[socket.socket] | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> int:
        """Serve HTTP and gRPC until SIGINT/SIGTERM, draining both.

        Args:
            log_config: uvicorn's logging configuration
                (``service.observability.request_ids.configure_logging``).
            sockets: HTTP's listening sockets, already bound (``--workers``); by default
                uvicorn binds ``settings.host:settings.port``.
            headers: headers added to every HTTP answer.

        Returns:
            0 after a drain that SIGTERM started, 130 after SIGINT, 1 if it never served.
        """
        from service.rest.server import HttpServer, uvicorn_config

        extra: dict[str, Any] = {} if headers is None else {"headers": headers}
        config = uvicorn_config(self.settings, self.rest_app(), log_config, **extra)
        self.http = HttpServer(config)
        get_loop_factory = getattr(config, "get_loop_factory", None)  # uvicorn >= 0.36
        if get_loop_factory is None:  # older uvicorn chooses its loop through the policy
            config.setup_event_loop()
            loop_factory = None
        else:
            loop_factory = get_loop_factory()
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(self._serve(self.http, sockets))

    async def _serve(self, http: HttpServer, sockets: list[socket.socket] | None) -> int:
        received: list[int] = []
        started = False

        def drain(sig: int) -> None:
            received.append(sig)
            http.handle_exit(sig, None)  # uvicorn: stop accepting; a 2nd SIGINT: no waiting
            if started:
                self.begin_stop()

        # Signals can only be listened to from the main thread (a test may run this in
        # another); a signal during the models' loading lets it finish, then stops.
        main = threading.current_thread() is threading.main_thread()
        loop = asyncio.get_running_loop()
        if main:
            for sig in SIGNALS:
                loop.add_signal_handler(sig, drain, sig)
        try:
            try:
                await self.start()
            except Exception:  # a peer unreachable, gRPC's port taken: never served
                log.exception("start-up failed")
                with contextlib.suppress(Exception):
                    await self.stop()
                return 1
            started = True
            self.control.models_changed = heap.settle
            heap.settle()  # the models are loaded: their objects are long-lived
            try:
                if not received:
                    await http.serve(sockets)
            finally:
                await self.stop()
        finally:
            if main:
                for sig in SIGNALS:
                    loop.remove_signal_handler(sig)
        if not received and not http.started:
            return 1
        # Ctrl-C keeps the shell's convention; SIGTERM (a supervisor's stop) is a clean exit.
        return 128 + signal.SIGINT if signal.SIGINT in received else 0


def in_process_app(
    settings: Settings,
    repository: Repository | None = None,
    *,
    metrics: Metrics | None = None,
    tracing: Tracing | None = None,
    cluster: Cluster | None = None,
) -> BitserveApp:
    """The REST application of a :class:`BitServer` without gRPC whose ASGI lifespan starts
    and stops the server: for an application served by someone else (Ray Serve's replicas,
    in-process tests over ``httpx.ASGITransport``, the in-process benchmark).

    ``app.state.server`` is the :class:`BitServer`.
    """
    server = BitServer(
        settings, repository, metrics=metrics, tracing=tracing, cluster=cluster, grpc=False
    )
    app = server.rest_app(lifespan=asynccontextmanager(server.lifespan))
    app.state.server = server
    return app


def exit_process(code: int) -> NoReturn:
    """End a drained server process with ``code``: exit handlers run, logs and stdio flushed,
    then ``os._exit`` without the interpreter's teardown.

    After the drain (models freed, sockets closed) the teardown would only delay the exit
    (seconds of torch's modules, per worker on shared cores) and let third-party extensions
    report at it: the ``triton`` package's nanobind bindings print ``nanobind: leaked ...``
    for every object its kernel caches still hold (about 100 lines on a CUDA host).
    """
    try:
        atexit._run_exitfuncs()  # what a normal exit runs first (e.g. tracing exporters)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
