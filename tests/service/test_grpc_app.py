"""The gRPC service in process, over the fake repository: every RPC through tritonclient's aio
client (and a raw channel where it cannot go), each error's status code with the message REST
gives for the same request, auth, limits, metrics, streaming order, draining, and fuzzed
bytes (never INTERNAL for a client's mistake)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import quote

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as tgrpc
from tritonclient.utils import InferenceServerException

from harness.server import free_port
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.proto import health_pb2
from service.models.signature import Bound
from service.rest.app import BitserveApp
from service.server import BitServer
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

pytestmark = pytest.mark.anyio

X = np.array([[1, 2, 3, 4], [0, 0, 1, 255]], dtype=np.uint8)
SERVICE = "/inference.GRPCInferenceService/"


@pytest.fixture
def settings() -> Settings:
    return Settings(max_body_bytes=4096, access_log=False, grpc_port=free_port())


@pytest.fixture
def repo() -> FakeRepository:
    return FakeRepository()


@pytest.fixture
async def server(settings: Settings, repo: FakeRepository) -> AsyncIterator[BitServer]:
    """The server's parts, gRPC started (as ``bitserve serve`` starts it), no HTTP server."""
    server = BitServer(settings, repo)
    async with server.running():
        yield server
    assert repo.stopped


@pytest.fixture
def app(server: BitServer) -> BitserveApp:
    """REST over the same planes (for tests that compare the transports)."""
    return server.rest_app()


@pytest.fixture
def target(server: BitServer) -> str:
    assert server.grpc is not None
    assert server.grpc.port is not None
    return f"127.0.0.1:{server.grpc.port}"


@pytest.fixture
async def client(target: str) -> AsyncIterator[tgrpc.InferenceServerClient]:
    c = tgrpc.InferenceServerClient(target)
    yield c
    await c.close()


@pytest.fixture
async def rest(app: BitserveApp) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def echo_input(x: np.ndarray = X) -> list[tgrpc.InferInput]:  # type: ignore[type-arg]
    inp = tgrpc.InferInput("x", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x)
    return [inp]


