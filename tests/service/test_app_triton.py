"""Triton's protocol details in process (httpx.ASGITransport over the fake repository): the
response id, HEAD on the health routes, Triton's wording, and the extensions' routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.metrics import Metrics
from service.settings import Settings
from tests.service.app_fakes import FakeRepository

pytestmark = pytest.mark.anyio

ECHO = {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def repo() -> FakeRepository:
    return FakeRepository()


@pytest.fixture
async def client(repo: FakeRepository) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(access_log=False), repo, metrics=Metrics(nvml=None))
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
