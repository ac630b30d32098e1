"""``bitserve serve --workers N``: N server processes on one port, and their supervisor.

The supervisor (this process) starts N workers with ``multiprocessing``'s ``spawn`` (fresh
interpreters: no CUDA state or threads inherited from a fork). Every worker runs its own
uvicorn server, event loop and device pipelines, listening on the same port with
``SO_REUSEPORT``: the kernel hashes each new connection to one of the listening workers. The
supervisor binds the port first (without listening, so it takes no connections) and holds it
for the life of the server, so ``--port 0`` works and a restarted worker gets the same port.

Why not one listening socket that every worker accepts on (uvicorn's own ``--workers``)?
Measured with ``python -m benchmarks.workers_spread`` (2 workers, a client opening 8
keep-alive connections at once): on a shared socket the first worker to wake often accepts
all 8 (17 trials in 30; the other worker then idles for as long as the connections live),
with ``SO_REUSEPORT`` never (4/4 or 5/3 in 25 of 30). The price: connections a crashed
worker had not yet accepted are reset, where a shared socket would hand them to another.
``SO_REUSEPORT`` balances only on Linux; elsewhere ``auto`` means one process.

The supervisor then only watches: a worker that dies is restarted with the same index (and
logged); SIGTERM/SIGINT is passed on as SIGTERM, each worker drains its in-flight requests as
a single server does, and the supervisor exits 0 (130 after SIGINT, as a single server does).
What the workers share lives in a private run directory: see :mod:`service.cluster.peers`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any, Literal

from service.cluster.peers import ready_path
from service.cluster.shared_state import ControlState
from service.cluster.worker import WorkerSpec, bind_port, run_worker
from service.models.devices import cuda_count, parse_device
from service.models.layout import repository_models
from service.settings import Settings

__all__ = [
    "WorkerPlan",
    "available_cores",
    "gpu_count",
    "plan_workers",
    "supervise",
    "worker_device",
]

log = logging.getLogger(__name__)

CPU_WORKERS_CAP = 8
"""``auto`` on a host without a GPU: one worker per core, at most this many (each worker holds
its own copy of every model; past a few, more processes add memory, not throughput)."""
SMALL_HOST_CORES = 2
"""``auto`` on a host without a GPU and with at most this many cores: one worker. Measured on
2 cores (issue 23, ``benchmarks/results/overhead.md``): a light model is bound by its
maths and by the clients on the same cores, and a second worker's loop and torch thread
share the two cores with the first and with the clients, so two workers served the tiny
model at concurrency 8 and the 2048-bit MLP at 0.89-0.90x of one (using 1.7x the CPU per
request); a compute-heavy model (the demo) gains from two (1.2-1.5x), and ``--workers 2``
is the setting for it. With the client's own lighter transport the MLP gained from two as well
(1.07-1.4x at 4 requests in flight, README "A light model at high rates"): one worker's
device thread, not the client, was then the limit."""
WORKERS_PER_GPU = 2
"""``auto`` on a GPU host: this many workers per GPU, so one's Python work (parsing, encoding)
overlaps another's kernels (with CUDA MPS their kernels can also run side by side).
``benchmarks/gpu_check.sh`` measures 1, 2 and 4 per GPU on a GPU host (``bench_mlp``)."""
_STARTUP_FAILED = 1  # a worker's exit status when its server never started (as cli.serve's)
_RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, cap; doubled while a worker keeps crashing
_STABLE_S = 30.0  # a worker that ran this long crashed afresh: restart it at once


@dataclass(frozen=True)
class WorkerPlan:
    """How many workers, with how many torch threads each, and why.

    Attributes:
        workers: the number of worker processes.
        torch_threads: intra-op threads per worker (``torch.set_num_threads``); None leaves
            torch's default (``OMP_NUM_THREADS`` was set).
        interop_threads: inter-op threads per worker (``torch.set_num_interop_threads``).
        reason: one line for the start-up log.
    """

    workers: int
    torch_threads: int | None
    interop_threads: int
    reason: str


def plan_workers(
    requested: int | Literal["auto"],
    *,
    cores: int,
    gpus: int,
    omp_threads: str | None = None,
    linux: bool = True,
) -> WorkerPlan:
    """The worker count for ``--workers`` and the torch threads of each worker.

    ``auto`` is ``min(cores, 8)`` on a host without a GPU (one worker where it has at most
    :data:`SMALL_HOST_CORES` cores), and ``2 x GPUs`` on a GPU host, bounded by the cores but
    never fewer than one worker per GPU. Each worker gets its share of
    the cores less one, for its event loop (``cores // workers - 1`` intra-op threads, at least
    1), so workers x (threads + loop) stays within the cores; and one inter-op thread (a
    worker runs one batch at a time per device). Measured on 2 cores: with a torch thread per
    core, the event loop that sheds load under a 3x overload is starved and goodput collapses
    (``benchmarks/results/hardening.md``).

    Args:
        requested: the ``workers`` setting.
        cores: the cores this process may use (:func:`available_cores`).
        gpus: the CUDA devices it sees (:func:`gpu_count`).
        omp_threads: ``OMP_NUM_THREADS`` if set: the user's choice of threads is kept.
        linux: whether ``SO_REUSEPORT`` balances connections (Linux); elsewhere ``auto`` is 1.

    Raises:
        ValueError: more than one worker asked for where the port cannot be shared.
    """
    if requested != "auto" and requested > 1 and not linux:
        raise ValueError("more than one worker needs Linux (SO_REUSEPORT); use --workers 1")
    if not linux:
        workers = 1
        why = "auto: one, workers share a port only on Linux"
    elif requested != "auto":
        workers = requested
        why = "as set"
    elif gpus:
        workers = max(gpus, min(WORKERS_PER_GPU * gpus, cores))
        why = f"auto: {WORKERS_PER_GPU} per GPU for {gpus} GPU(s), at most one per core"
        why += " but at least one per GPU" if workers > cores else ""
    elif cores <= SMALL_HOST_CORES:
        workers = 1
        why = f"auto: one on a host of at most {SMALL_HOST_CORES} cores, no GPU"
    else:
        workers = min(cores, CPU_WORKERS_CAP)
        why = f"auto: one per core, at most {CPU_WORKERS_CAP}, no GPU"
    threads: int | None = max(1, cores // workers - 1)
    if omp_threads:
        threads = None
        per = f"OMP_NUM_THREADS={omp_threads} torch threads"
    else:
        per = f"{threads} torch thread(s)"
    reason = f"{workers} worker(s) ({why}; {cores} core(s), {gpus} GPU(s)), {per} each"
    return WorkerPlan(workers, threads, 1, reason)


def worker_device(device: str, index: int, gpus: int) -> str:
    """Worker ``index``'s default device for models whose config says ``auto``.

    ``auto`` and ``cuda`` spread the workers over the GPUs (``cuda:(index mod gpus)``);
    ``auto`` without a GPU, ``cpu`` and ``cuda:N`` stay as they are.
    """
    kind, named = parse_device(device)
    if kind != "cpu" and named is None and gpus > 0:
        return f"cuda:{index % gpus}"
    return device


def available_cores(
    *, cgroup_root: Path = Path("/sys/fs/cgroup"), own_cgroup: Path = Path("/proc/self/cgroup")
) -> int:
    """The cores this process may use: its CPU affinity, bounded by a cgroup CPU quota
    (``docker run --cpus``, a Kubernetes CPU limit), which the affinity does not show."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota(cgroup_root, own_cgroup)
    return max(1, min(cores, quota)) if quota is not None else cores


