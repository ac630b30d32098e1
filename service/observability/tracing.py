"""OpenTelemetry traces of inference requests (the optional ``tracing`` extra).

The standard environment variables turn tracing on and configure it:

- ``OTEL_TRACES_EXPORTER``: ``otlp`` (or ``console``) turns it on, ``none`` off; unset, it is
  on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set.
  ``OTEL_SDK_DISABLED=true`` turns it off.
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or ``..._TRACES_PROTOCOL``): ``http/protobuf`` (default)
  or ``grpc``; the endpoint, headers, timeout, compression and certificates are the OTLP
  exporter's own variables.
- ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (``service.name`` is ``bitserve``
  unless they say otherwise); ``OTEL_BSP_*`` for the batch span processor.
- ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``: the start values of Triton's trace
  settings (:mod:`service.observability.trace_settings`), which decide which requests are traced.

Without the OpenTelemetry SDK the server runs, untraced, and says so at start when tracing
was asked for. With tracing off, nothing here runs per request: the transports check
``DataPlane.tracing is None`` before they look at a header.

A traced request has one server span (``POST /v2/models/{model}/infer``, or gRPC's
``inference.GRPCInferenceService/ModelInfer``), which continues the caller's W3C
``traceparent``/``tracestate`` when it sent one, with the children ``decode`` (for REST
with the reading of the body), ``queue`` (until its batch started), ``compute`` (its
batch, linked to the batch's span) and ``encode``. Each batch that computes a traced
request has a span of its own (``batch``, a root), linked to every traced request in it,
with its phases as children: ``compute_input``, ``compute_infer``, ``compute_output`` (the
statistics extension's phases, laid end to end from the batch's start). Attributes:
``model_name``, ``model_version``, ``request_id`` (Triton's names), ``bitserve.batch_size``
and ``bitserve.batch_requests``, ``bitserve.input_bytes`` and ``bitserve.output_bytes``
(tensor data), ``bitserve.outcome`` and ``bitserve.status_code`` (in HTTP's terms; a 5xx
sets the span's status to ERROR), ``bitserve.priority_level``, and for REST
``http.request.body.size`` and ``http.response.body.size``.

Tracing never costs a request its answer: a failure to record a span is logged and the
request goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from service.observability.trace_settings import Sampler, TraceSettings, sampler_defaults

log = logging.getLogger(__name__)

Headers = Iterable[tuple[Any, Any]]
"""Header or metadata pairs, names and values as ``str`` or ``bytes``."""
_PARENT_KEYS = {"traceparent", b"traceparent", "tracestate", b"tracestate"}
_INSTALL = "pip install 'bitserve[tracing]'"
_PHASES = ("compute_input", "compute_infer", "compute_output")


def asked_for(environ: Mapping[str, str]) -> str | None:
    """The exporter tracing is asked for (``otlp``, ``console``), or None: off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporter:
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return "otlp" if any(environ.get(k) for k in endpoints) else None
    names = [e.strip() for e in exporter.split(",") if e.strip() and e.strip() != "none"]
    return names[0] if names else None


def settings_without_tracing(environ: Mapping[str, str]) -> TraceSettings:
    """The trace settings of a server that does not trace, saying why (for the 400 that
    answers an attempt to turn tracing on)."""
    wanted = asked_for(environ)
    if wanted is None:
        reason = (
            "this server was started without tracing (set OTEL_TRACES_EXPORTER=otlp and "
            "OTEL_EXPORTER_OTLP_ENDPOINT to turn it on)"
        )
    else:
        reason = f"the OpenTelemetry SDK is not installed on this server ({_INSTALL})"
    return TraceSettings.off(reason)


