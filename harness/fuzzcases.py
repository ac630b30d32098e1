"""Hostile requests, shared by the fuzz tests and the hardening benchmark.

- :func:`bad_requests`: a hypothesis strategy of malformed V2 inference requests to the demo
  model (``(what, headers, body)``): header lengths, truncated and over-long tensors, shapes,
  datatypes, invalid JSON, non-UTF-8, deep nesting, duplicate names, unknown names and
  encodings, garbage, lone surrogates and control characters in text fields, absurd
  timeouts. Every one must be answered 4xx with ``{"error": ...}``.
- :data:`RAW_CASES` and :func:`raw_requests`: whole HTTP/1.1 requests as bytes, hand-made and
  generated (request lines, header names and values, framing, upgrades, paths), sent on raw
  sockets. None may be answered 5xx or without a JSON body on an error.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from harness.loadgen import is_error_body
from harness.workload import INPUT_NAME, N_FUNCTIONS, PACKED_LEN

INFER = "/v2/models/demo/infer"
ITEM = N_FUNCTIONS * PACKED_LEN  # packed bytes of one item
DATATYPES = [
    "BOOL", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES", "BF16", "FP8", "uint8", "", "UINT8 ", "STRING",
]  # fmt: skip


def _header(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _spec(
    datatype: str = "UINT8", shape: Any = (1, N_FUNCTIONS, PACKED_LEN), size: Any = ITEM
) -> dict[str, Any]:
    shape = list(shape) if isinstance(shape, tuple) else shape
    return {
        "name": INPUT_NAME,
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
                [(1, N_FUNCTIONS, PACKED_LEN - 1), (1, N_FUNCTIONS - 1, PACKED_LEN),
                 (17, N_FUNCTIONS, PACKED_LEN), (N_FUNCTIONS, PACKED_LEN),
                 (1, 1, N_FUNCTIONS, PACKED_LEN), (1, N_FUNCTIONS * PACKED_LEN)]
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
        shape: list[Any] = [1, N_FUNCTIONS, PACKED_LEN]
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
        shape = [1, N_FUNCTIONS, PACKED_LEN]
        doc = {"inputs": [{"name": INPUT_NAME, "datatype": "UINT8", "shape": shape,
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


# --- raw HTTP -------------------------------------------------------------------------------

_H = "Host: 127.0.0.1\r\nConnection: close\r\n"
_PATHS = [
    "/v2", "/v2/", "/", "*", "//v2", "/v2/models/demo", "/v2/models/demo/", INFER,
    "/v2/models/demo/versions/1/infer", "/v2/models/demo/config", "/v2/models/nope/infer",
    "/v2/repository/index", "/v2/repository/models/demo/load", "/metrics", "/openapi.json",
    "/v2/../../etc/passwd", "/v2/%2e%2e/%2e%2e/etc/passwd", "/v2/models/%00/ready",
    "/v2/models/demo/infer?x=%zz&y", "/v2/models/%ED%A0%80/infer", "/v2/models/a%0ab/ready",
    "http://evil.example/v2", "/v2/health/live#frag", "/v2/health/ready;p=1",
]  # fmt: skip
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "get", "POS"]
_VERSIONS = ["HTTP/1.1", "HTTP/1.0", "HTTP/0.9", "HTTP/2.0", "HTTP/1.2", "HTTP/1.1x", "http/1.1"]
_HEADER_NAMES = [
    "Content-Length", "Transfer-Encoding", "Content-Encoding", "Content-Type", "Expect",
    "Inference-Header-Content-Length", "Authorization", "X-Request-ID", "Accept-Encoding",
    "Upgrade", "Connection", "Host", "Cookie", "X-Forwarded-For",
]  # fmt: skip
_HEADER_VALUES = [
    "0", "-1", "+5", " 7 ", "1_0", "0x10", "99999999999999999999", "5, 5", "chunked",
    "gzip, chunked", "chunked, chunked", "xchunked", "gzip", "deflate", "br", "identity",
    "100-continue", "websocket", "h2c", "Upgrade", "keep-alive", "close", "Bearer", "\x1b[2J",
    "application/json", "gzip;q=nan", "a" * 300, "\udcff", "",
]  # fmt: skip


_TE = "Transfer-Encoding: chunked\r\n"
_IHCL = "Content-Length: 2\r\nInference-Header-Content-Length: "
_LOAD = "/v2/repository/models/demo/load"
_INDEX = "/v2/repository/index"


def _raw(first: str, headers: str = _H, body: bytes = b"") -> bytes:
    """A request line, headers (each ending in CRLF) and a body as bytes; lone surrogates
    stand for single bytes (``\udce9`` is the byte 0xE9)."""
    return (first + "\r\n" + headers + "\r\n").encode("utf-8", "surrogateescape") + body


def _get(extra: str, path: str = "/v2") -> bytes:
    return _raw(f"GET {path} HTTP/1.1", _H + extra)


def _post(extra: str, body: bytes = b"", path: str = INFER) -> bytes:
    return _raw(f"POST {path} HTTP/1.1", _H + extra, body)


RAW_CASES: list[tuple[str, bytes]] = [
    ("garbage line", b"GARBAGE\r\n\r\n"),
    ("empty lines only", b"\r\n\r\n\r\n"),
    ("TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64)),
    ("h2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("NUL in method", b"G\x00T /v2 HTTP/1.1\r\n" + _H.encode() + b"\r\n"),
    ("no version", _raw("GET /v2")),
    ("CONNECT", _raw("CONNECT example.com:443 HTTP/1.1")),
    ("absolute URI", _raw("GET http://evil.example/v2 HTTP/1.1")),
    ("Host evil, slash", _raw("GET /v2/ HTTP/1.1", "Host: evil.example\r\nConnection: close\r\n")),
    ("no Host", _raw("GET /v2 HTTP/1.1", "Connection: close\r\n")),
    ("two Hosts", _get("Host: other\r\n")),
    ("space before colon", _get("X-A : b\r\n")),
    ("no colon", _get("NoColonHere\r\n")),
    ("obs-fold", _get("X-A: b\r\n c\r\n")),
    ("NUL in value", _get("X-A: b\x00c\r\n")),
    ("DEL in value", _get("X-A: b\x7fc\r\n")),
    ("latin-1 value", _get("X-A: caf\udce9\r\n")),
    ("200 headers", _get("".join(f"X-{i}: v\r\n" for i in range(200)))),
    ("long path", _raw("GET /v2/" + "a" * 60_000 + " HTTP/1.1")),
    ("long header", _get("X-Big: " + "b" * 70_000 + "\r\n")),
    ("CL twice", _post("Content-Length: 2\r\nContent-Length: 2\r\n", b"{}")),
    ("CL plus", _post("Content-Length: +2\r\n", b"{}")),
    ("CL negative", _post("Content-Length: -1\r\n")),
    ("CL hex", _post("Content-Length: 0x2\r\n", b"{}")),
    ("CL huge", _post("Content-Length: 99999999999999999999\r\n")),
    ("CL and TE", _post("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n")),
    ("TE gzip", _post("Transfer-Encoding: gzip\r\n", b"{}")),
    ("TE xchunked", _post("Transfer-Encoding: xchunked\r\n", b"{}")),
    ("chunk overflow", _post(_TE, b"ffffffffffffffffffff\r\nx\r\n0\r\n\r\n")),
    ("chunk bad size", _post(_TE, b"zz\r\n")),
    ("chunk extension", _post(_TE, b"2;ext=1\r\n{}\r\n0\r\n\r\n")),
    ("chunk trailers", _post(_TE, b"2\r\n{}\r\n0\r\nX-T: 1\r\n\r\n")),
    ("chunked bad JSON", _post(_TE, b"3\r\n{{{\r\n0\r\n\r\n")),
    ("gzip garbage", _post("Content-Length: 4\r\nContent-Encoding: gzip\r\n", b"\x1f\x8bxx")),
    ("brotli", _post("Content-Length: 2\r\nContent-Encoding: br\r\n", b"{}")),
    ("IHCL plus", _post(_IHCL + "+2\r\n", b"{}")),
    ("IHCL exponent", _post(_IHCL + "1e0\r\n", b"{}")),
    ("IHCL spaces", _post(_IHCL + " 2 \r\n", b"{}")),
    ("bad request id", _get("X-Request-ID: \x1b[2J" + "i" * 300 + "\r\n")),
    ("expect, body", _post("Content-Length: 2\r\nExpect: 100-continue\r\n", b"{}")),
    ("expect garbage", _post("Content-Length: 2\r\nExpect: 99-sorry\r\n", b"{}")),
    ("websocket", _get("Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: "
                       "dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n")),
    ("h2c upgrade", _get("Upgrade: h2c\r\nConnection: Upgrade\r\nHTTP2-Settings: AAMAAABk\r\n")),
    ("accept-encoding nan", _get("Accept-Encoding: gzip;q=nan, br;q=-1\r\n")),
    ("control in token", _get("Authorization: Bearer \x01\x02\r\n")),
    ("load garbage", _post("Content-Length: 5\r\n", b"{{{{{", _LOAD)),
    ("index array", _post("Content-Length: 2\r\n", b"[]", _INDEX)),
    ("index deep", _post("Content-Length: 200000\r\n", b"[" * 100_000 + b"]" * 100_000, _INDEX)),
    ("1.0 keep-alive", _raw("GET /v2 HTTP/1.0", "Connection: keep-alive\r\n") + b"GET /v2\r\n\r\n"),
    ("pipelined bad 2nd", _raw("GET /v2/health/live HTTP/1.1", "Host: x\r\n") + b"BAD\r\n\r\n"),
    ("HEAD", _raw("HEAD /v2 HTTP/1.1")),
    ("OPTIONS *", _raw("OPTIONS * HTTP/1.1")),
    ("TRACE", _raw("TRACE /v2 HTTP/1.1")),
    ("DELETE infer", _raw(f"DELETE {INFER} HTTP/1.1")),
]  # fmt: skip
RAW_CASES += [(f"path {p}", _raw(f"GET {p} HTTP/1.1")) for p in _PATHS]
RAW_CASES += [(f"version {v}", _raw(f"GET /v2 {v}")) for v in _VERSIONS]


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A generated HTTP request: a known or random method, path and version, known or random
    header names and values, and a body framed rightly, wrongly or not at all."""
    token = st.binary(min_size=1, max_size=12)
    method = draw(st.sampled_from(_METHODS).map(str.encode) | token)
    path = draw(
        st.sampled_from(_PATHS).map(str.encode)
        | st.text(max_size=40).map(lambda t: b"/v2/" + t.encode("utf-8", "surrogatepass"))
        | token
    )
    version = draw(st.sampled_from(_VERSIONS).map(str.encode) | token)
    names = st.sampled_from(_HEADER_NAMES).map(str.encode) | token
    values = st.sampled_from(_HEADER_VALUES).map(
        lambda v: v.encode("utf-8", "surrogateescape")
    ) | st.binary(max_size=40)
    headers = draw(st.lists(st.tuples(names, values), max_size=8))
    body = draw(st.binary(max_size=256) | st.sampled_from([b"{}", b'{"inputs": []}', b"[]"]))
    framing = draw(st.sampled_from(["length", "wrong-length", "chunked", "none"]))
    lines = [method + b" " + path + b" " + version, b"Host: 127.0.0.1"]
    lines += [k + b": " + v for k, v in headers]
    if framing == "length":
        lines.append(b"Content-Length: %d" % len(body))
    elif framing == "wrong-length":
        lines.append(b"Content-Length: %d" % draw(st.integers(0, 2 * len(body) + 2)))
    elif framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
        body = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    lines.append(b"Connection: close")
    return "generated", b"\r\n".join(lines) + b"\r\n\r\n" + body


