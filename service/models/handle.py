"""One loaded model version: its signature, V2 metadata, Triton-style config, and its queue.

A handle holds no state of its own: whether a version serves is the repository's to say
(``service.models.repository``), and a handle whose batcher has stopped refuses new requests.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.batching.batcher import Batcher, BatchInfo
from service.batching.priority import level_of
from service.batching.queue import Answer, Pending
from service.models.config import ModelConfig
from service.models.pipeline import Pipeline
from service.models.response_cache import ResponseCache
from service.models.signature import Bound, Signature
from service.observability.statistics import ModelStats
from service.protocol.header_cache import HeaderCache

Result = list[np.ndarray[Any, Any]]


@dataclass(eq=False)
class ModelHandle:
    """One loaded model version.

    Args:
        name: the model name.
        version: this version.
        cfg: its configuration.
        pipeline: its device-resident pipeline.
        batcher: the queue in front of ``pipeline.run``.
        versions: every version of the model loaded with this one (for metadata).
        stats: its statistics (the batcher's and the pipeline's, which count its queue
            waits and batches; the data plane counts its requests).
        cache: the server's response cache when this version's answers go there
            (``[response_cache] enable = true`` and ``--cache-config``); None: not cached.
    """

    name: str
    version: str
    cfg: ModelConfig
    pipeline: Pipeline
    batcher: Batcher[Bound, Result]
    versions: list[str]
    stats: ModelStats
    cache: ResponseCache | None = None
    signature: Signature = field(init=False)
    """What the wire accepts and what comes back, compiled once."""
    headers: HeaderCache = field(init=False, default_factory=HeaderCache)
    """Binary V2 request headers decoded before for this version (REST decodes here)."""

    def __post_init__(self) -> None:
        self.signature = Signature(self.name, self.cfg, self.pipeline.output_shapes)

    async def submit(
        self,
        bound: Bound,
        timeout_us: int | None = None,
        priority: int | None = None,
        trace: Any = None,
    ) -> tuple[Result, BatchInfo]:
        """Queue a checked request and wait for its outputs (all of them, in config order).

        Args:
            bound: the request, checked by the signature.
            timeout_us: its ``parameters.timeout``.
            priority: its ``parameters.priority`` (see :meth:`level_of`).
            trace: its :class:`service.observability.tracing.RequestTrace` when it is traced.

        Raises:
            Overloaded: the queue (or its level's) is full. DeadlineExceeded: the timeout
            expired first. ModelNotReady: the model is unloading. ServiceError: the batch
            failed.
        """
        future: asyncio.Future[tuple[Result, BatchInfo]] = (
            asyncio.get_running_loop().create_future()
        )
        pending = self.enqueue(bound, future, timeout_us, priority, trace)
        try:
            return await future
        except asyncio.CancelledError:
            self.batcher.cancel(pending)  # the client went away
            raise

    def enqueue(
        self,
        bound: Bound,
        answer: Answer[Result],
        timeout_us: int | None = None,
        priority: int | None = None,
        trace: Any = None,
        request_id: str | None = None,
    ) -> Pending[Bound, Result]:
        """:meth:`submit` without the wait: ``answer`` gets the outputs or the error (see
        ``Batcher.enqueue``); returns the queued request, for ``batcher.cancel``."""
        return self.batcher.enqueue(
            bound,
            bound.size,
            answer,
            timeout_us=timeout_us,
            level=self.level_of(priority),
            trace=trace,
            request_id=request_id,
        )

    def level_of(self, priority: int | None) -> int:
        """The priority level (1 the highest) of a request that asked for ``priority``: as
        in Triton, 0, none or a priority past ``priority_levels`` is the default level; 1
        for a model without levels."""
        return level_of(priority, self.cfg.priority_levels, self.cfg.default_priority_level)

    def metadata(self) -> dict[str, Any]:
        """V2 model metadata; a packed input is advertised in its wire form (UINT8)."""
        return {
            "name": self.name,
            "versions": list(self.versions),
            "platform": "bitserve",
            "inputs": self.signature.input_metadata(),
            "outputs": self.signature.output_metadata(),
            "parameters": {
                "device": str(self.pipeline.device),
                "device_memory_bytes": self.pipeline.device_memory_bytes,
                **self.pipeline.parameters(),
            },
        }

    def config(self) -> dict[str, Any]:
        """Triton-style model configuration (``GET .../config``)."""
        cfg: dict[str, Any] = {
            "name": self.name,
            "platform": "bitserve",
            "backend": "bitserve",
            "max_batch_size": self.cfg.max_batch_size,
            "input": self.signature.input_config(),
            "output": self.signature.output_config(),
            "instance_group": [
                {"kind": "KIND_GPU" if self.pipeline.device.type == "cuda" else "KIND_CPU",
                 "count": 1}
            ],
        }  # fmt: skip
        # Triton's model parameters are strings: the pipeline's own (an index's) as JSON.
        extra = self.pipeline.parameters()
        if extra:
            cfg["parameters"] = {
                k: {"string_value": json.dumps(v, sort_keys=True)} for k, v in extra.items()
            }
        if self.cache is not None:  # Triton's field: perf_analyzer reads it
            cfg["response_cache"] = {"enable": True}
        if self.cfg.max_batch_size > 0:
            cfg["dynamic_batching"] = batching = {
                "max_queue_delay_microseconds": self.cfg.max_queue_delay_us,
                "preferred_batch_size": [self.cfg.max_batch_size],
                "default_queue_policy": {
                    "max_queue_size": self.cfg.max_queue_size,
                    "default_timeout_microseconds": self.cfg.queue_timeout_us,
                    "timeout_action": "REJECT",
                    # A request's own parameters.timeout can only shorten its wait.
                    "allow_timeout_override": True,
                },
            }
            if self.cfg.priority_levels:
                batching["priority_levels"] = self.cfg.priority_levels
                batching["default_priority_level"] = self.cfg.default_priority_level
                batching["priority_queue_policy"] = {
                    str(k): {"max_queue_size": p.max_queue_size}
                    for k, p in sorted(self.cfg.priority_queue_policy.items())
                }
        return cfg
