"""HTTP-level policies of the app in process: header limits (431), paths in error messages and
logs (escaped, cut), the response compression policy (``auto``/``always``/``never``), and the
served OpenAPI schema."""

from __future__ import annotations

import gzip
import json
import logging
import warnings
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from service.models.signature import Bound
from service.protocol import worth_compressing
from service.protocol.compression import MIN_BYTES, TRIAL_BYTES
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeHandle, FakeRepository

pytestmark = pytest.mark.anyio

Client = Callable[..., Any]


class NoiseHandle(FakeHandle):
    """Answers ``y``: ``rows`` x 100 random normal float32 (incompressible, like real
    outputs) or, with ``smooth``, a constant (compresses to almost nothing)."""

    def __init__(self, rows: int, *, smooth: bool = False) -> None:
        super().__init__("noise")
        self.rows = rows
        self.smooth = smooth

    def compute(self, bound: Bound) -> list[np.ndarray]:  # type: ignore[type-arg]
        rng = np.random.default_rng(len(self.requests) - 1)  # this request is recorded
        y = (
            np.full((self.rows, 100), 0.5, np.float32)
            if self.smooth
            else rng.normal(size=(self.rows, 100)).astype(np.float32)
        )
        return [y, np.zeros(1, np.int64)]


@asynccontextmanager
async def serve(settings: Settings, repo: FakeRepository) -> AsyncIterator[httpx.AsyncClient]:
    app = in_process_app(settings, repo)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c


def infer_body(binary: bool) -> tuple[bytes, dict[str, str]]:
    """A JSON request for model ``noise`` (one row of ``x``), outputs binary or JSON."""
    body = {
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [1, 4], "data": [1, 2, 3, 4]}],
        "outputs": [{"name": "y", "parameters": {"binary_data": binary}}],
    }
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


