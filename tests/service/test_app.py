"""The HTTP layer in process (httpx.ASGITransport) over a fake repository: routes, framing,
every error path with its status and text, auth, limits, compression, request ids, metrics."""

from __future__ import annotations

import gzip
import json
import re
import struct
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

pytestmark = pytest.mark.anyio

X = np.array([[1, 2, 3, 4], [0, 0, 1, 255]], dtype=np.uint8)
HUGE = json.dumps(
    {
        "inputs": [
            {
                "name": "x",
                "datatype": "UINT8",
                "shape": [2, 4],
                "parameters": {"binary_data_size": 10**10},
            }
        ]
    }
).encode()


@pytest.fixture
def settings() -> Settings:
    return Settings(max_body_bytes=4096, access_log=False)


@pytest.fixture
def repo() -> FakeRepository:
    return FakeRepository()


@pytest.fixture
async def client(settings: Settings, repo: FakeRepository) -> AsyncIterator[httpx.AsyncClient]:
    app = in_process_app(settings, repo)
    # ASGITransport does not run the lifespan, so the test runs it around the client.
    async with app.router.lifespan_context(app):
        assert repo.started
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c
    assert repo.stopped


def binary_request(x: np.ndarray, **top: Any) -> tuple[bytes, dict[str, str]]:  # type: ignore[type-arg]
    header = {
        "inputs": [
            {
                "name": "x",
                "datatype": "UINT8",
                "shape": list(x.shape),
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        **top,
    }
    head = json.dumps(header).encode()
    return head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


def split_binary(resp: httpx.Response) -> tuple[dict[str, Any], dict[str, np.ndarray]]:  # type: ignore[type-arg]
    n = int(resp.headers["inference-header-content-length"])
    head = json.loads(resp.content[:n])
    arrays = {}
    pos = n
    for out in head["outputs"]:
        if "data" in out:
            continue
        size = out["parameters"]["binary_data_size"]
        dtype = {"FP32": "<f4", "INT64": "<i8"}[out["datatype"]]
        arrays[out["name"]] = np.frombuffer(resp.content[pos : pos + size], dtype).reshape(
            out["shape"]
        )
        pos += size
    assert pos == len(resp.content)
    return head, arrays


def assert_error(resp: httpx.Response, status: int, text: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert text in body["error"], body["error"]


# ---- health, metadata ------------------------------------------------------------------------


async def test_health_and_server_metadata(client: httpx.AsyncClient, repo: FakeRepository) -> None:
    assert (await client.get("/v2/health/live")).json() == {"live": True}
    assert (await client.get("/v2/health/ready")).json() == {"ready": True}
    meta = (await client.get("/v2")).json()
    assert meta["name"] == "bitserve"
    assert "binary_tensor_data" in meta["extensions"]
    repo.is_ready = False
    assert_error(await client.get("/v2/health/ready"), 503, "server is not ready")
    assert (await client.get("/v2/health/live")).status_code == 200


async def test_model_metadata_ready_config(client: httpx.AsyncClient) -> None:
    for base in ("/v2/models/echo", "/v2/models/echo/versions/1"):
        meta = (await client.get(base)).json()
        assert meta["inputs"] == [{"name": "x", "datatype": "UINT8", "shape": [-1, 4]}]
        ready = await client.get(base + "/ready")
        assert ready.json() == {"name": "echo", "version": "1", "ready": True}
        assert (await client.get(base + "/config")).json()["max_batch_size"] == 65536
    assert_error(await client.get("/v2/models/nope"), 404, "Request for unknown model: 'nope'")
    assert_error(
        await client.get("/v2/models/echo/versions/7/config"), 404, "'echo' version 7 is not"
    )
    assert_error(
        await client.get("/v2/models/nope/ready"), 404, "Request for unknown model: 'nope'"
    )


async def test_framework_errors_have_the_error_shape(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v2/nothing/here"), 404, "no route GET /v2/nothing/here")
    assert_error(await client.get("/v2/models/echo/infer"), 405, "method GET is not allowed")
    assert_error(await client.delete("/v2/health/live"), 405, "method DELETE is not allowed")


# ---- inference ---------------------------------------------------------------------------------


async def test_infer_json_in_json_out(client: httpx.AsyncClient) -> None:
    body = {
        "id": "req-1",
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [2, 4], "data": X.tolist()}],
    }
    resp = await client.post("/v2/models/echo/infer", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    out = resp.json()
    assert out["id"] == "req-1"
    assert out["model_name"] == "echo"
    assert out["parameters"] == {"batch_size": 2, "batch_requests": 1}
    y, n = out["outputs"]
    assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [2, 4])
    assert y["data"] == (2.0 * X).reshape(-1).tolist()
    assert n["data"] == X.astype(np.int64).sum(axis=1).tolist()


async def test_infer_binary_in_binary_out(client: httpx.AsyncClient) -> None:
    body, headers = binary_request(
        X, parameters={"binary_data_output": True}, outputs=[{"name": "n"}, {"name": "y"}]
    )
    resp = await client.post("/v2/models/echo/versions/1/infer", content=body, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/octet-stream"
    head, arrays = split_binary(resp)
    assert [o["name"] for o in head["outputs"]] == ["n", "y"]
    np.testing.assert_array_equal(arrays["y"], 2.0 * X)
    np.testing.assert_array_equal(arrays["n"], X.astype(np.int64).sum(axis=1))


async def test_infer_mixed_binary_and_json_outputs(client: httpx.AsyncClient) -> None:
    body, headers = binary_request(
        X, outputs=[{"name": "y", "parameters": {"binary_data": True}}, {"name": "n"}]
    )
    resp = await client.post("/v2/models/echo/infer", content=body, headers=headers)
    head, arrays = split_binary(resp)
    np.testing.assert_array_equal(arrays["y"], 2.0 * X)
    assert head["outputs"][1]["data"] == X.astype(np.int64).sum(axis=1).tolist()


async def test_infer_raw_binary_form(client: httpx.AsyncClient, repo: FakeRepository) -> None:
    # curl --data-binary @x.bin -H 'Inference-Header-Content-Length: 0'
    resp = await client.post(
        "/v2/models/echo/infer",
        content=X.tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
    )
    assert resp.status_code == 200, resp.text
    _, arrays = split_binary(resp)
    np.testing.assert_array_equal(arrays["y"], 2.0 * X)
    (req,) = repo.models["echo"].requests
    assert req.inputs[0].shape == (2, 4)
    bad = await client.post(
        "/v2/models/echo/infer", content=b"\0" * 7, headers={"Inference-Header-Content-Length": "0"}
    )
    assert_error(bad, 400, "not a whole number of UINT8 items of shape [4]")


async def test_timeout_and_parameters_reach_the_model(
    client: httpx.AsyncClient, repo: FakeRepository
) -> None:
    body, headers = binary_request(X, parameters={"timeout": 1_500_000, "note": "x"})
    assert (await client.post("/v2/models/echo/infer", content=body, headers=headers)).is_success
    (req,) = repo.models["echo"].requests
    assert req.timeout_us == 1_500_000
    assert req.parameters["note"] == "x"
    assert not req.inputs[0].data.flags.writeable


@pytest.mark.parametrize(
    ("body", "headers", "status", "text"),
    [
        (b"{", {}, 400, "request JSON is malformed"),
        (b'{"inputs": []}', {}, 400, "'inputs' must be a non-empty list"),
        (
            json.dumps({"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1, 4]}]}).encode(),
            {},
            400,
            "neither 'data' nor",
        ),
        (HUGE, {"Inference-Header-Content-Length": str(len(HUGE))}, 400, "runs past the end"),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "z", "datatype": "UINT8", "shape": [1, 4], "data": [1, 2, 3, 4]}
                    ]
                }
            ).encode(),
            {},
            400,
            "unknown input 'z' (expected inputs: ['x'])",
        ),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "x", "datatype": "UINT8", "shape": [1, 4], "data": [1] * 4}
                    ],
                    "outputs": [{"name": "nope"}],
                }
            ).encode(),
            {},
            400,
            "unknown output 'nope' (outputs: ['y', 'n'])",
        ),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "x", "datatype": "UINT8", "shape": [1, 4], "data": [1] * 4}
                    ],
                    "parameters": {"triton_foo": 1},
                }
            ).encode(),
            {},
            400,
            "unknown parameter 'triton_foo'",
        ),
        (b"{}", {"Inference-Header-Content-Length": "x"}, 400, "must be an integer"),
        (b"{}", {"Inference-Header-Content-Length": "99"}, 400, "outside the body of 2 bytes"),
        (b"{}", {"Content-Encoding": "br"}, 415, "unsupported Content-Encoding 'br'"),
        (b"junk", {"Content-Encoding": "gzip"}, 400, "corrupt gzip request body"),
    ],
)
async def test_infer_bad_requests(
    client: httpx.AsyncClient, body: bytes, headers: dict[str, str], status: int, text: str
) -> None:
    assert_error(
        await client.post("/v2/models/echo/infer", content=body, headers=headers), status, text
    )


