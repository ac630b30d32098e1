"""Security against a real ``bitserve serve`` process on loopback.

- With a bearer token configured: 401 (with ``WWW-Authenticate``) without it, with a wrong
  one or another scheme; health endpoints stay open; the right token works.
- Model names with ``..``, slashes, backslashes, NUL or percent-encoded separators never reach
  outside the repository: a valid model placed next to the repository is never loaded.
- Oversized headers and floods of headers are refused, and the server keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from harness import wire
from harness.probes import (
    http_status,
    infer_ok,
    raw_request,
    request_bytes,
    write_repository,
)
from harness.server import BitserveServer
from harness.workload import Pool

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-Token_0123456789"


@pytest.fixture(scope="module")
def pool() -> Pool:
    return Pool.make(1)


def _error_body(raw: bytes) -> str:
    body = raw[raw.index(b"\r\n\r\n") + 4 :]
    doc = json.loads(body)
    assert isinstance(doc, dict)
    assert isinstance(doc.get("error"), str)
    return str(doc["error"])


def test_bearer_token(server_factory: Callable[..., BitserveServer], pool: Pool) -> None:
    server = server_factory(env={"BITSERVE_AUTH_TOKEN": TOKEN})
    body = wire.encode("packed", pool.items[0])
    url = server.url + "/v2/models/demo/infer"
    for auth in (
        None,
        "",
        "Bearer",
        "Bearer wrong",
        f"Bearer {TOKEN[:-1]}",
        f"Bearer {TOKEN}x",
        f"Basic {TOKEN}",
        TOKEN,
    ):
        headers = dict(body.headers)
        if auth is not None:
            headers["Authorization"] = auth
        r = httpx.post(url, content=body.content, headers=headers, timeout=30)
        assert r.status_code == 401, (auth, r.status_code, r.text)
        assert r.headers.get("www-authenticate", "").lower().startswith("bearer"), auth
        assert r.json()["error"]
    paths = ["/v2", "/v2/models/demo", "/v2/models/demo/config", "/v2/repository/index"]
    paths += ["/metrics", "/openapi.json", "/v2/logging", "/v2/systemsharedmemory/status"]
    for path in paths:
        method = "POST" if path.endswith("index") else "GET"
        r = httpx.request(method, server.url + path, timeout=30)
        assert r.status_code == 401, (path, r.text)
    for path in ("/docs", "/redoc"):  # no interactive docs at all
        r = httpx.get(server.url + path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 404, (path, r.text)
    schema = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert "/v2/models/{model}/infer" in schema.json()["paths"]
    # Health stays open to probes that carry no token.
    for path in ("/v2/health/live", "/v2/health/ready"):
        assert httpx.get(server.url + path).status_code == 200, path
    infer_ok(server.url, "demo", pool, headers={"Authorization": f"Bearer {TOKEN}"})


TRAVERSALS = [
    "..",
    "%2e%2e",
    "%2E%2E",
    "..%2foutside",
    "..%2Foutside",
    "%2e%2e%2foutside",
    "..%5coutside",
    "..\\outside",
    "%252e%252e%252foutside",
    "demo%2f..%2f..%2foutside",
    "demo%00",
    "%00",
    "outside%2f1",
    "..%2f..%2f..%2f..%2fetc%2fpasswd",
]


def test_model_names_cannot_leave_the_repository(
    server_factory: Callable[..., BitserveServer], tmp_path: Path, pool: Pool
) -> None:
    # A valid model right next to the repository: reaching it would be a traversal.
    write_repository(tmp_path / "side", name="outside")
    repo = write_repository(tmp_path / "repo")
    server = server_factory(repo)
    for name in TRAVERSALS:
        for method, path in (
            ("GET", f"/v2/models/{name}"),
            ("GET", f"/v2/models/{name}/ready"),
            ("GET", f"/v2/models/{name}/config"),
            ("GET", f"/v2/models/demo/versions/{name}"),
            ("POST", f"/v2/models/{name}/infer"),
            ("POST", f"/v2/repository/models/{name}/load"),
            ("POST", f"/v2/repository/models/{name}/unload"),
        ):
            # Raw bytes on the socket: no client-side normalisation of the path.
            raw = raw_request(server.port, request_bytes(path, b"{}", method=method))
            status = http_status(raw)
            assert status in (400, 404), (method, path, raw[:300])
            assert _error_body(raw), (method, path)
    index = httpx.post(server.url + "/v2/repository/index", timeout=30).json()
    assert [m["name"] for m in index] == ["demo"], index
    infer_ok(server.url, "demo", pool)


def test_oversized_headers_are_refused(demo_server: BitserveServer, pool: Pool) -> None:
    server = demo_server  # the default limits: the session's demo server
    # One header four times max_header_bytes (64 KiB).
    big = request_bytes("/v2/health/live", method="GET", headers={"X-Big": "a" * (256 << 10)})
    assert http_status(raw_request(server.port, big)) in (400, 413, 431)
    infer_ok(server.url, "demo", pool)


def test_header_bytes_limit_holds_for_many_headers(
    server_factory: Callable[..., BitserveServer],
) -> None:
    # Past the header count limit the bytes limit must hold on its own: the middleware checks
    # it, as h11 bounds only a head that arrives in pieces.
    server = server_factory(args=["--max-headers", "2000"])
    headers = {f"X-H{i}": "v" * 100 for i in range(1000)}  # ~107 KiB in all
    big = request_bytes("/v2/health/live", method="GET", headers=headers)
    assert http_status(raw_request(server.port, big)) in (400, 413, 431)


def test_too_many_headers_are_refused(demo_server: BitserveServer, pool: Pool) -> None:
    server = demo_server  # the default limits: the session's demo server
    many = {f"X-H{i}": "v" for i in range(5000)}
    flood = request_bytes("/v2/health/live", method="GET", headers=many)
    assert http_status(raw_request(server.port, flood)) in (400, 413, 431)
    infer_ok(server.url, "demo", pool)
