"""The bitserve-client CLI against the fake V2 server (MockTransport)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from bitserve_client._bench import BenchStats, random_inputs
from bitserve_client._cli import main
from bitserve_client._spec import parse_model_spec

from .conftest import rows
from .fake_v2 import FakeV2, reference_bits, reference_multi

ROOT = Path(__file__).resolve().parents[2]


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


def test_health_of_a_model_is_its_own_readiness(capsys: pytest.CaptureFixture[str]) -> None:
    """Another model that failed to load keeps a strict server not ready; ``--model M`` says
    whether M serves (exit 0 when it is ready)."""
    fake = FakeV2()
    not_ready = httpx.Response(503, json={"error": "model 'other' version 1 failed to load"})
    fake.script += [httpx.Response(200), not_ready]
    assert run(fake, "health", "--model", "bits") == 0
    assert capsys.readouterr().out.splitlines() == [
        "live: yes",
        "ready: no",
        "model bits ready: yes",
    ]
    fake.script += [httpx.Response(200), httpx.Response(200), httpx.Response(503, json={})]
    assert run(fake, "health", "--model", "bits") == 1
    assert "model bits ready: no" in capsys.readouterr().out


def test_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(FakeV2(), "metadata", "bits", "--config") == 0
    out = capsys.readouterr().out
    assert '"packing": "bits"' in out
    assert '"max_batch_size": 8' in out
    assert run(FakeV2(), "metadata", "nope") == 1
    assert "ModelNotFound" in capsys.readouterr().err


def test_repository_commands(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeV2()
    assert run(fake, "unload", "plain") == 0
    assert run(fake, "index", "--ready") == 0
    out = capsys.readouterr().out
    index = json.loads(out[out.index("[") :])
    assert [m["name"] for m in index] == ["bits", "multi"]
    assert run(fake, "load", "plain", "--config", '{"max_batch_size": 2}') == 0
    assert fake.load_bodies == [{"parameters": {"config": '{"max_batch_size": 2}'}}]
    assert run(fake, "load", "nope") == 1
    assert "failed to load" in capsys.readouterr().err


def test_infer_writes_exactly_the_output_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bits = rows(2)
    np.save(tmp_path / "x.npy", bits)
    out = tmp_path / "outx"  # no .npz suffix: np.savez(path) would have written outx.npz
    assert (
        run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out))
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outx", "x.npy"]
    assert f"wrote count, first to {out}" in capsys.readouterr().out
    with np.load(out) as saved:
        np.testing.assert_array_equal(saved["count"], reference_bits(bits)["count"])
    assert run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'x.npy'}") == 0
    assert "count: int32 [2, 3]" in capsys.readouterr().out


def test_npz_inputs_are_read_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(5)
    a, b = rng.random((3, 2, 10)) < 0.5, rng.random((3, 3)) < 0.5
    w = rng.standard_normal((3, 2)).astype(np.float32)
    np.savez(tmp_path / "in.npz", a=a, b=b, w=w)
    out = tmp_path / "out.npz"
    assert (
        run(FakeV2(), "infer", "multi", "--input", str(tmp_path / "in.npz"), "--output", str(out))
        == 0
    )
    ref = reference_multi(a, b, w)
    with np.load(out) as saved:
        assert sorted(saved.files) == ["count_a", "count_b", "score"]
        for name, expected in ref.items():
            np.testing.assert_array_equal(saved[name], expected)
    # NAME=FILE.npz picks that array; a one-array .npz gives its only array to NAME.
    np.savez(tmp_path / "w_only.npz", weights=w)
    args = ["--input", f"a={tmp_path / 'in.npz'}", "--input", f"b={tmp_path / 'in.npz'}"]
    args += ["--input", f"w={tmp_path / 'w_only.npz'}"]
    assert run(FakeV2(), "infer", "multi", *args) == 0
    assert "score: float32 [3, 2]" in capsys.readouterr().out
    assert run(FakeV2(), "infer", "multi", "--input", f"q={tmp_path / 'in.npz'}") == 1
    assert "has no array 'q'" in capsys.readouterr().err


def test_bad_inputs_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 12), bool))
    assert run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'x.npy'}") == 1
    assert "expects bits of shape" in capsys.readouterr().err
    assert run(FakeV2(), "infer", "bits", "--input", f"x={tmp_path / 'missing.npy'}") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: command"),
        (["infer", "bits", "--input", "no-equals-sign.npy"], "wants NAME=FILE.npy or FILE.npz"),
        (["infer", "bits", "--input", "=x.npy"], "wants [NAME=]PATH"),
        (["infer-many", "bits", "--input", "x.npy"], "--output"),
        (["infer-many", "multi", "--input", "a=a.npy", "--input", "b.npy", "--output", "o.npy"],
         "several --input need a NAME= each"),
        (["load", "bits", "--config", "{nope"], "--config is not JSON"),
        (["load", "bits", "--config", "[1]"], "--config must be a JSON object"),
        (["bench", "bits", "--requests", "many"], "invalid int value"),
    ],
)  # fmt: skip
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeV2()
    assert run(fake, *argv) == 2
    assert message in capsys.readouterr().err
    assert not [r for r in fake.requests if r.url.path.endswith("/infer")]


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(FakeV2(), "--help") == 0
    assert "infer-many" in capsys.readouterr().out


def test_infer_many_from_npy_with_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bits = rows(50, seed=2)
    np.save(tmp_path / "x.npy", bits)
    fake = FakeV2()
    fake.fail_infer_from = 3
    argv = ["infer-many", "bits", "--input", str(tmp_path / "x.npy")]
    argv += ["--output", f"count={tmp_path / 'c.npy'}", "--output", f"first={tmp_path / 'f.npy'}"]
    argv += ["--batch-size", "8", "--concurrency", "1", "--no-progress"]
    assert run(fake, *argv) == 1
    err = capsys.readouterr().err
    assert "BulkInferenceError: infer_many of model 'bits' stopped after 16 of 50 rows" in err
    assert "resume=True" in err
    assert np.load(tmp_path / "c.npy").shape == (16, 3)
    fake.fail_infer_from = None
    assert run(fake, *argv, "--resume") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote 50 rows of count to {tmp_path / 'c.npy'}",
        f"wrote 50 rows of first to {tmp_path / 'f.npy'}",
    ]
    ref = reference_bits(bits)
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), ref["count"])
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), ref["first"])


def test_infer_many_several_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(8)
    a, b = rng.random((11, 2, 10)) < 0.5, rng.random((11, 3)) < 0.5
    w = rng.standard_normal((11, 2)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.savez(tmp_path / "w.npz", w=w)
    argv = ["infer-many", "multi", "--input", f"a={tmp_path / 'a.npy'}"]
    argv += ["--input", f"b={tmp_path / 'b.npy'}", "--input", f"w={tmp_path / 'w.npz'}"]
    argv += ["--output", f"score={tmp_path / 's.npy'}", "--no-progress"]
    assert run(FakeV2(), *argv) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "s.npy"), reference_multi(a, b, w)["score"])
    assert "wrote 11 rows of score" in capsys.readouterr().out


PIPE_SCRIPT = """
import sys
import httpx
from bitserve_client._cli import main
from tests.clients.fake_v2 import FakeV2
sys.stdin.read()  # wait until the test has closed its end of stdout
sys.exit(main(sys.argv[1:], transport=httpx.MockTransport(FakeV2().handler)))
"""


def test_closed_stdout_is_quiet() -> None:
    # `bitserve-client metadata bits | head -0`: the reader is gone before the first write.
    proc = subprocess.Popen(
        [sys.executable, "-c", PIPE_SCRIPT, "--url", "http://fake", "metadata", "bits"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert proc.stdin is not None
    proc.stdout.close()
    proc.stdin.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""


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