async def post_noise(
    mode: str, rows: int, *, binary: bool, accept: str | None = "gzip", smooth: bool = False
) -> httpx.Response:
    repo = FakeRepository()
    repo.models["noise"] = NoiseHandle(rows, smooth=smooth)
    settings = Settings(access_log=False, response_compression=mode)  # type: ignore[arg-type]
    body, headers = infer_body(binary)
    if accept is not None:
        headers["Accept-Encoding"] = accept
    async with serve(settings, repo) as client:
        resp = await client.post("/v2/models/noise/infer", content=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


def output_of(resp: httpx.Response) -> np.ndarray:  # type: ignore[type-arg]
    """The ``y`` output of a (possibly binary) response, after httpx inflated it."""
    n = resp.headers.get("inference-header-content-length")
    if n is None:
        out = resp.json()["outputs"][0]
        return np.asarray(out["data"], np.float32).reshape(out["shape"])
    head = json.loads(resp.content[: int(n)])
    return np.frombuffer(resp.content[int(n) :], "<f4").reshape(head["outputs"][0]["shape"])


async def test_paths_are_escaped_and_cut_in_messages_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = "/v2/x%0a2026-01-01 00:00:00 INFO bitserve.access [-] GET /forged 200"
    long = "/v2/" + "a" * 60_000
    with caplog.at_level(logging.INFO, logger="service"):
        async with serve(Settings(), FakeRepository()) as client:
            r1 = await client.get(forged)
            r2 = await client.get(long)
            r3 = await client.post("/v2/models/%1b[2J/infer", content=b"{}")
    assert r1.status_code == r2.status_code == r3.status_code == 404
    expected = "no route GET /v2/x\\n2026-01-01 00:00:00 INFO bitserve.access [-] GET /forged 200"
    assert r1.json()["error"] == expected
    assert len(r2.json()["error"]) < 300
    assert r2.json()["error"].endswith("...")
    assert "\x1b" not in r3.json()["error"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 6, lines  # an access line per request, and the infer route's 404
    assert all(line.isprintable() and len(line) < 600 for line in lines), lines


def test_max_headers_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITSERVE_MAX_HEADERS", "42")
    monkeypatch.setenv("BITSERVE_RESPONSE_COMPRESSION", "never")
    s = Settings()
    assert (s.max_headers, s.response_compression) == (42, "never")
    with pytest.raises(ValueError, match="response_compression"):
        Settings(response_compression="sometimes")  # type: ignore[arg-type]


# ---- response compression policy -----------------------------------------------------------


async def test_auto_leaves_incompressible_binary_floats_alone() -> None:
    resp = await post_noise("auto", 200, binary=True)
    assert "content-encoding" not in resp.headers
    assert output_of(resp).shape == (200, 100)


async def test_auto_compresses_json_and_compressible_binary() -> None:
    for binary, smooth in ((False, False), (True, True)):
        resp = await post_noise("auto", 200, binary=binary, smooth=smooth)
        assert resp.headers["content-encoding"] == "gzip", (binary, smooth)
        assert int(resp.headers["content-length"]) < len(resp.content) * 0.5
        assert output_of(resp).shape == (200, 100)


async def test_always_and_never() -> None:
    resp = await post_noise("always", 200, binary=True, accept="deflate")
    assert resp.headers["content-encoding"] == "deflate"
    np.testing.assert_array_equal(
        output_of(resp),
        np.random.default_rng(0).normal(size=(200, 100)).astype(np.float32),
    )
    resp = await post_noise("never", 200, binary=False)
    assert "content-encoding" not in resp.headers


async def test_small_bodies_and_unasked_are_never_compressed() -> None:
    resp = await post_noise("always", 1, binary=True)  # ~ 550 bytes
    assert len(resp.content) < MIN_BYTES
    assert "content-encoding" not in resp.headers
    resp = await post_noise("always", 200, binary=False, accept="identity")
    assert "content-encoding" not in resp.headers


def test_worth_compressing_decides_on_the_tensor_bytes() -> None:
    rng = np.random.default_rng(1)
    header = json.dumps({"outputs": [{"name": "y"}] * 50}).encode()  # compressible
    noise = rng.normal(size=3 * TRIAL_BYTES // 4).astype(np.float32).tobytes()
    smooth = np.repeat(rng.normal(size=64), 4 * TRIAL_BYTES // 64).astype(np.float32).tobytes()
    assert not worth_compressing(header + noise, len(header), "auto")
    assert worth_compressing(header + smooth, len(header), "auto")
    assert worth_compressing(header + noise, None, "auto")  # JSON-only: always worth it
    assert worth_compressing(header + noise, len(header), "always")
    assert not worth_compressing(header + smooth, len(header), "never")
    assert not worth_compressing(b"x" * (MIN_BYTES - 1), None, "always")
    # the real ratio agrees with the trial
    assert len(zlib.compress(noise, 1)) > 0.9 * len(noise)
    assert len(gzip.compress(smooth, 1)) < 0.1 * len(smooth)


# ---- OpenAPI -------------------------------------------------------------------------------


async def test_openapi_is_guarded_with_unique_operation_ids() -> None:
    settings = Settings(access_log=False, auth_token="tok")  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns on duplicate operation ids
        async with serve(settings, FakeRepository()) as client:
            refused = await client.get("/openapi.json")
            docs = [await client.get(p) for p in ("/docs", "/redoc", "/docs/oauth2-redirect")]
            resp = await client.get("/openapi.json", headers={"Authorization": "Bearer tok"})
    assert (refused.status_code, refused.json()) == (
        401,
        {"error": "missing bearer token (send 'Authorization: Bearer <token>')"},
    )
    assert [r.status_code for r in docs] == [404, 404, 404]  # not served at all
    assert resp.status_code == 200
    schema = resp.json()
    ops = [
        (path, method, op["operationId"])
        for path, item in schema["paths"].items()
        for method, op in item.items()
    ]
    ids = [op_id for _, _, op_id in ops]
    assert len(ids) == len(set(ids)), ids
    routes = {(path, method) for path, method, _ in ops}
    assert ("/v2/models/{model}/infer", "post") in routes
    assert ("/v2/models/{model}/versions/{version}/infer", "post") in routes
    assert {("/v2/repository/index", "get"), ("/v2/repository/index", "post")} <= routes
    assert ("/v2/health/live", "get") in routes
    assert "/openapi.json" not in schema["paths"]


async def test_auto_reuses_a_models_trial_verdict_for_a_while() -> None:
    repo = FakeRepository()
    handle = NoiseHandle(200)
    repo.models["noise"] = handle
    body, headers = infer_body(True)
    headers["Accept-Encoding"] = "gzip"
    async with serve(Settings(access_log=False), repo) as client:
        first = await client.post("/v2/models/noise/infer", content=body, headers=headers)
        handle.smooth = True  # would compress now, but the verdict of the trial stands
        second = await client.post("/v2/models/noise/infer", content=body, headers=headers)
        json_body, json_headers = infer_body(False)  # JSON bodies have no trial
        third = await client.post(
            "/v2/models/noise/infer", content=json_body, headers={**json_headers, **headers}
        )
    assert "content-encoding" not in first.headers
    assert "content-encoding" not in second.headers
    np.testing.assert_array_equal(output_of(second), np.full((200, 100), 0.5, np.float32))
    assert third.headers["content-encoding"] == "gzip"
