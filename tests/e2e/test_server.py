"""A real ``bitserve serve`` process driven by the unmodified ``tritonclient.http`` (sync and
aio) and plain HTTP: metadata, bit-packed inference against a float64 dense reference, binary
and JSON outputs, compression, the raw binary form, errors, batching under concurrency, and
graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as tc
import tritonclient.http.aio as tca
from tritonclient.utils import InferenceServerException

from harness.repo_utils import bits_input, model_toml, tensor, write_model_folder
from harness.server import BitserveServer, wait_begun

pytestmark = pytest.mark.e2e

N, L, A = 3, 100, 7  # functions, bits per function (not a multiple of 8), coarse points
PACKED = (L + 7) // 8
HALF_WIDTH = 6.5


def write_model(root: Path, name: str, *, max_batch_size: int, delay_us: int) -> None:
    """A small bit-packed model with a triangle response (exact float64 reference below)."""
    rng = np.random.default_rng(7)
    x = np.arange(L, dtype=np.float32)
    c = np.sort(rng.uniform(0, L - 1, size=(N, A)), axis=1).astype(np.float32)
    config = model_toml(
        max_batch_size=max_batch_size,
        max_queue_delay_us=delay_us,
        max_queue_size=256,
        device="cpu",
        inputs=[bits_input(N, L, bitorder="big")],
        operator={
            "file": "operator.safetensors",
            "response": "triangle",
            "half_width": HALF_WIDTH,
            "dtype": "float32",
        },
        outputs=[tensor("out", "FP32", [N, A])],
    )
    write_model_folder(root / name / "1", config, {"x": x, "c": c}, "operator.safetensors")


def write_models(root: Path, **models: tuple[int, int]) -> Path:
    """:func:`write_model` each ``name=(max_batch_size, delay_us)`` under ``root``; return it."""
    for name, (max_batch_size, delay_us) in models.items():
        write_model(root, name, max_batch_size=max_batch_size, delay_us=delay_us)
    return root


def reference(root: Path, name: str, bits: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
    """float64 dense einsum: out[m, n, a] = sum_b tri(c[n, a] - x[b]) * f[m, n, b]."""
    from safetensors.numpy import load_file

    t = load_file(str(root / name / "1" / "operator.safetensors"))
    x, c = t["x"].astype(np.float64), t["c"].astype(np.float64)
    T = np.clip(1.0 - np.abs(c[:, :, None] - x[None, None, :]) / HALF_WIDTH, 0.0, None)
    return np.einsum("nab,mnb->mna", T, bits.astype(np.float64))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_models(tmp_path_factory.mktemp("repo"), tri=(8, 20_000), tri_nobatch=(0, 0))


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[BitserveServer]:
    from harness.server import start_server

    with start_server(repo) as s:
        yield s


def random_bits(m: int, seed: int) -> np.ndarray:  # type: ignore[type-arg]
    return np.random.default_rng(seed).random((m, N, L)) < 0.3


def packed_input(bits: np.ndarray, *, binary: bool = True) -> tc.InferInput:  # type: ignore[type-arg]
    packed = np.packbits(bits, axis=-1)
    inp = tc.InferInput("bits", list(packed.shape), "UINT8")
    inp.set_data_from_numpy(packed, binary_data=binary)
    return inp


def test_health_and_metadata(server: BitserveServer) -> None:
    client = tc.InferenceServerClient(server.host_port)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("tri")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata("tri")
    (inp,) = meta["inputs"]
    assert (inp["name"], inp["datatype"], inp["shape"]) == ("bits", "UINT8", [-1, N, PACKED])
    assert client.get_model_config("tri")["max_batch_size"] == 8
    index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
    assert index == {"tri": "READY", "tri_nobatch": "READY"}


@pytest.mark.parametrize("binary", [True, False])
def test_sync_infer_matches_dense_reference(
    server: BitserveServer, repo: Path, binary: bool
) -> None:
    client = tc.InferenceServerClient(server.host_port)
    bits = random_bits(3, seed=1)
    result = client.infer(
        "tri",
        [packed_input(bits, binary=binary)],
        outputs=[tc.InferRequestedOutput("out", binary_data=binary)],
        request_id="e2e-1",
    )
    out = result.as_numpy("out")
    assert out.dtype == np.float32
    assert out.shape == (3, N, A)
    np.testing.assert_allclose(out, reference(repo, "tri", bits), rtol=1e-5, atol=1e-4)
    response = result.get_response()
    assert response["id"] == "e2e-1"
    assert ("parameters" in response["outputs"][0]) is binary  # binary_data_size only if binary


def test_compressed_request_and_response(server: BitserveServer, repo: Path) -> None:
    """tritonclient compresses the request and asks for a compressed answer; the server's
    ``auto`` policy compresses JSON outputs (binary floats only when they shrink, and never
    under 1 KiB), so the outputs are asked for as JSON: 8 items make ~3 KB of it."""
    client = tc.InferenceServerClient(server.host_port)
    bits = random_bits(8, seed=2)
    as_json = [tc.InferRequestedOutput("out", binary_data=False)]
    for req_alg, resp_alg in (("gzip", "deflate"), ("deflate", "gzip")):
        result = client.infer(
            "tri",
            [packed_input(bits)],
            outputs=as_json,
            request_compression_algorithm=req_alg,
            response_compression_algorithm=resp_alg,
        )
        np.testing.assert_allclose(
            result.as_numpy("out"), reference(repo, "tri", bits), rtol=1e-5, atol=1e-4
        )
    # The same request over plain HTTP shows that the answer really was compressed.
    body = {
        "inputs": [
            {
                "name": "bits",
                "datatype": "UINT8",
                "shape": [8, N, PACKED],
                "data": np.packbits(bits, axis=-1).reshape(-1).tolist(),
            }
        ],
        "outputs": [{"name": "out", "parameters": {"binary_data": False}}],
    }
    for alg in ("gzip", "deflate"):
        r = httpx.post(
            server.url + "/v2/models/tri/infer", json=body, headers={"Accept-Encoding": alg}
        )
        assert r.status_code == 200, r.text
        assert r.headers["content-encoding"] == alg
        assert int(r.headers["content-length"]) < len(r.content)  # httpx inflated it
        out = np.asarray(r.json()["outputs"][0]["data"]).reshape(8, N, A)
        np.testing.assert_allclose(out, reference(repo, "tri", bits), rtol=1e-5, atol=1e-4)


def test_aio_client(server: BitserveServer, repo: Path) -> None:
    bits = random_bits(4, seed=3)

    async def run() -> np.ndarray:  # type: ignore[type-arg]
        client = tca.InferenceServerClient(server.host_port)
        try:
            assert await client.is_server_ready()
            meta = await client.get_model_metadata("tri_nobatch")
            assert meta["inputs"][0]["shape"] == [N, PACKED]  # no batch dimension
            result = await client.infer("tri", [packed_input(bits)])
            out = result.as_numpy("out")
            assert out is not None
            return out
        finally:
            await client.close()

    out = asyncio.run(run())
    np.testing.assert_allclose(out, reference(repo, "tri", bits), rtol=1e-5, atol=1e-4)


def test_raw_binary_form_like_curl(server: BitserveServer, repo: Path) -> None:
    # curl --data-binary @packed.bin -H 'Inference-Header-Content-Length: 0' .../infer
    bits = random_bits(2, seed=4)
    resp = httpx.post(
        server.url + "/v2/models/tri/infer",
        content=np.packbits(bits, axis=-1).tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
    )
    assert resp.status_code == 200, resp.text
    n = int(resp.headers["inference-header-content-length"])
    head = json.loads(resp.content[:n])
    assert head["outputs"][0]["shape"] == [2, N, A]
    out = np.frombuffer(resp.content[n:], dtype="<f4").reshape(2, N, A)
    np.testing.assert_allclose(out, reference(repo, "tri", bits), rtol=1e-5, atol=1e-4)


def test_errors_over_the_wire(server: BitserveServer) -> None:
    client = tc.InferenceServerClient(server.host_port)
    with pytest.raises(InferenceServerException, match="nope"):
        client.get_model_metadata("nope")
    wrong = tc.InferInput("bits", [1, N, PACKED + 1], "UINT8")
    wrong.set_data_from_numpy(np.zeros((1, N, PACKED + 1), np.uint8))
    with pytest.raises(InferenceServerException) as info:
        client.infer("tri", [wrong])
    assert "bits" in str(info.value)
    r = httpx.post(server.url + "/v2/models/tri/infer", content=b"{", timeout=10)
    assert r.status_code == 400
    assert "malformed" in r.json()["error"]
    r = httpx.get(server.url + "/v2/models/tri/nothing")
    assert r.status_code == 404
    assert set(r.json()) == {"error"}


def test_refused_tensors_over_the_wire(server: BitserveServer) -> None:
    url = server.url + "/v2/models/tri/infer"
    # 300 KB of empty BYTES strings: refused from the header alone (the model takes UINT8/BOOL).
    n = 75_000
    head = json.dumps(
        {"inputs": [{"name": "bits", "datatype": "BYTES", "shape": [n],
                     "parameters": {"binary_data_size": 4 * n}}]}
    ).encode()  # fmt: skip
    r = httpx.post(
        url,
        content=head + bytes(4 * n),
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert "input 'bits' has datatype BYTES; expected UINT8" in r.json()["error"]
    # A zero-element shape with a dimension NumPy cannot describe: 400, not 500.
    body = {"inputs": [{"name": "bits", "datatype": "UINT8", "shape": [0, 2**70], "data": []}]}
    r = httpx.post(url, json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert "has a dimension 1180591620717411303424 past" in r.json()["error"]


def batch_requests_histogram(server: BitserveServer, model: str) -> tuple[float, float]:
    """(sum, count) of the bitserve_batch_requests histogram for ``model``."""
    text = httpx.get(server.url + "/metrics").text
    total = count = 0.0
    for line in text.splitlines():
        m = re.match(rf'bitserve_batch_requests_(sum|count)\{{model="{model}"\}} (\S+)', line)
        if m:
            if m.group(1) == "sum":
                total = float(m.group(2))
            else:
                count = float(m.group(2))
    return total, count


def test_concurrent_requests_are_merged(server: BitserveServer, repo: Path) -> None:
    k = 24
    inputs = [random_bits(1, seed=100 + i) for i in range(k)]
    one_by_one = []
    client = tc.InferenceServerClient(server.host_port)
    for bits in inputs:
        one_by_one.append(client.infer("tri_nobatch", [packed_input(bits[0])]).as_numpy("out"))
    before = batch_requests_histogram(server, "tri")

    async def run() -> list[tuple[np.ndarray, dict[str, object]]]:  # type: ignore[type-arg]
        aio = tca.InferenceServerClient(server.host_port, conn_limit=k)
        try:
            results = await asyncio.gather(*(aio.infer("tri", [packed_input(b)]) for b in inputs))
            return [(r.as_numpy("out"), r.get_response()) for r in results]
        finally:
            await aio.close()

    results = asyncio.run(run())
    merged = 0
    for bits, unbatched, (out, response) in zip(inputs, one_by_one, results, strict=True):
        np.testing.assert_array_equal(out[0], unbatched)  # batched == unbatched, exactly
        np.testing.assert_allclose(out, reference(repo, "tri", bits), rtol=1e-5, atol=1e-4)
        merged = max(merged, int(response["parameters"]["batch_requests"]))  # type: ignore[index]
    assert merged > 1
    after = batch_requests_histogram(server, "tri")
    requests_seen, batches = after[0] - before[0], after[1] - before[1]
    assert requests_seen == k
    assert batches < k  # fewer batches than requests: they were merged


def _nanobind_leak_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose server holds ``triton``'s nanobind objects until the interpreter's
    teardown, as its kernel caches do on a CUDA host (where that printed ~100 ``nanobind:
    leaked`` lines at SIGTERM): a ``sitecustomize`` that makes an MLIR context permanent.
    Empty where the ``triton`` package is not installed."""
    if importlib.util.find_spec("triton") is None:
        return {}
    site = tmp_path / "leak-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import gc\nfrom triton._C import libtriton\n_held = libtriton.ir.context()\ngc.freeze()\n"
    )
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def test_limits_auth_and_graceful_sigterm(
    server_factory: Callable[..., BitserveServer], tmp_path: Path
) -> None:
    """One guarded server (small body limit, bearer token; starting one costs seconds here):
    limits and auth over a real socket, then SIGTERM with a request in flight."""
    root = tmp_path / "slow"
    # A lone request waits up to 1.5 s for company: it is in flight when SIGTERM arrives.
    write_model(root, "slow", max_batch_size=8, delay_us=1_500_000)
    # A drain deadline no sane machine reaches: the exit must come when the request is
    # answered, not at the deadline.
    grace_s = 120
    server = server_factory(
        root,
        args=["--max-body-bytes", "1000", "--graceful-shutdown-s", str(grace_s)],
        env={"BITSERVE_AUTH_TOKEN": "tok", **_nanobind_leak_env(tmp_path)},
    )
    auth = {"Authorization": "Bearer tok"}

    # Two Authorization headers: 400 on every route, whichever of them is right.
    for method, path in (("POST", "/v2/models/slow/infer"), ("GET", "/v2/models/slow")):
        headers = [("Authorization", "Bearer tok"), ("Authorization", "Bearer nope")]
        r = httpx.request(method, server.url + path, headers=headers, content=b"{}")
        assert r.status_code == 400, (path, r.text)
        assert "more than one Authorization header" in r.json()["error"]

    # Content-Length over the limit: 413 before the body is read.
    r = httpx.post(server.url + "/v2/models/slow/infer", content=b"\0" * 5000, headers=auth)
    assert r.status_code == 413
    assert "request body of 5000 bytes exceeds the limit of 1000 bytes" in r.json()["error"]
    r = httpx.get(server.url + "/v2/models/slow")
    assert r.status_code == 401
    assert r.json() == {"error": "missing bearer token (send 'Authorization: Bearer <token>')"}
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    client = tc.InferenceServerClient(server.host_port)
    assert client.get_model_metadata("slow", headers=auth)["name"] == "slow"
    with pytest.raises(InferenceServerException, match="invalid bearer token"):
        client.get_model_metadata("slow", headers={"Authorization": "Bearer nope"})

    bits = random_bits(1, seed=9)
    result: dict[str, object] = {}

    def call() -> None:
        try:
            r = httpx.post(
                server.url + "/v2/models/slow/infer",
                content=np.packbits(bits, axis=-1).tobytes(),
                headers={"Inference-Header-Content-Length": "0", **auth},
                timeout=30,
            )
            result["status"] = r.status_code
        except httpx.HTTPError as e:  # pragma: no cover - reported below
            result["error"] = repr(e)

    t = threading.Thread(target=call)
    t.start()
    wait_begun(server.url, 1, "slow", headers=auth)  # it waits in the batcher now
    started = time.monotonic()
    code = server.terminate()
    t.join(30)
    assert result == {"status": 200}, server.log()[-3000:]
    # A drained server exits 0 (service.server owns SIGTERM: a drain is a clean exit).
    assert code == 0, server.log()[-3000:]
    log = server.log()
    assert log.index("POST /v2/models/slow/infer 200") < log.index("repository stopped")
    assert "Application shutdown complete" in log
    assert "nanobind: leaked" not in log  # third-party leak reports at teardown: none
    assert time.monotonic() - started < grace_s
    with pytest.raises(httpx.ConnectError):  # after shutdown, new connections are refused
        httpx.get(server.url + "/v2/health/live", timeout=2)


