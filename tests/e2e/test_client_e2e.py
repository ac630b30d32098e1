"""bitserve_client against a real ``bitserve serve`` process on a loopback port.

The repository holds small models (so float64 references are cheap): ``small`` (bits
little-endian), ``tiny_queue`` (max_queue_size 1, to make the server shed load) and ``slow``
(a long batching delay, to make server-side deadlines expire).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bitserve_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidInputError,
    ModelNotFound,
    Retry,
    TimeoutException,
    Unavailable,
)

from harness.repo_utils import bits_input, demo_reference, model_toml, tensor, write_model_folder
from harness.server import BitserveServer, start_server

pytestmark = pytest.mark.e2e

N, B, A, SIGMA = 3, 100, 7, 5.0
SEED = 7


def _config(*, queue: int, delay_us: int, batch: int, bitorder: str) -> str:
    return model_toml(
        max_batch_size=batch,
        max_queue_delay_us=delay_us,
        max_queue_size=queue,
        device="cpu",
        inputs=[bits_input(N, B, bitorder=bitorder)],
        operator={
            "file": "operator.safetensors",
            "response": "gaussian",
            "sigma": SIGMA,
            "support": 4.0,
            "dtype": "float32",
        },
        outputs=[tensor("out", "FP32", [N, A])],
    )


def operator_tensors() -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(SEED)
    x = np.arange(B, dtype=np.float32)
    c = np.sort(rng.uniform(0, B - 1, size=(N, A)), axis=1).astype(np.float32)
    return {"x": x, "c": c}


def reference(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float64 dense reference: out[m, n, a] = sum_b r(c[n, a] - x[b]) * f[m, n, b]."""
    t = operator_tensors()
    d = t["c"].astype(np.float64)[:, :, None] - t["x"].astype(np.float64)[None, None, :]
    r = np.exp(-0.5 * (d / SIGMA) ** 2) * (np.abs(d) <= 4.0 * SIGMA)
    return np.einsum("nab,mnb->mna", r, bits.astype(np.float64))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    models = {
        "small": _config(queue=128, delay_us=2000, batch=8, bitorder="little"),
        "tiny_queue": _config(queue=1, delay_us=20000, batch=1, bitorder="big"),
        "slow": _config(queue=128, delay_us=3_000_000, batch=8, bitorder="big"),
    }
    for name, text in models.items():
        write_model_folder(root / name, text, operator_tensors(), "operator.safetensors")
    return root


@pytest.fixture(scope="module")
def url(repository: Path) -> Iterator[str]:
    with start_server(repository, args=["--no-warmup"], log_dir=repository) as server:
        yield server.url


def random_bits(m: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).random((m, N, B)) < 0.3


def test_round_trip_equals_float64_reference(url: str) -> None:
    bits = random_bits(5)
    with Client(url) as client:
        result = client.infer("small", {"bits": bits}, request_id="e2e-1")
        assert (result.model_name, result.id) == ("small", "e2e-1")
        np.testing.assert_allclose(result["out"], reference(bits), rtol=1e-5, atol=1e-4)
        single = client.infer("small", bits[0])
        assert single["out"].shape == (N, A)
        np.testing.assert_allclose(single["out"], reference(bits[:1])[0], rtol=1e-5, atol=1e-4)
        as_json = client.infer("small", bits, binary=False)
        np.testing.assert_array_equal(as_json["out"], result["out"])


def test_packed_and_unpacked_inputs_are_identical(url: str) -> None:
    bits = random_bits(4, seed=1)
    with Client(url, compression="gzip") as client:
        a = client.infer("small", bits)
        b = client.infer("small", np.packbits(bits, axis=-1, bitorder="little"))
        c = client.infer("small", bits.astype(np.float32))
    np.testing.assert_array_equal(a["out"], b["out"])
    np.testing.assert_array_equal(a["out"], c["out"])


def test_async_client_round_trip(url: str) -> None:
    bits = random_bits(6, seed=2)

    async def run() -> list[np.ndarray[Any, Any]]:
        async with AsyncClient(url) as client:
            results = await asyncio.gather(
                *(client.infer("small", bits[i : i + 2]) for i in range(0, 6, 2))
            )
        return [r["out"] for r in results]

    out = np.concatenate(asyncio.run(run()))
    np.testing.assert_allclose(out, reference(bits), rtol=1e-5, atol=1e-4)


def test_server_errors_carry_the_server_text(url: str) -> None:
    with Client(url) as client:
        with pytest.raises(ModelNotFound) as info:
            client.infer("no_such_model", random_bits(1)[0])
        assert info.value.status == 404
        assert "no_such_model" in info.value.message
        with pytest.raises(ModelNotFound):
            client.model_metadata("small", version="9")
        with pytest.raises(InvalidInputError, match=r"expects bits of shape \[batch, 3, 100\]"):
            client.infer("small", np.zeros((1, N, 99), bool))  # refused locally


