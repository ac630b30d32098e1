"""A real OTLP trace receiver on loopback, for the tests and the benchmarks: OTLP/HTTP (protobuf,
``POST /v1/traces``) or OTLP/gRPC (``TraceService/Export``), decoding the exporters' messages
with the opentelemetry-proto package (the ``tracing`` extra brings it).

    with OtlpReceiver("http") as receiver:   # or "grpc"
        env = receiver.environ()             # OTEL_* variables that point a server at it
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 5)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class Span:
    """One received span, its ids in hex."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]
    status_code: int
    """0 unset, 1 OK, 2 ERROR."""
    trace_state: str
    resource: dict[str, Any] = field(default_factory=dict)


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> Iterator[Span]:
    """The spans of one export request."""
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield Span(
                    name=s.name,
                    trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    kind=s.kind,
                    start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano,
                    attributes=_attributes(s.attributes),
                    links=tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links),
                    status_code=s.status.code,
                    trace_state=s.trace_state,
                    resource=resource,
                )


class OtlpReceiver:
    """Receives OTLP trace exports on 127.0.0.1 and keeps every span.

    Args:
        protocol: ``"http"`` (OTLP/HTTP protobuf) or ``"grpc"``.
    """

    def __init__(self, protocol: Literal["http", "grpc"] = "http") -> None:
        self.protocol = protocol
        self.spans: list[Span] = []
        self.exports = 0
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None
        self.port = 0

    def _take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.spans.extend(spans_of(request))
            self.exports += 1

    def __enter__(self) -> OtlpReceiver:
        if self.protocol == "http":
            self._start_http()
        else:
            self._start_grpc()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(0)

    def _start_http(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def _start_grpc(self) -> None:
        import grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(  # noqa: N802 - the service's method name
                self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                receiver._take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        self.port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()

    def environ(self, **more: str) -> dict[str, str]:
        """``OTEL_*`` variables that send a server's traces here, quickly (100 ms batches)."""
        protocol = "http/protobuf" if self.protocol == "http" else "grpc"
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **more,
        }

    def snapshot(self) -> list[Span]:
        """The spans received so far."""
        with self._lock:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout: float = 60.0) -> list[Span]:
        """The spans received, once ``done`` holds for them (AssertionError after
        ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise AssertionError(f"not all spans arrived: {len(spans)} received, {names}")
            time.sleep(0.05)
