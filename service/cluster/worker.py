"""One worker process of ``bitserve serve --workers N`` (started by
:mod:`service.cluster.supervisor`).

A fresh interpreter (``spawn``): it sizes torch's threads, builds its own repository (its own
copy of every model, on its device) and :class:`~service.cluster.peers.Cluster`, and runs its
:class:`~service.server.BitServer`: HTTP on the server's port, shared with the other workers
through ``SO_REUSEPORT`` (its control plane listens for its peers' changes on a private unix
socket); gRPC (unless ``grpc_port`` is 0) shares the gRPC port with the other workers the
same way.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.cluster.peers import WORKER_HEADER, Cluster
from service.models.devices import set_torch_threads
from service.settings import Settings

__all__ = ["WorkerSpec", "bind_port", "run_worker"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process is started with (pickled to it by ``spawn``)."""

    settings: Settings
    port: int
    index: int
    workers: int
    device: str
    devices: tuple[str, ...]
    """Every worker's default device, by index (which workers share a device's budget)."""
    torch_threads: int | None
    interop_threads: int
    run_dir: str
    secret: str


def bind_port(host: str, port: int) -> socket.socket:
    """A socket on ``host:port`` with ``SO_REUSEPORT``, bound and not listening: the
    supervisor's hold on the port (and its number when ``port`` is 0); each worker's is the
    same but listening, which puts it in the kernel's group that connections are spread over."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_worker(spec: WorkerSpec) -> None:
    """A worker process: its own torch threads, models, uvicorn server and private socket."""
    # Ctrl-C reaches the whole process group; the supervisor passes it on as SIGTERM, which
    # drains. (uvicorn takes SIGINT over again once it serves.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_torch_threads(spec.torch_threads, spec.interop_threads)
    from service.observability.request_ids import configure_logging

    log_config = configure_logging(spec.settings.log_level, worker=spec.index)
    from service.server import exit_process

    exit_process(_serve_worker(spec, log_config))  # drained: no interpreter teardown


def _budget_sharers(spec: WorkerSpec) -> Callable[[str], int]:
    """The workers that share a device's memory budget: every worker for the host's memory
    (``cpu``), and on a GPU the workers whose default device it is."""
    on = list(spec.devices)

    def sharers(device: str) -> int:
        if not device.startswith("cuda"):
            return spec.workers
        return max(1, on.count(device))

    return sharers


def _serve_worker(spec: WorkerSpec, log_config: dict[str, Any]) -> int:
    # Imported here: the supervisor imports this module too, and stays without torch.
    from service.models.repository import ModelRepository
    from service.observability.metrics import Metrics
    from service.observability.tracing import Tracing
    from service.server import BitServer

    settings = spec.settings
    tracing = Tracing.from_environ(os.environ)
    metrics = Metrics(multiprocess_dir=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    cluster = Cluster(
        Path(spec.run_dir),
        spec.index,
        spec.workers,
        spec.secret,
        statistics=metrics.statistics.snapshots,
    )
    metrics.statistics_source = cluster.statistics  # /metrics and the stats routes: all of it
    repository = ModelRepository.from_settings(
        settings,
        metrics,
        device=spec.device,
        initial_models=cluster.initial_models(),
        tracing=tracing,
        sharers=_budget_sharers(spec),
    )
    server = BitServer(
        settings,
        repository,
        metrics=metrics,
        tracing=tracing,
        cluster=cluster,
        grpc_shared_port=True,
    )
    # HTTP listens once the models are loaded and the worker has caught up with its peers
    # (BitServer.start): until then the kernel sends this worker no connections.
    return server.run(
        log_config,
        sockets=[bind_port(settings.host, spec.port)],
        headers=[(WORKER_HEADER, str(spec.index))],
    )
