"""The uvicorn server of a ``bitserve serve`` process (the one process, or each worker of
``--workers``): its configuration, and a server that leaves the signals and the lifecycle to
:class:`service.server.BitServer`. Imports nothing heavy: the supervisor imports it too."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import uvicorn

from service.settings import Settings


class HttpServer(uvicorn.Server):
    """uvicorn's server as one transport of :class:`service.server.BitServer`, which owns the
    signals: this one installs no handlers of its own (``BitServer`` calls
    :meth:`handle_exit`, uvicorn's own handler, on SIGTERM and SIGINT), and starts and stops
    no models (the application has no lifespan work)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def uvicorn_config(
    settings: Settings, app: Any, log_config: dict[str, Any] | None, **extra: Any
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