def examples(strategy: st.SearchStrategy[Any], n: int, *, rng_seed: int = 0) -> list[Any]:
    """``n`` examples drawn by hypothesis from ``strategy`` (outside a test: for the
    benchmark's counted runs; the same seed gives the same examples)."""
    out: list[Any] = []

    @settings(
        max_examples=n,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @seed(rng_seed)
    @given(strategy)
    def collect(example: Any) -> None:
        out.append(example)

    collect()
    return out


def judge_raw(answer: bytes, *, v2: bool = False) -> str | None:
    """What is wrong with the server's bytes for one request, else None.

    Allowed: nothing (the request was incomplete, or the connection closed), or responses
    each with a status under 500 whose non-2xx bodies are ``{"error": "<text>"}`` in JSON
    (never ``text/plain``, uvicorn's own). With ``v2`` (a malformed V2 request) only 4xx. An answer
    cut short (the client stopped reading) is judged on what came.
    """
    rest = answer
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 "):
            return f"not an HTTP/1.1 response: {head[:80]!r}"
        status = int(head[9:12])
        if status >= 500:
            return f"{status}: {rest[:200]!r}"
        if not sep:
            return None  # a head cut short
        if status == 100:
            continue
        fields = {}
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            fields[k.strip().lower()] = v.strip()
        n = int(fields.get(b"content-length", b"0"))
        if len(rest) < n:
            return None  # a body cut short
        body, rest = rest[:n], rest[n:]
        if v2 and not 400 <= status < 500:
            return f"{status} to a malformed V2 request: {body[:200]!r}"
        if status >= 400 and b"text/plain" in fields.get(b"content-type", b""):
            return f"plain-text answer {status}: {body[:200]!r}"
        if not 200 <= status < 300 and not is_error_body(body):
            return f"{status} without a JSON error body: {body[:200]!r}"
    return None
