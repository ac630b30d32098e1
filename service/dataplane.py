"""The data plane: everything about a request, decided once, for every transport.

Transports (REST in ``service.rest``, gRPC in ``service.grpc``) are thin adapters: they take
their envelope apart, decode it with their own framing, call a method here, and write the
answer back in their own envelope. The data plane looks the model up and checks its queue
before a transport decodes anything, checks the request against the model once
(``service.signature``), submits it to the model's batcher, builds the response, writes
outputs into shared memory, and counts requests in the metrics and statistics. Model state
belongs to the repository alone (``service.repository``); what changes it is the control
plane's (``service.controlplane``).

The model layout is after MLServer's ``handlers/dataplane.py`` ("used by both the gRPC and
REST servers").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

import service
from service.batch_queue import Answer, Pending
from service.batcher import BatchInfo
from service.config_override import ConfigOverride
from service.errors import (
    InvalidInput,
    ModelNotReady,
    ServiceError,
)
from service.handle import ModelHandle, Result
from service.metrics import Metrics
from service.observability import request_id_var
from service.protocol import (
    InferRequest,
    InferResponse,
    ResponseOutput,
)
from service.protocol.types import SharedOutput
from service.response_cache import ResponseCache, cache_key
from service.shared_memory import SystemSharedMemory
from service.signature import Bound

if TYPE_CHECKING:
    from service.tracing import RequestTrace, Tracing

T = TypeVar("T")
log = logging.getLogger(__name__)

Decoder = Callable[[ModelHandle], Awaitable[InferRequest]]
"""A transport's decoder: the request for a model, its inputs checked by
``handle.signature.check_input`` (see :meth:`DataPlane.infer_with`)."""

# Work above these sizes leaves the event loop for a worker thread; below them the thread hop
# costs more than the work. Decoding is sized by the whole request, not its JSON part: the
# binary part can cost as much (BYTES elements are split in Python, BOOL bytes are scanned).
THREAD_BYTES = 64 << 10

EXTENSIONS = [
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
    "logging",
]


class Repository(Protocol):
    """What the data plane needs of the model repository (``service.repository``)."""

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


class NotResident(ModelNotReady):
    """The version is READY but evicted (``--device-memory-budget``): its request waits for
    its load (:meth:`DataPlane.infer_with`); the express lane hands such a request over."""

    def __init__(self, handle: ModelHandle) -> None:
        super().__init__(f"model '{handle.name}' version {handle.version} is not resident")
        self.handle = handle


def load_wait_s(handle: ModelHandle, request: InferRequest) -> float | None:
    """How long a request may wait for its version's load: its ``parameters.timeout`` or its
    model's ``queue_timeout_us``, whichever is shorter; None: no bound."""
    bounds = [us for us in (request.timeout_us, handle.cfg.queue_timeout_us) if us]
    return min(bounds) / 1e6 if bounds else None


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
    """Check a decoded request against its model, compute it, and build the response.

    The request's inputs have passed ``handle.signature.check_input`` in their decoder. A
    traced request records its wait in the queue and its batch's compute.

    Raises:
        InvalidInput: the request does not fit the model (never queued). Overloaded,
            DeadlineExceeded, ModelNotReady, ServiceError: see ``Batcher.submit``.
    """
    bound = handle.signature.bind(request)
    queued_ns = 0
    if trace is not None:
        queued_ns = time.time_ns()
        trace.set("bitserve.priority_level", handle.level_of(request.parameters.get("priority")))
    future: asyncio.Future[tuple[list[np.ndarray[Any, Any]], BatchInfo]]
    future = asyncio.get_running_loop().create_future()
    pending = enqueue(handle, request, bound, future, trace=trace)
    try:
        arrays, info = await future
    except asyncio.CancelledError:
        if pending is not None:
            handle.batcher.cancel(pending)  # the client went away
        raise
    finally:
        if trace is not None:
            trace.queued(queued_ns)
    outputs = handle.signature.outputs
    shared = shared_outputs(request)
    if shared:
        await _write_shared(
            [
                (shared[outputs[i].name], arrays[i])
                for i in bound.outputs
                if outputs[i].name in shared
            ]
        )
    return build_response(
        handle, request, bound.outputs, arrays, info, request_id_var.get(), shared
    )


