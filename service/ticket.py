"""The data plane's core: one admitted inference request, driven by its transport without a
coroutine.

Every transport (REST's infer route and its express lane, gRPC, Ray Serve through REST) runs a
request through the same steps, each decided here once::

    ticket = dataplane.admit(name, version)   # counted in flight; lookup, queue room
    request = decode(ticket.handle)           # the transport's own framing
    again = ticket.settle()                   # looked up again: a reload during the decode
    if not ticket.resident:                   # evicted (the device memory budget):
        again = await ticket.loaded(request)  #   waits for its load
    if again is not None:                     # the reload changed what the model accepts:
        request = decode(again)               #   decoded again for the version serving now
    ticket.submit(request, on_done)           # checked, cached or queued for its batch
    # on_done(response or error), from the batcher's callback (shared memory written)
    ticket.finish()                           # outcome and latency counted (or fail/cancel)

:meth:`Ticket.proceed` runs the middle steps for a caller without coroutines (the express
lane: the rare wait for a load runs in a task it is given), and
:meth:`service.dataplane.DataPlane.infer_with` runs them all for coroutine callers (REST's
general route, gRPC).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from service.batching.batcher import BatchInfo
from service.batching.queue import Answer, Pending
from service.errors import ModelNotReady, ServiceError
from service.models.handle import ModelHandle, Result
from service.models.response_cache import cache_key
from service.models.signature import Bound
from service.protocol import InferRequest, InferResponse, ResponseOutput
from service.protocol.types import SharedOutput

if TYPE_CHECKING:
    from service.observability.metrics import Metrics
    from service.observability.tracing import RequestTrace

THREAD_BYTES = 64 << 10
"""Work above this many bytes leaves the event loop for a worker thread; below it the thread
hop costs more than the work. Decoding is sized by the whole request, not its JSON part: the
binary part can cost as much (BYTES elements are split in Python, BOOL bytes are scanned)."""

Done = Callable[[InferResponse | BaseException], None]
"""What a transport is told when a submitted request is answered: its response, or the
error (a ServiceError: a timeout, an unload, a failed batch)."""


class Versions(Protocol):
    """What a ticket asks of the model repository (``service.models.repository``)."""

    def get(self, name: str, version: str | None = None) -> ModelHandle: ...
    def use(self, handle: ModelHandle) -> bool: ...
    async def resident(
        self, handle: ModelHandle, timeout_s: float | None = None
    ) -> ModelHandle: ...


class Plane(Protocol):
    """What a ticket asks of its data plane (``service.dataplane.DataPlane``)."""

    @property
    def repository(self) -> Versions: ...
    @property
    def metrics(self) -> Metrics: ...
    def finished(self, t0: int, label: str, outcome: str, handle: ModelHandle | None) -> None: ...


class Ticket:
    """One request admitted by the data plane (:meth:`DataPlane.admit`), until it is
    finished: its model version, its place in the queue, its accounting.

    Attributes:
        handle: the model version the request is decoded for and submitted to.
        resident: after :meth:`settle`, whether that version is on the device now (False:
            ``await`` :meth:`loaded` before submitting).
        request_id: the transport's id of the request (``-``: none).
    """

    __slots__ = (
        "_answered",
        "_decoded_for",
        "_finished",
        "_pending",
        "_plane",
        "_queued_ns",
        "_shared",
        "_submitted",
        "_t0",
        "_wanted",
        "handle",
        "label",
        "request",
        "request_id",
        "resident",
        "trace",
        "version",
    )

    def __init__(
        self,
        plane: Plane | None,
        handle: ModelHandle,
        version: str | None,
        t0: int,
        request_id: str,
        trace: RequestTrace | None = None,
    ) -> None:
        self._plane = plane
        self.handle = handle
        self._decoded_for = handle
        self.version = version
        self.label = handle.name
        self.resident = True
        self.request_id = request_id
        self.request: InferRequest | None = None
        """The request submitted (:meth:`submit`)."""
        self.trace = trace
        self._t0 = t0
        self._pending: Pending[Bound, Result] | None = None
        self._submitted = self._answered = self._finished = False
        self._queued_ns = 0
        self._wanted: tuple[int, ...] = ()
        self._shared: dict[str, SharedOutput] | None = None

    # --- the version --------------------------------------------------------------------

    def settle(self) -> ModelHandle | None:
        """After the decode: the version that serves now. A reload during a decode off the
        loop retires the version found first, and the request belongs to the one serving now.

        Returns:
            The version to decode the request again for (a reload changed what the model
            accepts), or None: the request as decoded is right. ``resident`` False: the
            version is evicted, and :meth:`loaded` waits for it (and then says whether to
            decode again).
        """
        assert self._plane is not None
        repository = self._plane.repository
        self.handle = repository.get(self.handle.name, self.version)
        self.resident = repository.use(self.handle)
        return self._again() if self.resident else None

    async def loaded(self, request: InferRequest) -> ModelHandle | None:
        """Wait for an evicted version's load (one load for every waiting request), within
        the request's ``parameters.timeout`` or its model's ``queue_timeout_us``; returns as
        :meth:`settle` does.

        Raises:
            ModelNotReady: evicted again as soon as it loaded (three times), or the load
                failed; DeadlineExceeded: it took longer than the request may wait.
        """
        assert self._plane is not None
        repository = self._plane.repository
        wait_s = load_wait_s(self.handle, request)
        for _ in range(3):
            self.handle = await repository.resident(self.handle, wait_s)
            if repository.use(self.handle):
                self.resident = True
                return self._again()
        raise ModelNotReady(f"model '{self.handle.name}' was evicted again as soon as it loaded")

    def _again(self) -> ModelHandle | None:
        """The version to decode the request again for, or None (see :meth:`settle`); the
        caller decodes it again when it is not None."""
        decoded, current = self._decoded_for, self.handle
        if current is decoded or current.signature.same_as(decoded.signature):
            return None
        self._decoded_for = current
        return current

    def proceed(
        self, request: InferRequest, decode: Callable[[ModelHandle], InferRequest], on_done: Done
    ) -> asyncio.Task[None] | None:
        """:meth:`settle`, then :meth:`submit`, for a caller without coroutines: an evicted
        version's load is awaited in a task (returned, for the caller to keep or cancel;
        cancelled, it calls ``on_done`` with the CancelledError), ``decode`` (the
        transport's, here and now) decodes again after a reload that changed the model's
        inputs, and any error goes to ``on_done``."""
        try:
            again = self.settle()
            if not self.resident:
                return asyncio.get_running_loop().create_task(
                    self._after_load(request, decode, on_done)
                )
            self.submit(request if again is None else decode(again), on_done)
        except ServiceError as e:
            on_done(e)
        return None

    async def _after_load(
        self, request: InferRequest, decode: Callable[[ModelHandle], InferRequest], on_done: Done
    ) -> None:
        try:
            again = await self.loaded(request)
            self.submit(request if again is None else decode(again), on_done)
        except (ServiceError, asyncio.CancelledError) as e:
            on_done(e)

    # --- the request --------------------------------------------------------------------

    def submit(self, request: InferRequest, on_done: Done) -> None:
        """Check a decoded request against its resident version and queue it for its batch
        (or answer it from the response cache). ``on_done`` is called once, later, with the
        response (outputs in shared memory written first) or the batch's error.

        Raises:
            InvalidInput: the request does not fit the model (never queued).
            Overloaded, ModelNotReady: refused by the queue (see ``Batcher.enqueue``).
        """
        handle, trace = self.handle, self.trace
        bound = handle.signature.bind(request)
        self.request = request
        if trace is not None:
            self._queued_ns = time.time_ns()
            trace.set(
                "bitserve.priority_level", handle.level_of(request.parameters.get("priority"))
            )
        self._wanted = bound.outputs
        self._shared = shared_outputs(request) if request.outputs is not None else None
        answer = _Answer(self, request, on_done)
        self._submitted = True  # from here on the batcher counts what it drops
        self._pending = enqueue(
            handle, request, bound, answer, trace=trace, request_id=self.request_id
        )

    def _answer(
        self, request: InferRequest, on_done: Done, result: tuple[Result, BatchInfo]
    ) -> None:
        self._answered = True
        self._pending = None  # no cycle ticket -> queued request -> its answer -> ticket
        if self.trace is not None:
            self._queued()
        arrays, info = result
        shared = self._shared
        if not shared:
            rid = self.request_id
            on_done(build_response(self.handle, request, self._wanted, arrays, info, rid))
            return
        outputs = self.handle.signature.outputs
        writes = [
            (shared[outputs[i].name], arrays[i]) for i in self._wanted if outputs[i].name in shared
        ]

        def respond(_: object = None) -> None:
            response = build_response(
                self.handle, request, self._wanted, arrays, info, self.request_id, shared
            )
            on_done(response)

        if sum(arr.nbytes for _, arr in writes) <= THREAD_BYTES:
            _write_shared(writes)
            respond()
            return
        written = asyncio.get_running_loop().run_in_executor(None, _write_shared, writes)

        def after(future: asyncio.Future[None]) -> None:
            error = future.exception()
            if error is not None:
                on_done(error)
            else:
                respond()

        written.add_done_callback(after)

    def _failed(self, on_done: Done, error: BaseException) -> None:
        self._answered = True
        self._pending = None
        if self.trace is not None:
            self._queued()
        on_done(error)

    def _queued(self) -> None:
        if self.trace is not None and self._queued_ns:
            self.trace.queued(self._queued_ns)
            self._queued_ns = 0

    def cancel(self) -> None:
        """The client went away: a request still queued is dropped, never computed (the
        batcher counts it); one not yet submitted is counted cancelled here. Finishes the
        ticket as ``Cancelled`` (logged 499, left out of the statistics)."""
        if self._finished:
            return
        if self._pending is not None and not self._answered:
            self.handle.batcher.cancel(self._pending)
        elif not self._submitted and self._plane is not None:
            self._plane.metrics.cancelled(self.handle.name, self.handle.version).inc()
        self._queued()
        self.finish("Cancelled", 499)

    # --- the end ------------------------------------------------------------------------

    def fail(self, error: BaseException, request: InferRequest | None = None) -> None:
        """Finish with ``error``: a ServiceError's name and status, a cancellation (the
        client went away, or its gRPC deadline passed; see :meth:`cancel`), else an
        internal error (500)."""
        if isinstance(error, ServiceError):
            self.finish(type(error).__name__, error.status_code, request)
        elif isinstance(error, asyncio.CancelledError):
            self.cancel()
        else:
            self.finish("InternalError", 500, request)

    def finish(
        self,
        outcome: str = "success",
        status: int = 200,
        request: InferRequest | None = None,
        response: InferResponse | None = None,
    ) -> None:
        """Count the request as done (once): its outcome and latency in the metrics, and in
        its model version's statistics (except a cancelled one: neither a success nor a
        failure of the server's); a traced request's server span ends here."""
        if self._finished:
            return
        self._finished = True
        if self.trace is not None:
            end_trace(self.trace, self.handle, request, response, outcome, status)
        if self._plane is not None:
            self._plane.finished(self._t0, self.label, outcome, self.handle)


class _Answer:
    """The batcher's side of a submitted ticket (``service.batching.queue.Answer``).

    Attributes:
        cache_key: a response cache miss's key (:func:`enqueue`): its outputs are stored
            under it when they come, before it is answered; None: not stored.
    """

    __slots__ = ("cache_key", "on_done", "request", "ticket")

    def __init__(self, ticket: Ticket, request: InferRequest, on_done: Done) -> None:
        self.ticket, self.request, self.on_done = ticket, request, on_done
        self.cache_key: bytes | None = None

    def done(self) -> bool:
        return self.ticket._answered or self.ticket._finished

    def set_result(self, result: tuple[Result, BatchInfo], /) -> None:
        try:
            if self.cache_key is not None:
                handle = self.ticket.handle
                if handle.cache is not None:
                    t0 = time.perf_counter_ns()
                    handle.cache.put(self.cache_key, (handle.name, handle.version), *result)
                    handle.stats.cache_stored(time.perf_counter_ns() - t0)
            self.ticket._answer(self.request, self.on_done, result)
        except Exception as error:  # the answer could not be built or written: it is an error
            self.on_done(error)

    def set_exception(self, exception: BaseException, /) -> None:
        self.ticket._failed(self.on_done, exception)


def load_wait_s(handle: ModelHandle, request: InferRequest) -> float | None:
    """How long a request may wait for its version's load: its ``parameters.timeout`` or its
    model's ``queue_timeout_us``, whichever is shorter; None: no bound."""
    bounds = [us for us in (request.timeout_us, handle.cfg.queue_timeout_us) if us]
    return min(bounds) / 1e6 if bounds else None


