"""Triton's statistics extension and metrics: the counters, their JSON layout and Prometheus
text, adding up worker processes' snapshots, the GPU gauges with a fake NVML, and the counts
the batcher, the real pipeline and the data plane write."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.backends import ModuleModel
from service.batching.batcher import Batcher
from service.errors import InvalidInput
from service.models.builder import build_pipeline
from service.models.config import ModelConfig
from service.models.files import Artifacts
from service.models.signature import Bound, WireInput
from service.observability.gpu_gauges import GpuGauges
from service.observability.metrics import Metrics
from service.observability.statistics import ModelStats, Snapshot, Statistics, merge, triton_metrics
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Prometheus text -> {family name: {sorted labels: value}}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(fam.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


# --- the counters -------------------------------------------------------------------------


def test_counts_follow_tritons_meanings() -> None:
    s = ModelStats("m", "2")
    before = time.time_ns() // 1_000_000
    s.request_done(True, 7_000)
    s.request_done(True, 9_000)
    s.request_done(False, 1_000)
    s.queued(3, 4_500)
    s.executed(5, 2, 100, 200, 300)  # 5 items from 2 requests
    s.executed(1, 1, 10, 20, 30)
    t = s.snapshot().triton()
    assert t["name"] == "m"
    assert t["version"] == "2"
    assert before <= t["last_inference"] <= time.time_ns() // 1_000_000
    assert t["inference_count"] == 6
    assert t["execution_count"] == 2
    inf = t["inference_stats"]
    assert inf["success"] == {"count": 2, "ns": 16_000}
    assert inf["fail"] == {"count": 1, "ns": 1_000}
    assert inf["queue"] == {"count": 3, "ns": 4_500}
    # A batch's phase durations count once for every request it computed (Triton's way).
    assert inf["compute_input"] == {"count": 3, "ns": 2 * 100 + 10}
    assert inf["compute_infer"] == {"count": 3, "ns": 2 * 200 + 20}
    assert inf["compute_output"] == {"count": 3, "ns": 2 * 300 + 30}
    assert [b["batch_size"] for b in t["batch_stats"]] == [1, 5]
    five = t["batch_stats"][1]
    assert five["compute_input"] == {"count": 1, "ns": 100}
    assert five["compute_infer"] == {"count": 1, "ns": 200}
    assert five["compute_output"] == {"count": 1, "ns": 300}
    json.dumps(t)  # JSON-ready as it is


def test_snapshots_of_workers_add_up_and_travel_as_json() -> None:
    a, b = ModelStats("m", "1"), ModelStats("m", "1")
    a.request_done(True, 10)
    a.executed(4, 4, 1, 2, 3)
    b.request_done(False, 5)
    b.executed(4, 1, 10, 20, 30)
    b.executed(2, 2, 7, 7, 7)
    sa, sb = a.snapshot(), b.snapshot()
    sb.last_inference_ms = sa.last_inference_ms + 1000  # a later batch in the other worker
    total = Snapshot.from_dict(json.loads(json.dumps(sa.to_dict()))) + sb
    assert total.success_count == 1
    assert total.fail_count == 1
    assert total.fail_ns == 5
    assert total.execution_count == 3
    assert total.inference_count == 10
    assert total.compute_count == 7
    assert total.compute_input_ns == 4 * 1 + 1 * 10 + 2 * 7
    assert total.batches == {4: [2, 11, 22, 33], 2: [1, 7, 7, 7]}
    assert total.last_inference_ms == sb.last_inference_ms  # the latest, not a sum
    # The operands are left as they were.
    assert sa.batches == {4: [1, 1, 2, 3]}
    # merge() adds per version, keeping other versions apart.
    c = ModelStats("m", "2").snapshot()
    merged = merge([sa, c, sb])
    assert [(s.name, s.version) for s in merged] == [("m", "1"), ("m", "2")]
    assert merged[0].to_dict() == total.to_dict()
    with pytest.raises(ValueError, match="cannot add"):
        sa + c


def test_statistics_keep_counts_across_reloads_and_forget_unloaded_models() -> None:
    stats = Statistics()
    stats.for_version("m", "10").request_done(True, 1)
    stats.for_version("m", "2").request_done(True, 1)
    stats.for_version("n", "1")
    assert stats.for_version("m", "10").success_count == 1  # the same counters again
    assert [(s.name, s.version) for s in stats.snapshots()] == [("m", "2"), ("m", "10"), ("n", "1")]
    stats.forget("m")
    assert [(s.name, s.version) for s in stats.snapshots()] == [("n", "1")]


def test_triton_metric_names_and_values() -> None:
    s = ModelStats('we"ird\\name', "3")
    s.request_done(True, 12_345)
    s.request_done(False, 999)
    s.queued(1, 2_999)
    s.executed(4, 1, 1_000, 2_000, 3_999)
    text = triton_metrics([s.snapshot()]).decode()
    # Triton's names as they are: no "_total" added to the counters' sample lines.
    assert '\nnv_inference_request_success{model="we\\"ird\\\\name",version="3"} 1\n' in text
    assert "_total" not in text
    got = families(text)
    labels = (("model", 'we"ird\\name'), ("version", "3"))
    expected = {
        "nv_inference_request_success": 1,
        "nv_inference_request_failure": 1,
        "nv_inference_count": 4,
        "nv_inference_exec_count": 1,
        "nv_inference_request_duration_us": 12,  # of the successes, in whole µs
        "nv_inference_queue_duration_us": 2,
        "nv_inference_compute_input_duration_us": 1,
        "nv_inference_compute_infer_duration_us": 2,
        "nv_inference_compute_output_duration_us": 3,
    }
    assert {name: got[name][labels] for name in expected} == expected


# --- the GPU gauges -----------------------------------------------------------------------


class FakeNvml:
    """What GpuGauges uses of pynvml, for two GPUs (the second one's reading can fail)."""

    def __init__(self, *, init_error: bool = False, broken: int | None = None) -> None:
        self.init_error = init_error
        self.broken = broken

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if self.init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - pynvml's names
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802 - pynvml's names
        return i

    def nvmlDeviceGetUUID(self, h: int) -> Any:  # noqa: N802 - pynvml's names
        return f"GPU-{h:08d}" if h == 0 else f"GPU-{h:08d}".encode()  # old bindings: bytes

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802 - pynvml's names
        if h == self.broken:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(gpu=37 + h, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802 - pynvml's names
        return SimpleNamespace(total=(80 << 30) + h, used=123_456_789_012 + h, free=0)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802 - pynvml's names
        return 81_619 + h  # milliwatts


def test_gpu_gauges_with_a_fake_nvml() -> None:
    gauges = GpuGauges(FakeNvml())
    assert gauges.available
    got = families(gauges.render().decode())
    for i in range(2):
        label = (("gpu_uuid", f"GPU-{i:08d}"),)
        assert got["nv_gpu_utilization"][label] == pytest.approx((37 + i) / 100)
        assert got["nv_gpu_memory_total_bytes"][label] == (80 << 30) + i
        assert got["nv_gpu_memory_used_bytes"][label] == 123_456_789_012 + i  # exact
        assert got["nv_gpu_power_usage"][label] == pytest.approx((81_619 + i) / 1000)


def test_gpu_gauges_leave_out_a_failing_gpu_and_are_absent_without_nvml() -> None:
    got = families(GpuGauges(FakeNvml(broken=1)).render().decode())
    assert list(got["nv_gpu_utilization"]) == [(("gpu_uuid", "GPU-00000000"),)]
    for absent in (GpuGauges(FakeNvml(init_error=True)), GpuGauges(None)):
        assert not absent.available
        assert absent.render() == b""
    # The real binding on this host: a CPU host has no GPU gauges, and that is no error.
    GpuGauges().render()


def test_metrics_render_bitserve_then_triton_then_gpu() -> None:
    m = Metrics(nvml=FakeNvml())
    m.statistics.for_version("demo", "1").request_done(True, 2_000)
    got = families(m.render().decode())
    assert "bitserve_in_flight_requests" in got
    assert got["nv_inference_request_success"][(("model", "demo"), ("version", "1"))] == 1
    assert len(got["nv_gpu_power_usage"]) == 2
    assert "nv_gpu_utilization" not in families(Metrics(nvml=None).render().decode())


# --- the writers: batcher and pipeline ----------------------------------------------------


def test_batcher_counts_queue_waits_once_per_batch() -> None:
    stats = ModelStats("m", "1")

    async def main() -> None:
        b: Batcher[int, int] = Batcher(
            "m",
            lambda xs: xs,
            max_batch_size=4,
            max_queue_delay_us=20_000,
            max_queue_size=16,
            stats=stats,
        )
        b.start()
        t0 = time.perf_counter_ns()
        await asyncio.gather(*(b.submit(i) for i in range(3)))
        elapsed = time.perf_counter_ns() - t0
        await b.stop()
        assert stats.queue_count == 3
        # Each waited about the batch's delay (the first the whole of it), never longer
        # than the test itself.
        assert 3 * 15_000_000 <= stats.queue_ns <= 3 * elapsed

    asyncio.run(main())


def test_the_pipeline_times_its_three_phases_once_per_batch() -> None:
    cfg = ModelConfig.model_validate(
        {
            "max_batch_size": 8,
            "device": "cpu",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
            "model": {"file": "m.pt"},
            "outputs": [{"name": "y", "datatype": "FP32"}],
        }
    )

    class Double:
        def __call__(self, x: Any) -> Any:
            time.sleep(0.002)  # compute_infer: at least 2 ms
            return x * 2

        def to(self, device: Any) -> Double:
            return self

        def eval(self) -> None:
            pass

    pipe = build_pipeline("m", cfg, Artifacts({}, ModuleModel(Double())), "cpu", warmup=False)
    pipe.stats = stats = ModelStats("m", "1")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    bound = [Bound((WireInput(x[i : i + 1], False),), (0,), 1) for i in range(2)]
    out = pipe.run(bound)
    np.testing.assert_array_equal(np.concatenate([o[0] for o in out]), 2 * x)
    assert stats.execution_count == 1
    assert stats.inference_count == 2
    assert stats.compute_count == 2
    (row,) = stats.snapshot().batches.values()
    assert row[0] == 1
    assert all(ns > 0 for ns in row[1:])
    assert row[2] >= 2_000_000
    assert stats.compute_infer_ns == 2 * row[2]  # added once per request of the batch
    pipe.run(bound[:1])
    assert sorted(stats.snapshot().batches) == [1, 2]


@pytest.mark.needs_cuda
def test_the_pipeline_times_its_phases_with_cuda_events() -> None:
    import torch

    cfg = ModelConfig.model_validate(
        {
            "max_batch_size": 4,
            "device": "cuda",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1 << 20]}],
            "model": {"file": "m.pt"},
            "outputs": [{"name": "y", "datatype": "FP32"}],
        }
    )

    class Heavy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(50):  # enough device work to time
                x = torch.sin(x) + 1
            return x

    pipe = build_pipeline("m", cfg, Artifacts({}, ModuleModel(Heavy())), "cuda:0", warmup=True)
    pipe.stats = stats = ModelStats("m", "1")
    x = np.random.default_rng(0).random((2, 1 << 20), dtype=np.float32)
    out = pipe.run([Bound((WireInput(x, False),), (0,), 2)])
    ref = x.copy()
    for _ in range(50):
        ref = np.sin(ref) + 1
    np.testing.assert_allclose(out[0][0], ref, rtol=1e-5, atol=1e-5)
    (row,) = stats.snapshot().batches.values()
    assert row[0] == 1
    assert all(ns > 0 for ns in row[1:])  # each phase took device time
    assert row[2] > row[3]  # 50 kernels over 8 MiB take longer than copying it back


