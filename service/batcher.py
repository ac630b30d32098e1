"""Dynamic batching: concurrent requests of one model merged along the batch dimension.

The asyncio side keeps a FIFO queue of waiting requests, each with a future. One scheduler task
per model closes a batch when it holds ``max_batch_size`` items or when its first request has
waited ``max_queue_delay_us``, and hands it to the device's single worker thread, so the event
loop never waits on device work. Requests are never split: one whose items do not fit in what
is left of a batch opens the next one.

- A full queue answers :class:`~service.errors.Overloaded` at once (503 + Retry-After).
- A request whose timeout expires before its batch starts is answered
  :class:`~service.errors.DeadlineExceeded` and never computed.
- With a queue timeout (``queue_timeout_us``, Triton's ``default_timeout_microseconds`` with
  ``timeout_action: REJECT``), a request still waiting after it is answered ``Overloaded``,
  never computed, and a new one is refused at once when the batches ahead of it would take
  longer to clear at the pace of recent batches (shed from the headers, before the body).
- A cancelled request (the client went away) leaves the queue at once.
- An exception in one batch fails that batch's requests only (500 naming the exception class
  and the request id, never its text: that goes to the log); the scheduler keeps serving.
- Should the scheduler itself die, every waiting request is failed and the batcher refuses new
  ones (503): no request is ever left waiting on a scheduler that is gone.
- :meth:`Batcher.stop` refuses new requests and finishes the queued ones.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from service.errors import DeadlineExceeded, ModelNotReady, Overloaded, ServiceError
from service.metrics import Metrics
from service.observability import request_id_var
from service.statistics import ModelStats

log = logging.getLogger(__name__)

_MAX_TIMEOUT_US = 86_400 * 10**6  # a day
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
    three methods the batcher calls."""

    def done(self) -> bool: ...
    def set_result(self, result: tuple[R_contra, BatchInfo], /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass(eq=False)
class _Pending(Generic[P, R]):
    payload: P
    size: int
    future: Answer[R]
    enqueued: float
    deadline: float | None
    timer: asyncio.TimerHandle | None = field(default=None)
    request_id: str = "-"
    queue_policy: bool = False
    """The deadline is the queue timeout's, not the request's own."""
    # The loop's clock can be as coarse as a millisecond (uvloop's is): queue waits are
    # measured with this one.
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


class Batcher(Generic[P, R]):
    """A model's queue and its scheduler.

    Args:
        name: the model name (metric label, messages).
        run_batch: computes a batch; called in ``executor`` with the payloads in queue order
            and must return one result per payload. It may raise: that batch fails.
        max_batch_size: most items per batch; 0 means no batching (every request runs
            alone, and counts as one item).
        max_queue_delay_us: how long a batch's first request waits for others.
        max_queue_size: most requests waiting (not counting the batch being computed);
            0 = unbounded.
        executor: where ``run_batch`` runs (the device's single worker thread); default: a
            private single-thread executor shut down by :meth:`stop`.
        metrics: optional metrics sink.
        queue_timeout_us: answer a request that has waited this long :class:`Overloaded`,
            and refuse new ones that would by the recent pace; 0 (the default): no bound.
        stats: where the queue waits of each batch's requests go (the statistics extension).
        inline_below_s: run a batch on the event loop itself, not in ``executor``, while
            recent batches took less than this much CPU time in the thread that ran them (a
            moving average): below a few hundred microseconds the thread hop and the hand-offs
            of the GIL between the loop and the worker cost more than the batch. 0 (the
            default): always in ``executor``. For CPU devices only (a CUDA batch waits for
            the device, which must not happen on the loop).
    """

    def __init__(
        self,
        name: str,
        run_batch: Callable[[list[P]], Sequence[R]],
        *,
        max_batch_size: int,
        max_queue_delay_us: int,
        max_queue_size: int,
        executor: Executor | None = None,
        metrics: Metrics | None = None,
        queue_timeout_us: int = 0,
        stats: ModelStats | None = None,
        inline_below_s: float = 0.0,
    ) -> None:
        if min(max_batch_size, max_queue_delay_us, max_queue_size, queue_timeout_us) < 0:
            raise ValueError("batch size, queue delay, queue size and timeout must be >= 0")
        self.name = name
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self._capacity = max(max_batch_size, 1)
        self._delay = max_queue_delay_us / 1e6 if max_batch_size > 0 else 0.0
        self.max_queue_size = max_queue_size
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix=f"batch-{name}")
        self._metrics = metrics
        self.stats = stats
        self._queue: deque[_Pending[P, R]] = deque()
        self._queued_items = 0
        # The scheduler sleeps on this future (and a timer for the batch's delay) when there
        # is nothing to take; submit() and the queue's other changes resolve it.
        self._waiter: asyncio.Future[None] | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._running: list[_Pending[P, R]] = []
        self._reported_depth = 0
        self._depth_gauge: Any = None
        self._inline_below_s = inline_below_s
        self._batch_cpu_s = math.inf  # moving average; unknown until a batch has run
        self.queue_timeout_s = queue_timeout_us / 1e6
        self._batch_wall_s = 0.0  # moving average of a batch's wall time; 0: none yet

    # --- public ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._schedule(), name=f"batcher-{self.name}"
            )
            self._task.add_done_callback(self._scheduler_done)
            if self._metrics is not None:
                # The series exists from the start; its child is looked up once, not per
                # request (the repository forgets it only after this batcher has stopped).
                self._depth_gauge = self._metrics.queue_depth.labels(self.name)

    @property
    def depth(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    def expected_wait_s(self) -> float:
        """How long a request queued now would wait for its batch to start, at the pace of
        recent batches: the running batch, then every full batch queued ahead of it (0 before
        any batch has run)."""
        ahead = self._queued_items // self._capacity + (1 if self._running else 0)
        return ahead * self._batch_wall_s

    def check_capacity(self) -> None:
        """Refuse a new request now if the queue has no room for it (transports call this
        before they read a body, so overload is shed at the cost of the headers).

        Raises:
            Overloaded: the queue holds ``max_queue_size`` requests, or with a queue
                timeout, the queue ahead would take longer than it to clear.
        """
        if self.max_queue_size and len(self._queue) >= self.max_queue_size:
            raise Overloaded(
                f"model '{self.name}' is overloaded: {len(self._queue)} requests queued "
                f"(max_queue_size {self.max_queue_size}); retry later",
                retry_after=1.0,
            )
        if self.queue_timeout_s and self._queue:
            wait = self.expected_wait_s()
            if wait > self.queue_timeout_s:
                raise Overloaded(
                    f"model '{self.name}' is overloaded: {len(self._queue)} requests queued "
                    f"would take about {wait * 1e3:.0f} ms to start, more than its "
                    f"queue_timeout_us {self.queue_timeout_s * 1e6:.0f}; retry later",
                    retry_after=1.0,
                )

    @property
    def idle(self) -> bool:
        """No request is queued or being computed."""
        return not self._queue and not self._running

    async def submit(
        self, payload: P, size: int = 1, *, timeout_us: int | None = None
    ) -> tuple[R, BatchInfo]:
        """Queue one request and wait for its result.

        Args:
            payload: what ``run_batch`` receives for this request.
            size: its number of items (1 when ``max_batch_size`` is 0).
            timeout_us: answer :class:`DeadlineExceeded` if its batch has not started within
                this many microseconds; None or 0: no timeout.

        Returns:
            ``(result, info)`` for this request.

        Raises:
            Overloaded: the queue is full.
            ModelNotReady: the batcher is stopping.
            DeadlineExceeded: the timeout expired first.
            ServiceError: the batch's computation failed.
        """
        future: asyncio.Future[tuple[R, BatchInfo]] = asyncio.get_running_loop().create_future()
        pending = self.enqueue(payload, size, future, timeout_us=timeout_us)
        try:
            return await future
        except asyncio.CancelledError:
            self._remove(pending)  # the client went away: it must not stay queued
            raise

    def enqueue(
        self,
        payload: P,
        size: int,
        answer: Answer[R],
        *,
        timeout_us: int | None = None,
        request_id: str | None = None,
    ) -> _Pending[P, R]:
        """Queue one request without waiting: ``answer`` gets its result or its error (an
        ``asyncio.Future``, or an object with the same three methods that calls back:
        ``service.rest.express``). :meth:`submit` without the await; ``request_id`` names the
        request in the log (default: the current one's).

        Returns:
            the queued request, for :meth:`cancel`.

        Raises:
            see :meth:`submit` (the errors raised before the request is queued).
        """
        if self._closing or self._task is None or self._task.done():
            raise ModelNotReady(f"model '{self.name}' is not accepting requests (unloading)")
        if not 1 <= size <= self._capacity:
            raise ValueError(f"size {size} outside 1..{self._capacity}")  # validated before
        self.check_capacity()
        loop = asyncio.get_running_loop()
        now = loop.time()
        # 0 means no timeout, as in Triton (its default request timeout is 0); a timeout past
        # a day is as good as none (and 1e309 µs would overflow the float maths).
        own = timeout_us / 1e6 if timeout_us and 0 < timeout_us < _MAX_TIMEOUT_US else None
        policy = self.queue_timeout_s
        by_policy = policy > 0 and (own is None or policy < own)
        wait = policy if by_policy else own
        pending: _Pending[P, R] = _Pending(
            payload,
            size,
            answer,
            now,
            None if wait is None else now + wait,
            request_id=request_id_var.get() if request_id is None else request_id,
            queue_policy=by_policy,
        )
        if pending.deadline is not None:
            pending.timer = loop.call_at(pending.deadline, self._expire, pending)
        self._queue.append(pending)
        self._queued_items += size
        self._depth_changed()
        self._wake()
        return pending

    def cancel(self, pending: _Pending[P, R]) -> None:
        """Take a request that :meth:`enqueue` queued out of the queue (its client went
        away); one already in a batch is computed, its answer dropped by the caller."""
        self._remove(pending)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish the queued and running ones, then stop.

        Requests still waiting after ``timeout_s`` are answered :class:`ModelNotReady`.
        """
        self._closing = True
        self._wake()
        task = self._task
        if task is not None and not task.done():
            # asyncio.wait never raises the task's own error (a dead scheduler was logged by
            # its done-callback; stop() still has to clean up).
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                log.warning("model %s: drain timed out after %.1f s", self.name, timeout_s)
                task.cancel()
                await asyncio.wait({task})
        while self._queue:
            p = self._queue.popleft()
            self._cancel_timer(p)
            _fail(p, ModelNotReady(f"model '{self.name}' was unloaded before this request ran"))
        self._queued_items = 0
        if self._depth_gauge is not None:
            self._report_depth()  # now: the repository may forget the series next
        if self._own_executor:
            self._executor.shutdown(wait=False)

    # --- queue bookkeeping ----------------------------------------------------------------

    def _remove(self, pending: _Pending[P, R]) -> bool:
        self._cancel_timer(pending)
        try:
            self._queue.remove(pending)
        except ValueError:
            return False  # already taken into a batch (or removed)
        self._queued_items -= pending.size
        self._depth_changed()
        self._wake()  # the head may have changed
        return True

    def _expire(self, pending: _Pending[P, R]) -> None:
        pending.timer = None
        if self._remove(pending):
            _fail(pending, self._expired(pending))

    def _expired(self, pending: _Pending[P, R]) -> ServiceError:
        waited = asyncio.get_running_loop().time() - pending.enqueued
        if pending.queue_policy:
            return Overloaded(
                f"model '{self.name}' is overloaded: the request waited {waited * 1e3:.0f} ms "
                f"in the queue (queue_timeout_us {self.queue_timeout_s * 1e6:.0f}); it was not "
                "computed; retry later",
                retry_after=1.0,
            )
        return DeadlineExceeded(
            f"model '{self.name}': the request's timeout expired after {waited * 1e3:.1f} ms "
            "in the queue; it was not computed"
        )

    @staticmethod
    def _cancel_timer(pending: _Pending[P, R]) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None

    def _depth_changed(self) -> None:
        if self._depth_gauge is not None and self._metrics is not None:
            self._metrics.defer(self._report_depth)  # written once per turn of the loop

    def _report_depth(self) -> None:
        assert self._depth_gauge is not None
        # Deltas, not the value: other versions of the model share the metric's label.
        depth = len(self._queue)
        if depth != self._reported_depth:
            self._depth_gauge.inc(depth - self._reported_depth)
            self._reported_depth = depth

    # --- scheduler ------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            try:
                await self._execute(batch)
            finally:
                # Whatever escaped (a bug, a cancellation), none of this batch may hang.
                for p in batch:
                    if not p.future.done():
                        _fail(p, ModelNotReady(f"model '{self.name}' stopped during this request"))
                self._running = []

    def _scheduler_done(self, task: asyncio.Task[None]) -> None:
        # Normally the scheduler ends only in stop(); anything else is a bug, and requests
        # queued behind a dead scheduler would wait forever: fail them, refuse new ones.
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("model %s: the batch scheduler died", self.name, exc_info=exc)
        self._closing = True
        while self._queue:
            p = self._queue.popleft()
            self._cancel_timer(p)
            _fail(p, ModelNotReady(f"model '{self.name}' stopped serving before this request ran"))
        self._queued_items = 0
        self._depth_changed()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep(self, until: float | None) -> None:
        """Wait for :meth:`_wake`, or until the loop time ``until`` (None: no limit)."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if until is None else loop.call_at(until, self._wake)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _inline_next(self) -> bool:
        """Whether the next batch runs on the event loop (see ``inline_below_s``)."""
        return self._batch_cpu_s < self._inline_below_s

    async def _next_batch(self) -> list[_Pending[P, R]] | None:
        loop = asyncio.get_running_loop()
        gathered = False
        while True:
            if not self._queue:
                if self._closing:
                    return None
                await self._sleep(None)
                continue
            # A batch closes when it is full, when its first request has waited the delay,
            # or at once when there is no delay: requests that queued while the previous
            # batch ran are all taken now, so batches grow with the load.
            if self._queued_items < self._capacity and self._delay and not self._closing:
                close_at = self._queue[0].enqueued + self._delay
                if loop.time() < close_at:
                    await self._sleep(close_at)
                    continue  # re-check: more items, a new head, or the delay has passed
            elif self._queued_items < self._capacity and self._inline_next() and not gathered:
                # A batch run on the loop holds it: first the requests whose bytes have
                # already arrived join it (one turn reads the sockets and starts their tasks,
                # the next lets those tasks queue), which costs two turns, never a wait.
                gathered = True
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                continue
            gathered = False
            batch = self._take_batch(loop.time())
            if batch:
                return batch

    def _take_batch(self, now: float) -> list[_Pending[P, R]]:
        batch: list[_Pending[P, R]] = []
        items = 0
        while self._queue:
            p = self._queue[0]
            if p.deadline is not None and now >= p.deadline:
                self._queue.popleft()
                self._queued_items -= p.size
                self._cancel_timer(p)
                _fail(p, self._expired(p))
                continue
            if batch and items + p.size > self._capacity:
                break  # whole requests only: this one opens the next batch
            self._queue.popleft()
            self._queued_items -= p.size
            self._cancel_timer(p)
            batch.append(p)
            items += p.size
        self._depth_changed()
        return batch

    async def _execute(self, batch: list[_Pending[P, R]]) -> None:
        loop = asyncio.get_running_loop()
        start_ns = time.perf_counter_ns()
        waits_ns = [start_ns - p.enqueued_ns for p in batch]
        if self._metrics is not None:
            self._metrics.observe_queue(self.name, [w / 1e9 for w in waits_ns])
        if self.stats is not None:
            self.stats.queued(len(batch), sum(waits_ns))
        info = BatchInfo(sum(p.size for p in batch), len(batch))
        self._running = batch
        payloads = [p.payload for p in batch]
        try:
            if self._inline_next():
                results, seconds, cpu = _timed(self._run_batch, payloads)
            else:
                results, seconds, cpu = await loop.run_in_executor(
                    self._executor, _timed, self._run_batch, payloads
                )
            avg = self._batch_cpu_s
            self._batch_cpu_s = cpu if avg == math.inf else 0.75 * avg + 0.25 * cpu
            wall, last = (time.perf_counter_ns() - start_ns) / 1e9, self._batch_wall_s
            self._batch_wall_s = 0.75 * last + 0.25 * wall if last else wall
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)}")
        except asyncio.CancelledError:
            for p in batch:  # stop() gave up waiting: nobody may be left hanging
                _fail(p, ModelNotReady(f"model '{self.name}' was unloaded during this request"))
            raise
        except BaseException as exc:
            if not isinstance(exc, ServiceError):
                ids = ", ".join(p.request_id for p in batch)
                log.error("model %s: batch failed (request ids %s)", self.name, ids, exc_info=exc)
            for p in batch:  # one error object each: a shared one would pile up tracebacks
                _fail(p, _request_error(self.name, exc, p.request_id))
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the requests are answered, now stop
            return
        finally:
            self._running = []
        if self._metrics is not None:
            try:
                self._metrics.observe_batch(
                    self.name, info.batch_size, info.batch_requests, seconds
                )
            except Exception:  # metrics must never cost a request its answer
                log.exception("model %s: recording batch metrics failed", self.name)
        for p, result in zip(batch, results, strict=True):
            if not p.future.done():  # a cancelled request's result is dropped
                p.future.set_result((result, info))


def _timed(
    fn: Callable[[list[P]], Sequence[R]], payloads: list[P]
) -> tuple[Sequence[R], float, float]:
    """``fn(payloads)``, its wall time and the CPU time of the thread that ran it."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn(payloads)
    return out, time.perf_counter() - t0, time.thread_time() - c0


def _fail(pending: _Pending[P, R], error: BaseException) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)


def _request_error(name: str, exc: BaseException, request_id: str) -> ServiceError:
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