def _cgroup_cpu_quota(root: Path, own_cgroup: Path) -> int | None:
    """The smallest CPU quota in whole cores (rounded up) on the way from this process's
    cgroup up to the root (cgroup v2 ``cpu.max``), or cgroup v1's CFS quota; None: no quota."""
    limits: list[int] = []
    with contextlib.suppress(OSError):
        line = next((x for x in own_cgroup.read_text().splitlines() if x.startswith("0::")), None)
        if line is not None:
            folder = root / line[3:].strip().lstrip("/")
            for d in (folder, *folder.parents):
                with contextlib.suppress(OSError, ValueError):
                    quota, period = (d / "cpu.max").read_text().split()
                    if quota != "max":
                        limits.append(math.ceil(int(quota) / int(period)))
                if d == root:
                    break
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        if quota_us > 0:
            limits.append(math.ceil(quota_us / period_us))
    return min(limits) if limits else None


def gpu_count(device: str = "auto") -> int:
    """The GPUs the workers are spread over for the server's ``device`` setting: none for
    ``cpu`` (then torch is not even imported here), one for a named ``cuda:N``, else the CUDA
    devices this process sees (``CUDA_VISIBLE_DEVICES`` applies)."""
    kind, named = parse_device(device)
    if kind == "cpu":
        return 0
    return 1 if named is not None else cuda_count()