async def test_unknown_model_infer_is_404(client: httpx.AsyncClient) -> None:
    body, headers = binary_request(X)
    resp = await client.post("/v2/models/nope/infer", content=body, headers=headers)
    assert_error(resp, 404, "Request for unknown model: 'nope' is not found")
    # Percent-encoded separators cannot smuggle a path into the model name.
    resp = await client.post("/v2/models/..%2F..%2Fetc/infer", content=body, headers=headers)
    assert resp.status_code == 404


async def test_overloaded_is_503_with_retry_after(client: httpx.AsyncClient) -> None:
    body, headers = binary_request(X)
    resp = await client.post("/v2/models/busy/infer", content=body, headers=headers)
    assert_error(resp, 503, "queue is full")
    assert resp.headers["retry-after"] == "2"


async def test_unexpected_error_is_500_without_details(client: httpx.AsyncClient) -> None:
    body, headers = binary_request(X)
    resp = await client.post(
        "/v2/models/boom/infer", content=body, headers={**headers, "X-Request-ID": "abc-123"}
    )
    assert_error(resp, 500, "inference failed (RuntimeError); request id abc-123, details in")
    assert "secret" not in resp.text
    assert "Traceback" not in resp.text
    assert resp.headers["x-request-id"] == "abc-123"


async def test_request_ids(client: httpx.AsyncClient) -> None:
    given = await client.get("/v2/health/live", headers={"X-Request-ID": "my-id.1"})
    assert given.headers["x-request-id"] == "my-id.1"
    fresh = await client.get("/v2/health/live", headers={"X-Request-ID": "bad id\twith space"})
    other = await client.get("/v2/health/live")
    # Fresh ids: a per-process random prefix and a counter (cheaper than a uuid4 each).
    assert re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]+", fresh.headers["x-request-id"])
    assert fresh.headers["x-request-id"] != other.headers["x-request-id"]
    assert fresh.headers["x-request-id"][:13] == other.headers["x-request-id"][:13]