def test_retries_get_through_a_tiny_queue(url: str, caplog: pytest.LogCaptureFixture) -> None:
    bits = random_bits(1, seed=3)
    expected = reference(bits)[0]
    retry = Retry(retries=30, backoff=0.05, max_backoff=0.5)
    with (
        Client(url, retries=retry) as client,
        caplog.at_level("INFO", "bitserve_client"),
        ThreadPoolExecutor(8) as pool,
    ):
        outs = list(pool.map(lambda _: client.infer("tiny_queue", bits[0])["out"], range(24)))
    for out in outs:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    assert any("retry" in r.message for r in caplog.records), "the queue never overflowed"


def test_tiny_queue_without_retries_raises_unavailable(url: str) -> None:
    bits = random_bits(1, seed=4)[0]
    with Client(url, retries=0) as client, ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.infer, "tiny_queue", bits) for _ in range(24)]
        errors = [f.exception() for f in futures]
    refused = [e for e in errors if e is not None]
    assert refused, "the queue never overflowed"
    assert all(isinstance(e, Unavailable) and e.status == 503 for e in refused)
    assert all(e.retry_after is not None for e in refused if isinstance(e, Unavailable))


def test_client_timeout_raises_timeout_exception(url: str) -> None:
    # The "slow" model waits up to 3 s for a batch to fill: a 0.3 s read timeout fires first.
    with Client(url, timeout=0.3, retries=0) as client:
        client.model_spec("slow")
        with pytest.raises(TimeoutException):
            client.infer("slow", random_bits(1)[0])


def test_server_deadline_raises_deadline_exceeded(url: str) -> None:
    with Client(url, timeout=30) as client, pytest.raises(DeadlineExceeded) as info:
        client.infer("slow", random_bits(1)[0], deadline=0.05)
    assert info.value.status == 504
    assert isinstance(info.value, TimeoutError)


def test_infer_many_over_a_memmap_keeps_order(url: str, tmp_path: Path) -> None:
    src = tmp_path / "bits.npy"
    bits = random_bits(203, seed=5)
    np.save(src, bits)
    out = tmp_path / "out.npy"
    with Client(url) as client:
        result = client.infer_many(
            "small", str(src), batch_size=6, concurrency=4, progress=False, out=out
        )
    expected = reference(bits)
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(result["out"], expected, rtol=1e-5, atol=1e-4)

    async def run() -> dict[str, np.ndarray[Any, Any]]:
        async with AsyncClient(url) as client:
            mm = np.load(src, mmap_mode="r")
            return await client.infer_many("small", mm, batch_size=8, concurrency=3, progress=False)

    np.testing.assert_array_equal(asyncio.run(run())["out"], np.load(out))


CLI = "import sys; from bitserve_client._cli import main; sys.exit(main())"


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    # The installed console script when there is one, else the same entry point via -c.
    script = Path(sys.executable).parent / "bitserve-client"
    command = [str(script)] if script.exists() else [sys.executable, "-c", CLI]
    return subprocess.run(
        [*command, "--url", url, *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_commands(url: str, tmp_path: Path) -> None:
    health = _cli(url, "health", "--model", "small")
    assert health.returncode == 0, health.stderr
    assert "model small ready: yes" in health.stdout
    meta = _cli(url, "metadata", "small")
    assert meta.returncode == 0, meta.stderr
    assert '"packing": "bits"' in meta.stdout
    bits = random_bits(2, seed=6)
    np.save(tmp_path / "b.npy", bits)
    infer = _cli(
        url,
        "infer",
        "small",
        "--input",
        f"bits={tmp_path / 'b.npy'}",
        "--output",
        str(tmp_path / "o.npz"),
    )
    assert infer.returncode == 0, infer.stderr
    with np.load(tmp_path / "o.npz") as saved:
        np.testing.assert_allclose(saved["out"], reference(bits), rtol=1e-5, atol=1e-4)
    bench = _cli(
        url, "bench", "small", "--requests", "20", "--concurrency", "4", "--batch-size", "2"
    )
    assert bench.returncode == 0, bench.stderr
    assert "requests: 20 ok, 0 failed" in bench.stdout
    assert "latency ms: p50" in bench.stdout
    missing = _cli(url, "metadata", "nope")
    assert missing.returncode == 1
    assert "ModelNotFound" in missing.stderr


def test_demo_model_round_trip(demo_server: BitserveServer) -> None:
    bits = np.random.default_rng(8).random((2, 20, 50000)) < 0.01
    with Client(demo_server.url) as client:
        spec = client.model_spec("demo")
        assert spec.inputs["spikes"].packing is not None
        result = client.infer("demo", {"spikes": bits})
        packed = client.infer("demo", {"spikes": np.packbits(bits, axis=-1)})
    assert result["resampled"].shape == (2, 20, 500)
    np.testing.assert_array_equal(result["resampled"], packed["resampled"])
    np.testing.assert_allclose(result["resampled"], demo_reference(bits), rtol=1e-4, atol=1e-3)