@pytest.mark.needs_cuda
def test_gpu_gauges_on_a_gpu() -> None:
    gauges = GpuGauges()
    assert gauges.available
    got = families(gauges.render().decode())
    assert all(total > 1 << 30 for total in got["nv_gpu_memory_total_bytes"].values())
    assert set(got) == {
        "nv_gpu_utilization",
        "nv_gpu_memory_total_bytes",
        "nv_gpu_memory_used_bytes",
        "nv_gpu_power_usage",
    }


# --- the routes, in process ---------------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    metrics = Metrics(nvml=None)
    repo = FakeRepository(metrics.statistics)
    app = in_process_app(Settings(access_log=False), repo, metrics=metrics)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c


async def infer(client: httpx.AsyncClient, data: list[int], model: str = "echo") -> int:
    body = {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1, 4], "data": data}]}
    return (await client.post(f"/v2/models/{model}/infer", json=body)).status_code


@pytest.mark.anyio
async def test_statistics_routes(client: httpx.AsyncClient) -> None:
    assert await infer(client, [1, 2, 3, 4]) == 200
    assert await infer(client, [1, 2, 3, 4]) == 200
    assert await infer(client, [1, 2, 3, 999]) == 400  # refused by the decoder: a failure
    one = (await client.get("/v2/models/echo/stats")).json()
    (entry,) = one["model_stats"]
    assert entry["name"] == "echo"
    assert entry["version"] == "1"
    inf = entry["inference_stats"]
    assert inf["success"]["count"] == 2
    assert inf["success"]["ns"] > 0
    assert inf["fail"]["count"] == 1
    assert inf["queue"]["count"] == 2
    assert entry["inference_count"] == 2
    assert entry["execution_count"] == 2
    assert set(DURATIONS) <= set(inf)
    assert entry["batch_stats"][0]["batch_size"] == 1
    assert (await client.get("/v2/models/echo/versions/1/stats")).json() == one
    every = (await client.get("/v2/models/stats")).json()
    assert [e["name"] for e in every["model_stats"]] == ["boom", "echo"]
    for path in ("/v2/models/nope/stats", "/v2/models/nope/versions/1/stats"):
        resp = await client.get(path)
        assert resp.status_code == 404, path
        assert resp.json()["error"].startswith("Request for unknown model"), path
    meta = (await client.get("/v2")).json()
    assert "statistics" in meta["extensions"]


