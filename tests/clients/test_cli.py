"""The bitserve-client CLI against the fake V2 server (MockTransport)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from bitserve_client._cli import BenchStats, main, random_inputs
from bitserve_client._spec import parse_model_spec

from .fake_v2 import FakeV2, reference_bits


def run(fake: FakeV2, *argv: str) -> int:
    return main(["--url", "http://fake", *argv], transport=httpx.MockTransport(fake.handler))


def test_health(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeV2()
    assert run(fake, "health", "--model", "bits") == 0
    assert capsys.readouterr().out.splitlines() == [
        "live: yes",
        "ready: yes",
        "model bits ready: yes",
    ]
    fake.script += [httpx.Response(200), httpx.Response(503, json={"error": "loading"})]
    assert run(fake, "health") == 1
    assert "ready: no" in capsys.readouterr().out


def test_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(FakeV2(), "metadata", "bits", "--config") == 0
    out = capsys.readouterr().out
    assert '"packing": "bits"' in out
    assert '"max_batch_size": 8' in out
    assert run(FakeV2(), "metadata", "nope") == 1
    assert "ModelNotFound" in capsys.readouterr().err


def test_infer_to_npz(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bits = np.random.default_rng(0).random((2, 3, 13)) < 0.5
    np.save(tmp_path / "x.npy", bits)
    out = tmp_path / "out.npz"
    assert (
        run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out))
        == 0
    )
    with np.load(out) as saved:
        np.testing.assert_array_equal(saved["count"], reference_bits(bits)["count"])
    assert run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'x.npy'}") == 0
    assert "count: int32 [2, 3]" in capsys.readouterr().out


def test_infer_reports_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 12), bool))
    assert run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'x.npy'}") == 1
    assert "expects bits of shape" in capsys.readouterr().err
    assert run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'missing.npy'}") == 1
    with pytest.raises(SystemExit):
        run(FakeV2(), "infer", "bits", "--input", "no-equals-sign")


def test_bench_prints_throughput_and_percentiles(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeV2()
    argv = ["bench", "bits", "--requests", "30", "--concurrency", "3", "--batch-size", "4"]
    assert run(fake, *argv, "--no-progress") == 0
    out = capsys.readouterr().out
    assert "requests: 30 ok, 0 failed" in out
    assert "latency ms: p50" in out
    assert len([r for r in fake.requests if r.url.path.endswith("/infer")]) == 31  # + warm-up


def test_bench_counts_errors() -> None:
    fake = FakeV2()
    fake.script += [
        httpx.Response(200, json=fake.metadata("bits")),
        httpx.Response(200, json=fake.config()),
    ]
    fake.script += [httpx.Response(200, content=b"{}")]  # warm-up answer (not checked)
    fake.script += [httpx.Response(500, json={"error": "boom"})] * 2
    assert run(fake, "bench", "bits", "--requests", "5", "--concurrency", "1", "--no-progress") == 1


def test_random_inputs_are_valid_for_the_spec() -> None:
    spec = parse_model_spec(FakeV2().metadata("bits"), FakeV2().config())
    x = random_inputs(spec, 4)["x"]
    assert (x.dtype, x.shape) == (np.uint8, (4, 3, 2))
    plain = random_inputs(parse_model_spec(FakeV2().metadata("plain")), 2)
    assert plain["a"].dtype == np.float32
    assert plain["b"].shape == (2, 4)


def test_bench_stats_summary() -> None:
    stats = BenchStats(latencies=[0.001, 0.002, 0.003, 0.004])
    stats.errors["Unavailable"] += 1
    text = stats.summary(wall_s=2.0, batch_size=8)
    assert "requests: 4 ok, 1 failed in 2.00 s" in text
    assert "throughput: 2.0 req/s, 16.0 items/s" in text
    assert "p50 2.50" in text
    assert "errors: 1 x Unavailable" in text