class RequestTrace:
    """The spans of one traced request: the server span, open from the request's start; its
    children, made with their own times as the request goes."""

    __slots__ = ("_sampler", "_tracing", "batch", "context", "span")

    def __init__(self, tracing: Tracing, sampler: Sampler, span: Any) -> None:
        from opentelemetry.trace import set_span_in_context

        self._tracing = tracing
        self._sampler = sampler
        self.span = span
        self.context = set_span_in_context(span)
        self.batch: tuple[int, int, Any] | None = None
        """``(start_ns, end_ns, span context)`` of the batch that computed it."""

    def set(self, name: str, value: Any) -> None:
        """Set an attribute of the server span."""
        self.span.set_attribute(name, value)

    def child(self, name: str, start_ns: int, end_ns: int, links: list[Any] | None = None) -> None:
        """A child span of the server span, from ``start_ns`` to ``end_ns`` (epoch ns)."""
        try:
            span = self._tracing.tracer.start_span(
                name, context=self.context, links=links, start_time=start_ns
            )
            span.end(end_time=end_ns)
        except Exception:
            log.exception("recording span %r failed", name)

    def queued(self, since_ns: int) -> None:
        """Its wait in the queue, from ``since_ns`` until its batch started (or now, when it
        left the queue without one), and its batch's compute."""
        batch = self.batch
        self.child("queue", since_ns, time.time_ns() if batch is None else batch[0])
        if batch is not None:
            from opentelemetry.trace import Link

            self.child("compute", batch[0], batch[1], [Link(batch[2])])

    def end(self, outcome: str, status: int, message: str = "") -> None:
        """End the server span: the request's outcome, its status in HTTP's terms."""
        from opentelemetry.trace import Status, StatusCode

        try:
            span = self.span
            span.set_attribute("bitserve.outcome", outcome)
            span.set_attribute("bitserve.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, message or outcome))
            span.end()
        except Exception:
            log.exception("ending a request's span failed")
        if self._sampler.collected_one():
            self._tracing.flush_soon()


class BatchTracer:
    """The spans of one model version's batches that compute a traced request.

    Args:
        tracing: the server's tracing.
        model, version: the model version.
        phases: the last batch's ``(input_ns, infer_ns, output_ns)`` (the pipeline's), or
            None.
    """

    def __init__(
        self,
        tracing: Tracing,
        model: str,
        version: str,
        phases: Callable[[], tuple[int, int, int] | None],
    ) -> None:
        self.tracing = tracing
        self.attributes = {"model_name": model, "model_version": version}
        self.phases = phases

    def record(
        self,
        traces: list[RequestTrace],
        start_ns: int,
        end_ns: int,
        info: Any,
        error: BaseException | None,
    ) -> None:
        """A batch ran from ``start_ns`` to ``end_ns``: its span, linked to each of its
        traced requests, and its phases; each request learns its batch. Never raises."""
        try:
            self._record(traces, start_ns, end_ns, info, error)
        except Exception:  # tracing must never cost a request its answer
            log.exception("recording a batch's spans failed")

    def _record(self, traces: list[RequestTrace], start_ns: int, end_ns: int, info: Any,
                error: BaseException | None) -> None:  # fmt: skip
        from opentelemetry.context import Context
        from opentelemetry.trace import Link, Status, StatusCode, set_span_in_context

        tracer = self.tracing.tracer
        attributes = {
            **self.attributes,
            "bitserve.batch_size": info.batch_size,
            "bitserve.batch_requests": info.batch_requests,
        }
        links = [Link(t.span.get_span_context()) for t in traces]
        span = tracer.start_span(
            "batch", context=Context(), links=links, attributes=attributes, start_time=start_ns
        )
        phases = self.phases() if error is None else None
        if phases is not None:
            parent, at = set_span_in_context(span), start_ns
            for name, ns in zip(_PHASES, phases, strict=True):
                child = tracer.start_span(name, context=parent, start_time=at)
                at += ns
                child.end(end_time=at)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.end(end_time=end_ns)
        context = span.get_span_context()
        for t in traces:
            t.batch = (start_ns, end_ns, context)
            t.set("bitserve.batch_size", info.batch_size)
            t.set("bitserve.batch_requests", info.batch_requests)


class Tracing:
    """The server's OpenTelemetry tracer and the settings that decide what it traces.

    Args:
        settings: the trace settings (Triton's extension).
        provider: an OpenTelemetry SDK ``TracerProvider`` with its span processors.
    """

    def __init__(self, settings: TraceSettings, provider: Any) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        import service

        self.settings = settings
        self.provider = provider
        self.tracer = provider.get_tracer("bitserve", service.__version__)
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Tracing | None:
        """Tracing as the ``OTEL_*`` variables ask (see the module); None when they do not,
        or when the SDK or the exporter is missing (logged: the server runs untraced)."""
        exporter_name = asked_for(environ)
        if exporter_name is None:
            return None
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        except ImportError:
            log.warning(
                "tracing was asked for (OTEL_TRACES_EXPORTER=%s) but the OpenTelemetry SDK is "
                "not installed (%s): serving without traces",
                exporter_name,
                _INSTALL,
            )
            return None
        exporter = _exporter(exporter_name, environ)
        if exporter is None:
            return None
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "bitserve"}))
        # Which requests are traced is decided before a span exists (the trace settings):
        # every span made is kept.
        provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        start, follow = sampler_defaults(environ)
        log.info(
            "tracing to %s (%s); trace settings %s",
            exporter_name,
            type(exporter).__module__,
            start.triton(),
        )
        return cls(TraceSettings(start, follow_parent=follow), provider)

    def begin(
        self, model: str, headers: Headers, name: str, attributes: dict[str, Any]
    ) -> RequestTrace | None:
        """Start a request's trace if it is to be traced (its model's settings, and with a
        ``parentbased`` sampler its caller's sampled flag); else None (no span made)."""
        try:
            return self._begin(model, headers, name, attributes)
        except Exception:
            log.exception("starting a request's trace failed")
            return None

    def _begin(
        self, model: str, headers: Headers, name: str, attributes: dict[str, Any]
    ) -> RequestTrace | None:
        sampler = self.settings.sampler(model)
        if not sampler.on:
            return None
        parent = self._parent(headers)
        if parent is not None and self.settings.follow_parent:
            from opentelemetry.trace import get_current_span

            if not get_current_span(parent).get_span_context().trace_flags.sampled:
                return None
        elif not sampler.take():
            return None
        attributes["model_name"] = model
        span = self.tracer.start_span(
            name, context=parent, kind=self._server, attributes=attributes
        )
        return RequestTrace(self, sampler, span)

    def _parent(self, headers: Headers) -> Any:
        """The caller's context from W3C ``traceparent``/``tracestate``, or None (absent or
        invalid)."""
        carrier: dict[str, str] = {}
        for key, value in headers:
            if key in _PARENT_KEYS:
                name = key if isinstance(key, str) else key.decode("latin-1")
                carrier[name] = value if isinstance(value, str) else value.decode("latin-1")
        if "traceparent" not in carrier:
            return None
        from opentelemetry.trace import get_current_span

        context = self._propagator.extract(carrier)
        return context if get_current_span(context).get_span_context().is_valid else None

    def batch_tracer(
        self, model: str, version: str, phases: Callable[[], tuple[int, int, int] | None]
    ) -> BatchTracer:
        """The tracer of one model version's batches."""
        return BatchTracer(self, model, version, phases)

    def flush_soon(self) -> None:
        """Export the ended spans now, in a worker thread (``log_frequency``, the last of
        ``trace_count``)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._flush()
        else:
            loop.run_in_executor(None, self._flush)

    def _flush(self) -> None:
        try:
            self.provider.force_flush()
        except Exception:
            log.exception("flushing the trace exporter failed")

    def shutdown(self) -> None:
        """Export what is left and stop (blocks: call it in a thread at shutdown)."""
        self.provider.shutdown()


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    """The span exporter ``name`` with the protocol the environment asks for, or None
    (logged)."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        log.error("OTEL_TRACES_EXPORTER=%r: bitserve exports otlp or console; no traces", name)
        return None
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        elif protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        else:
            log.error(
                "OTEL_EXPORTER_OTLP_PROTOCOL=%r: bitserve exports http/protobuf or grpc; no traces",
                protocol[:40],
            )
            return None
    except ImportError:
        log.warning(
            "the OTLP %s exporter is not installed (%s): serving without traces", protocol, _INSTALL
        )
        return None
    return OTLPSpanExporter()
