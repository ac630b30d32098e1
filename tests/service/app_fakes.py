"""A tiny in-memory repository for transport tests of the app (not for end-to-end tests).

Its handles are real :class:`service.models.handle.ModelHandle` objects with a real signature and a
real batcher; only the device pipeline is replaced by NumPy maths, so the HTTP layer and the
data plane can be tested on their own: framing, errors, auth, limits, compression.

* ``echo``: input ``x`` UINT8 ``[-1, 4]``; outputs ``y`` FP32 = 2·x and ``n`` INT64 = row sums.
* ``boom``: same input, its compute raises an unexpected exception (the app must answer 500).
* ``busy``: same input, its queue is always full (503 with Retry-After).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from service.batching.batcher import Batcher
from service.errors import InvalidInput, ModelNotFound, ModelNotReady, Overloaded
from service.models.config import ModelConfig
from service.models.handle import ModelHandle, Result
from service.models.override import ConfigOverride
from service.models.readiness import unknown_model
from service.models.signature import Bound, Signature
from service.observability.statistics import ModelStats, Statistics
from service.protocol.header_cache import HeaderCache
from service.protocol.types import InferRequest

ECHO_CONFIG = ModelConfig.model_validate(
    {
        "max_batch_size": 65536,
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [4]}],
        "model": {"file": "never-loaded.pt"},
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [4]},
            {"name": "n", "datatype": "INT64", "shape": []},
        ],
    }
)


class _RecordingSignature(Signature):
    """The real signature, recording what the decoder checked and what was bound."""

    def __init__(self, handle: FakeHandle, cfg: ModelConfig, shapes: list[list[int]]) -> None:
        super().__init__(handle.name, cfg, shapes)
        self.handle = handle

    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> int:
        self.handle.checked.append((name, datatype, shape))
        return super().check_input(name, datatype, shape)

    def bind(self, request: InferRequest) -> Bound:
        self.handle.requests.append(request)
        return super().bind(request)


class _AlwaysFull(Batcher[Bound, Result]):
    def check_capacity(self, level: int | None = None) -> None:
        raise Overloaded(f"model {self.name!r} queue is full", retry_after=2)


class FakeHandle(ModelHandle):
    """One fake model version: the echo maths, or its variants by name (see the module)."""

    def __init__(
        self,
        name: str,
        version: str = "1",
        cfg: ModelConfig = ECHO_CONFIG,
        stats: ModelStats | None = None,
    ) -> None:
        shapes = [list(o.shape or []) for o in cfg.outputs]
        pipeline = SimpleNamespace(
            output_shapes=shapes,
            device=SimpleNamespace(type="cpu"),
            device_memory_bytes=0,
            parameters=dict,
        )
        kind = _AlwaysFull if name == "busy" else Batcher
        batcher = kind(
            name,
            self._run,
            max_batch_size=cfg.max_batch_size,
            max_queue_delay_us=0,
            max_queue_size=16,
            stats=stats if stats is not None else ModelStats(name, version),
        )
        super().__init__(name, version, cfg, pipeline, batcher, [version], batcher.stats)  # type: ignore[arg-type]
        self.signature = _RecordingSignature(self, cfg, shapes)
        self.headers = HeaderCache()
        self.requests: list[InferRequest] = []
        self.checked: list[tuple[str, str, tuple[int, ...]]] = []

    async def submit(
        self,
        bound: Bound,
        timeout_us: int | None = None,
        priority: int | None = None,
        trace: Any = None,
    ) -> tuple[Result, Any]:
        self.batcher.start()  # a no-op once started; tests swap handles in at any time
        return await super().submit(bound, timeout_us, priority, trace)

    def enqueue(self, *args: Any, **kw: Any) -> Any:
        self.batcher.start()  # a no-op once started; tests swap handles in at any time
        return super().enqueue(*args, **kw)

    def compute(self, bound: Bound) -> Result:
        """One request's outputs, in config order."""
        if self.name == "boom":
            raise RuntimeError("secret internal detail")
        x = bound.inputs[0].data.astype(np.float64)
        return [(2 * x).astype(np.float32), x.sum(axis=1).astype(np.int64)]

    def _run(self, requests: Sequence[Bound]) -> list[Result]:
        t0 = time.perf_counter_ns()
        out = [self.compute(b) for b in requests]
        # As the real pipeline does once per batch (here everything counts as compute_infer).
        items = sum(b.size for b in requests)
        self.stats.executed(items, len(requests), 0, time.perf_counter_ns() - t0, 0)
        return out


class FakeRepository:
    """Models ``echo``, ``boom`` and ``busy``; ``ready`` can be switched off by a test.

    Their counters come from ``statistics`` when given (a ``Metrics``' own, for its
    ``nv_inference_*`` series), else each handle has its own.
    """

    def __init__(self, statistics: Statistics | None = None) -> None:
        def stats(name: str) -> ModelStats | None:
            return None if statistics is None else statistics.for_version(name, "1")

        self.models: dict[str, FakeHandle] = {
            n: FakeHandle(n, stats=stats(n)) for n in ("echo", "boom", "busy")
        }
        self.started = False
        self.stopped = False
        self.is_ready = True
        self.loaded: list[str] = []
        self.overrides: list[ConfigOverride | None] = []
        self.unloaded: list[str] = []
        self.broken: dict[str, str] = {}
        """Models whose files are bad: their load fails with this reason."""

    @property
    def ready(self) -> bool:
        return self.started and self.is_ready

    def not_ready_reason(self) -> str | None:
        return None if self.ready else "server is not ready: loading models"

    async def start(self) -> None:
        self.started = True

    async def stop(self, timeout_s: float = 30.0) -> None:
        for h in self.models.values():
            await h.batcher.stop(timeout_s)
        self.stopped = True

    def index(self) -> list[dict[str, Any]]:
        return [
            {"name": n, "version": "1", "state": "READY" if n != "busy" else "UNAVAILABLE"}
            for n in self.models
        ]

    async def load(self, name: str, override: ConfigOverride | None = None) -> None:
        if name not in self.models:
            raise ModelNotFound(unknown_model(name))  # the real repository's wording
        if name in self.broken:
            raise InvalidInput(f"failed to load '{name}': {self.broken[name]}")
        self.loaded.append(name)
        self.overrides.append(override)

    async def unload(self, name: str) -> None:
        if name not in self.models:
            raise ModelNotFound(unknown_model(name))  # the real repository's wording
        self.unloaded.append(name)

    def ready_handles(self, name: str | None = None) -> list[FakeHandle]:
        if name is not None and name not in self.models:
            raise ModelNotFound(unknown_model(name))
        names = sorted(self.models) if name is None else [name]
        return [self.models[n] for n in names if self.is_ready and n != "busy"]

    def use(self, handle: Any) -> bool:
        return True  # every fake model is resident

    async def resident(self, handle: Any, timeout_s: float | None = None) -> Any:
        return handle

    def get(self, name: str, version: str | None = None) -> FakeHandle:
        if name not in self.models:
            raise ModelNotFound(unknown_model(name))  # the real repository's wording
        if version not in (None, "1"):
            raise ModelNotFound(unknown_model(name, version))
        if not self.is_ready:
            raise ModelNotReady(f"model {name!r} is not ready")
        return self.models[name]
