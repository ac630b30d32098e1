"""A real ``bitserve serve`` over gRPC, driven by the unmodified ``tritonclient.grpc`` (sync, aio,
callbacks, streaming, shared memory) as Triton's gRPC example programs drive Triton.

Each test makes the calls of one of Triton's examples (triton-inference-server/client,
``src/python/examples/simple_grpc_*``) against Triton's "simple" model (TorchScript, written
by the test): infer, aio infer, async infer, health and metadata, model control (with the
config override), system shared memory, keepalive options, custom channel arguments. Then:
streaming, the demo model's packed bits against the float64 reference, gRPC compression,
SIGTERM draining in-flight calls, keepalive behaviour, the port settings, and fuzzed bytes
against the real process.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from harness.server import BitserveServer, bitserve_command, free_port, start_server
from harness.workload import Pool, check
from service.models.demo import write_demo_repository
from tests.e2e.slow_model import write_slow_model
from tests.e2e.triton_simple import write_simple

pytestmark = pytest.mark.e2e

A = np.arange(16, dtype=np.int32)[None]  # the examples' INPUT0
B = np.ones((1, 16), dtype=np.int32)  # and INPUT1


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpc-repo")
    write_simple(root)
    write_demo_repository(root)
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[BitserveServer]:
    with start_server(repo) as s:
        yield s


def simple_inputs(module: Any = grpcclient, a: np.ndarray = A, b: np.ndarray = B) -> list[Any]:  # type: ignore[type-arg]
    inputs = [module.InferInput("INPUT0", list(a.shape), "INT32"),
              module.InferInput("INPUT1", list(b.shape), "INT32")]  # fmt: skip
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def simple_outputs(module: Any = grpcclient) -> list[Any]:
    return [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]


def assert_sum_and_difference(result: Any, a: np.ndarray = A, b: np.ndarray = B) -> None:  # type: ignore[type-arg]
    out0, out1 = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
    assert out0.dtype == np.int32
    assert out1.dtype == np.int32
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)


# --- Triton's examples ---------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_infer_client(server: BitserveServer, compression: str | None) -> None:
    """simple_grpc_infer_client: with and without requested outputs, headers, a client
    timeout, and each gRPC compression (its -C flag)."""
    client = grpcclient.InferenceServerClient(server.grpc_target)
    result = client.infer(
        "simple",
        simple_inputs(),
        outputs=simple_outputs(),
        client_timeout=30.0,
        headers={"test": "1"},
        compression_algorithm=compression,
    )
    assert_sum_and_difference(result)
    statistics = client.get_inference_statistics(model_name="simple")
    assert len(statistics.model_stats) == 1
    assert statistics.model_stats[0].inference_stats.success.count >= 1
    result = client.infer("simple", simple_inputs(), compression_algorithm=compression)
    assert_sum_and_difference(result)
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT0", "OUTPUT1"]
    client.close()


def test_aio_infer_client(server: BitserveServer) -> None:
    """simple_grpc_aio_infer_client: one call, then two in parallel."""

    async def main() -> None:
        client = grpcaio.InferenceServerClient(server.grpc_target)
        try:
            result = await client.infer(
                "simple",
                simple_inputs(grpcaio),
                outputs=simple_outputs(grpcaio),
                headers={"test": "1"},
            )
            assert_sum_and_difference(result)
            one, two = await asyncio.gather(
                client.infer("simple", simple_inputs(grpcaio)),
                client.infer("simple", simple_inputs(grpcaio)),
            )
            assert_sum_and_difference(one)
            assert_sum_and_difference(two)
        finally:
            await client.close()

    asyncio.run(main())


def test_async_infer_client(server: BitserveServer) -> None:
    """simple_grpc_async_infer_client: a callback receives the result."""
    client = grpcclient.InferenceServerClient(server.grpc_target)
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def callback(q: queue.Queue[tuple[Any, Any]], result: Any, error: Any) -> None:
        q.put((result, error))

    client.async_infer("simple", simple_inputs(), partial(callback, done), outputs=simple_outputs())
    result, error = done.get(timeout=30)
    assert error is None
    assert_sum_and_difference(result)
    client.close()


def test_health_metadata_client(server: BitserveServer) -> None:
    """simple_grpc_health_metadata (its check that the server is named "triton" aside)."""
    client = grpcclient.InferenceServerClient(server.grpc_target)
    assert client.is_server_live(headers={"test": "1", "dummy": "2"})
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert client.get_server_metadata().name == "bitserve"
    meta = client.get_model_metadata("simple", headers={"test": "1", "dummy": "2"})
    assert meta.name == "simple"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])
    ]  # fmt: skip
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("wrong_model_name")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model" in str(e.value.message())
    assert client.get_model_config("simple").config.name == "simple"
    client.close()


def test_model_control_client(server_factory: Any, repo: Path) -> None:
    """simple_grpc_model_control (its count of Triton's example models aside; model files
    sent with a load are refused, INVALID_ARGUMENT, where Triton polls them: INTERNAL)."""
    s = server_factory(repo, args=["--workers", "2"])
    client = grpcclient.InferenceServerClient(s.grpc_target)
    assert len(client.get_model_repository_index().models) == 2
    client.load_model("simple")
    assert client.is_model_ready("simple")
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    # the change reached both workers, not only the one behind this gRPC channel: fresh
    # HTTP connections, which the kernel spreads over the workers, agree
    answers = {}
    for _ in range(16):
        r = httpx.get(f"{s.url}/v2/models/simple/ready", timeout=30)
        answers[r.headers.get("x-bitserve-worker", "-")] = r.status_code
    assert answers == {"0": 503, "1": 503}
    assert client.is_server_ready()  # a model unloaded on purpose does not count
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index == {"simple": "UNAVAILABLE", "demo": "READY"}
    client.load_model("simple")
    assert client.is_model_ready("simple")
    with pytest.raises(InferenceServerException) as e:  # not JSON
        client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    assert "failed to load" in str(e.value.message())
    client.load_model("simple", config='{"max_batch_size":"16"}')
    assert client.get_model_config("simple").config.max_batch_size == 16
    with pytest.raises(InferenceServerException) as e:
        client.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "failed to load" in str(e.value.message())
    assert client.is_server_live()
    with pytest.raises(InferenceServerException) as e:
        client.load_model("wrong_model_name")
    assert "failed to load" in str(e.value.message())
    client.close()


def test_shm_client(server_factory: Any, repo: Path) -> None:
    """simple_grpc_shm_client: inputs read from and outputs written to system shared memory."""
    s = server_factory(repo, args=["--allow-client-shm"])
    client = grpcclient.InferenceServerClient(s.grpc_target)
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    a, b = A[0], B[0]
    nbytes = a.nbytes
    tag = f"bitserve-test-{os.getpid()}"
    out_handle = shm.create_shared_memory_region("output_data", f"/{tag}-out", nbytes * 2)
    in_handle = shm.create_shared_memory_region("input_data", f"/{tag}-in", nbytes * 2)
    try:
        client.register_system_shared_memory("output_data", f"/{tag}-out", nbytes * 2)
        shm.set_shared_memory_region(in_handle, [a])
        shm.set_shared_memory_region(in_handle, [b], offset=nbytes)
        client.register_system_shared_memory("input_data", f"/{tag}-in", nbytes * 2)
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
                  grpcclient.InferInput("INPUT1", [1, 16], "INT32")]  # fmt: skip
        inputs[0].set_shared_memory("input_data", nbytes)
        inputs[1].set_shared_memory("input_data", nbytes, offset=nbytes)
        outputs = simple_outputs()
        outputs[0].set_shared_memory("output_data", nbytes)
        outputs[1].set_shared_memory("output_data", nbytes, offset=nbytes)
        result = client.infer("simple", inputs, outputs=outputs)
        got = []
        for k, name in enumerate(("OUTPUT0", "OUTPUT1")):
            out = result.get_output(name)
            dtype = triton_to_np_dtype(out.datatype)
            got.append(shm.get_contents_as_numpy(out_handle, dtype, out.shape, offset=k * nbytes))
        np.testing.assert_array_equal(got[0][0], a + b)
        np.testing.assert_array_equal(got[1][0], a - b)
        status = client.get_system_shared_memory_status()
        assert sorted(status.regions) == ["input_data", "output_data"]
        assert status.regions["input_data"].byte_size == 2 * nbytes
        client.unregister_system_shared_memory()
        assert not client.get_system_shared_memory_status().regions
    finally:
        shm.destroy_shared_memory_region(in_handle)
        shm.destroy_shared_memory_region(out_handle)
        client.close()


def test_keepalive_client(server: BitserveServer) -> None:
    """simple_grpc_keepalive_client: the example's keepalive options."""
    options = grpcclient.KeepAliveOptions(
        keepalive_time_ms=2**31 - 1,
        keepalive_timeout_ms=20000,
        keepalive_permit_without_calls=False,
        http2_max_pings_without_data=2,
    )
    client = grpcclient.InferenceServerClient(server.grpc_target, keepalive_options=options)
    assert_sum_and_difference(
        client.infer("simple", simple_inputs(), outputs=simple_outputs(), headers={"test": "1"})
    )
    client.close()


