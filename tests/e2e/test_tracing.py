"""OpenTelemetry traces end to end: real ``bitserve serve`` processes configured by the
``OTEL_*`` variables export to a real OTLP receiver on loopback (``harness.otlp_receiver``,
HTTP and gRPC), every traced request's spans arrive whole and carry its caller's trace id,
and Triton's trace extension (REST and gRPC, through the unmodified ``tritonclient``)
changes what is traced, on every worker of ``--workers 2``.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from harness.otlp_receiver import OtlpReceiver, Span
from harness.paced import write_paced_model
from harness.server import BitserveServer, start_server

pytestmark = pytest.mark.e2e

MODEL = "paced"
REST_SPAN = "POST /v2/models/{model}/infer"
GRPC_SPAN = "inference.GRPCInferenceService/ModelInfer"
CHILDREN = {"decode", "queue", "compute", "encode"}
PHASES = {"compute_input", "compute_infer", "compute_output"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_paced_model(root, MODEL, max_batch_size=4, max_queue_delay_us=2000)
    return write_paced_model(root, "other")


class Caller:
    """A caller's trace context: a W3C ``traceparent`` (and ``tracestate``)."""

    def __init__(self, sampled: bool = True) -> None:
        self.trace_id = secrets.token_hex(16)
        self.span_id = secrets.token_hex(8)
        self.traceparent = f"00-{self.trace_id}-{self.span_id}-{'01' if sampled else '00'}"
        self.tracestate = "vendor=abc"

    def headers(self) -> dict[str, str]:
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}


def rest_infer(
    server: BitserveServer, headers: dict[str, str], model: str = MODEL
) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 1], "data": [2]}]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def grpc_infer(server: BitserveServer, headers: dict[str, str]) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_target)
    x = grpcclient.InferInput("x", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[2]], np.int32))
    out = client.infer(MODEL, [x], headers=headers).as_numpy("y")
    assert out is not None
    assert out.tolist() == [[2.0]]
    client.close()


def trace_of(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s.trace_id == trace_id]


def whole(spans: list[Span], trace_id: str, name: str) -> bool:
    """The request's server span and its four children arrived, and its batch's span."""
    mine = trace_of(spans, trace_id)
    servers = [s for s in mine if s.name == name]
    if len(servers) != 1 or CHILDREN - {s.name for s in mine}:
        return False
    batch = [s for s in spans if s.name == "batch" and (trace_id, servers[0].span_id) in s.links]
    return (
        len(batch) == 1
        and {s.name for s in spans if s.parent_span_id == batch[0].span_id} >= PHASES
    )


def check_request_trace(spans: list[Span], caller: Caller, name: str) -> Span:
    """The spans of one traced request, as the tracing module promises them."""
    mine = trace_of(spans, caller.trace_id)
    (server,) = [s for s in mine if s.name == name]
    assert server.parent_span_id == caller.span_id  # continues the caller's trace
    assert server.kind == 2  # SERVER
    assert server.trace_state == caller.tracestate
    assert server.resource["service.name"] == "bitserve-test"
    a = server.attributes
    assert (a["model_name"], a["model_version"]) == (MODEL, "1")
    assert a["bitserve.outcome"] == "success"
    assert a["bitserve.status_code"] == 200
    assert a["bitserve.input_bytes"] == 4
    assert a["bitserve.output_bytes"] == 4
    assert a["bitserve.batch_size"] >= 1
    assert a["bitserve.priority_level"] == 1
    assert a["request_id"]
    children = {s.name: s for s in mine if s.parent_span_id == server.span_id}
    assert set(children) == CHILDREN
    order = [children[n] for n in ("decode", "queue", "compute", "encode")]
    for before, after in itertools.pairwise(order):
        assert before.start_ns <= after.start_ns
    assert server.start_ns <= order[0].start_ns
    assert order[-1].end_ns <= server.end_ns
    (batch,) = [
        s for s in spans if s.name == "batch" and (caller.trace_id, server.span_id) in s.links
    ]
    assert batch.parent_span_id == ""
    assert batch.trace_id != caller.trace_id
    assert children["compute"].links == ((batch.trace_id, batch.span_id),)
    assert (batch.start_ns, batch.end_ns) == (
        children["compute"].start_ns,
        children["compute"].end_ns,
    )
    assert batch.attributes["model_name"] == MODEL
    phases = sorted(
        (s for s in spans if s.parent_span_id == batch.span_id), key=lambda s: s.start_ns
    )
    assert [s.name for s in phases] == ["compute_input", "compute_infer", "compute_output"]
    assert batch.start_ns <= phases[0].start_ns
    assert phases[-1].end_ns <= batch.end_ns
    return server


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver("http") as r:
        yield r