def supervise(settings: Settings, plan: WorkerPlan, gpus: int) -> int:
    """Run ``plan.workers`` workers on ``settings.host:port`` until SIGTERM/SIGINT.

    Returns:
        the exit status: 0 after SIGTERM, 130 after SIGINT, 1 if the port cannot be bound or
        a worker fails to start before the server was ever ready.
    """
    return _Supervisor(settings, plan, gpus).run()


class _Supervisor:
    def __init__(self, settings: Settings, plan: WorkerPlan, gpus: int) -> None:
        self.settings = settings
        self.plan = plan
        self.gpus = gpus
        self.secret = secrets.token_urlsafe(32)
        self.run_dir = Path()
        self.procs: list[SpawnProcess | None] = [None] * plan.workers
        self.started_at = [0.0] * plan.workers
        self.backoff = [0.0] * plan.workers
        self.due: dict[int, float] = {}  # index -> when to restart it
        self.ever_ready = False
        self.signals: list[int] = []
        self.grpc_sock: socket.socket | None = None

    def run(self) -> int:
        _remove_stale_run_dirs()
        self.run_dir = Path(tempfile.mkdtemp(prefix="bitserve-"))  # mode 0700
        # Held (flock) for the life of the server: how a later supervisor tells this
        # directory from one a killed supervisor left behind, whatever its PID namespace.
        self._pid_file = os.open(self.run_dir / "supervisor.pid", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._pid_file, fcntl.LOCK_EX)
        os.write(self._pid_file, str(os.getpid()).encode())
        (self.run_dir / "ready").mkdir()
        metrics_dir = self.run_dir / "metrics"
        metrics_dir.mkdir()
        # Read by prometheus_client when a worker imports it: every worker writes there.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        wake_r, wake_w = socket.socketpair()
        previous: dict[int, Any] = {}
        try:
            ControlState.create(self.run_dir, repository_models(self.settings.model_repository))
            try:
                self.sock = _hold_port(self.settings.host, self.settings.port)
            except OSError as e:
                log.error("cannot listen on %s:%d: %s", self.settings.host, self.settings.port,
                          "address already in use" if e.errno == 98 else e)  # fmt: skip
                return 1
            host, self.port = self.sock.getsockname()[:2]
            port = self.port
            if self.settings.grpc_port:  # held as the HTTP port is; the workers' gRPC joins it
                try:
                    self.grpc_sock = _hold_port(self.settings.host, self.settings.grpc_port)
                except OSError as e:
                    log.error("gRPC cannot listen on %s:%d: %s; choose another --grpc-port, or "
                              "0 to turn gRPC off", self.settings.host, self.settings.grpc_port,
                              "address already in use" if e.errno == 98 else e)  # fmt: skip
                    self.sock.close()
                    return 1
            log.info("bitserve listening on http://%s:%d: %s; run directory %s",
                     host, port, self.plan.reason, self.run_dir)  # fmt: skip
            previous = {
                sig: signal.signal(sig, lambda s, f: self.signals.append(s))
                for sig in (signal.SIGTERM, signal.SIGINT)
            }
            wake_w.setblocking(False)
            signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
            try:
                for i in range(self.plan.workers):
                    self._start(i)
                failed = self._watch(wake_r)
            except BaseException:
                self._stop(1)  # never leave workers behind (multiprocessing would wait)
                raise
            return self._stop(failed)
        finally:
            signal.set_wakeup_fd(-1)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            wake_r.close()
            wake_w.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            os.close(self._pid_file)

    def _start(self, index: int) -> None:
        spec = WorkerSpec(
            settings=self.settings,
            port=self.port,
            index=index,
            workers=self.plan.workers,
            device=worker_device(self.settings.device, index, self.gpus),
            devices=tuple(
                worker_device(self.settings.device, j, self.gpus) for j in range(self.plan.workers)
            ),
            torch_threads=self.plan.torch_threads,
            interop_threads=self.plan.interop_threads,
            run_dir=str(self.run_dir),
            secret=self.secret,
        )
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=run_worker, args=(spec,), name=f"bitserve-w{index}")
        proc.start()
        self.procs[index] = proc
        self.started_at[index] = time.monotonic()
        log.info("worker %d started: pid %s, device %s", index, proc.pid, spec.device)

    def _watch(self, wake: socket.socket) -> int | None:
        """Restart workers that die until a signal; the exit status if start-up failed."""
        wake.setblocking(False)
        while not self.signals:
            now = time.monotonic()
            timeout = min([t - now for t in self.due.values()] + [0.5])
            waitables: list[Any] = [p.sentinel for p in self.procs if p is not None]
            multiprocessing.connection.wait([*waitables, wake], timeout=max(0.0, timeout))
            with contextlib.suppress(BlockingIOError):
                wake.recv(4096)
            if self.signals:
                break
            for i, p in enumerate(self.procs):
                if p is not None and p.exitcode is not None and self._died(i, p):
                    return 1
            now = time.monotonic()
            for i, t in list(self.due.items()):
                if t <= now:
                    del self.due[i]
                    self._start(i)
            if not self.ever_ready and all(
                ready_path(self.run_dir, i).exists() for i in range(self.plan.workers)
            ):
                self.ever_ready = True
                log.info("all %d workers are ready", self.plan.workers)
        return None

    def _died(self, index: int, proc: SpawnProcess) -> bool:
        """Clean up after a dead worker and schedule its restart; True: give up instead."""
        from prometheus_client.multiprocess import mark_process_dead

        code, pid = proc.exitcode, proc.pid
        assert code is not None
        assert pid is not None
        proc.close()
        self.procs[index] = None
        ready_path(self.run_dir, index).unlink(missing_ok=True)
        mark_process_dead(pid, os.environ["PROMETHEUS_MULTIPROC_DIR"])  # type: ignore[no-untyped-call]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        if code == _STARTUP_FAILED and not self.ever_ready:
            log.error("worker %d (pid %d) %s before the server was ready: stopping",
                      index, pid, how)  # fmt: skip
            return True
        lived = time.monotonic() - self.started_at[index]
        first, cap = _RESTART_BACKOFF_S
        if lived >= _STABLE_S:
            self.backoff[index] = 0.0
        else:
            self.backoff[index] = min(cap, max(first, 2 * self.backoff[index]))
        self.due[index] = time.monotonic() + self.backoff[index]
        log.error("worker %d (pid %d) %s; restarting it in %.1f s",
                  index, pid, how, self.backoff[index])  # fmt: skip
        return False

    def _stop(self, failed: int | None) -> int:
        """SIGTERM every worker, wait for them to drain, and return the exit status."""
        sig = self.signals[0] if self.signals else None
        if sig is not None:
            log.info("received %s: draining %d workers", signal.Signals(sig).name,
                     sum(p is not None for p in self.procs))  # fmt: skip
        alive = [p for p in self.procs if p is not None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)  # type: ignore[arg-type]
        deadline = time.monotonic() + self.settings.graceful_shutdown_s + 10.0
        killed = 0
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                log.error("worker pid %d did not finish draining in time: killing it", p.pid)
                p.kill()
                p.join()
                killed += 1
        self.sock.close()
        if self.grpc_sock is not None:
            self.grpc_sock.close()
        log.info("all workers stopped")
        if failed is not None:
            return failed
        if killed:
            return 1
        return 128 + signal.SIGINT if sig == signal.SIGINT else 0


def _hold_port(host: str, port: int) -> socket.socket:
    """The supervisor's :func:`~service.cluster.worker.bind_port`, after checking that
    nothing listens on the port: a server of this user's with ``SO_REUSEPORT`` would
    otherwise silently share it. (Only
    ``SO_REUSEADDR`` on the probe, so connections of an earlier server in TIME_WAIT do not
    count; a second supervisor that has bound the port but whose workers do not listen yet
    is not seen.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    return bind_port(host, port)


def _remove_stale_run_dirs() -> None:
    """Remove the run directories that killed supervisors left (SIGKILL skips the clean-up):
    those whose ``supervisor.pid`` no process holds locked."""
    for d in Path(tempfile.gettempdir()).glob("bitserve-*"):
        with contextlib.suppress(OSError):
            if d.stat().st_uid != os.getuid() or not d.is_dir():
                continue
            fd = os.open(d / "supervisor.pid", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: in use
                shutil.rmtree(d, ignore_errors=True)
            finally:
                os.close(fd)