def enqueue(
    handle: ModelHandle,
    request: InferRequest,
    bound: Bound,
    answer: _Answer,
    *,
    trace: RequestTrace | None = None,
    request_id: str | None = None,
) -> Pending[Bound, Result] | None:
    """Queue a checked request for its batch, or answer it from the response cache
    (:meth:`Ticket.submit`).

    A hit answers ``answer`` in the next turn of the loop with the stored outputs (the model
    never runs) and returns None; a miss queues the request, and its outputs are stored when
    its batch answers (``answer.cache_key``) when the cache admits it
    (``ResponseCache.admit``). Both count in the version's ``cache_hit`` /
    ``cache_miss`` statistics.

    Args:
        handle: the resident version.
        request: the decoded request; ``bound``: it, checked (``Signature.bind``).
        answer: gets ``(outputs in config order, BatchInfo)`` or the error.
        trace: the request's trace when traced. request_id: names it in the log.

    Returns:
        The queued request (for ``handle.batcher.cancel``), or None for a hit.

    Raises:
        Overloaded, ModelNotReady: see ``Batcher.enqueue`` (before it is queued).
    """
    timeout_us, priority = request.timeout_us, request.parameters.get("priority")
    cache = handle.cache
    if cache is None:
        return handle.enqueue(bound, answer, timeout_us, priority, trace, request_id)
    t0 = time.perf_counter_ns()
    key = cache_key(handle, request, bound)
    hit = cache.get(key)
    if hit is not None:
        handle.stats.cache_hit(time.perf_counter_ns() - t0)
        asyncio.get_running_loop().call_soon(_answer_hit, answer, hit)
        return None
    stored = cache.admit(key)  # a full cache: only if it missed before
    if stored:
        answer.cache_key = key
    ns = time.perf_counter_ns() - t0  # the lookup's: its key, the probe, the admission
    pending = handle.enqueue(bound, answer, timeout_us, priority, trace, request_id)
    handle.stats.cache_miss(ns, stored)  # once queued
    return pending


