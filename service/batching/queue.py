"""The requests waiting for a model's batches: one FIFO per priority level, level 1 first.

A model without priority levels has one level. Batches are taken from the highest level
first and FIFO within a level, whole requests only (:meth:`LevelQueue.take`), as Triton's
priority queue hands them to its dynamic batcher. Each level may have its own bound on the
requests waiting in it (``[priority_queue_policy.N] max_queue_size``); the batcher checks it
with the bound on all levels together (``max_queue_size``).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from service.errors import DeadlineExceeded, Overloaded, ServiceError

if TYPE_CHECKING:
    from service.observability.metrics import Metrics

P = TypeVar("P")
R = TypeVar("R")
R_contra = TypeVar("R_contra", contravariant=True)


@dataclass(frozen=True)
class BatchInfo:
    """What the batch that computed a request looked like (for response parameters)."""

    batch_size: int
    """Items in the executed batch."""
    batch_requests: int
    """Requests merged into it."""


class Answer(Protocol[R_contra]):
    """Where a queued request's result goes: an ``asyncio.Future``, or any object with the
    three methods the batcher calls (``service.ticket``)."""

    def done(self) -> bool: ...
    def set_result(self, result: tuple[R_contra, BatchInfo], /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass(eq=False)
class Pending(Generic[P, R]):
    """One request waiting for (or in) its batch."""

    payload: P
    size: int
    future: Answer[R]
    enqueued: float
    """The event loop's time when it was queued."""
    deadline: float | None
    timer: asyncio.TimerHandle | None = field(default=None)
    request_id: str = "-"
    queue_policy: bool = False
    """The deadline is the queue timeout's, not the request's own."""
    level: int = 0
    """Its priority level's index (0: level 1, the highest)."""
    trace: Any = None
    """Its :class:`service.observability.tracing.RequestTrace` when the request is traced, else
    None."""
    # The loop's clock can be as coarse as a millisecond (uvloop's is): queue waits are
    # measured with this one.
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)

    def fail(self, error: BaseException) -> None:
        """Answer ``error``, unless it was answered already."""
        if not self.future.done():
            self.future.set_exception(error)


class LevelQueue(Generic[P, R]):
    """The waiting requests of one model, by priority level.

    Args:
        limits: one entry per level, level 1 first: the most requests that level may hold
            (0: no bound of its own).
    """

    def __init__(self, limits: Sequence[int] = (0,)) -> None:
        if not limits:
            raise ValueError("a queue has at least one level")
        self.limits = list(limits)
        self._levels: list[deque[Pending[P, R]]] = [deque() for _ in limits]
        self._level_items = [0] * len(limits)
        self._count = 0
        self.items = 0
        """Items waiting, over every level."""

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Pending[P, R]]:
        for level in self._levels:
            yield from level

    @property
    def levels(self) -> int:
        """How many levels there are."""
        return len(self._levels)

    def count(self, level: int) -> int:
        """Requests waiting at level index ``level`` (0: level 1)."""
        return len(self._levels[level])

    def items_up_to(self, level: int) -> int:
        """Items waiting at level index ``level`` and the levels above it (what a request of
        that level waits behind)."""
        return sum(self._level_items[: level + 1])

    def full(self, level: int) -> bool:
        """Whether level index ``level`` holds as many requests as its own bound allows."""
        limit = self.limits[level]
        return bool(limit) and len(self._levels[level]) >= limit

    def append(self, pending: Pending[P, R]) -> None:
        """Queue ``pending`` at the end of its level."""
        self._levels[pending.level].append(pending)
        self._added(pending, 1)

    def remove(self, pending: Pending[P, R]) -> bool:
        """Take ``pending`` out; False when it is not waiting (taken into a batch, or gone)."""
        try:
            self._levels[pending.level].remove(pending)
        except ValueError:
            return False
        self._added(pending, -1)
        return True

    def oldest_enqueued(self) -> float:
        """The loop time at which the longest-waiting request was queued (the queue is not
        empty)."""
        return min(level[0].enqueued for level in self._levels if level)

    def take(
        self, capacity: int, now: float, expired: Callable[[Pending[P, R]], None]
    ) -> list[Pending[P, R]]:
        """The next batch: whole requests, the highest level first, FIFO within a level, up
        to ``capacity`` items; a request that does not fit opens the next batch (no request
        of a lower level passes it). Requests whose deadline is past ``now`` are handed to
        ``expired`` instead."""
        batch: list[Pending[P, R]] = []
        items = 0
        for level in self._levels:
            while level:
                p = level[0]
                if p.deadline is not None and now >= p.deadline:
                    level.popleft()
                    self._added(p, -1)
                    expired(p)
                    continue
                if batch and items + p.size > capacity:
                    return batch
                level.popleft()
                self._added(p, -1)
                batch.append(p)
                items += p.size
        return batch

    def drain(self) -> list[Pending[P, R]]:
        """Every waiting request, taken out, highest level first."""
        out = list(self)
        for level in self._levels:
            level.clear()
        self._level_items = [0] * len(self._levels)
        self._count = self.items = 0
        return out

    def _added(self, pending: Pending[P, R], sign: int) -> None:
        self._count += sign
        self.items += sign * pending.size
        self._level_items[pending.level] += sign * pending.size


