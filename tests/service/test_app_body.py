"""The request body path in process: reading (limits, timeout, buffer growth), what leaves the
event loop (decoding, inflating), early refusal of tensors a model does not take, the JSON
limit, and a reload while the body arrives."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import struct
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import pytest

import service.protocol.header_cache as header_cache
import service.protocol.tensors as tensors
import service.rest.inference as inference
from service.errors import InvalidInput, ModelNotReady, PayloadTooLarge, RequestTimeout
from service.models.signature import Bound
from service.rest.bodies import Receive, read_body
from service.rest.infer_route import parse_content_length
from service.server import in_process_app
from service.settings import Settings
from tests.service.app_fakes import FakeHandle, FakeRepository

pytestmark = pytest.mark.anyio


@pytest.fixture
def settings() -> Settings:
    return Settings(
        max_body_bytes=4 << 20, max_json_bytes=2048, body_timeout_s=30, access_log=False
    )


@pytest.fixture
def repo() -> FakeRepository:
    return FakeRepository()


@pytest.fixture
async def client(settings: Settings, repo: FakeRepository) -> AsyncIterator[httpx.AsyncClient]:
    app = in_process_app(settings, repo)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c


def assert_error(resp: httpx.Response, status: int, text: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert text in body["error"], body["error"]


def binary_body(
    name: str, datatype: str, shape: list[int], data: bytes
) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": shape,
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    return head + data, {"Inference-Header-Content-Length": str(len(head))}


def on_thread_recorder(
    monkeypatch: pytest.MonkeyPatch, attr: str, module: Any = inference
) -> list[bool]:
    """Wrap ``module.<attr>`` (``service.rest.inference`` by default): records whether each
    call ran off the main thread."""
    calls: list[bool] = []
    real: Callable[..., Any] = getattr(module, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread() is not threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, wrapped)
    return calls


# ---- what the event loop does not do --------------------------------------------------------


async def test_bytes_for_a_model_without_bytes_is_refused_before_parsing_elements(
    client: httpx.AsyncClient, repo: FakeRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_run(*args: object) -> object:
        raise AssertionError("BYTES elements were parsed for a model that refuses BYTES")

    monkeypatch.setattr(tensors, "_parse_bytes", must_not_run)
    n = 20_000  # 80 KB of empty strings behind a small JSON header
    body, headers = binary_body("x", "BYTES", [n, 4 // 4], struct.pack("<I", 0) * n)
    resp = await client.post("/v2/models/echo/infer", content=body, headers=headers)
    assert_error(resp, 400, "input 'x' has datatype BYTES; expected UINT8 [-1, 4]")
    assert repo.models["echo"].checked == [("x", "BYTES", (n, 1))]
    assert repo.models["echo"].requests == []


async def test_small_header_big_binary_part_decodes_off_the_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Headers not seen before: the full decoder (each request's own shape).
    calls = on_thread_recorder(monkeypatch, "decode_infer_request", header_cache)
    x = np.random.default_rng(0).integers(0, 256, size=(40_000, 4), dtype=np.uint8)
    body, headers = binary_body("x", "UINT8", list(x.shape), x.tobytes())
    resp = await client.post("/v2/models/echo/infer", content=body, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["outputs"][1]["data"] == x.astype(np.int64).sum(axis=1).tolist()
    # A tiny request stays on the loop (the thread hop would cost more than the work).
    small, small_headers = binary_body("x", "UINT8", [1, 4], bytes(4))
    assert (
        await client.post("/v2/models/echo/infer", content=small, headers=small_headers)
    ).status_code == 200
    assert calls == [True, False]


async def test_small_gzip_body_inflates_off_the_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = on_thread_recorder(monkeypatch, "decompress")
    x = np.frombuffer(os.urandom(8 << 10), np.uint8).reshape(-1, 4)  # random: stays > 4 KiB
    body, headers = binary_body("x", "UINT8", list(x.shape), x.tobytes())
    packed = gzip.compress(body)
    assert 4 << 10 < len(packed) < 32 << 10  # under the old inline bound
    resp = await client.post(
        "/v2/models/echo/infer", content=packed, headers={**headers, "Content-Encoding": "gzip"}
    )
    assert resp.status_code == 200, resp.text
    assert calls == [True]


# ---- the JSON limit ---------------------------------------------------------------------------


async def test_json_body_over_max_json_bytes_is_413_naming_the_binary_extension(
    client: httpx.AsyncClient, repo: FakeRepository
) -> None:
    rows = [[1, 2, 3, 4]] * 200  # about 2.8 KB of JSON, over the fixture's 2048
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [200, 4], "data": rows}]}
    )
    resp = await client.post("/v2/models/echo/infer", content=body)
    assert_error(resp, 413, "more than the limit of 2048 bytes; send large tensors as binary")
    assert "binary_tensor_data" in resp.json()["error"]
    assert repo.models["echo"].requests == []
    # The same tensor in the binary extension is fine: only the JSON part is bounded.
    x = np.array(rows, np.uint8)
    body2, headers = binary_body("x", "UINT8", [200, 4], x.tobytes())
    assert (
        await client.post("/v2/models/echo/infer", content=body2, headers=headers)
    ).status_code == 200


# ---- a reload while the body arrives ----------------------------------------------------------


class _Retired(FakeHandle):
    def compute(self, bound: Bound) -> list[np.ndarray]:  # type: ignore[type-arg]
        raise ModelNotReady(f"model '{self.name}' version {self.version} is not ready")


async def test_reload_during_upload_serves_the_new_version(
    client: httpx.AsyncClient, repo: FakeRepository
) -> None:
    repo.models["echo"] = old = _Retired("echo")
    new = FakeHandle("echo")
    body, headers = binary_body("x", "UINT8", [1, 4], bytes([1, 2, 3, 4]))

    async def upload() -> AsyncIterator[bytes]:
        yield body[:10]
        repo.models["echo"] = new  # the reload swaps versions while the body arrives
        yield body[10:]

    resp = await client.post("/v2/models/echo/infer", content=upload(), headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["outputs"][1]["data"] == [10]
    assert len(new.requests) == 1
    assert old.requests == []


# ---- read_body ---------------------------------------------------------------------------------


def _receive(chunks: list[bytes], then_wait: bool = False) -> Receive:
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        if pending:
            return {
                "type": "http.request",
                "body": pending.pop(0),
                "more_body": bool(pending) or then_wait,
            }
        if then_wait:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": b"", "more_body": False}

    return receive


@pytest.mark.parametrize("declared", ["-1", "+5", "1_0", " 5", "5 ", "0x5", "five", "\u0665"])
async def test_malformed_content_length_is_refused(declared: str) -> None:
    with pytest.raises(InvalidInput, match="malformed Content-Length"):
        parse_content_length(declared.encode())
    assert parse_content_length(b"0123") == 123


async def test_read_body_reads_declared_and_chunked_bodies() -> None:
    data = os.urandom(3 << 20)
    parts = [data[i : i + 65536] for i in range(0, len(data), 65536)]

    async def read(chunks: list[bytes], declared: int | None, limit: int) -> bytes:
        return bytes(
            await read_body(_receive(chunks), declared=declared, limit=limit, timeout_s=None)
        )

    assert await read(parts, len(data), 4 << 20) == data
    assert await read(parts, None, 4 << 20) == data
    assert await read([b"12", b"345"], 5, 10) == b"12345"
    with pytest.raises(InvalidInput, match="ended after 3 of 5 bytes"):
        await read([b"123"], 5, 10)
    with pytest.raises(InvalidInput, match="ended after 2000000 of 2000001 bytes"):
        await read([bytes(2_000_000)], 2_000_001, 4 << 20)
    with pytest.raises(InvalidInput, match="longer than its Content-Length"):
        await read([b"12", b"3456"], 5, 10)
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 10 bytes"):
        await read([b"123456", b"78901"], None, 10)
    # In one piece too: a body without a Content-Length is held to the limit however it came.
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 10 bytes"):
        await read([b"12345678901"], None, 10)
    assert await read([b"1234567890"], None, 10) == b"1234567890"


async def test_slow_body_times_out_holding_only_what_arrived() -> None:
    tracemalloc.start()
    try:
        receive = _receive([b"x"], then_wait=True)
        with pytest.raises(RequestTimeout, match=r"did not arrive within 0.2 s"):
            await read_body(receive, declared=60 << 20, limit=64 << 20, timeout_s=0.2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # not the declared 60 MiB


async def test_slow_body_is_408_over_http(settings: Settings, repo: FakeRepository) -> None:
    app = in_process_app(settings.model_copy(update={"body_timeout_s": 0.2}), repo)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async def trickle() -> AsyncIterator[bytes]:
        yield b"{"
        await asyncio.sleep(5)
        yield b"}"

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as c,
    ):
        resp = await asyncio.wait_for(
            c.post("/v2/models/echo/infer", content=trickle(), headers={"Content-Length": "2"}), 4
        )
    assert_error(resp, 408, "did not arrive within 0.2 s")
    assert resp.headers["connection"] == "close"