@pytest.mark.anyio
async def test_metrics_carry_tritons_names_next_to_bitserves(client: httpx.AsyncClient) -> None:
    assert await infer(client, [9, 9, 9, 9]) == 200
    got = families((await client.get("/metrics")).text)
    assert got["nv_inference_request_success"][(("model", "echo"), ("version", "1"))] == 1
    assert got["nv_inference_exec_count"][(("model", "echo"), ("version", "1"))] == 1
    assert got["bitserve_requests"][(("model", "echo"), ("outcome", "success"))] == 1


def test_transports_that_decode_on_their_own_are_counted_too() -> None:
    # gRPC decodes its own messages and frames its own answers: what it hands the data plane
    # (DataPlane.infer_with) is counted in the statistics as REST's requests are.
    from service.dataplane import DataPlane
    from service.protocol.types import InferRequest, RequestInput

    async def main() -> None:
        repo = FakeRepository()
        dp = DataPlane(repo, Metrics(nvml=None))
        handle = repo.models["echo"]
        x = np.ones((1, 4), np.uint8)

        async def run(name: str) -> None:
            async def decode(h: Any) -> InferRequest:
                return InferRequest(id=None, inputs=[RequestInput(name, "UINT8", (1, 4), x)])

            async def encode(h: Any, request: InferRequest, response: Any) -> None:
                return None

            await dp.infer_with("echo", None, decode, encode)

        await run("x")
        with pytest.raises(InvalidInput, match="missing input 'x'"):
            await run("y")
        await handle.batcher.stop()
        assert (handle.stats.success_count, handle.stats.fail_count) == (1, 1)

    asyncio.run(main())