@pytest.fixture(scope="module")
def server(repo: Path, receiver: OtlpReceiver) -> Iterator[BitserveServer]:
    env = receiver.environ(OTEL_SERVICE_NAME="bitserve-test")
    with start_server(repo, env=env) as s:
        yield s


def test_rest_requests_continue_their_callers_traces(
    server: BitserveServer, receiver: OtlpReceiver
) -> None:
    callers = [Caller() for _ in range(3)]
    for caller in callers:
        rest_infer(server, caller.headers())
    spans = receiver.wait_for(lambda s: all(whole(s, c.trace_id, REST_SPAN) for c in callers))
    for caller in callers:
        server_span = check_request_trace(spans, caller, REST_SPAN)
        assert server_span.attributes["http.request.method"] == "POST"
        assert server_span.attributes["http.request.body.size"] > 0
        assert server_span.attributes["http.response.body.size"] > 0
    # Not sampled by its caller (the default sampler is parent-based): no span at all.
    unsampled = Caller(sampled=False)
    rest_infer(server, unsampled.headers())
    marker = Caller()
    rest_infer(server, marker.headers())
    spans = receiver.wait_for(lambda s: whole(s, marker.trace_id, REST_SPAN))
    assert not trace_of(spans, unsampled.trace_id)


def test_grpc_requests_continue_their_callers_traces(
    server: BitserveServer, receiver: OtlpReceiver
) -> None:
    caller = Caller()
    grpc_infer(server, caller.headers())
    spans = receiver.wait_for(lambda s: whole(s, caller.trace_id, GRPC_SPAN))
    server_span = check_request_trace(spans, caller, GRPC_SPAN)
    assert server_span.attributes["rpc.system"] == "grpc"


def test_trace_extension_over_rest_changes_what_is_traced(
    server: BitserveServer, receiver: OtlpReceiver
) -> None:
    client = httpclient.InferenceServerClient(server.host_port)
    start = client.get_trace_settings()
    assert start == {
        "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
        "log_frequency": "0", "trace_mode": "opentelemetry",
    }  # fmt: skip
    assert client.get_trace_settings(model_name=MODEL) == start
    # Global: every 2nd request without a caller's decision, two of them at most; the
    # other model traces every request (its own rate), all of them.
    got = client.update_trace_settings(settings={"trace_rate": "2", "trace_count": "2"})
    assert (got["trace_rate"], got["trace_count"]) == ("2", "2")
    got = client.update_trace_settings(model_name="other", settings={"trace_rate": "1"})
    assert (got["trace_rate"], got["trace_count"]) == ("1", "2")
    ids = [
        rest_infer(server, {"X-Request-ID": f"rate-{i}"}).headers["x-request-id"] for i in range(6)
    ]
    marker = Caller()  # a caller's sampled context is traced whatever the rate and count
    rest_infer(server, marker.headers())
    spans = receiver.wait_for(lambda s: whole(s, marker.trace_id, REST_SPAN))
    traced = {s.attributes.get("request_id") for s in spans if s.name == REST_SPAN}
    assert [i for i in ids if i in traced] == ["rate-1", "rate-3"]
    # Model settings: nulls clear them; unknown models and bad values are refused.
    client.update_trace_settings(model_name="other", settings={"trace_rate": None})
    assert client.get_trace_settings(model_name="other") == client.get_trace_settings()
    with pytest.raises(InferenceServerException, match="Request for unknown model"):
        client.get_trace_settings(model_name="nope")
    r = httpx.post(server.url + "/v2/trace/setting", json={"trace_level": ["TENSORS"]})
    assert r.status_code == 400
    assert "TENSORS is not supported" in r.json()["error"]
    r = httpx.post(server.url + "/v2/trace/setting", json={"trace_file": "/tmp/x"})
    assert r.status_code == 400
    assert "can not be updated" in r.json()["error"]
    # OFF: nothing is traced, not even a caller's sampled request.
    client.update_trace_settings(settings={"trace_level": ["OFF"]})
    off = Caller()
    rest_infer(server, off.headers())
    client.update_trace_settings(
        settings={"trace_level": None, "trace_rate": None, "trace_count": None}
    )
    assert client.get_trace_settings() == start
    marker = Caller()
    rest_infer(server, marker.headers())
    spans = receiver.wait_for(lambda s: whole(s, marker.trace_id, REST_SPAN))
    assert not trace_of(spans, off.trace_id)
    assert "trace" in httpx.get(server.url + "/v2").json()["extensions"]