class QueueGauges:
    """A queue's depth gauges (``bitserve_queue_depth``, and each priority level's when it
    has several), written once per turn of the event loop (``Metrics.defer``) as deltas:
    other versions of the model share the series' labels.

    Args:
        metrics: the server's metrics.
        name: the model (the series' label).
        queue: the queue whose depths they show.
    """

    def __init__(self, metrics: Metrics, name: str, queue: LevelQueue[Any, Any]) -> None:
        self.metrics = metrics
        self.queue = queue
        self.depth = metrics.queue_depth.labels(name)
        self.levels = metrics.level_depths(name, queue.levels) if queue.levels > 1 else []
        self._shown = 0
        self._shown_levels = [0] * queue.levels

    def changed(self) -> None:
        """The queue changed: its gauges are written at the end of the loop's turn."""
        self.metrics.defer(self.report)

    def report(self) -> None:
        """Write the gauges now."""
        depth = len(self.queue)
        if depth != self._shown:
            self.depth.inc(depth - self._shown)
            self._shown = depth
        for i, gauge in enumerate(self.levels):
            n = self.queue.count(i)
            if n != self._shown_levels[i]:
                gauge.inc(n - self._shown_levels[i])
                self._shown_levels[i] = n


def timed(
    fn: Callable[[list[P]], Sequence[R]], payloads: list[P]
) -> tuple[Sequence[R], float, float]:
    """``fn(payloads)``, its wall time and the CPU time of the thread that ran it."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn(payloads)
    return out, time.perf_counter() - t0, time.thread_time() - c0


def expired_error(
    name: str, by_policy: bool, waited: float, queue_timeout_s: float
) -> ServiceError:
    """The answer of a request of model ``name`` that waited ``waited`` seconds in the queue
    and was dropped, never computed: by the queue timeout (``by_policy``), or by its own."""
    if by_policy:
        return Overloaded(
            f"model '{name}' is overloaded: the request waited {waited * 1e3:.0f} ms in the "
            f"queue (queue_timeout_us {queue_timeout_s * 1e6:.0f}); it was not computed; "
            "retry later",
            retry_after=1.0,
        )
    return DeadlineExceeded(
        f"model '{name}': the request's timeout expired after {waited * 1e3:.1f} ms in the "
        "queue; it was not computed"
    )


def request_error(name: str, exc: BaseException, request_id: str) -> ServiceError:
    """A fresh error for one request of a failed batch.

    A ServiceError raised on purpose is copied (its message is meant for the client); any
    other exception becomes a 500 naming only its class: exception text can carry TorchScript
    tracebacks and code locations, which stay in the log, found by the request id.
    """
    if isinstance(exc, ServiceError):
        return copy.copy(exc).with_traceback(None)
    return ServiceError(
        f"model '{name}': inference failed ({type(exc).__name__}); request id {request_id}, "
        "details in the server log"
    )