def test_custom_args_client(server: BitserveServer) -> None:
    """simple_grpc_custom_args_client: the example's channel arguments."""
    channel_args = [
        ("grpc.max_send_message_length", 1024 * 1024),
        ("grpc.max_receive_message_length", 1024 * 1024),
        ("grpc.keepalive_time_ms", 2**31 - 1),
        ("grpc.keepalive_timeout_ms", 20000),
        ("grpc.keepalive_permit_without_calls", False),
        ("grpc.http2.max_pings_without_data", 2),
        ("grpc.dns_enable_srv_queries", 1),
    ]
    client = grpcclient.InferenceServerClient(server.grpc_target, channel_args=channel_args)
    assert_sum_and_difference(
        client.infer("simple", simple_inputs(), outputs=simple_outputs(), headers={"test": "1"})
    )
    client.close()


# --- streaming, the demo model, batching -----------------------------------------------------


def test_sync_stream_in_request_order(server: BitserveServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_target)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    rng = np.random.default_rng(0)
    sent = []
    for i in range(24):
        a = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
        b = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
        model = "nope" if i == 5 else "simple"
        client.async_stream_infer(
            model,
            simple_inputs(grpcclient, a, b),
            request_id=f"r{i}",
            enable_empty_final_response=i % 2 == 1,  # what perf_analyzer sends over gRPC
        )
        sent.append((a, b))
    got = [results.get(timeout=60) for _ in sent]
    client.stop_stream()
    client.close()
    for i, ((result, error), (a, b)) in enumerate(zip(got, sent, strict=True)):
        if i == 5:
            assert result is None
            assert "nope" in str(error)
            continue
        assert error is None
        response = result.get_response()
        assert response.id == f"r{i}"
        assert_sum_and_difference(result, a, b)
        final = response.parameters.get("triton_final_response")
        assert (final.bool_param if final is not None else None) == (True if i % 2 else None)