def test_trace_extension_over_grpc(server: BitserveServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_target)
    got = client.update_trace_settings(
        model_name=MODEL, settings={"trace_rate": "7", "log_frequency": "3"}, as_json=True
    )
    assert got["settings"]["trace_rate"]["value"] == ["7"]
    assert got["settings"]["log_frequency"]["value"] == ["3"]
    assert got["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
    rest = httpx.get(f"{server.url}/v2/models/{MODEL}/trace/setting").json()
    assert (rest["trace_rate"], rest["log_frequency"]) == ("7", "3")
    got = client.update_trace_settings(
        model_name=MODEL, settings={"trace_rate": None, "log_frequency": None}, as_json=True
    )
    assert got["settings"]["trace_rate"]["value"] == ["1"]
    with pytest.raises(InferenceServerException, match="Unable to parse 'trace_count'"):
        client.update_trace_settings(settings={"trace_count": "many"})
    assert client.get_trace_settings(as_json=True)["settings"]["trace_count"]["value"] == ["-1"]
    client.close()


def test_otlp_grpc_export_and_one_in_a_hundred(repo: Path, tmp_path: Path) -> None:
    with OtlpReceiver("grpc") as receiver:
        env = receiver.environ(
            OTEL_SERVICE_NAME="bitserve-test",
            OTEL_TRACES_SAMPLER="parentbased_traceidratio",
            OTEL_TRACES_SAMPLER_ARG="0.01",
        )
        with start_server(repo, env=env, log_dir=tmp_path) as s:
            assert httpx.get(s.url + "/v2/trace/setting").json()["trace_rate"] == "100"
            ids = [
                rest_infer(s, {"X-Request-ID": f"r{i}"}).headers["x-request-id"] for i in range(200)
            ]
            caller = Caller()
            grpc_infer(s, caller.headers())
            spans = receiver.wait_for(lambda sp: whole(sp, caller.trace_id, GRPC_SPAN))
            check_request_trace(spans, caller, GRPC_SPAN)
            traced = {sp.attributes.get("request_id") for sp in spans if sp.name == REST_SPAN}
            assert [i for i in ids if i in traced] == ["r99", "r199"]


def test_every_worker_traces_and_takes_the_settings(repo: Path, tmp_path: Path) -> None:
    with OtlpReceiver("http") as receiver:
        env = receiver.environ(OTEL_SERVICE_NAME="bitserve-test")
        with start_server(repo, args=["--workers", "2"], env=env, log_dir=tmp_path) as s:
            r = httpx.post(s.url + "/v2/trace/setting", json={"trace_rate": "3"}, timeout=60)
            assert r.status_code == 200
            assert r.json()["trace_rate"] == "3"
            callers: dict[str, Caller] = {}
            for _ in range(200):  # fresh connections until both workers have answered
                caller = Caller()
                with httpx.Client(timeout=60) as client:
                    body = {
                        "inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 1], "data": [1]}]
                    }
                    answer = client.post(
                        f"{s.url}/v2/models/{MODEL}/infer", json=body, headers=caller.headers()
                    )
                worker = answer.headers["x-bitserve-worker"]
                callers.setdefault(worker, caller)
                got = client_settings(s.url, worker)
                assert got["trace_rate"] == "3", (worker, got)
                if len(callers) == 2:
                    break
            assert set(callers) == {"0", "1"}
            spans = receiver.wait_for(
                lambda sp: all(whole(sp, c.trace_id, REST_SPAN) for c in callers.values())
            )
            for caller in callers.values():
                check_request_trace(spans, caller, REST_SPAN)


def client_settings(url: str, worker: str) -> dict[str, str]:
    """The global trace settings as worker ``worker`` answers them."""
    for _ in range(200):
        with httpx.Client(timeout=60) as client:
            r = client.get(url + "/v2/trace/setting")
        if r.headers["x-bitserve-worker"] == worker:
            return dict(r.json())
    raise AssertionError(f"worker {worker} never answered")


def test_without_the_sdk_the_server_runs_untraced_and_says_so(repo: Path, tmp_path: Path) -> None:
    # A stand-in "opentelemetry.sdk" that cannot be imported, first on the path (the API,
    # which FastAPI itself needs, stays).
    fake = tmp_path / "no-sdk" / "opentelemetry" / "sdk"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "PYTHONPATH": os.pathsep.join([str(fake.parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    with start_server(repo, env=env, log_dir=tmp_path) as s:
        rest_infer(s, Caller().headers())
        assert "OpenTelemetry SDK is not installed" in s.log()
        assert httpx.get(s.url + "/v2/trace/setting").json()["trace_level"] == ["OFF"]
        r = httpx.post(s.url + "/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"]})
        assert r.status_code == 400
        assert "the OpenTelemetry SDK is not installed" in json.loads(r.text)["error"]
