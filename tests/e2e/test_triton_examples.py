"""Triton's HTTP client examples, as our own tests: the calls that ``simple_http_infer_client``,
``simple_http_aio_infer_client``, ``simple_http_async_infer_client``,
``simple_http_health_metadata``, ``simple_http_model_control`` and ``simple_http_shm_client``
(triton-inference-server/client, ``src/python/examples``) make, with the unmodified
``tritonclient.http``, against a real ``bitserve serve`` holding Triton's "simple" model as
TorchScript. Only the examples' check that the server is named "triton" is left out. Also the
extensions those examples lean on: statistics, Triton's metric names, logging, and the
SDK's packing of several inputs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
import tritonclient.utils.shared_memory as shm
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from harness.server import BitserveServer, start_server
from tests.e2e.triton_simple import write_simple

pytestmark = pytest.mark.e2e

INPUT0 = np.arange(16, dtype=np.int32)[None, :]
INPUT1 = np.full((1, 16), -1, dtype=np.int32)
OTHER_MODELS = ("simple_copy", "simple_more")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton-repo")
    for name in ("simple", *OTHER_MODELS):
        write_simple(root, name)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BitserveServer]:
    with start_server(
        repo,
        args=["--allow-client-shm", "--no-access-log"],
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as s:
        yield s


@pytest.fixture
def client(server: BitserveServer) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(server.host_port)
    yield c
    c.close()


def inputs(binary0: bool = False, binary1: bool = True) -> list[httpclient.InferInput]:
    a = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    a.set_data_from_numpy(INPUT0, binary_data=binary0)
    b = httpclient.InferInput("INPUT1", [1, 16], "INT32")
    b.set_data_from_numpy(INPUT1, binary_data=binary1)
    return [a, b]


def check_sum_and_difference(result: httpclient.InferResult) -> None:
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), INPUT0 + INPUT1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), INPUT0 - INPUT1)


# --- simple_http_health_metadata --------------------------------------------------------------


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live(query_params={"test_1": 1, "test_2": 2})
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    meta = client.get_server_metadata()
    assert meta["name"] == "bitserve"  # the one check of the example left out ("triton")
    for ext in ("statistics", "logging", "system_shared_memory", "model_repository"):
        assert ext in meta["extensions"]
    model = client.get_model_metadata("simple", query_params={"test_1": 1, "test_2": 2})
    assert model["name"] == "simple"
    assert [i["name"] for i in model["inputs"]] == ["INPUT0", "INPUT1"]
    assert [o["shape"] for o in model["outputs"]] == [[-1, 16], [-1, 16]]
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in info.value.message()


def test_head_on_health_routes_and_no_redirects(server: BitserveServer) -> None:
    for path in ("/v2/health/live", "/v2/health/ready"):
        resp = httpx.head(server.url + path)
        assert resp.status_code == 200
        assert resp.content == b""
    for path in ("/v2/", "/v2/models/simple/", "/v2/models/simple/versions/1/stats/"):
        resp = httpx.get(server.url + path, headers={"Host": "evil.example"})
        assert resp.status_code == 200, path  # answered as the path without the slash
        assert "location" not in resp.headers
    # A request without an id gets its X-Request-ID as the response's id.
    body = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}
                       for n in ("INPUT0", "INPUT1")]}  # fmt: skip
    resp = httpx.post(
        server.url + "/v2/models/simple/infer", json=body, headers={"X-Request-ID": "job-7"}
    )
    assert resp.json()["id"] == "job-7"


# --- simple_http_infer_client -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_compression", "response_compression"),
    [(None, None), ("gzip", "deflate"), ("deflate", "gzip")],
)
def test_infer(
    client: httpclient.InferenceServerClient,
    request_compression: str | None,
    response_compression: str | None,
) -> None:
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
    ]
    kw = {
        "query_params": {"test_1": 1, "test_2": 2},
        "request_compression_algorithm": request_compression,
        "response_compression_algorithm": response_compression,
    }
    result = client.infer("simple", inputs(), outputs=outputs, **kw)  # type: ignore[arg-type]
    check_sum_and_difference(result)
    # The response id is the request's X-Request-ID when the request had none.
    assert result.get_response()["id"]
    stats = client.get_inference_statistics(model_name="simple")
    assert len(stats["model_stats"]) == 1
    # Without requested outputs: all of them.
    check_sum_and_difference(client.infer("simple", inputs(), outputs=None, **kw))  # type: ignore[arg-type]
    with pytest.raises(InferenceServerException) as info:
        client.infer("wrong_model_name", inputs(), outputs=outputs)
    assert info.value.message().startswith("Request for unknown model")


# --- simple_http_aio_infer_client -------------------------------------------------------------


def test_aio_infer_in_parallel(server: BitserveServer) -> None:
    async def main() -> None:
        client = aioclient.InferenceServerClient(server.host_port)
        try:

            def fresh(binary0: bool) -> list[aioclient.InferInput]:
                a = aioclient.InferInput("INPUT0", [1, 16], "INT32")
                a.set_data_from_numpy(INPUT0, binary_data=binary0)
                b = aioclient.InferInput("INPUT1", [1, 16], "INT32")
                b.set_data_from_numpy(INPUT1, binary_data=True)
                return [a, b]

            outs = [
                aioclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                aioclient.InferRequestedOutput("OUTPUT1", binary_data=False),
            ]
            first = await client.infer("simple", fresh(False), outputs=outs)
            check_sum_and_difference(first)  # type: ignore[arg-type]
            stats = await client.get_inference_statistics(model_name="simple")
            assert len(stats["model_stats"]) == 1
            with pytest.raises(InferenceServerException) as info:
                await client.infer("wrong_model_name", fresh(False), outputs=outs)
            assert info.value.message().startswith("Request for unknown model")
            both = await asyncio.gather(
                client.infer("simple", fresh(False), outputs=outs),
                client.infer("simple", fresh(True), outputs=None),
            )
            for result in both:
                check_sum_and_difference(result)  # type: ignore[arg-type]
        finally:
            await client.close()

    asyncio.run(main())


# --- simple_http_async_infer_client -----------------------------------------------------------


def test_async_infer_with_concurrency(server: BitserveServer) -> None:
    count = 4
    client = httpclient.InferenceServerClient(server.host_port, concurrency=count)
    try:
        outs = [
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=True),
        ]
        pending = [
            client.async_infer("simple", inputs(True, True), outputs=outs) for _ in range(count)
        ]
        for p in pending:
            check_sum_and_difference(p.get_result())
    finally:
        client.close()


# --- simple_http_shm_client -------------------------------------------------------------------


def test_system_shared_memory(client: httpclient.InferenceServerClient) -> None:
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    a = np.arange(16, dtype=np.int32)
    b = np.ones(16, dtype=np.int32)
    size = a.nbytes
    out_handle = shm.create_shared_memory_region("output_data", "/i12_output_simple", size * 2)
    in_handle = shm.create_shared_memory_region("input_data", "/i12_input_simple", size * 2)
    try:
        client.register_system_shared_memory("output_data", "/i12_output_simple", size * 2)
        shm.set_shared_memory_region(in_handle, [a])
        shm.set_shared_memory_region(in_handle, [b], offset=size)
        client.register_system_shared_memory("input_data", "/i12_input_simple", size * 2)
        ins = [
            httpclient.InferInput("INPUT0", [1, 16], "INT32"),
            httpclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        ins[0].set_shared_memory("input_data", size)
        ins[1].set_shared_memory("input_data", size, offset=size)
        outs = [
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=True),
        ]
        outs[0].set_shared_memory("output_data", size)
        outs[1].set_shared_memory("output_data", size, offset=size)
        result = client.infer("simple", ins, outputs=outs)
        got = []
        for name, offset in (("OUTPUT0", 0), ("OUTPUT1", size)):
            out = result.get_output(name)
            assert out is not None
            assert "data" not in out  # the data is in shared memory only
            assert "binary_data_size" not in out.get("parameters", {})
            got.append(
                shm.get_contents_as_numpy(
                    out_handle, triton_to_np_dtype(out["datatype"]), out["shape"], offset=offset
                )
            )
        np.testing.assert_array_equal(got[0][0], a + b)
        np.testing.assert_array_equal(got[1][0], a - b)
        status = client.get_system_shared_memory_status()
        assert sorted(r["name"] for r in status) == ["input_data", "output_data"]
        assert client.get_cuda_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported"):
            client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64)
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(in_handle)
        shm.destroy_shared_memory_region(out_handle)


# --- statistics, metrics, logging -------------------------------------------------------------


def test_statistics_and_tritons_metrics(
    client: httpclient.InferenceServerClient, server: BitserveServer
) -> None:
    before = client.get_inference_statistics("simple", "1")["model_stats"][0]
    for _ in range(3):
        client.infer("simple", inputs())
    (entry,) = client.get_inference_statistics("simple", "1")["model_stats"]
    assert (entry["name"], entry["version"]) == ("simple", "1")
    inf, was = entry["inference_stats"], before["inference_stats"]
    assert inf["success"]["count"] - was["success"]["count"] == 3
    assert entry["execution_count"] - before["execution_count"] == 3
    assert entry["inference_count"] - before["inference_count"] == 3
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inf[phase]["count"] - was[phase]["count"] == 3, phase
        assert inf[phase]["ns"] > was[phase]["ns"], phase
    assert entry["last_inference"] > 1_600_000_000_000  # ms since the epoch
    assert {b["batch_size"] for b in entry["batch_stats"]} >= {1}
    every = client.get_inference_statistics()["model_stats"]
    assert {e["name"] for e in every} == {"simple", *OTHER_MODELS}
    text = httpx.get(server.url + "/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    labels = (("model", "simple"), ("version", "1"))
    assert samples[("nv_inference_request_success_total", labels)] == inf["success"]["count"]
    assert samples[("nv_inference_exec_count_total", labels)] == entry["execution_count"]
    assert samples[("nv_inference_compute_infer_duration_us_total", labels)] == (
        inf["compute_infer"]["ns"] // 1000
    )
    assert "\nnv_inference_count{" in text  # Triton's name exactly, no "_total"


def test_log_settings(client: httpclient.InferenceServerClient) -> None:
    first = client.get_log_settings()
    assert set(first) == {
        "log_file",
        "log_info",
        "log_warning",
        "log_error",
        "log_verbose_level",
        "log_format",
    }
    changed = client.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
    assert changed == first | {"log_verbose_level": 1, "log_format": "ISO8601"}
    with pytest.raises(InferenceServerException, match="log_info must be a boolean"):
        client.update_log_settings({"log_info": "yes"})
    assert client.update_log_settings(first) == first


def test_bitserve_client_packs_several_inputs(server: BitserveServer) -> None:
    from bitserve_client import Client

    with Client(server.url) as c:
        result = c.infer("simple", {"INPUT0": INPUT0, "INPUT1": INPUT1})
        np.testing.assert_array_equal(result["OUTPUT0"], INPUT0 + INPUT1)
        np.testing.assert_array_equal(result["OUTPUT1"], INPUT0 - INPUT1)
        one = c.infer("simple", {"INPUT0": INPUT0[0], "INPUT1": INPUT1[0]})  # no batch dim
        np.testing.assert_array_equal(one["OUTPUT1"], INPUT0[0] - INPUT1[0])


# --- simple_http_model_control (last: it reloads and unloads "simple") ------------------------


def test_model_control(client: httpclient.InferenceServerClient) -> None:
    assert len(client.get_model_repository_index()) == 1 + len(OTHER_MODELS)
    client.load_model("simple")
    assert client.is_model_ready("simple")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    assert "failed to load" in info.value.message()
    client.load_model("simple", config='{"max_batch_size":"16"}')
    assert client.get_model_config("simple")["max_batch_size"] == 16
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("wrong_model_name")
    assert "failed to load" in info.value.message()
    client.load_model("simple")  # back as on disk
    assert client.get_model_config("simple")["max_batch_size"] == 8