def test_aio_stream(server: BitserveServer) -> None:
    async def requests() -> Any:
        for i in range(10):
            yield {"model_name": "simple", "inputs": simple_inputs(grpcaio), "request_id": str(i)}

    async def main() -> list[str]:
        client = grpcaio.InferenceServerClient(server.grpc_target)
        ids = []
        try:
            async for result, error in client.stream_infer(requests()):
                assert error is None
                assert_sum_and_difference(result)
                ids.append(result.get_response().id)
        finally:
            await client.close()
        return ids

    assert asyncio.run(main()) == [str(i) for i in range(10)]


def test_demo_packed_bits_match_the_float64_reference(server: BitserveServer) -> None:
    """The demo model over gRPC: UINT8 bits packed along the last axis in raw_input_contents,
    exactly as over HTTP; concurrent requests batch together."""
    pool = Pool.make(4)
    client = grpcclient.InferenceServerClient(server.grpc_target)
    meta = client.get_model_metadata("demo")
    (inp,) = meta.inputs
    assert (inp.datatype, list(inp.shape)) == ("UINT8", [-1, *pool.packed.shape[1:]])
    config = client.get_model_config("demo").config
    assert config.parameters["spikes.packing"].string_value == "bits"
    assert config.parameters["spikes.bitorder"].string_value == "big"

    def one(k: int) -> Any:
        x = grpcclient.InferInput("spikes", [1, *pool.packed.shape[1:]], "UINT8")
        x.set_data_from_numpy(pool.packed[k : k + 1])
        return client.infer("demo", [x])

    results: list[Any] = [None] * 8
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, one(i % 4))) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, r in enumerate(results):
        out = r.as_numpy("resampled")
        assert out.shape == (1, *pool.expected.shape[1:])
        assert check(out[0].astype(np.float64), pool.expected[i % 4]) is None
    whole = grpcclient.InferInput("spikes", list(pool.packed.shape), "UINT8")
    whole.set_data_from_numpy(pool.packed)
    out = client.infer("demo", [whole]).as_numpy("resampled")
    for k in range(4):
        assert check(out[k].astype(np.float64), pool.expected[k]) is None
    client.close()


