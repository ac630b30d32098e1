"""Triton's protocol details in process (httpx.ASGITransport over the fake repository): the
response id, HEAD on the health routes, Triton's wording, and the extensions' routes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from multiprocessing import shared_memory
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from service.observability.metrics import Metrics
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

pytestmark = pytest.mark.anyio

ECHO = {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


@pytest.fixture
def repo() -> FakeRepository:
    return FakeRepository()


@pytest.fixture
async def client(repo: FakeRepository) -> AsyncIterator[httpx.AsyncClient]:
    app = in_process_app(Settings(access_log=False), repo, metrics=Metrics(nvml=None))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c


def error_of(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    body: dict[str, Any] = resp.json()
    assert set(body) == {"error"}
    message: str = body["error"]
    return message


async def test_response_id_is_the_request_id_when_the_request_has_none(
    client: httpx.AsyncClient,
) -> None:
    sent = await client.post(
        "/v2/models/echo/infer", json=ECHO, headers={"X-Request-ID": "trace-42"}
    )
    assert sent.json()["id"] == "trace-42" == sent.headers["x-request-id"]
    fresh = await client.post("/v2/models/echo/infer", json=ECHO)
    assert fresh.json()["id"] == fresh.headers["x-request-id"] != "trace-42"
    # An id in the body wins, even an empty one (echoed as it came).
    for given in ("mine", ""):
        own = await client.post(
            "/v2/models/echo/infer", json={**ECHO, "id": given}, headers={"X-Request-ID": "t"}
        )
        assert own.json()["id"] == given


async def test_head_on_the_health_routes(client: httpx.AsyncClient, repo: FakeRepository) -> None:
    for path in ("/v2/health/live", "/v2/health/ready"):
        resp = await client.head(path)
        assert resp.status_code == 200, path
        assert resp.content == b""
    repo.is_ready = False
    assert (await client.head("/v2/health/ready")).status_code == 503
    assert (await client.head("/v2/health/live")).status_code == 200


async def test_unknown_models_in_tritons_words(client: httpx.AsyncClient) -> None:
    for method, path in (
        ("GET", "/v2/models/nope"),
        ("GET", "/v2/models/nope/ready"),
        ("GET", "/v2/models/nope/config"),
        ("GET", "/v2/models/nope/stats"),
        ("POST", "/v2/models/nope/infer"),
    ):
        resp = await client.request(method, path, json=ECHO if method == "POST" else None)
        assert error_of(resp, 404).startswith("Request for unknown model"), path


async def test_load_body_and_override(client: httpx.AsyncClient, repo: FakeRepository) -> None:
    ok = await client.post(
        "/v2/repository/models/echo/load",
        json={"parameters": {"config": '{"max_batch_size":"16"}'}},
    )
    assert ok.status_code == 200, ok.text
    assert ok.json() == {}
    override = repo.overrides[-1]
    assert override is not None
    assert override.patch == {"max_batch_size": 16}
    for body in (
        b"not json",
        b"[1]",
        b'{"parameters": {"config": "{nope"}}',
        b'{"parameters": {"config": {"max_batch_size": 2}}}',
    ):
        resp = await client.post("/v2/repository/models/echo/load", content=body)
        assert "failed to load 'echo'" in error_of(resp, 400), body
    resp = await client.post("/v2/repository/models/wrong_model_name/load")
    assert "failed to load 'wrong_model_name'" in error_of(resp, 400)
    assert (await client.post("/v2/repository/models/echo/load", content=b"")).status_code == 200
    assert repo.overrides[-1] is None


# --- system shared memory through the data plane --------------------------------------------


@pytest.fixture
def posix() -> Iterator[shared_memory.SharedMemory]:
    obj = shared_memory.SharedMemory(create=True, size=4096)
    yield obj
    obj.close()
    obj.unlink()


@pytest.fixture
async def shm_client(repo: FakeRepository) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(access_log=False, allow_client_shm=True, max_shm_regions=3)
    app = in_process_app(settings, repo, metrics=Metrics(nvml=None))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c


def shm_request(
    x_region: str = "in", y: dict[str, Any] | None = None, **x_params: Any
) -> dict[str, Any]:
    params = {"shared_memory_region": x_region, "shared_memory_byte_size": 8} | x_params
    out_y = {"shared_memory_region": "out", "shared_memory_byte_size": 32} | (y or {})
    return {
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [2, 4], "parameters": params}],
        "outputs": [{"name": "y", "parameters": out_y}, {"name": "n"}],
    }


async def test_inputs_from_and_outputs_into_shared_memory(
    shm_client: httpx.AsyncClient, posix: shared_memory.SharedMemory, repo: FakeRepository
) -> None:
    key = "/" + posix.name.lstrip("/")
    x = np.array([[1, 2, 3, 4], [5, 6, 7, 255]], np.uint8)
    posix.buf[100:108] = x.tobytes()
    for name, offset, size in (("in", 96, 16), ("out", 1024, 64)):
        resp = await shm_client.post(
            f"/v2/systemsharedmemory/region/{name}/register",
            json={"key": key, "offset": offset, "byte_size": size},
        )
        assert resp.status_code == 200, resp.text
    status = (await shm_client.get("/v2/systemsharedmemory/status")).json()
    assert [r["name"] for r in status] == ["in", "out"]
    one = (await shm_client.get("/v2/systemsharedmemory/region/out/status")).json()
    assert one == [{"name": "out", "key": key, "offset": 1024, "byte_size": 64}]
    resp = await shm_client.post(
        "/v2/models/echo/infer",
        json=shm_request(shared_memory_offset=4, y={"shared_memory_offset": 16}),
    )
    assert resp.status_code == 200, resp.text
    y_entry, n_entry = resp.json()["outputs"]
    # Triton's way: an output written into shared memory has no data in the response.
    assert y_entry == {"name": "y", "datatype": "FP32", "shape": [2, 4]}
    np.testing.assert_array_equal(n_entry["data"], x.astype(np.int64).sum(axis=1))
    y = np.frombuffer(bytes(posix.buf[1040:1072]), np.float32).reshape(2, 4)
    np.testing.assert_array_equal(y, 2 * x.astype(np.float32))
    assert bytes(posix.buf[1024:1040]) == b"\0" * 16  # before the output: untouched
    assert "system_shared_memory" in (await shm_client.get("/v2")).json()["extensions"]


async def test_an_output_region_that_shrank_is_a_400_and_the_model_serves_on(
    shm_client: httpx.AsyncClient, posix: shared_memory.SharedMemory, repo: FakeRepository
) -> None:
    # The output is written after the model ran, in the batcher's answer: a failure there is
    # this request's error, never the model's batch scheduler's (it once died of it).
    key = "/" + posix.name.lstrip("/")
    for name, offset, size in (("in", 96, 16), ("out", 1024, 64)):
        body = {"key": key, "offset": offset, "byte_size": size}
        assert (await shm_client.post(f"/v2/systemsharedmemory/region/{name}/register",
                                      json=body)).status_code == 200  # fmt: skip
    path = f"/dev/shm/{posix.name.lstrip('/')}"
    body = shm_request(shared_memory_offset=4, y={"shared_memory_offset": 16})
    for _ in range(2):
        os.truncate(path, 1030)  # the input is whole, the output's bytes are gone
        with anyio.fail_after(60):  # unanswered, it would hang
            resp = await shm_client.post("/v2/models/echo/infer", json=body)
        text = error_of(resp, 400)
        assert text.startswith("output 'y': shared memory region 'out'"), text
        assert "shrank since registration" in text
    os.truncate(path, 4096)
    resp = await shm_client.post("/v2/models/echo/infer", json=body)
    assert resp.status_code == 200, resp.text  # the model still serves
    assert repo.models["echo"].stats.execution_count == 3


@pytest.mark.parametrize(
    ("request_body", "text"),
    [
        (shm_request("nope"), "input 'x': shared memory region 'nope' is not registered"),
        (
            shm_request(shared_memory_byte_size=7),
            "needs 8 bytes, shared_memory_byte_size of region 'in' is 7",
        ),
        (shm_request(shared_memory_offset=33), "region 'in': offset 33 + byte size 8 runs past"),
        (
            shm_request(y={"shared_memory_byte_size": 31}),
            "output 'y' needs 32 bytes, but its shared_memory_byte_size in region 'out' is 31",
        ),
        (
            shm_request(y={"binary_data": True}),
            "can't set both 'shared_memory_region' and 'binary_data'",
        ),
        (shm_request(data=[1]), "set only one of 'data'"),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "UINT8",
                        "shape": [2, 4],
                        "data": [0] * 8,
                        "parameters": {"shared_memory_byte_size": 8},
                    }
                ]
            },
            "'shared_memory_byte_size' without 'shared_memory_region'",
        ),
    ],
)
async def test_shared_memory_violations_are_400s_naming_the_region(
    shm_client: httpx.AsyncClient,
    posix: shared_memory.SharedMemory,
    repo: FakeRepository,
    request_body: dict[str, Any],
    text: str,
) -> None:
    key = "/" + posix.name.lstrip("/")
    for name, offset in (("in", 0), ("out", 2048)):
        body = {"key": key, "offset": offset, "byte_size": 40}
        assert (await shm_client.post(f"/v2/systemsharedmemory/region/{name}/register",
                                      json=body)).status_code == 200  # fmt: skip
    posix.buf[2048:2088] = b"\7" * 40
    if "data" in request_body["inputs"][0]["parameters"]:
        request_body["inputs"][0]["data"] = request_body["inputs"][0]["parameters"].pop("data")
    resp = await shm_client.post("/v2/models/echo/infer", json=request_body)
    assert text in error_of(resp, 400)
    assert repo.models["echo"].stats.execution_count == 0  # refused before any compute
    assert bytes(posix.buf[2048:2088]) == b"\7" * 40  # and nothing written


async def test_shared_memory_registration_errors(
    shm_client: httpx.AsyncClient, posix: shared_memory.SharedMemory
) -> None:
    key = "/" + posix.name.lstrip("/")
    base = "/v2/systemsharedmemory/region"
    for body, text in (
        ({"key": "/etc/passwd", "byte_size": 8}, "is not a POSIX shared memory name"),
        ({"key": key}, "byte_size must be an integer"),
        ({"key": key, "offset": 4090, "byte_size": 8}, "runs past the end"),
        ({"byte_size": 8}, "key None is not a POSIX"),
    ):
        resp = await shm_client.post(f"{base}/r/register", json=body)
        assert "region 'r'" in (message := error_of(resp, 400)), body
        assert text in message, body
    for name in ("a", "b", "c"):
        resp = await shm_client.post(f"{base}/{name}/register", json={"key": key, "byte_size": 8})
        assert resp.status_code == 200
    resp = await shm_client.post(f"{base}/d/register", json={"key": key, "byte_size": 8})
    assert "max_shm_regions 3" in error_of(resp, 400)
    assert "already in manager" in error_of(
        await shm_client.post(f"{base}/a/register", json={"key": key, "byte_size": 8}), 400
    )
    assert (await shm_client.post(f"{base}/a/unregister")).status_code == 200
    assert (await shm_client.post(f"{base}/never/unregister")).status_code == 200
    assert error_of(await shm_client.get(f"{base}/a/status"), 404).startswith("Unable to find")
    assert (await shm_client.post("/v2/systemsharedmemory/unregister")).status_code == 200
    assert (await shm_client.get("/v2/systemsharedmemory/status")).json() == []


async def test_shared_memory_is_off_by_default_and_cuda_is_not_supported(
    client: httpx.AsyncClient, posix: shared_memory.SharedMemory
) -> None:
    key = "/" + posix.name.lstrip("/")
    resp = await client.post(
        "/v2/systemsharedmemory/region/r/register", json={"key": key, "byte_size": 8}
    )
    assert "--allow-client-shm" in error_of(resp, 400)
    assert (await client.get("/v2/systemsharedmemory/status")).json() == []
    assert "system_shared_memory" not in (await client.get("/v2")).json()["extensions"]
    resp = await client.post("/v2/models/echo/infer", json=shm_request())
    assert "client shared memory is disabled" in error_of(resp, 400)
    # CUDA shared memory: the routes answer, registering does not.
    assert (await client.get("/v2/cudasharedmemory/status")).json() == []
    assert (await client.post("/v2/cudasharedmemory/unregister")).status_code == 200
    assert (await client.post("/v2/cudasharedmemory/region/r/unregister")).status_code == 200
    resp = await client.post("/v2/cudasharedmemory/region/r/register", json={"byte_size": 8})
    assert "CUDA shared memory is not supported" in error_of(resp, 400)
    assert error_of(await client.get("/v2/cudasharedmemory/region/r/status"), 404)


def test_readme_documents_every_advertised_extension_and_setting() -> None:
    from pathlib import Path

    from service.dataplane import DataPlane
    from service.shared_memory import SystemSharedMemory

    docs = Path(__file__).resolve().parents[2] / "docs"
    protocol = (docs / "protocol.md").read_text()
    start = protocol.index("\n## Triton's extensions\n")
    end = protocol.find("\n## ", start + 1)
    section = protocol[start : end if end >= 0 else len(protocol)]
    configuration = (docs / "configuration.md").read_text()
    dp = DataPlane(FakeRepository(), Metrics(nvml=None), shared_memory=SystemSharedMemory())
    for ext in dp.server_metadata()["extensions"]:
        assert f"**{ext}**" in section, ext
    for name in Settings.model_fields:
        assert f"`BITSERVE_{name.upper()}`" in configuration, name