# ---- compression and limits -----------------------------------------------------------------


@pytest.mark.parametrize(("name", "squash"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_compressed_request_and_response(
    client: httpx.AsyncClient, name: str, squash: Any
) -> None:
    # Small integers as float32 compress well, so the default ``auto`` policy compresses them
    # (random floats would not be; see test_app_http.py); 800 rows make it worth it.
    x = np.random.default_rng(0).integers(0, 4, size=(800, 4), dtype=np.uint8)
    body, headers = binary_request(x, parameters={"binary_data_output": True})
    resp = await client.post(
        "/v2/models/echo/infer",
        content=squash(body),
        headers={**headers, "Content-Encoding": name, "Accept-Encoding": name},
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-encoding"] == name
    assert int(resp.headers["content-length"]) < len(resp.content) // 2
    _, arrays = split_binary(resp)  # httpx inflated it
    np.testing.assert_array_equal(arrays["y"], 2.0 * x)


async def test_body_limit_checked_before_reading(client: httpx.AsyncClient) -> None:
    pulled: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(10):
            pulled.append(i)
            yield b"\0" * 1000

    resp = await client.post(
        "/v2/models/echo/infer", content=body(), headers={"Content-Length": "10000"}
    )
    assert_error(resp, 413, "request body of 10000 bytes exceeds the limit of 4096 bytes")
    assert len(pulled) <= 1  # at most the transport's prefetch, never the whole body


async def test_chunked_body_limit(client: httpx.AsyncClient) -> None:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"\0" * 1000

    resp = await client.post("/v2/models/echo/infer", content=body())
    assert_error(resp, 413, "request body exceeds the limit of 4096 bytes")


async def test_gzip_bomb_is_413(client: httpx.AsyncClient) -> None:
    bomb = gzip.compress(b"\0" * (1 << 20))
    assert len(bomb) < 4096
    resp = await client.post(
        "/v2/models/echo/infer", content=bomb, headers={"Content-Encoding": "gzip"}
    )
    assert_error(resp, 413, "decompressed request body exceeds the limit of 4096 bytes")


# ---- auth -------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [Settings(auth_token="s3cret", access_log=False)])
async def test_bearer_auth(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 200
    missing = await client.get("/v2/models/echo")
    assert_error(missing, 401, "missing bearer token")
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = await client.get("/v2/models/echo", headers={"Authorization": "Bearer s3cre"})
    assert_error(wrong, 401, "invalid bearer token")
    basic = await client.get("/v2", headers={"Authorization": "Basic czNjcmV0"})
    assert_error(basic, 401, "missing bearer token")
    body, headers = binary_request(X)
    no_auth_infer = await client.post("/v2/models/echo/infer", content=body, headers=headers)
    assert_error(no_auth_infer, 401, "bearer token")
    assert_error(await client.get("/metrics"), 401, "bearer token")
    ok = await client.get("/v2/models/echo", headers={"Authorization": "bearer s3cret"})
    assert ok.status_code == 200


# ---- repository and metrics -----------------------------------------------------------------


async def test_repository_endpoints(client: httpx.AsyncClient, repo: FakeRepository) -> None:
    names = [m["name"] for m in (await client.get("/v2/repository/index")).json()]
    assert names == ["echo", "boom", "busy"]
    posted = (await client.post("/v2/repository/index", json={"ready": True})).json()
    assert [m["name"] for m in posted] == ["echo", "boom"]
    assert len((await client.post("/v2/repository/index")).json()) == 3
    assert_error(
        await client.post("/v2/repository/index", json={"ready": "yes"}), 400, "'ready' must be"
    )
    assert (await client.post("/v2/repository/models/echo/load")).status_code == 200
    assert (await client.post("/v2/repository/models/echo/unload")).status_code == 200
    assert (repo.loaded, repo.unloaded) == (["echo"], ["echo"])
    # Triton's wording and status for a load of a model that is not there.
    assert_error(await client.post("/v2/repository/models/zz/load"), 400, "failed to load 'zz'")


async def test_metrics_count_outcomes(client: httpx.AsyncClient) -> None:
    body, headers = binary_request(X)
    await client.post("/v2/models/echo/infer", content=body, headers=headers)
    await client.post("/v2/models/busy/infer", content=body, headers=headers)
    await client.post("/v2/models/nope/infer", content=body, headers=headers)
    text = (await client.get("/metrics")).text
    assert 'bitserve_requests_total{model="echo",outcome="success"} 1.0' in text
    assert 'bitserve_requests_total{model="busy",outcome="Overloaded"} 1.0' in text
    assert 'bitserve_requests_total{model="_unknown",outcome="ModelNotFound"} 1.0' in text
    assert "bitserve_in_flight_requests 0.0" in text


def test_struct_sanity() -> None:
    # the helpers above assume little-endian wire data
    assert struct.pack("<f", 2.0) == np.float32(2.0).tobytes()


async def test_request_id_is_on_log_records(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    from service.observability.request_ids import RequestIdFilter

    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level("INFO", logger="service"):
        await client.post("/v2/models/echo/infer", content=b"{", headers={"X-Request-ID": "rid-42"})
    records = [r for r in caplog.records if "-> 400" in r.getMessage()]
    assert records
    assert records[0].request_id == "rid-42"
    assert "request JSON is malformed" in records[0].getMessage()