# --- lifecycle and settings ----------------------------------------------------------------


def test_sigterm_drains_in_flight_calls(server_factory: Any, tmp_path: Path) -> None:
    root = write_slow_model(tmp_path / "repo", rounds=12)
    s = server_factory(root)
    client = grpcclient.InferenceServerClient(s.grpc_target)
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    for i in range(3):
        x = grpcclient.InferInput("x", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[i]], np.int32))
        client.async_infer("slow", [x], lambda result, error: done.put((result, error)))
    time.sleep(0.2)  # the calls are in (a batch of the slow model takes about a second)
    s.process.send_signal(signal.SIGTERM)
    answers = [done.get(timeout=120) for _ in range(3)]
    assert [e for _, e in answers] == [None] * 3
    assert sorted(float(r.as_numpy("y")[0, 0]) for r, _ in answers) == [0.0, 1.0, 2.0]
    assert s.process.wait(120) == 0
    log = s.log()
    assert log.index("Shutting down") < log.index("gRPC stopped") < log.index("repository stopped")
    with pytest.raises(InferenceServerException) as e:
        grpcclient.InferenceServerClient(s.grpc_target).is_server_live(client_timeout=2)
    assert e.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    client.close()


def test_grpc_port_settings(server_factory: Any, tmp_path: Path) -> None:
    off = server_factory(args=["--grpc-port", "0"])
    assert "gRPC listening" not in off.log()
    env_port = free_port()
    s = server_factory(env={"BITSERVE_GRPC_PORT": str(env_port)})
    assert s.grpc_port == env_port
    assert grpcclient.InferenceServerClient(f"127.0.0.1:{env_port}").is_server_ready()
    with socket.socket() as taken:  # a port in use: the server stops at start, saying so
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [*bitserve_command(), "serve", "--port", str(free_port()), "--grpc-port", str(port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("BITSERVE_")}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    assert f"gRPC cannot listen on 127.0.0.1:{port}: address already in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_keepalive_settings_govern_client_pings(server_factory: Any, demo_server: Any) -> None:
    """A client pinging every 100 ms on an idle connection: the default server (pings at
    most every 5 minutes, 2 strikes) sends it GOAWAY; a server told to allow such pings keeps
    the connection."""
    relaxed = server_factory(
        args=[
            "--grpc-keepalive-permit-without-calls",
            "--grpc-http2-min-recv-ping-interval-without-data-ms", "50",
        ]
    )  # fmt: skip
    strict = demo_server  # the default keepalive settings

    def transitions(target: str) -> list[grpc.ChannelConnectivity]:
        seen: list[grpc.ChannelConnectivity] = []
        channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.keepalive_time_ms", 100),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
            ],
        )
        channel.subscribe(seen.append, try_to_connect=True)
        time.sleep(6.0)  # the client pings at most once a second; the third strike is GOAWAY
        channel.close()
        return seen

    ready = grpc.ChannelConnectivity.READY
    kept = transitions(relaxed.grpc_target)
    assert kept[-1] == ready, kept
    dropped = transitions(strict.grpc_target)
    assert ready in dropped
    assert dropped[dropped.index(ready) + 1 :] != [], dropped  # GOAWAY: it left READY


def test_fuzzed_bytes_against_the_process(server: BitserveServer) -> None:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    seed = grpcclient.service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        seed.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        seed.raw_input_contents.append(A.tobytes())
    raw = seed.SerializeToString()
    bad = []
    with grpc.insecure_channel(server.grpc_target) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(200):
            body = bytearray(raw)
            for _ in range(int(rng.integers(1, 6))):
                body[int(rng.integers(len(body)))] = int(rng.integers(256))
            try:
                infer(bytes(body), timeout=30)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    bad.append((bytes(body), e.details()))
    assert bad == []
    assert grpcclient.InferenceServerClient(server.grpc_target).is_server_live()