def _one_answer(port: int, start: threading.Barrier) -> tuple[int, bytes]:
    """Connect, wait for the others, send one whole GET; the answer's status and head (0 and
    b"" when the connection closed without a byte)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        start.wait(30)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while b"\r\n\r\n" not in raw:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            raw += part
    head = raw.partition(b"\r\n\r\n")[0]
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
    return (int(m.group(1)) if m else 0), head


def test_at_the_connection_cap_every_simultaneous_client_is_answered(
    server_factory: Callable[..., BitserveServer],
) -> None:
    """40 clients at once against ``--max-connections 16``: each one's GET is answered,
    200 or 503 with Retry-After; none is closed without a byte (three rounds)."""
    server = server_factory(None, args=["--max-connections", "16"])
    port = int(server.host_port.rsplit(":", 1)[1])
    for _ in range(3):
        start = threading.Barrier(40)
        with ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(_one_answer, [port] * 40, [start] * 40))
        statuses = sorted(status for status, _ in answers)
        assert set(statuses) <= {200, 503}, statuses
        assert 200 in statuses, statuses
        for status, head in answers:
            if status == 503:
                assert re.search(rb"(?im)^retry-after: \d+\r?$", head), head
        time.sleep(1.5)  # the answered keep-alive connections are idle: the next round evicts
