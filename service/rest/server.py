"""The uvicorn server of a ``bitserve serve`` process (the one process, or each worker of
``--workers``): its configuration, its shutdown (gRPC and the peers stop with HTTP), and a
run that exits 0 after a drain. Imports nothing heavy: the supervisor imports it too."""

from __future__ import annotations

import signal
import socket
import types
from typing import Any

import uvicorn

from service import heap
from service.settings import Settings


def begin_shutdown(app: Any) -> None:
    """Stop taking gRPC calls and changes from peers now, and answer not ready (when HTTP
    stops taking requests, on SIGTERM); the lifespan, after the HTTP drain, waits for the
    calls in flight before it stops the repository."""
    grpc_server = getattr(app.state, "grpc", None)
    if grpc_server is not None:
        grpc_server.begin_stop()
    control = getattr(app.state, "control", None)
    if control is not None:
        control.begin_stop()


class Server(uvicorn.Server):
    """uvicorn's server: gRPC and the peers stop with HTTP (:func:`begin_shutdown`); the
    process's long-lived objects are frozen out of the garbage collector once the models are
    loaded, and again after each load or unload (:mod:`service.heap`)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the lifespan has loaded the models
        control = getattr(getattr(self.config.app, "state", None), "control", None)
        if control is not None:
            control.models_changed = heap.settle
        heap.settle()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        begin_shutdown(self.config.app)
        await super().shutdown(sockets)


def uvicorn_config(
    settings: Settings, app: Any, log_config: dict[str, Any], **extra: Any
) -> uvicorn.Config:
    """The uvicorn configuration of a server process (``extra``: more ``uvicorn.Config``);
    the HTTP protocol is given the application's express lane."""
    from service.rest.app import BitserveApp
    from service.rest.http_protocol import protocol_class
    from service.rest.sockets import max_connections

    http = protocol_class(
        head_timeout_s=settings.head_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        max_connections=max_connections(settings.max_connections),
        max_body_bytes=settings.max_body_bytes,
        lane=app.express if isinstance(app, BitserveApp) else None,
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=http,
        ws="none",  # no WebSocket routes: an upgrade request is plain HTTP (JSON answers)
        loop="auto",
        lifespan="on",
        log_config=log_config,
        log_level=settings.log_level,
        access_log=False,  # our middleware writes access lines with the request id
        server_header=False,
        # No layer reads the client's address (X-Forwarded-For would only rewrite it): the
        # proxy-headers middleware would be one more coroutine on every request.
        proxy_headers=False,
        timeout_keep_alive=settings.timeout_keep_alive_s,
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        **extra,
    )


def run_server(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> int:
    """Run a uvicorn server until SIGINT/SIGTERM, which let in-flight requests finish first.

    Returns:
        0 after a drain that SIGTERM started, 130 after SIGINT, 1 if it never started.
    """
    # uvicorn handles SIGTERM/SIGINT: it stops accepting, lets in-flight requests finish
    # (up to timeout_graceful_shutdown), then runs the lifespan shutdown (repository.stop).
    # Then it restores the handlers it found and raises the signal again, which by default
    # kills the process (exit status -15/143 after a clean drain, which supervisors count as
    # a failure). The handlers it restores are these: they take the re-raised signal as the
    # end of a graceful shutdown and let ``serve`` return, so a drained server exits 0.
    received: list[int] = []

    def after_drain(sig: int, frame: types.FrameType | None) -> None:
        if not server.should_exit:  # uvicorn was not running yet: stop at once
            raise SystemExit(128 + sig)
        received.append(sig)

    previous = {sig: signal.signal(sig, after_drain) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        return 1
    # Ctrl-C keeps the shell's convention; SIGTERM (a supervisor's stop) is a clean exit.
    return 128 + signal.SIGINT if signal.SIGINT in received else 0
