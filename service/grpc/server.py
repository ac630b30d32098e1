"""The gRPC server (grpcio's asyncio API) beside HTTP, on the same event loop and data plane.

:class:`GrpcServer` is started by :class:`service.server.BitServer` after the models load,
as HTTP's equal, and stopped before the repository is: on SIGTERM it refuses new calls at
once (alongside HTTP) and lets in-flight ones finish for up to ``graceful_shutdown_s``.

Limits: the largest message accepted is ``max_body_bytes`` (larger: RESOURCE_EXHAUSTED, from
grpcio before the message is read whole); ``limit_concurrency`` bounds the calls handled at
once (grpcio answers RESOURCE_EXHAUSTED past it); keepalive follows the ``grpc_*`` settings.
The port is not shared with other processes (``SO_REUSEPORT`` off), so a second server on
the same port fails at start instead of silently taking half the connections; only the
worker processes of one ``--workers`` server share it (their supervisor holds it first).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import grpc

from service.controlplane import ControlPlane
from service.dataplane import DataPlane
from service.grpc.rpc import Rpcs
from service.grpc.servicer import GrpcEndpoints
from service.settings import Settings

log = logging.getLogger(__name__)


def server_options(settings: Settings, *, shared_port: bool = False) -> list[tuple[str, Any]]:
    """grpcio channel arguments of the server (``shared_port``: ``SO_REUSEPORT``, for worker
    processes that share the port)."""
    return [
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", int(shared_port)),
        ("grpc.keepalive_time_ms", settings.grpc_keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.grpc_keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(settings.grpc_keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", settings.grpc_http2_max_pings_without_data),
        # grpc-core's name for the shortest interval it accepts between a client's pings
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            settings.grpc_http2_min_recv_ping_interval_without_data_ms,
        ),
        ("grpc.http2.max_ping_strikes", settings.grpc_http2_max_ping_strikes),
    ]


def address(host: str, port: int) -> str:
    """``host:port`` as grpcio takes it (an IPv6 address in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def check_bindable(host: str, port: int) -> None:
    """Fail now, before models load, if ``host:port`` cannot be bound (as grpcio binds it:
    ``SO_REUSEADDR``, no ``SO_REUSEPORT``); the port is free again on return.

    Raises:
        OSError: with a message that names the address and the setting to change.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
    except OSError as e:
        raise OSError(_bind_message(address(host, port), e.strerror or str(e))) from None


def _bind_message(where: str, why: str) -> str:
    return (
        f"gRPC cannot listen on {where}: {why.lower()}; choose another --grpc-port, or 0 to "
        "turn gRPC off"
    )


class GrpcServer:
    """``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` on one port.

    Args:
        dataplane: the server's data plane (shared with HTTP).
        control: the server's control plane (shared with HTTP).
        settings: host, ``grpc_port``, limits, keepalive, token, access log.
        shared_port: bind with ``SO_REUSEPORT``: each worker process of ``--workers`` serves
            the port, the kernel spreading connections over them (a gRPC channel is one
            connection: its calls all go to one worker).
    """

    def __init__(
        self,
        dataplane: DataPlane,
        control: ControlPlane,
        settings: Settings,
        *,
        shared_port: bool = False,
    ) -> None:
        self.settings = settings
        self.shared_port = shared_port
        token = settings.token
        rpcs = Rpcs(auth_token=token, access_log=settings.access_log)
        self.endpoints = GrpcEndpoints(dataplane, control, rpcs)
        self.port: int | None = None
        """The port bound, once started."""
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the port.

        Raises:
            OSError: the address cannot be bound (in use, or not an address of this host).
        """
        s = self.settings
        server = grpc.aio.server(
            options=server_options(s, shared_port=self.shared_port),
            maximum_concurrent_rpcs=s.limit_concurrency,
        )
        server.add_generic_rpc_handlers(self.endpoints.handlers())
        where = address(s.host, s.grpc_port)
        try:
            port = server.add_insecure_port(where)
        except RuntimeError:
            raise OSError(_bind_message(where, "address already in use or not available")) from None
        await server.start()
        self._server, self.port = server, port
        log.info("gRPC listening on %s", address(s.host, port))
        return port

    def begin_stop(self) -> None:
        """Refuse new calls now; in-flight ones get ``graceful_shutdown_s`` to finish."""
        if self._server is not None and self._stopping is None:
            grace = float(self.settings.graceful_shutdown_s)
            self._stopping = asyncio.ensure_future(self._server.stop(grace))

    async def stop(self) -> None:
        """:meth:`begin_stop`, and wait until every call has finished or been cancelled."""
        self.begin_stop()
        if self._stopping is not None:
            await self._stopping
            log.info("gRPC stopped")
