"""Prometheus metrics, one registry per application (no module-level globals).

``/metrics`` serves bitserve's own ``bitserve_*`` series, then Triton's: the per-model
``nv_inference_*`` counters, written from the statistics extension's counts at scrape time
(``service.observability.statistics``: nothing per request beyond those counts), and the
``nv_gpu_*`` gauges where NVML finds a GPU (``service.observability.gpu_gauges``).

With ``--workers N`` every worker writes its samples to files in ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode, chosen when prometheus_client is first imported: the
supervisor sets the variable before it starts the workers), and ``/metrics`` on any worker
renders the whole server: counters and histograms summed over every worker that ever ran,
gauges summed over the live ones (a worker's own share disappears when it dies). The
statistics of every worker are summed the same way (``statistics_source``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter as Tally
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as _values

from service.observability.gpu_gauges import GpuGauges
from service.observability.statistics import Snapshot, Statistics, triton_metrics

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The server's metrics.

    The data plane and the batchers call :meth:`request_started`, :meth:`request_finished`
    and the ``observe_*`` methods; ``/metrics`` serves :meth:`render`.

    Per-request records go into plain Python counts first and reach prometheus_client once
    per turn of the event loop (:meth:`flush`, scheduled by the first record of a turn, and
    run before every render): each of its updates takes a lock (and in multiprocess mode
    writes a memory-mapped file), and the requests of one batch finish in the same turn.
    Counters still count every request and histograms still observe every latency; a
    scrape sees every record made before it.

    Args:
        multiprocess_dir: render every process's samples from this folder (it must be the
            ``PROMETHEUS_MULTIPROC_DIR`` this process started with); None: this process's.
        nvml: the NVML binding for the GPU gauges (``pynvml`` by default, imported at the
            first scrape; None: no GPU gauges). Tests pass a fake.

    Attributes:
        statistics: this process's counts of every model version (the statistics
            extension's, and the source of Triton's ``nv_inference_*`` metrics).
        statistics_source: what the stats routes and ``/metrics`` read: this process's
            snapshots, or (set by ``--workers``) every worker's, summed.
    """

    def __init__(self, multiprocess_dir: str | None = None, *, nvml: Any = "import") -> None:
        self.statistics = Statistics()
        self.statistics_source: Callable[[], list[Snapshot]] = self.statistics.snapshots
        self._nvml = nvml
        self._gpus: GpuGauges | None = None
        # Labelled children of the per-request series, looked up once per (model, outcome).
        self._request_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._levels: dict[str, int] = {}  # models with priority levels: how many
        self._in_flight = 0
        self._in_flight_shown = 0
        self._finished: list[tuple[str, str, float]] = []
        self._waits: list[tuple[str, list[float], list[int] | None]] = []
        self._deferred: dict[Callable[[], None], None] = {}
        self._flush_due = False
        self.registry = CollectorRegistry()
        self._render_registry = self.registry
        if multiprocess_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            if _values.ValueClass is _values.MutexValue:
                raise RuntimeError(
                    "PROMETHEUS_MULTIPROC_DIR was not set when prometheus_client was imported"
                )
            self._render_registry = CollectorRegistry()
            MultiProcessCollector(self._render_registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
        self._multiprocess = multiprocess_dir is not None
        r = self.registry
        self.requests = Counter(
            "bitserve_requests",
            "Inference requests by model and outcome (success, or the error class).",
            ["model", "outcome"],
            registry=r,
        )
        self.request_latency = Histogram(
            "bitserve_request_latency_seconds",
            "Time from receiving an inference request to sending its answer.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "bitserve_queue_seconds",
            "Time a request waited in its model's queue before its batch started.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_time = Histogram(
            "bitserve_compute_seconds",
            "Device time of one batch (staging copy, unpack, operator, model, copy back).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "bitserve_batch_size",
            "Items per executed batch.",
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "bitserve_batch_requests",
            "Requests merged into one executed batch.",
            ["model"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "bitserve_in_flight_requests",
            "Inference requests being handled now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        # Each version's batcher adds its own changes (inc/dec of its cached child), so
        # versions served side by side, or a retiring one, add up and never overwrite.
        self.queue_depth = Gauge(
            "bitserve_queue_depth",
            "Requests waiting in a model's queue.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.requests_cancelled = Counter(
            "bitserve_requests_cancelled",
            "Inference requests dropped before they were computed because their client went "
            "away (HTTP connection closed, gRPC call cancelled or past its deadline).",
            ["model", "version"],
            registry=r,
        )
        # Per priority level, for models with priority_levels (Triton reports none per level).
        self.level_queue_depth = Gauge(
            "bitserve_priority_queue_depth",
            "Requests waiting in a model's queue, by priority level (1 the highest).",
            ["model", "priority"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.level_queue_time = Histogram(
            "bitserve_priority_queue_seconds",
            "Time a request waited in its model's queue, by priority level (1 the highest).",
            ["model", "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.device_memory = Gauge(
            "bitserve_device_memory_bytes",
            "Bytes held on the device by a loaded model (operator, model, buffers).",
            ["model", "device"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.device_memory_budget = Gauge(
            "bitserve_device_memory_budget_bytes",
            "The device memory budget of resident model versions (--device-memory-budget); "
            "with --workers, the workers' shares added up.",
            ["device"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.loads = Counter(
            "bitserve_model_loads",
            "Model versions loaded (at start, by a load call, or on demand after an eviction).",
            ["model"],
            registry=r,
        )
        self.evictions = Counter(
            "bitserve_model_evictions",
            "Model versions evicted to make room within the device memory budget.",
            ["model"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "bitserve_model_load_seconds",
            "Time to load a model's versions (room made, built, dry run, measured).",
            ["model"],
            buckets=_LOAD_BUCKETS,
            registry=r,
        )
        self.load_waits = Counter(
            "bitserve_requests_waited_for_load",
            "Inference requests that found their model version evicted and waited for its load.",
            ["model"],
            registry=r,
        )

    def request_started(self) -> None:
        """One inference request more in flight."""
        self._in_flight += 1
        self._flush_later()

    def request_finished(self, model: str, outcome: str, seconds: float) -> None:
        """One request fewer in flight, counted; ``outcome`` is ``"success"`` or an error
        class name."""
        self._in_flight -= 1
        self._finished.append((model, outcome, seconds))
        self._flush_later()

    def observe_queue(
        self, model: str, waits: list[float], levels: list[int] | None = None
    ) -> None:
        """Record the queue times, in seconds, of one batch's requests (and by their priority
        ``levels``, 1 the highest, for a model with priority levels)."""
        self._waits.append((model, waits, levels))
        self._flush_later()

    def defer(self, update: Callable[[], None]) -> None:
        """Call ``update`` (which writes a series) at the next flush, once however often it
        was deferred (the batchers' queue depths)."""
        self._deferred[update] = None
        self._flush_later()

    def _flush_later(self) -> None:
        if self._flush_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool, a test): at once
            self.flush()
            return
        self._flush_due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write the records made since the last flush to the Prometheus series."""
        self._flush_due = False
        if self._in_flight != self._in_flight_shown:
            self._in_flight_shown = self._in_flight
            self.in_flight.set(self._in_flight)
        finished, self._finished = self._finished, []
        if finished:
            children = self._request_children
            for (model, outcome), n in Tally((m, o) for m, o, _ in finished).items():
                pair = children.get((model, outcome))
                if pair is None:
                    latency = self.request_latency.labels(model)
                    pair = (self.requests.labels(model, outcome), latency)
                    children[(model, outcome)] = pair
                pair[0].inc(n)
            for model, outcome, seconds in finished:
                children[(model, outcome)][1].observe(seconds)
        deferred, self._deferred = self._deferred, {}
        for update in deferred:
            update()
        waits, self._waits = self._waits, []
        for model, seconds_list, levels in waits:
            child = self.queue_time.labels(model)
            for seconds in seconds_list:
                child.observe(seconds)
            if levels is not None:
                for level, seconds in zip(levels, seconds_list, strict=True):
                    self.level_queue_time.labels(model, str(level)).observe(seconds)

    def cancelled(self, model: str, version: str) -> Any:
        """The counter of ``model``'s requests dropped because their client went away (its
        version's child: call ``.inc()``)."""
        return self.requests_cancelled.labels(model, version)

    def level_depths(self, model: str, levels: int) -> list[Any]:
        """The queue-depth gauges of ``model``'s priority levels 1 .. ``levels`` (each
        version's batcher adds its own changes, as to ``bitserve_queue_depth``)."""
        self._levels[model] = max(levels, self._levels.get(model, 0))
        return [self.level_queue_depth.labels(model, str(k)) for k in range(1, levels + 1)]

    def observe_batch(self, model: str, items: int, requests: int, compute_seconds: float) -> None:
        """Record one executed batch: its size in items and in requests, and its compute time."""
        self.batch_size.labels(model).observe(items)
        self.batch_requests.labels(model).observe(requests)
        self.compute_time.labels(model).observe(compute_seconds)

    def set_device_memory(self, model: str, device: str, nbytes: int) -> None:
        """Set the device bytes held by ``model``."""
        self.device_memory.labels(model, device).set(nbytes)

    def forget_model(self, model: str) -> None:
        """Drop a model's per-model gauges when it is unloaded (by the repository, once, after
        its batchers have stopped; not on a reload, whose new batchers own the series)."""
        levels = [str(k) for k in range(1, self._levels.pop(model, 0) + 1)]
        if self._multiprocess:  # its file keeps the series: show it empty, not stale
            self.queue_depth.labels(model).set(0)
            for level in levels:
                self.level_queue_depth.labels(model, level).set(0)
        else:
            with contextlib.suppress(KeyError):
                self.queue_depth.remove(model)
            for level in levels:
                self.level_queue_depth.remove(model, level)
        for key in [k for k in self._request_children if k[0] == model]:
            del self._request_children[key]

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric: bitserve's, then Triton's."""
        self.flush()
        if self._gpus is None:
            self._gpus = GpuGauges(self._nvml)
        return (
            generate_latest(self._render_registry)
            + triton_metrics(self.statistics_source())
            + self._gpus.render()
        )
