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
from hypothesis import strategies as st

from benchmarks.e2e.loadgen import tree_rss_bytes
from benchmarks.e2e.probes import infer_ok, wait_idle
from benchmarks.e2e.workload import PACKED_LEN, Pool
from tests.e2e.conftest import BitserveServer, start_server

pytestmark = pytest.mark.e2e

INFER = "/v2/models/demo/infer"
ITEM = 20 * PACKED_LEN  # packed bytes of one item
MAX_BODY = 4 << 20  # the fuzzed server's body limit: bombs decompress far beyond it
DATATYPES = [
    "BOOL", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES", "BF16", "FP8", "uint8", "", "UINT8 ", "STRING",
]  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[BitserveServer]:
    with start_server(env={"BITSERVE_MAX_BODY_BYTES": str(MAX_BODY)}) as s:
        yield s


@pytest.fixture(scope="module")
def pool() -> Pool:
    return Pool.make(1)


def _header(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _spec(
    datatype: str = "UINT8", shape: Any = (1, 20, PACKED_LEN), size: Any = ITEM
) -> dict[str, Any]:
    shape = list(shape) if isinstance(shape, tuple) else shape
    return {
        "name": "spikes",
        "datatype": datatype,
        "shape": shape,
        "parameters": {"binary_data_size": size},
    }


def _binary(head: bytes, data: bytes, hlen: str | None = None) -> tuple[dict[str, str], bytes]:
    return {
        "Inference-Header-Content-Length": str(len(head)) if hlen is None else hlen
    }, head + data


# a lone surrogate or a control character (C0, DEL, C1)
BAD_TEXT = ["\ud800", "\udfff", "\udbff\udbff", "\x00", "\x1b[2J", "\n", "\x7f", "\x9b"]


@st.composite
def bad_requests(draw: st.DrawFn) -> tuple[str, dict[str, str], bytes]:
    """(what, headers, body) of a malformed V2 request to the demo model."""
    data = b"\x55" * ITEM
    kind = draw(
        st.sampled_from(
            [
                "hlen", "truncated", "overlong", "shape", "dims", "datatype", "json",
                "utf8", "nesting", "duplicate", "json-data", "names", "encoding", "garbage",
                "text", "timeout",
            ]
        )
    )  # fmt: skip
    head = _header([_spec()])
    if kind == "hlen":
        n = str(len(head))
        hlen = draw(
            st.sampled_from(["-1", "-100", "abc", "", "1e3", "0x10", "+5", "9" * 30])
            # what Python's int() would take for the right length (spaces around a header
            # value are HTTP's optional whitespace, stripped before the server sees it)
            | st.sampled_from([f"+{n}", f"{n[0]}_{n[1:]}", f"{n}.0", f"{n}\t{n}", "-0"])
            | st.integers(len(head) + len(data) + 1, 10**9).map(str)
            | st.integers(1, len(head) - 1).map(str)
        )
        return kind, *_binary(head, data, hlen)
    if kind == "text":
        # a lone surrogate or a control character in a text field the server echoes
        any_text = st.text(st.characters(exclude_categories=()), max_size=4)
        bad = draw(any_text) + draw(st.sampled_from(BAD_TEXT)) + draw(any_text)
        where = draw(st.sampled_from(["id", "input", "output"]))
        spec = _spec()
        extra: dict[str, Any] = {"id": f"r{bad}"} if where == "id" else {}
        if where == "input":
            spec["name"] = f"spikes{bad}"
        if where == "output":
            extra["outputs"] = [{"name": f"resampled{bad}"}]
        return kind, *_binary(_header([spec], **extra), data)
    if kind == "timeout":
        timeout = draw(
            st.sampled_from([10**400, 10**309, 2**63, -1, -(2**70), 1e309, 1.5, "10", True, [1]])
        )
        return kind, *_binary(_header([_spec()], parameters={"timeout": timeout}), data)
    if kind == "truncated":
        cut = draw(st.integers(1, ITEM))
        return kind, *_binary(head, data[: ITEM - cut])
    if kind == "overlong":
        extra = draw(st.integers(1, 4096))
        return kind, *_binary(head, data + b"\0" * extra)
    if kind == "shape":
        shape = draw(
            st.sampled_from(
                [(1, 20, PACKED_LEN - 1), (1, 19, PACKED_LEN), (17, 20, PACKED_LEN),
                 (20, PACKED_LEN), (1, 1, 20, PACKED_LEN), (1, 20 * PACKED_LEN)]
            )
        )  # fmt: skip
        n = 1
        for d in shape:
            n *= d
        body = b"\x01" * n
        return kind, *_binary(_header([_spec(shape=shape, size=n)]), body)
    if kind == "dims":
        dim = draw(st.sampled_from([-1, 0, -(2**63), 2**31, 10**12, 2**63, 2**64, 1.5, "1", None]))
        pos = draw(st.integers(0, 2))
        shape: list[Any] = [1, 20, PACKED_LEN]
        shape[pos] = dim
        return kind, *_binary(_header([_spec(shape=shape)]), data)
    if kind == "datatype":
        dt = draw(st.sampled_from(DATATYPES))
        return kind, *_binary(_header([_spec(datatype=dt)]), data)
    if kind == "json":
        text = draw(
            st.sampled_from([b"{", b"[]", b"null", b"1", b'"x"', b'{"inputs": 5}', b"{}"])
            | st.binary(min_size=1, max_size=64).filter(lambda b: b[:1] not in b"{[ \t\r\n")
        )
        return kind, {"Content-Type": "application/json"}, text
    if kind == "utf8":
        raw = head.replace(b'"spikes"', b'"sp\xff\xfekes"')
        return kind, *_binary(raw, data)
    if kind == "nesting":
        depth = draw(st.integers(1_000, 100_000))
        doc = b'{"inputs": [{"name": "spikes", "datatype": "BOOL", "shape": [1], "data": '
        doc += b"[" * depth + b"]" * depth + b"}]}"
        return kind, {"Content-Type": "application/json"}, doc
    if kind == "duplicate":
        return kind, *_binary(_header([_spec(), _spec()]), data + data)
    if kind == "json-data":
        values = draw(st.sampled_from([[1, 2, 3], ["a"] * 4, [[1, 2], [3]], [None], [1.5, True]]))
        doc = {"inputs": [{"name": "spikes", "datatype": "UINT8", "shape": [1, 20, PACKED_LEN],
                           "data": values}]}  # fmt: skip
        return kind, {"Content-Type": "application/json"}, json.dumps(doc).encode()
    if kind == "names":
        variant = draw(st.sampled_from(["unknown-input", "missing", "output", "triton"]))
        if variant == "unknown-input":
            spec = {**_spec(), "name": "spokes"}
            return kind, *_binary(_header([spec]), data)
        if variant == "missing":
            return kind, {"Content-Type": "application/json"}, _header([])
        if variant == "output":
            return kind, *_binary(_header([_spec()], outputs=[{"name": "nope"}]), data)
        params = {"triton_enable_empty_final_response": True}
        return kind, *_binary(_header([_spec()], parameters=params), data)
    if kind == "encoding":
        enc = draw(st.sampled_from(["br", "compress", "zstd", "gzip, br", "x-unknown"]))
        headers, body = _binary(head, data)
        return kind, {**headers, "Content-Encoding": enc}, body
    # garbage: random bytes under a random header length
    body = draw(st.binary(min_size=0, max_size=512))
    hlen = draw(st.integers(1, 600))
    return kind, {"Inference-Header-Content-Length": str(hlen)}, body


class Case:
    """A generated request; its repr stays short (bodies are up to megabytes)."""

    def __init__(self, what: str, headers: dict[str, str], body: bytes) -> None:
        self.what, self.headers, self.body = what, headers, body

    def __repr__(self) -> str:
        return f"Case({self.what!r}, {self.headers!r}, {self.body[:120]!r}... {len(self.body)} B)"


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
    from service.app import create_app
    from service.settings import Settings

    with warnings.catch_warnings():
        # FastAPI warns about a duplicate operation id (the repository index is registered
        # for GET and POST with one function); reported, harmless for fuzzing.
        warnings.simplefilter("ignore", UserWarning)
        raw = create_app(Settings()).openapi()
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
