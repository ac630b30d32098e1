"""Bad input, fuzzed, against a real ``bitserve serve`` process on loopback.

Every malformed request must get a 4xx with ``{"error": "<message>"}``; the server stays up
and its memory bounded. The V2 body cases cover: the binary header length negative, beyond
the body or not a number; truncated and over-long tensors; size/shape mismatches; negative,
zero and huge dimensions; every wrong datatype; invalid JSON, non-UTF-8, deep nesting;
duplicate input names; gzip and deflate bombs; unsupported encodings; lone surrogates and
control characters in ids and names (in bodies and URLs); absurd timeouts. Each test prints
how many cases it tried; ``FUZZ_EXAMPLES`` sets the number of V2 bodies (default 250).
"""

from __future__ import annotations

import gzip
import json
import os
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from harness.fuzzcases import INFER, Case, bad_requests
from harness.loadgen import tree_rss_bytes
from harness.probes import infer_ok, wait_idle
from harness.server import BitserveServer, start_server
from harness.workload import Pool

pytestmark = pytest.mark.e2e

MAX_BODY = 4 << 20  # the fuzzed server's body limit: bombs decompress far beyond it


@pytest.fixture(scope="module")
def server() -> Iterator[BitserveServer]:
    with start_server(env={"BITSERVE_MAX_BODY_BYTES": str(MAX_BODY)}) as s:
        yield s


@pytest.fixture(scope="module")
def pool() -> Pool:
    return Pool.make(1)


def _assert_4xx_error(r: httpx.Response, what: str) -> None:
    assert 400 <= r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    try:
        doc = r.json()
    except ValueError:
        pytest.fail(f"{what}: non-JSON error body {r.content[:200]!r}")
    assert isinstance(doc, dict), what
    assert isinstance(doc.get("error"), str), f"{what}: {doc}"
    assert doc["error"], what


def test_fuzzed_v2_bodies_get_4xx_errors(server: BitserveServer, pool: Pool) -> None:
    tried: dict[str, int] = {}
    client = httpx.Client(base_url=server.url, timeout=30)
    rss0 = tree_rss_bytes(server.process.pid)

    @settings(
        max_examples=int(os.environ.get("FUZZ_EXAMPLES", "250")),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=bad_requests().map(lambda t: Case(*t)))
    def run(case: Case) -> None:
        tried[case.what] = tried.get(case.what, 0) + 1
        r = client.post(INFER, content=case.body, headers=case.headers)
        _assert_4xx_error(r, repr(case))

    try:
        run()
    finally:
        client.close()
        print(f"fuzzed V2 bodies: {sum(tried.values())} cases {dict(sorted(tried.items()))}")
    wait_idle(server.url)
    infer_ok(server.url, "demo", pool)
    rss1 = tree_rss_bytes(server.process.pid)
    print(f"RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
    assert rss1 < rss0 * 1.25


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/%ED%A0%80/infer",  # a UTF-8-encoded lone surrogate
        "/v2/models/%FF%FE/ready",  # not UTF-8
        "/v2/models/a%1B%5B2Jb",  # an escape sequence
        "/v2/models/a%00b/config",
        "/v2/models/demo/versions/%ED%B0%80/infer",
        "/v2/models/demo/versions/1%0A2/ready",
        "/v2/models/" + "n" * 5000,
    ],
)
def test_hostile_model_names_in_urls(server: BitserveServer, path: str) -> None:
    method = "POST" if path.endswith("infer") else "GET"
    r = httpx.request(method, server.url + path, content=b"{}", timeout=30)
    _assert_4xx_error(r, path)
    error = r.json()["error"]
    assert error.isprintable(), ascii(error)  # echoed names are escaped
    assert len(error) < 1000


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compression_bombs_are_413_without_memory_blowup(
    server: BitserveServer, encoding: str
) -> None:
    # 256 MiB of zeros: about 250 KiB compressed, 64x the server's body limit once inflated.
    plain = bytes(256 << 20)
    packed = gzip.compress(plain, 9) if encoding == "gzip" else zlib.compress(plain, 9)
    del plain
    assert len(packed) < MAX_BODY
    rss0 = tree_rss_bytes(server.process.pid)
    for headers in (
        {"Content-Type": "application/json"},
        {"Inference-Header-Content-Length": "100"},
    ):
        r = httpx.post(
            server.url + INFER,
            content=packed,
            headers={**headers, "Content-Encoding": encoding},
            timeout=60,
        )
        assert r.status_code == 413, r.text[:300]
        _assert_4xx_error(r, f"{encoding} bomb")
    rss1 = tree_rss_bytes(server.process.pid)
    print(f"{encoding} bomb: RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
    assert rss1 < rss0 + 2 * MAX_BODY + (32 << 20)
    assert httpx.get(server.url + "/v2/health/live").status_code == 200


def test_schemathesis_against_the_app_schema(server: BitserveServer) -> None:
    """Schema-driven fuzzing of every route (methods, path parameters, bodies).

    The server does not publish ``/openapi.json`` (``openapi_url=None``), so the schema is
    taken from the same application object in-process and the calls go to the real server.
    """
    schemathesis = pytest.importorskip("schemathesis")
    from service.server import in_process_app
    from service.settings import Settings

    with warnings.catch_warnings():
        # FastAPI warns about a duplicate operation id (the repository index is registered
        # for GET and POST with one function); reported, harmless for fuzzing.
        warnings.simplefilter("ignore", UserWarning)
        raw = in_process_app(Settings()).openapi()
    schema = schemathesis.openapi.from_dict(raw)
    tried = 0
    client = httpx.Client(base_url=server.url, timeout=30)
    try:
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(max_examples=15, deadline=None, database=None)
            @given(case=operation.as_strategy())
            def run(case: Any) -> None:
                nonlocal tried
                tried += 1
                kwargs = case.as_transport_kwargs(base_url=server.url)
                r = client.request(
                    kwargs["method"],
                    kwargs["url"],
                    params=kwargs.get("params"),
                    headers=kwargs.get("headers"),
                    content=json.dumps(kwargs["json"]).encode() if "json" in kwargs else None,
                )
                what = f"{kwargs['method']} {kwargs['url']}"
                assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
                if r.status_code != 200:
                    _assert_4xx_error(r, what)

            run()
    finally:
        client.close()
        print(f"schemathesis: {tried} cases over {len(raw.get('paths', {}))} paths")
    assert tried > 0
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