def enqueue(
    handle: ModelHandle,
    request: InferRequest,
    bound: Bound,
    answer: Answer[Result],
    *,
    trace: RequestTrace | None = None,
    request_id: str | None = None,
) -> Pending[Bound, Result] | None:
    """Queue a checked request for its batch, or answer it from the response cache: every
    transport's requests come here (:func:`infer`, and the REST express lane).

    A hit answers ``answer`` in the next turn of the loop with the stored outputs (the model
    never runs) and returns None; a miss queues the request, and its outputs are stored when
    its batch answers. Both count in the version's ``cache_hit`` / ``cache_miss`` statistics.

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
    storing = _Storing(answer, cache, key, (handle.name, handle.version))
    pending = handle.enqueue(bound, storing, timeout_us, priority, trace, request_id)
    handle.stats.cache_miss(time.perf_counter_ns() - t0)
    return pending


def _answer_hit(answer: Answer[Result], hit: tuple[Result, BatchInfo]) -> None:
    if not answer.done():  # its client may have gone meanwhile
        answer.set_result(hit)


class _Storing:
    """A missed request's answer: its outputs go to the response cache, then to it."""

    __slots__ = ("answer", "cache", "key", "version")

    def __init__(
        self, answer: Answer[Result], cache: ResponseCache, key: bytes, version: tuple[str, str]
    ) -> None:
        self.answer, self.cache, self.key, self.version = answer, cache, key, version

    def done(self) -> bool:
        return self.answer.done()

    def set_result(self, result: tuple[Result, BatchInfo], /) -> None:
        self.cache.put(self.key, self.version, *result)
        self.answer.set_result(result)

    def set_exception(self, exception: BaseException, /) -> None:
        self.answer.set_exception(exception)


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


async def _traced(trace: RequestTrace, name: str, work: Awaitable[T]) -> T:
    """``await work``, recorded as the child span ``name`` of a traced request."""
    start = time.time_ns()
    try:
        return await work
    finally:
        trace.child(name, start, time.time_ns())


def _end_trace(
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


async def _write_shared(writes: list[tuple[SharedOutput, np.ndarray[Any, Any]]]) -> None:
    """Copy outputs into their shared memory (sizes were checked by ``Signature.bind``)."""

    def write() -> None:
        for target, arr in writes:
            target.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)

    if sum(arr.nbytes for _, arr in writes) > THREAD_BYTES:
        await off_loop(write)
    else:
        write()


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

    def admit(self, name: str, version: str | None) -> ModelHandle:
        """A new inference request's model version, before its body is read (every
        transport's first step): resident (counted as used now) and with room in its queue.

        Raises:
            ModelNotFound, ModelNotReady: see :meth:`model`. NotResident: evicted (the
            request waits for its load: :meth:`infer_with`). Overloaded: its queue is full.
        """
        handle = self.repository.get(name, version)
        if not self.admits(handle):
            raise NotResident(handle)
        return handle

    def admits(self, handle: ModelHandle) -> bool:
        """:meth:`admit` of a version already looked up: False when it is evicted.

        Raises:
            Overloaded: its queue is full.
        """
        if not self.repository.use(handle):
            return False
        handle.batcher.check_capacity()
        return True

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
        """One inference for any transport: its decoder and encoder around the data plane.

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
        t0 = self.started()
        label = "_unknown"  # unknown names must not grow the metrics' label set
        outcome = "success"
        handle: ModelHandle | None = None
        request = response = None
        submitted = False
        status = 200
        try:
            handle = self.repository.get(name, version)
            label = handle.name
            self.admits(handle)  # evicted: decoded with its signature, then waits for its load
            if trace is None:
                request = await decode(handle)
            else:
                request = await _traced(trace, "decode", decode(handle))
            # Looked up again: a reload during a decode off the loop retires the version
            # found first, and the request belongs to the one serving now (decoded again if
            # the reload changed what the model accepts).
            current = self.repository.get(handle.name, version)
            wait_s = load_wait_s(current, request)
            for _ in range(3):  # evicted: loaded again (one load for every waiting request)
                if self.repository.use(current):
                    break
                current = await self.repository.resident(current, wait_s)
            else:
                raise ModelNotReady(f"model '{name}' was evicted again as soon as it loaded")
            if current is not handle:
                if not current.signature.same_as(handle.signature):
                    request = await decode(current)
                handle = current
            submitted = True  # from here on the batcher counts what it drops
            response = await infer(handle, request, trace)
            if trace is None:
                return await encode(handle, request, response)
            return await _traced(trace, "encode", encode(handle, request, response))
        except ServiceError as e:
            outcome, status = type(e).__name__, e.status_code
            raise
        except asyncio.CancelledError:  # the client went away (or its gRPC deadline passed)
            outcome, status = "Cancelled", 499
            if handle is not None and not submitted:  # dropped before its queue
                self.metrics.cancelled(handle.name, handle.version).inc()
            raise
        except Exception:
            outcome, status = "InternalError", 500
            raise
        finally:
            if trace is not None:
                _end_trace(trace, handle, request, response, outcome, status)
            self.finished(t0, label, outcome, handle)

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