def slow_down(repo: FakeRepository, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make every batch of the echo model take ``seconds`` longer."""
    handle = repo.models["echo"]
    real = handle.compute

    def slow(bound: Bound) -> list[np.ndarray]:  # type: ignore[type-arg]
        time.sleep(seconds)
        return real(bound)

    monkeypatch.setattr(handle, "compute", slow)


async def raw_call(target: str, method: str, body: bytes, **kw: Any) -> bytes:
    async with grpc.aio.insecure_channel(target) as channel:
        response: bytes = await channel.unary_unary(SERVICE + method)(body, **kw)
        return response


async def raw_error(target: str, method: str, body: bytes, **kw: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await raw_call(target, method, body, **kw)
    return e.value


# --- health, metadata, repository ----------------------------------------------------------


async def test_health_metadata_and_config(
    client: tgrpc.InferenceServerClient, repo: FakeRepository, rest: httpx.AsyncClient
) -> None:
    assert await client.is_server_live()
    assert await client.is_server_ready()
    assert await client.is_model_ready("echo")
    assert not await client.is_model_ready("nope")  # unknown: not ready, as in Triton
    meta = await client.get_server_metadata()
    server = (await rest.get("/v2")).json()
    assert (meta.name, meta.version, list(meta.extensions)) == (
        server["name"], server["version"], server["extensions"]
    )  # fmt: skip
    model = await client.get_model_metadata("echo", "1", as_json=True)
    expected = (await rest.get("/v2/models/echo/versions/1")).json()
    for key in ("name", "versions", "platform"):
        assert model[key] == expected[key]
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model["inputs"]] == [
        (t["name"], t["datatype"], t["shape"]) for t in expected["inputs"]
    ]
    config = (await client.get_model_config("echo")).config
    assert (config.name, config.max_batch_size) == ("echo", 65536)
    assert ([i.name for i in config.input], [o.name for o in config.output]) == (["x"], ["y", "n"])
    repo.is_ready = False
    assert not await client.is_server_ready()
    assert not await client.is_model_ready("echo")


async def test_health_service(target: str, repo: FakeRepository) -> None:
    async def check(service: str) -> int:
        body = health_pb2.HealthCheckRequest(service=service).SerializeToString()
        async with grpc.aio.insecure_channel(target) as channel:
            raw = await channel.unary_unary("/grpc.health.v1.Health/Check")(body)
        return int(health_pb2.HealthCheckResponse.FromString(raw).status)

    serving = health_pb2.HealthCheckResponse.ServingStatus
    assert await check("") == serving.SERVING
    assert await check("inference.GRPCInferenceService") == serving.SERVING
    repo.is_ready = False
    assert await check("") == serving.NOT_SERVING
    body = health_pb2.HealthCheckRequest(service="other").SerializeToString()
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await channel.unary_unary("/grpc.health.v1.Health/Check")(body)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown service 'other'" in str(e.value.details())


async def test_repository_control(
    client: tgrpc.InferenceServerClient,
    repo: FakeRepository,
    target: str,
    rest: httpx.AsyncClient,
) -> None:
    index = await client.get_model_repository_index(as_json=True)
    assert [(m["name"], m["state"]) for m in index["models"]] == [
        ("echo", "READY"), ("boom", "READY"), ("busy", "UNAVAILABLE")
    ]  # fmt: skip
    ready = pb.RepositoryIndexResponse.FromString(
        await raw_call(
            target, "RepositoryIndex", pb.RepositoryIndexRequest(ready=True).SerializeToString()
        )
    )
    assert [m.name for m in ready.models] == ["echo", "boom"]
    await client.load_model("echo")
    await client.unload_model("boom")
    assert (repo.loaded, repo.unloaded) == (["echo"], ["boom"])
    for name in ("nope", "../x"):  # a name no route takes goes to the data plane itself
        with pytest.raises(InferenceServerException) as e:
            await client.load_model(name)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        r = await rest.post(f"/v2/repository/models/{quote(name, safe='')}/load")
        if name == "nope":
            assert e.value.message() == r.json()["error"]
        assert str(e.value.message()).startswith(f"failed to load '{name}'")
    # Triton's config override, and its file parameters refused
    await client.load_model("echo", config='{"max_batch_size": 16}')
    assert repo.overrides[-1] is not None
    with pytest.raises(InferenceServerException) as e:
        await client.load_model("echo", config="{}", files={"file:1/model.pt": b"x"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unsupported parameters ['file:1/model.pt']" in str(e.value.message())
    with pytest.raises(InferenceServerException) as e:
        await client.load_model("echo", config="{not json")
    assert str(e.value.message()).startswith("failed to load 'echo'")


async def test_statistics_count_grpc_requests(
    client: tgrpc.InferenceServerClient, rest: httpx.AsyncClient
) -> None:
    for _ in range(3):
        await client.infer("echo", echo_input())
    with pytest.raises(InferenceServerException):
        await client.infer("echo", [tgrpc.InferInput("x", [1, 5], "UINT8")])  # no data
    stats = await client.get_inference_statistics("echo", as_json=True)
    (entry,) = stats["model_stats"]
    assert int(entry["inference_stats"]["success"]["count"]) == 3
    assert int(entry["inference_stats"]["fail"]["count"]) == 1
    assert int(entry["inference_count"]) == 6  # 3 requests of 2 items
    rest_stats = (await rest.get("/v2/models/echo/stats")).json()["model_stats"][0]
    assert rest_stats["inference_stats"]["success"]["count"] == 3
    every = await client.get_inference_statistics(as_json=True)  # every READY model
    assert [m["name"] for m in every["model_stats"]] == [
        m["name"] for m in (await rest.get("/v2/models/stats")).json()["model_stats"]
    ]
    assert "echo" in [m["name"] for m in every["model_stats"]]


async def test_shared_memory_disabled_and_cuda_refused(
    client: tgrpc.InferenceServerClient, rest: httpx.AsyncClient
) -> None:
    assert (await client.get_system_shared_memory_status(as_json=True)) == {}
    with pytest.raises(InferenceServerException) as e:
        await client.register_system_shared_memory("r", "/bitserve-none", 64)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    r = await rest.post(
        "/v2/systemsharedmemory/region/r/register", json={"key": "/bitserve-none", "byte_size": 64}
    )
    assert e.value.message() == r.json()["error"]
    assert "--allow-client-shm" in str(e.value.message())
    with pytest.raises(InferenceServerException) as e:
        await client.register_cuda_shared_memory("c", b"aGFuZGxl", 0, 64)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "not supported" in str(e.value.message())
    await client.unregister_cuda_shared_memory()
    assert (await client.get_cuda_shared_memory_status(as_json=True)) == {}
    with pytest.raises(InferenceServerException) as e:
        await client.get_cuda_shared_memory_status("c")
    assert e.value.status() == "StatusCode.NOT_FOUND"


async def test_log_settings(client: tgrpc.InferenceServerClient, rest: httpx.AsyncClient) -> None:
    before = await client.get_log_settings(as_json=True)
    assert before["settings"]["log_info"] == {"bool_param": True}
    after = await client.update_log_settings({"log_verbose_level": 1, "log_info": False})
    settings = after.settings
    assert (settings["log_verbose_level"].uint32_param, settings["log_info"].bool_param) == (
        1,
        False,
    )
    assert (await rest.get("/v2/logging")).json()["log_verbose_level"] == 1
    with pytest.raises(InferenceServerException) as e:
        await client.update_log_settings({"log_file": "/tmp/x"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    await client.update_log_settings({"log_verbose_level": 0, "log_info": True})


async def test_trace_settings_of_a_server_without_tracing(
    client: tgrpc.InferenceServerClient, rest: httpx.AsyncClient
) -> None:
    got = await client.get_trace_settings(as_json=True)
    assert got["settings"]["trace_level"]["value"] == ["OFF"]
    got = await client.update_trace_settings("echo", {"trace_rate": "5"}, as_json=True)
    assert got["settings"]["trace_rate"]["value"] == ["5"]
    assert (await rest.get("/v2/models/echo/trace/setting")).json()["trace_rate"] == "5"
    assert (await rest.get("/v2/trace/setting")).json()["trace_rate"] == "1"
    with pytest.raises(InferenceServerException) as e:
        await client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "started without tracing" in str(e.value.message())
    with pytest.raises(InferenceServerException) as e:
        await client.update_trace_settings(settings={"trace_rate": ["1", "2"]})
    assert "trace_rate takes one value" in str(e.value.message())
    with pytest.raises(InferenceServerException) as e:
        await client.get_trace_settings("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"


# --- inference -----------------------------------------------------------------------------


async def test_infer_raw_and_typed(
    client: tgrpc.InferenceServerClient, repo: FakeRepository, target: str
) -> None:
    out = tgrpc.InferRequestedOutput("n")
    result = await client.infer("echo", echo_input(), outputs=[out], request_id="r-1")
    np.testing.assert_array_equal(result.as_numpy("n"), X.astype(np.int64).sum(axis=1))
    assert result.get_response().id == "r-1"
    assert [o.name for o in result.get_response().outputs] == ["n"]
    result = await client.infer("echo", echo_input())
    np.testing.assert_array_equal(result.as_numpy("y"), 2 * X.astype(np.float32))
    params = result.get_response(as_json=True)["parameters"]
    assert params["batch_size"] == {"int64_param": "2"}
    # typed contents: tritonclient always sends raw, so a message of our own
    msg = pb.ModelInferRequest(model_name="echo", model_version="1")
    t = msg.inputs.add(name="x", datatype="UINT8", shape=[2, 4])
    t.contents.uint_contents.extend(X.reshape(-1).tolist())
    response = pb.ModelInferResponse.FromString(
        await raw_call(target, "ModelInfer", msg.SerializeToString())
    )
    y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 4)
    np.testing.assert_array_equal(y, 2 * X.astype(np.float32))
    checked = repo.models["echo"].checked
    assert checked == [("x", "UINT8", (2, 4))] * 3  # once per request


async def _rest_message(rest: httpx.AsyncClient, model: str, header: dict[str, Any]) -> str:
    r = await rest.post(f"/v2/models/{model}/infer", content=json.dumps(header))
    assert r.status_code >= 400
    message: str = r.json()["error"]
    return message


@pytest.mark.parametrize(
    ("model", "inputs", "code"),
    [
        ("nope", [("x", "UINT8", [2, 4])], "NOT_FOUND"),
        ("echo", [("x", "INT32", [2, 4])], "INVALID_ARGUMENT"),
        ("echo", [("x", "UINT8", [2, 5])], "INVALID_ARGUMENT"),
        ("echo", [("z", "UINT8", [2, 4])], "INVALID_ARGUMENT"),
        ("echo", [("x", "UINT8", [2, 4]), ("x", "UINT8", [2, 4])], "INVALID_ARGUMENT"),
        ("busy", [("x", "UINT8", [2, 4])], "UNAVAILABLE"),
    ],
)
async def test_errors_have_rests_messages(
    target: str,
    rest: httpx.AsyncClient,
    model: str,
    inputs: list[tuple[str, str, list[int]]],
    code: str,
) -> None:
    msg = pb.ModelInferRequest(model_name=model)
    header: dict[str, Any] = {"inputs": []}
    for name, datatype, shape in inputs:
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        n = int(np.prod(shape))
        msg.raw_input_contents.append(bytes(n * (4 if datatype == "INT32" else 1)))
        header["inputs"].append(
            {"name": name, "datatype": datatype, "shape": shape, "data": [0] * n}
        )
    e = await raw_error(target, "ModelInfer", msg.SerializeToString())
    assert e.code().name == code
    assert e.details() == await _rest_message(rest, model, header)
    if code == "UNAVAILABLE":
        assert ("retry-after", "2") in tuple(e.trailing_metadata() or ())


async def test_internal_errors_leak_nothing(
    target: str, app: BitserveApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    msg = pb.ModelInferRequest(model_name="boom", raw_input_contents=[bytes(4)])
    msg.inputs.add(name="x", datatype="UINT8", shape=[1, 4])
    e = await raw_error(target, "ModelInfer", msg.SerializeToString())
    assert e.code() == grpc.StatusCode.INTERNAL
    assert "inference failed (RuntimeError); request id" in str(e.details())
    assert "secret" not in str(e.details())

    def broken(ready: bool = False) -> list[dict[str, Any]]:
        raise KeyError("secret internal detail")

    monkeypatch.setattr(app.state.control, "repository_index", broken)
    e = await raw_error(target, "RepositoryIndex", b"")
    assert e.code() == grpc.StatusCode.INTERNAL
    assert re.fullmatch(r"internal error \(request id [0-9a-f]+-[0-9a-f]+\)", str(e.details()))


async def test_message_larger_than_the_body_limit(target: str) -> None:
    big = np.zeros((1100, 4), np.uint8)  # 4400 bytes of data, more than max_body_bytes 4096
    msg = pb.ModelInferRequest(model_name="echo", raw_input_contents=[big.tobytes()])
    msg.inputs.add(name="x", datatype="UINT8", shape=list(big.shape))
    e = await raw_error(target, "ModelInfer", msg.SerializeToString())
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a gzip bomb: a few dozen bytes on the wire, past the limit once inflated
    e = await raw_error(
        target, "ModelInfer", msg.SerializeToString(), compression=grpc.Compression.Gzip
    )
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    small = np.zeros((900, 4), np.uint8)
    ok = pb.ModelInferRequest(model_name="echo", raw_input_contents=[small.tobytes()])
    ok.inputs.add(name="x", datatype="UINT8", shape=list(small.shape))
    assert pb.ModelInferResponse.FromString(
        await raw_call(target, "ModelInfer", ok.SerializeToString())
    ).outputs


async def test_deadline_exceeded(
    client: tgrpc.InferenceServerClient, repo: FakeRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_down(repo, monkeypatch, 0.3)
    first = asyncio.ensure_future(client.infer("echo", echo_input()))
    await asyncio.sleep(0.05)
    with pytest.raises(InferenceServerException) as e:  # waits in the queue past 1 ms
        await client.infer("echo", echo_input(), timeout=1000)
    assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "echo" in str(e.value.message())
    with pytest.raises(InferenceServerException) as e:  # the call's own gRPC deadline
        await client.infer("echo", echo_input(), client_timeout=0.05)
    assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    await first


async def test_metrics_count_grpc_requests(
    client: tgrpc.InferenceServerClient, app: BitserveApp
) -> None:
    def count(model: str, outcome: str) -> float:
        text = app.state.metrics.render().decode()
        m = re.search(
            rf'bitserve_requests_total\{{model="{model}",outcome="{outcome}"\}} ([0-9.e+]+)', text
        )
        return float(m.group(1)) if m else 0.0

    for _ in range(3):
        await client.infer("echo", echo_input())
    with pytest.raises(InferenceServerException):
        await client.infer("nope", echo_input())
    assert count("echo", "success") == 3
    assert count("_unknown", "ModelNotFound") == 1


# --- auth ----------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [Settings(access_log=False, auth_token="s3cret")])
async def test_bearer_token_in_metadata(settings: Settings, repo: FakeRepository) -> None:
    settings = settings.model_copy(update={"grpc_port": free_port()})
    server = BitServer(settings, repo)
    async with server.running():
        assert server.grpc is not None
        c = tgrpc.InferenceServerClient(f"127.0.0.1:{server.grpc.port}")
        try:
            assert await c.is_server_live()  # open, as REST's health routes
            assert await c.is_server_ready()
            for headers, message in (
                (None, "missing bearer token (send 'Authorization: Bearer <token>')"),
                ({"authorization": "Bearer nope"}, "invalid bearer token"),
                ({"authorization": "Basic s3cret"}, "missing bearer token"),
            ):
                for call in (
                    c.get_model_metadata("echo", headers=headers),
                    c.infer("echo", echo_input(), headers=headers),
                ):
                    with pytest.raises(InferenceServerException) as e:
                        await call
                    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
                    assert str(e.value.message()).startswith(message)
            good = {"authorization": "Bearer s3cret"}
            result = await c.infer("echo", echo_input(), headers=good)
            assert result.as_numpy("n") is not None
            # The server refuses the stream before reading it; a client still writing then
            # may see its own write fail (grpcio's INTERNAL) first, so this one waits.
            stream = c.stream_infer(
                _requests(2, delay_s=0.5), headers={"authorization": "Bearer x"}
            )
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                async for _ in stream:
                    pass
            assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert raw.value.details() == "invalid bearer token"
        finally:
            await c.close()


# --- streaming -----------------------------------------------------------------------------


async def _requests(
    n: int, bad: Sequence[int] = (), delay_s: float = 0.0
) -> AsyncIterator[dict[str, Any]]:
    await asyncio.sleep(delay_s)
    for i in range(n):
        x = np.full((1, 4), i % 256, np.uint8)
        model = "nope" if i in bad else "echo"
        yield {"model_name": model, "inputs": echo_input(x), "request_id": str(i)}


async def test_stream_answers_in_request_order_and_errors_in_band(
    client: tgrpc.InferenceServerClient, repo: FakeRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_down(repo, monkeypatch, 0.02)  # the errors (unknown model) are ready long before
    seen: list[tuple[str, Any]] = []
    # 14 at once: fewer than the echo model's queue of 16 (a stream's requests are
    # computed concurrently, STREAM_WINDOW at a time, and take their places in the queue)
    async for result, error in client.stream_infer(_requests(14, bad=(3, 11))):
        if error is not None:
            seen.append(("error", error.message()))
        else:
            response = result.get_response()
            n = int(result.as_numpy("n")[0])
            seen.append((response.id, n))
    assert len(seen) == 14
    for i, item in enumerate(seen):
        if i in (3, 11):
            assert item == ("error", "Request for unknown model: 'nope' is not found")
        else:
            assert item == (str(i), 4 * i)


# --- draining and fuzz ---------------------------------------------------------------------


async def test_stop_drains_in_flight_calls_and_refuses_new_ones(
    server: BitServer, client: tgrpc.InferenceServerClient, repo: FakeRepository,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    slow_down(repo, monkeypatch, 0.4)
    in_flight = asyncio.ensure_future(client.infer("echo", echo_input()))
    await asyncio.sleep(0.1)
    assert server.grpc is not None
    server.grpc.begin_stop()
    await asyncio.sleep(0.1)  # the server's GOAWAY reaches the client
    with pytest.raises(InferenceServerException) as e:
        await client.infer("echo", echo_input())
    assert e.value.status() == "StatusCode.UNAVAILABLE"
    result = await in_flight
    np.testing.assert_array_equal(result.as_numpy("y"), 2 * X.astype(np.float32))


async def test_fuzzed_messages_are_never_internal(target: str) -> None:
    rng = np.random.default_rng(0)
    valid = pb.ModelInferRequest(model_name="echo", raw_input_contents=[X.tobytes()])
    valid.inputs.add(name="x", datatype="UINT8", shape=[2, 4])
    seed = valid.SerializeToString()
    methods = ["ModelInfer", "ModelMetadata", "ModelConfig", "RepositoryModelLoad", "ModelReady"]
    internal = []
    async with grpc.aio.insecure_channel(target) as channel:
        for i in range(300):
            if i % 2:
                body = bytearray(seed)
                for _ in range(int(rng.integers(1, 5))):
                    body[int(rng.integers(len(body)))] = int(rng.integers(256))
            else:
                body = bytearray(rng.integers(0, 256, int(rng.integers(0, 60)), np.uint8).tobytes())
            method = methods[i % len(methods)]
            try:
                await channel.unary_unary(SERVICE + method)(bytes(body))
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    internal.append((method, bytes(body), e.details()))
    assert internal == []
