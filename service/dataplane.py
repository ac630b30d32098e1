"""The data plane: everything about a request, decided once, for every transport.

Transports (REST in ``service.rest``, gRPC in ``service.grpc``) are thin adapters: they take
their envelope apart, decode it with their own framing, call a method here, and write the
answer back in their own envelope. The data plane looks the model up and checks its queue
before a transport decodes anything, checks the request against the model once
(``service.models.signature``), submits it to the model's batcher, builds the response, writes
outputs into shared memory, and counts requests in the metrics and statistics. Model state
belongs to the repository alone (``service.models.repository``); what changes it is the control
plane's (``service.controlplane``).

What happens to one inference request is the core's (:mod:`service.ticket`: admit, settle,
submit, finish, without coroutines); :meth:`DataPlane.infer_with` is its wrapper for
coroutine callers.

The model layout is after MLServer's ``handlers/dataplane.py`` ("used by both the gRPC and
REST servers").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import service
from service.errors import InvalidInput, ModelNotReady, Overloaded, ServiceError
from service.models.handle import ModelHandle
from service.models.override import ConfigOverride
from service.observability.metrics import Metrics
from service.observability.request_ids import request_id_var
from service.protocol import InferRequest, InferResponse
from service.shared_memory import SystemSharedMemory
from service.ticket import THREAD_BYTES, Ticket, end_trace

if TYPE_CHECKING:
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["THREAD_BYTES", "DataPlane", "Decoder", "Repository", "compute", "infer"]

T = TypeVar("T")
log = logging.getLogger(__name__)

Decoder = Callable[[ModelHandle], Awaitable[InferRequest]]
"""A transport's decoder: the request for a model, its inputs checked by
``handle.signature.check_input`` (see :meth:`DataPlane.infer_with`)."""

EXTENSIONS = [
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
    "logging",
]


class Repository(Protocol):
    """What the data plane needs of the model repository (``service.models.repository``)."""

    @property
    def ready(self) -> bool: ...
    def not_ready_reason(self) -> str | None: ...
    async def start(self) -> None: ...
    async def stop(self, timeout_s: float = 30.0) -> None: ...
    def index(self) -> list[dict[str, Any]]: ...
    async def load(self, name: str, override: ConfigOverride | None = None) -> None: ...
    async def unload(self, name: str) -> None: ...
    def get(self, name: str, version: str | None = None) -> ModelHandle: ...
    def ready_handles(self, name: str | None = None) -> list[ModelHandle]: ...
    def use(self, handle: ModelHandle) -> bool: ...
    async def resident(
        self, handle: ModelHandle, timeout_s: float | None = None
    ) -> ModelHandle: ...


async def off_loop(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread (work that would hold the event loop)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)


async def decode_sized(nbytes: int, fn: Callable[[], T]) -> T:
    """Run a decoder over ``nbytes`` of request: in a worker thread above 64 KiB (the thread
    hop costs more than a smaller decode), on the event loop below. Every transport's decoding
    goes through here."""
    if nbytes > THREAD_BYTES:
        return await off_loop(fn)
    return fn()


async def infer(
    handle: ModelHandle, request: InferRequest, trace: RequestTrace | None = None
) -> InferResponse:
    """Compute a decoded request on a resident version, outside any transport's accounting
    (its inputs passed ``handle.signature.check_input`` in their decoder).

    Raises:
        InvalidInput: the request does not fit the model (never queued). Overloaded,
            DeadlineExceeded, ModelNotReady, ServiceError: see ``Batcher.submit``.
    """
    ticket = Ticket(None, handle, handle.version, 0, request_id_var.get(), trace)
    return await compute(ticket, request)


async def compute(ticket: Ticket, request: InferRequest) -> InferResponse:
    """:meth:`Ticket.submit`, awaited: the response, or the batch's error raised; a
    cancelled caller (its client gone) drops the request from its queue."""
    future: asyncio.Future[InferResponse] = asyncio.get_running_loop().create_future()

    def done(outcome: InferResponse | BaseException) -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    ticket.submit(request, done)
    try:
        return await future
    except asyncio.CancelledError:
        ticket.cancel()
        raise


async def _traced(trace: RequestTrace | None, name: str, work: Awaitable[T]) -> T:
    """``await work``, recorded as the child span ``name`` of a traced request."""
    if trace is None:
        return await work
    start = time.time_ns()
    try:
        return await work
    finally:
        trace.child(name, start, time.time_ns())


class DataPlane:
    """The server's logic, behind every transport.

    Args:
        repository: the model repository (the only owner of model state).
        metrics: where request outcomes and in-flight counts go.
        shared_memory: the client's system shared memory regions (the extension), or None
            when client shared memory is disabled (``service.controlplane`` registers them).
        tracing: the server's tracing (transports start a request's trace with it and pass
            it in); None: off, and nothing about tracing happens per request.
    """

    def __init__(
        self,
        repository: Repository,
        metrics: Metrics,
        *,
        shared_memory: SystemSharedMemory | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.repository = repository
        self.tracing = tracing
        self.shared_memory = shared_memory
        self.metrics = metrics

    # --- server and models ----------------------------------------------------------------

    def server_metadata(self) -> dict[str, Any]:
        """V2 server metadata."""
        extensions = [*EXTENSIONS, "trace"]
        if self.shared_memory is not None:
            extensions.append("system_shared_memory")
        return {"name": "bitserve", "version": service.__version__, "extensions": extensions}

    def admit(
        self,
        name: str,
        version: str | None,
        *,
        request_id: str | None = None,
        trace: RequestTrace | None = None,
    ) -> Ticket:
        """A new inference request, before its body is read (every transport's first step):
        counted in flight, its model version looked up, counted as used now, and its queue
        checked for room. An evicted version is admitted (``ticket.resident`` is then False
        after :meth:`Ticket.settle`: the request waits for its load).

        Args:
            name, version: the model (version None: the highest READY one).
            request_id: the transport's id of the request; None: the current one
                (``service.observability.request_ids.request_id_var``).
            trace: the request's trace, when it is traced (:meth:`Tracing.begin`); its
                server span ends when the ticket is finished.

        Raises:
            ModelNotFound, ModelNotReady: see :meth:`model`. Overloaded: its queue is full.
            The refused request is counted as finished before it is raised.
        """
        t0 = self.started()
        try:
            handle = self.repository.get(name, version)
        except ServiceError as e:
            # Unknown names must not grow the metrics' label set.
            if trace is not None:
                end_trace(trace, None, None, None, type(e).__name__, e.status_code)
            self.finished(t0, "_unknown", type(e).__name__, None)
            raise
        rid = request_id_var.get() if request_id is None else request_id
        ticket = Ticket(self, handle, version, t0, rid, trace)
        try:
            if self.repository.use(handle):  # evicted: decoded, then waits for its load
                handle.batcher.check_capacity()
        except ServiceError as e:
            ticket.fail(e)
            raise
        return ticket

    def would_shed(self, name: str, version: str | None = None) -> bool:
        """Whether :meth:`admit` would refuse a request now for a full queue (a look, with
        no request counted): the express lane sheds such requests without their body."""
        try:
            handle = self.repository.get(name, version)
            handle.batcher.check_capacity()
        except Overloaded:
            return True
        except ServiceError:
            return False  # unknown or not ready: the general way answers it
        return False

    def model(self, name: str, version: str | None = None) -> ModelHandle:
        """The READY handle of a model version (the highest READY one by default).

        Raises:
            ModelNotFound: no such model or version. ModelNotReady: not READY.
        """
        return self.repository.get(name, version)

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether the model (version) serves; unknown names raise ModelNotFound."""
        try:
            self.repository.get(name, version)
        except ModelNotReady:
            return False
        return True

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension: every READY version of every model, of one model,
        or one version.

        Raises:
            ModelNotFound: no such model or version. ModelNotReady: the version is not READY.
            InvalidInput: the model has no READY version.
        """
        if version is not None:
            handles = [self.repository.get(name or "", version)]
        else:
            handles = self.repository.ready_handles(name)
            if name is not None and not handles:
                raise InvalidInput(f"requested model '{name}' is not available")
        # The counts of the whole server: this process's, or with --workers every worker's.
        counts = {(s.name, s.version): s for s in self.metrics.statistics_source()}
        stats = [counts.get((h.name, h.version)) or h.stats.snapshot() for h in handles]
        return {"model_stats": [s.triton() for s in stats]}

    # --- inference ------------------------------------------------------------------------

    async def infer_with(
        self,
        name: str,
        version: str | None,
        decode: Decoder,
        encode: Callable[[ModelHandle, InferRequest, InferResponse], Awaitable[T]],
        trace: RequestTrace | None = None,
    ) -> T:
        """One inference for a coroutine caller: its decoder and encoder around the data
        plane's core (:class:`service.ticket.Ticket`, whose module docstring lists the steps).

        The model is looked up and its queue checked before ``decode`` is awaited (so an
        unknown model or a full queue is answered before a transport reads or decodes the
        request); the request is computed, ``encode`` frames the response, and the outcome
        and latency go to the metrics and the model's statistics.

        Args:
            name, version: the model (version None: the highest READY one).
            decode: the transport's decoder, given the model; it calls
                ``handle.signature.check_input`` on each input before converting its data
                (and may be called a second time, with the version a reload put in place).
            encode: frames the response for the transport.
            trace: the request's trace, when it is traced (:meth:`Tracing.begin`): its
                decode, queue, compute and encode become spans, and its server span ends
                here.

        Raises:
            ServiceError: with the status the transport answers.
        """
        ticket = self.admit(name, version, trace=trace)
        request = response = None
        try:
            request = await _traced(trace, "decode", decode(ticket.handle))
            again = ticket.settle()
            if not ticket.resident:
                again = await ticket.loaded(request)
            if again is not None:
                request = await decode(again)
            response = await compute(ticket, request)
            out = await _traced(trace, "encode", encode(ticket.handle, request, response))
        except BaseException as e:
            ticket.fail(e, request)
            raise
        ticket.finish(request=request, response=response)
        return out

    def started(self) -> int:
        """Count a request in flight (every transport's, from the data plane's start);
        returns its start, for :meth:`finished`."""
        self.metrics.request_started()
        return time.perf_counter_ns()

    def finished(self, t0: int, label: str, outcome: str, handle: ModelHandle | None) -> None:
        """Count a request that :meth:`started` at ``t0`` as done: its outcome and latency in
        the metrics (labelled ``label``), and in its model version's statistics (every
        transport's requests, except those whose client went away: neither a success nor a
        failure of the server's)."""
        ns = time.perf_counter_ns() - t0
        self.metrics.request_finished(label, outcome, ns / 1e9)
        if handle is not None and outcome != "Cancelled":
            handle.stats.request_done(outcome == "success", ns)
