"""Dynamic batching: concurrent requests of one model merged along the batch dimension.

The asyncio side keeps the waiting requests, each with its answer (a future, or a call back:
:meth:`Batcher.enqueue`), in one FIFO per priority level
(:class:`service.batching.queue.LevelQueue`; one level without priorities). One scheduler task per
model closes a batch when it holds ``max_batch_size`` items or when its oldest request has waited
``max_queue_delay_us``, and hands it to the device's single worker thread, so the event loop never
waits on device work. Batches take the highest level first, FIFO within a level. Requests are never
split: one whose items do not fit in what is left of a batch opens the next one.

- A full queue (all levels together, or the request's own level) answers
  :class:`~service.errors.Overloaded` at once (503 + Retry-After).
- A request whose timeout expires before its batch starts is answered
  :class:`~service.errors.DeadlineExceeded` and never computed.
- With a queue timeout (``queue_timeout_us``, Triton's ``default_timeout_microseconds`` with
  ``timeout_action: REJECT``), a request still waiting after it is answered ``Overloaded``,
  never computed, and a new one is refused at once when the batches ahead of it would take
  longer to clear at the pace of recent batches (shed from the headers, before the body).
- A cancelled request (the client went away) leaves the queue at once and is never computed
  (counted in ``bitserve_requests_cancelled_total``); one whose batch is running is computed
  with it, and its result is dropped.
- An exception in one batch fails that batch's requests only (500 naming the exception class
  and the request id, never its text: that goes to the log); the scheduler keeps serving, as
  it does when answering one request fails (logged: the answer's own callback raised).
- Should the scheduler itself die, every waiting request is failed and the batcher refuses new
  ones (503): no request is ever left waiting on a scheduler that is gone.
- :meth:`Batcher.stop` refuses new requests and finishes the queued ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from service.batching.queue import (
    Answer,
    BatchInfo,
    LevelQueue,
    Pending,
    QueueGauges,
    expired_error,
    request_error,
    timed,
)
from service.errors import ModelNotReady, Overloaded, ServiceError
from service.observability.metrics import Metrics
from service.observability.request_ids import request_id_var
from service.observability.statistics import ModelStats

log = logging.getLogger(__name__)

_MAX_TIMEOUT_US = 86_400 * 10**6  # a day
P = TypeVar("P")
R = TypeVar("R")

__all__ = ["BatchInfo", "Batcher"]


class Batcher(Generic[P, R]):
    """A model's queue and its scheduler.

    Args:
        name: the model name (metric label, messages).
        run_batch: computes a batch; called in ``executor`` with the payloads in queue order
            and must return one result per payload. It may raise: that batch fails.
        max_batch_size: most items per batch; 0: no batching (a request runs alone, 1 item).
        max_queue_delay_us: how long a batch's first request waits for others.
        max_queue_size: most requests waiting, all levels together (not the running
            batch); 0: unbounded.
        executor: where ``run_batch`` runs (the device's single worker thread); default: a
            private single-thread executor shut down by :meth:`stop`.
        metrics: optional metrics sink.
        queue_timeout_us: answer a request that has waited this long :class:`Overloaded`,
            and refuse new ones that would by the recent pace; 0 (the default): no bound.
        stats: where the queue waits of each batch's requests go (the statistics extension).
        inline_below_s: run a batch on the event loop, not in ``executor``, while recent
            batches took less CPU time than this in their thread (a moving average): below a
            few hundred microseconds the thread hop and GIL hand-offs cost more than the batch.
            0 (default): always in ``executor``. CPU devices only (a CUDA batch waits for the
            device, which must not happen on the loop).
        level_limits: one entry per priority level, level 1 first: the most requests that
            level may hold (0: no bound of its own); default: one level, no bound of its own.
        version: the model version (the label of its cancelled requests' count).
        tracer: records the spans of batches that compute a traced request
            (:class:`service.observability.tracing.BatchTracer`); None: tracing is off.
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
        level_limits: Sequence[int] = (0,),
        version: str = "",
        tracer: Any = None,
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
        self._queue: LevelQueue[P, R] = LevelQueue(level_limits)
        self.version = version
        self._tracer = tracer
        # The scheduler sleeps on this future (and a timer for the batch's delay) when there
        # is nothing to take; submit() and the queue's other changes resolve it.
        self._waiter: asyncio.Future[None] | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._running: list[Pending[P, R]] = []
        self._gauges: QueueGauges | None = None
        self._cancelled: Any = None
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
                # The series exist from the start; their children are looked up once, not per
                # request (the repository forgets them only after this batcher has stopped).
                self._gauges = QueueGauges(self._metrics, self.name, self._queue)
                self._cancelled = self._metrics.cancelled(self.name, self.version)

    @property
    def depth(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    def expected_wait_s(self, level: int | None = None) -> float:
        """How long a request queued now would wait for its batch to start, at the pace of
        recent batches: the running batch, then every full batch queued ahead of it (of its
        priority ``level`` and above; None: all of them) (0 before any batch has run)."""
        items = self._queue.items if level is None else self._queue.items_up_to(level - 1)
        ahead = items // self._capacity + (1 if self._running else 0)
        return ahead * self._batch_wall_s

    def check_capacity(self, level: int | None = None) -> None:
        """Refuse a new request now if the queue has no room for it (transports call this
        before they read a body, so overload is shed at the cost of the headers; the
        request's priority ``level`` is known only after, and checked again then).

        Raises:
            Overloaded: the queue holds ``max_queue_size`` requests, or its level holds as
                many as that level's own bound, or with a queue timeout, the queue ahead
                would take longer than it to clear.
        """
        queue = self._queue
        if self.max_queue_size and len(queue) >= self.max_queue_size:
            raise Overloaded(
                f"model '{self.name}' is overloaded: {len(queue)} requests queued "
                f"(max_queue_size {self.max_queue_size}); retry later",
                retry_after=1.0,
            )
        if level is not None and queue.full(level - 1):
            raise Overloaded(
                f"model '{self.name}' is overloaded: {queue.count(level - 1)} requests of "
                f"priority level {level} queued (its max_queue_size "
                f"{queue.limits[level - 1]}); retry later",
                retry_after=1.0,
            )
        # Before the level is known, the whole queue is ahead only without levels.
        if self.queue_timeout_s and queue and (level is not None or queue.levels == 1):
            wait = self.expected_wait_s(level)
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
        self,
        payload: P,
        size: int = 1,
        *,
        timeout_us: int | None = None,
        level: int = 1,
        trace: Any = None,
    ) -> tuple[R, BatchInfo]:
        """Queue one request and wait for its result: ``(result, info)``.

        Args:
            payload: what ``run_batch`` receives for this request.
            size: its number of items (1 when ``max_batch_size`` is 0).
            timeout_us: answer :class:`DeadlineExceeded` if its batch has not started within
                this many microseconds; None or 0: no timeout.
            level: its priority level, 1 (the highest) to the number of levels.
            trace: its :class:`service.observability.tracing.RequestTrace` when it is traced.

        Raises:
            Overloaded: the queue is full.
            ModelNotReady: the batcher is stopping.
            DeadlineExceeded: the timeout expired first.
            ServiceError: the batch's computation failed.
        """
        future: asyncio.Future[tuple[R, BatchInfo]] = asyncio.get_running_loop().create_future()
        pending = self.enqueue(payload, size, future, timeout_us=timeout_us, level=level,
                               trace=trace)  # fmt: skip
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel(pending)  # the client went away
            raise

    def enqueue(
        self,
        payload: P,
        size: int,
        answer: Answer[R],
        *,
        timeout_us: int | None = None,
        level: int = 1,
        trace: Any = None,
        request_id: str | None = None,
    ) -> Pending[P, R]:
        """:meth:`submit` without the wait: ``answer`` gets the result or the error (an
        ``asyncio.Future``, or an object with its three methods that calls back:
        ``service.ticket``); ``request_id`` names the request in the log (default: the
        request being handled). Returns the queued request, for :meth:`cancel`.

        Raises:
            see :meth:`submit` (what is refused before the request is queued).
        """
        if self._closing or self._task is None or self._task.done():
            raise ModelNotReady(f"model '{self.name}' is not accepting requests (unloading)")
        if not 1 <= size <= self._capacity:
            raise ValueError(f"size {size} outside 1..{self._capacity}")  # validated before
        if not 1 <= level <= self._queue.levels:
            raise ValueError(f"level {level} outside 1..{self._queue.levels}")  # mapped before
        self.check_capacity(level)
        loop = asyncio.get_running_loop()
        now = loop.time()
        # 0 means no timeout, as in Triton (its default request timeout is 0); a timeout past
        # a day is as good as none (and 1e309 µs would overflow the float maths).
        own = timeout_us / 1e6 if timeout_us and 0 < timeout_us < _MAX_TIMEOUT_US else None
        policy = self.queue_timeout_s
        by_policy = policy > 0 and (own is None or policy < own)
        wait = policy if by_policy else own
        pending: Pending[P, R] = Pending(
            payload,
            size,
            answer,
            now,
            None if wait is None else now + wait,
            request_id=request_id_var.get() if request_id is None else request_id,
            queue_policy=by_policy,
            level=level - 1,
            trace=trace,
        )
        if pending.deadline is not None:
            pending.timer = loop.call_at(pending.deadline, self._expire, pending)
        self._queue.append(pending)
        self._depth_changed()
        self._wake()
        return pending

    def cancel(self, pending: Pending[P, R]) -> None:
        """The client of a queued request went away: still queued, it is dropped, never
        computed (and counted); already in a batch, it is computed and its answer dropped."""
        if self._remove(pending) and self._cancelled is not None:
            self._cancelled.inc()

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
        for p in self._queue.drain():
            self._cancel_timer(p)
            p.fail(ModelNotReady(f"model '{self.name}' was unloaded before this request ran"))
        if self._gauges is not None:
            self._gauges.report()  # now: the repository may forget the series next
        if self._own_executor:
            self._executor.shutdown(wait=False)

    # --- queue bookkeeping ----------------------------------------------------------------

    def _remove(self, pending: Pending[P, R]) -> bool:
        self._cancel_timer(pending)
        if not self._queue.remove(pending):
            return False  # already taken into a batch (or removed)
        self._depth_changed()
        self._wake()  # the head may have changed
        return True

    def _expire(self, pending: Pending[P, R]) -> None:
        pending.timer = None
        if self._remove(pending):
            pending.fail(self._expired(pending))

    def _expired(self, pending: Pending[P, R]) -> ServiceError:
        waited = asyncio.get_running_loop().time() - pending.enqueued
        return expired_error(self.name, pending.queue_policy, waited, self.queue_timeout_s)

    @staticmethod
    def _cancel_timer(pending: Pending[P, R]) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None

    def _depth_changed(self) -> None:
        if self._gauges is not None:
            self._gauges.changed()

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
                        p.fail(ModelNotReady(f"model '{self.name}' stopped during this request"))
                self._running = []

    def _scheduler_done(self, task: asyncio.Task[None]) -> None:
        # Normally the scheduler ends only in stop(); anything else is a bug, and requests
        # queued behind a dead scheduler would wait forever: fail them, refuse new ones.
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("model %s: the batch scheduler died", self.name, exc_info=exc)
        self._closing = True
        for p in self._queue.drain():
            self._cancel_timer(p)
            p.fail(ModelNotReady(f"model '{self.name}' stopped serving before this request ran"))
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

    async def _next_batch(self) -> list[Pending[P, R]] | None:
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
            if self._queue.items < self._capacity and self._delay and not self._closing:
                close_at = self._queue.oldest_enqueued() + self._delay
                if loop.time() < close_at:
                    await self._sleep(close_at)
                    continue  # re-check: more items, a new head, or the delay has passed
            elif self._queue.items < self._capacity and self._inline_next() and not gathered:
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

    def _take_batch(self, now: float) -> list[Pending[P, R]]:
        def expired(p: Pending[P, R]) -> None:
            self._cancel_timer(p)
            p.fail(self._expired(p))

        batch = self._queue.take(self._capacity, now, expired)
        for p in batch:
            self._cancel_timer(p)
        self._depth_changed()
        return batch

    async def _execute(self, batch: list[Pending[P, R]]) -> None:
        loop = asyncio.get_running_loop()
        start_ns = time.perf_counter_ns()
        waits_ns = [start_ns - p.enqueued_ns for p in batch]
        if self._metrics is not None:
            levels = [p.level + 1 for p in batch] if self._queue.levels > 1 else None
            self._metrics.observe_queue(self.name, [w / 1e9 for w in waits_ns], levels)
        if self.stats is not None:
            self.stats.queued(len(batch), sum(waits_ns))
        info = BatchInfo(sum(p.size for p in batch), len(batch))
        self._running = batch
        payloads = [p.payload for p in batch]
        # Spans only for a batch that computes a traced request (tracing off: no list even).
        traced = None if self._tracer is None else [p.trace for p in batch if p.trace]
        wall0 = time.time_ns() if traced else 0
        error: BaseException | None = None
        try:
            if self._inline_next():
                results, seconds, cpu = timed(self._run_batch, payloads)
            else:
                results, seconds, cpu = await loop.run_in_executor(
                    self._executor, timed, self._run_batch, payloads
                )
            avg = self._batch_cpu_s
            self._batch_cpu_s = cpu if avg == math.inf else 0.75 * avg + 0.25 * cpu
            wall, last = (time.perf_counter_ns() - start_ns) / 1e9, self._batch_wall_s
            self._batch_wall_s = 0.75 * last + 0.25 * wall if last else wall
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)}")
        except asyncio.CancelledError:
            for p in batch:  # stop() gave up waiting: nobody may be left hanging
                p.fail(ModelNotReady(f"model '{self.name}' was unloaded during this request"))
            raise
        except BaseException as exc:
            error = exc
            if not isinstance(exc, ServiceError):
                ids = ", ".join(p.request_id for p in batch)
                log.error("model %s: batch failed (request ids %s)", self.name, ids, exc_info=exc)
            for p in batch:  # one error object each: a shared one would pile up tracebacks
                p.fail(request_error(self.name, exc, p.request_id))
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the requests are answered, now stop
            return
        finally:
            self._running = []
            if traced:
                self._tracer.record(traced, wall0, time.time_ns(), info, error)
        if self._metrics is not None:
            try:
                self._metrics.observe_batch(
                    self.name, info.batch_size, info.batch_requests, seconds
                )
            except Exception:  # metrics must never cost a request its answer
                log.exception("model %s: recording batch metrics failed", self.name)
        for p, result in zip(batch, results, strict=True):
            if not p.future.done():  # a cancelled request's result is dropped
                try:
                    p.future.set_result((result, info))
                except Exception:
                    log.exception("model %s: answering request %s failed", self.name, p.request_id)