def _answer_hit(answer: Answer[Result], hit: tuple[Result, BatchInfo]) -> None:
    if not answer.done():  # its client may have gone meanwhile
        answer.set_result(hit)


def shared_outputs(request: InferRequest) -> dict[str, SharedOutput]:
    """The outputs ``request`` wants written into shared memory, by name."""
    return {o.name: o.shared_memory for o in request.outputs or () if o.shared_memory}


def build_response(
    handle: ModelHandle,
    request: InferRequest,
    wanted: tuple[int, ...],
    arrays: list[np.ndarray[Any, Any]],
    info: BatchInfo,
    request_id: str,
    shared: dict[str, SharedOutput] | None = None,
) -> InferResponse:
    """The response to ``request`` from its batch's outputs (``arrays``, in config order;
    ``wanted``: the indices of those it asked for, ``Bound.outputs``); ``request_id``: the
    transport's id of the request (its response's id when the request gave none; ``-``:
    none); ``shared``: the outputs already written to shared memory."""
    outputs = handle.signature.outputs
    shared = shared or {}
    rid = request.id
    if rid is None:
        # KServe's response model requires an id; Triton's clients log it: the request id
        # that X-Request-ID carries (sent or made by the transport) stands in.
        rid = None if request_id == "-" else request_id
    return InferResponse(
        model_name=handle.name,
        model_version=handle.version,
        id=rid,
        outputs=[
            ResponseOutput(
                name=outputs[i].name,
                datatype=outputs[i].datatype,
                shape=arrays[i].shape,
                data=arrays[i],
                in_shared_memory=outputs[i].name in shared,
            )
            for i in wanted
        ],
        parameters={"batch_size": info.batch_size, "batch_requests": info.batch_requests},
    )


def _write_shared(writes: list[tuple[SharedOutput, np.ndarray[Any, Any]]]) -> None:
    """Copy outputs into their shared memory (sizes were checked by ``Signature.bind``)."""
    for target, arr in writes:
        target.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


def end_trace(
    trace: RequestTrace,
    handle: ModelHandle | None,
    request: InferRequest | None,
    response: InferResponse | None,
    outcome: str,
    status: int,
) -> None:
    """End a traced request's server span with what became of it."""
    if handle is not None:
        trace.set("model_version", handle.version)
    if request is not None:
        trace.set("bitserve.input_bytes", sum(i.data.nbytes for i in request.inputs))
    if response is not None:
        trace.set("bitserve.output_bytes", sum(o.data.nbytes for o in response.outputs))
        if response.id is not None:
            trace.set("request_id", response.id)
    trace.end(outcome, status)
