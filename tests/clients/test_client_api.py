"""What tritonclient and httpx users expect of the client: per-call headers and timeouts,
defaults from the environment, TLS and proxy options, results with names and headers, the
error types, the model repository calls, and a closed client."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from bitserve_client import (
    AsyncClient,
    BitserveError,
    Client,
    ModelNotFound,
    ServerError,
    Unauthorized,
)

from .conftest import Harness, rows
from .fake_v2 import FakeV2, reference_bits


def infer_header(request: httpx.Request) -> dict[str, Any]:
    n = int(request.headers["Inference-Header-Content-Length"])
    return json.loads(request.content[:n])  # type: ignore[no-any-return]


# -- per-call options ---------------------------------------------------------------------------


def test_headers_per_call_on_every_method(make: Callable[..., Harness]) -> None:
    h = make(headers={"X-Team": "a"})
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("is_live", ()),
        ("is_ready", ()),
        ("is_ready", ("bits",)),
        ("server_metadata", ()),
        ("model_metadata", ("bits",)),
        ("model_config", ("bits",)),
        ("repository_index", ()),
        ("load_model", ("bits",)),
        ("unload_model", ("plain",)),
        ("infer", ("bits", rows(1))),
    ]
    for method, args in calls:
        before = len(h.fake.requests)
        h(method, *args, headers={"X-Call": method, "X-Team": "b"})
        sent = h.fake.requests[before:]
        assert sent, method
        assert all(r.headers["X-Call"] == method for r in sent[-1:]), method
        assert sent[-1].headers["X-Team"] == "b"  # the call's header wins over the client's
    plain = h.fake.requests[-1]
    h("infer", "bits", rows(1))
    assert "X-Call" not in h.fake.requests[-1].headers
    assert plain.headers["Content-Type"] == "application/octet-stream"


def test_bulk_calls_pass_headers_and_deadline_to_every_request(
    make: Callable[..., Harness],
) -> None:
    h = make()
    h("infer_many", "bits", rows(10), batch_size=4, progress=False, headers={"X-Bulk": "1"},
      deadline=2.0)  # fmt: skip
    infers = [r for r in h.fake.requests if r.url.path.endswith("/infer")]
    assert len(infers) == 3
    assert all(r.headers["X-Bulk"] == "1" for r in infers)
    assert all(infer_header(r)["parameters"]["timeout"] == 2_000_000 for r in infers)


@pytest.mark.mock_transport
def test_timeout_is_the_http_timeout_everywhere(kind: str) -> None:
    seen: list[dict[str, Any]] = []
    fake = FakeV2()

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.extensions["timeout"]))
        return fake.handler(request)

    async def ahandler(request: httpx.Request) -> httpx.Response:
        await request.aread()
        return handler(request)

    h = Harness(kind, fake, timeout=7.0)
    transport = httpx.MockTransport(handler if kind == "sync" else ahandler)
    h.client._http._transport = transport  # the same client, a recording transport
    try:
        h("model_metadata", "bits")
        h("infer", "bits", rows(1), timeout=0.5)
    finally:
        h.close()
    assert seen[0] == {"connect": 7.0, "read": 7.0, "write": 7.0, "pool": 7.0}
    assert seen[-1] == {"connect": 0.5, "read": 0.5, "write": 0.5, "pool": 0.5}
    assert (
        "parameters" not in infer_header(fake.requests[-1])
        or "timeout" not in (infer_header(fake.requests[-1])["parameters"])
    )  # the HTTP timeout is not a server-side deadline


def test_deadline_must_be_positive(make: Callable[..., Harness]) -> None:
    h = make()
    with pytest.raises(ValueError, match="deadline must be > 0"):
        h("infer", "bits", rows(1), deadline=0)


# -- defaults from the environment, TLS, proxy --------------------------------------------------


@pytest.mark.mock_transport
def test_url_and_token_default_to_the_environment(
    monkeypatch: pytest.MonkeyPatch, make: Callable[..., Harness]
) -> None:
    monkeypatch.setenv("BITSERVE_URL", "http://from-env:9000")
    monkeypatch.setenv("BITSERVE_TOKEN", "env-token")
    h = make(url=None)
    assert h.client.url == "http://from-env:9000"
    h("server_metadata")
    sent = h.fake.requests[-1]
    assert str(sent.url) == "http://from-env:9000/v2"
    assert sent.headers["Authorization"] == "Bearer env-token"
    h2 = make(url="http://explicit:1", token="")  # "" sends no token at all
    h2("server_metadata")
    assert "Authorization" not in h2.fake.requests[-1].headers
    monkeypatch.delenv("BITSERVE_URL")
    assert make(url=None).client.url == "http://127.0.0.1:8000"


class RecordingContext(ssl.SSLContext):
    """An SSL context that records the client certificates loaded into it."""

    loaded: list[tuple[Any, ...]]

    def load_cert_chain(self, *args: Any, **kwargs: Any) -> None:
        self.loaded = [*getattr(self, "loaded", []), args]


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_tls_proxy_and_http2_options_reach_httpx(
    cls: type[Client] | type[AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    captured: dict[str, Any] = {}
    name = "Client" if cls is Client else "AsyncClient"
    real = getattr(httpx, name)

    def record(**kwargs: Any) -> Any:
        captured.update(kwargs)
        return real(**{k: v for k, v in kwargs.items() if k != "http2"})  # h2 not needed

    monkeypatch.setattr(httpx, name, record)
    cls("http://x", proxy="http://proxy:3128", http2=True, verify=False)
    assert captured["proxy"] == "http://proxy:3128"
    assert captured["http2"] is True
    assert captured["verify"] is False
    # A client certificate is loaded into the context httpx gets (httpx itself deprecates
    # cert=: with warnings as errors, passing it through would fail this test).
    ctx = RecordingContext(ssl.PROTOCOL_TLS_CLIENT)
    cls("https://x", verify=ctx, cert=("client.pem", "client.key"))
    assert captured["verify"] is ctx
    assert ctx.loaded == [("client.pem", "client.key")]


def test_verify_and_cert_become_one_ssl_context(tmp_path: Path) -> None:
    import certifi
    from bitserve_client._base import _ssl_verify

    assert _ssl_verify(True, None) is True  # httpx's own default (certifi, SSL_CERT_FILE)
    assert _ssl_verify(False, None) is False
    from_file = _ssl_verify(certifi.where(), None)  # a CA bundle path
    assert isinstance(from_file, ssl.SSLContext)
    assert from_file.verify_mode == ssl.CERT_REQUIRED
    assert from_file.cert_store_stats()["x509_ca"] > 10
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(ssl.SSLError):
        _ssl_verify(str(tmp_path / "bad.pem"), None)
    for verify in (False, True):  # the client certificate is loaded, and checked, now
        with pytest.raises(ssl.SSLError):
            _ssl_verify(verify, str(tmp_path / "bad.pem"))


# -- results ------------------------------------------------------------------------------------


def test_results_by_name_and_response_headers(make: Callable[..., Harness]) -> None:
    h = make()
    bits = rows(3, seed=7)
    result = h("infer", "bits", bits, headers={"X-Request-ID": "trace-1"}, request_id="r1")
    np.testing.assert_array_equal(result.as_numpy("count"), reference_bits(bits)["count"])
    assert result.as_numpy("nope") is None
    with pytest.raises(KeyError, match=r"no output 'nope'.*outputs: \['count', 'first'\]"):
        result["nope"]
    assert result.get_output("first") == {
        "name": "first",
        "datatype": "FP32",
        "shape": [3, 3],
        "parameters": {"binary_data_size": 36},
    }
    assert result.get_output("nope") is None
    assert (result.id, result.request_id) == ("r1", "trace-1")
    assert result.headers["content-type"] == "application/octet-stream"
    as_json = h("infer", "bits", bits, binary=False)
    assert as_json.get_output("count") == {"name": "count", "datatype": "INT32", "shape": [3, 3]}
    assert as_json.request_id is not None
    assert as_json.request_id.startswith("fake-")


def test_server_error_carries_the_request_id(make: Callable[..., Harness]) -> None:
    h = make()
    with pytest.raises(ModelNotFound) as info:
        h("model_metadata", "nope", headers={"X-Request-ID": "find-me"})
    assert info.value.request_id == "find-me"
    h.fake.script.append(httpx.Response(500, json={"error": "InternalError"}))
    with pytest.raises(ServerError) as info:
        h("server_metadata")
    assert info.value.request_id is not None


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 403])
def test_unauthorized(make: Callable[..., Harness], status: int) -> None:
    h = make()
    h.fake.script.append(httpx.Response(status, json={"error": "token"}))
    with pytest.raises(Unauthorized) as info:
        h("server_metadata")
    assert isinstance(info.value, ServerError)
    assert info.value.status == status


def test_a_missing_token_raises_instead_of_not_ready(make: Callable[..., Harness]) -> None:
    h = make(FakeV2(token="t0k"))
    assert h("is_live") is True  # health routes need no token (as bitserve)
    with pytest.raises(Unauthorized, match="bearer token"):
        h("is_ready", "bits")
    with pytest.raises(Unauthorized):
        h("infer", "bits", rows(1))
    good = make(FakeV2(token="t0k"), token="t0k")
    assert good("is_ready", "bits") is True


def test_health_raises_for_answers_that_are_not_health(make: Callable[..., Harness]) -> None:
    h = make(url="http://fake:1/wrong-prefix")
    with pytest.raises(ModelNotFound):  # the fake's 404 for a route it does not have
        h("is_live")
    ok = make()
    ok.fake.script.append(httpx.Response(503, json={"error": "shutting down"}))
    assert ok("is_live") is False
    ok.fake.script.append(httpx.Response(503, json={"error": "loading"}))
    assert ok("is_ready") is False
    assert ok("is_ready", "nope") is False  # an unknown (or unloaded) model is not ready
    assert ok.sleeps == []  # health checks are not retried


def test_a_closed_client_raises_bitserve_error(make: Callable[..., Harness]) -> None:
    h = make()
    assert h.client.is_closed is False
    h.close()
    assert h.client.is_closed is True
    with pytest.raises(BitserveError, match="the client is closed"):
        h("is_live")
    with pytest.raises(BitserveError, match="the client is closed"):
        h("infer", "bits", rows(1))


# -- the model repository -----------------------------------------------------------------------


def test_repository_index_load_and_unload(make: Callable[..., Harness]) -> None:
    h = make()
    assert [m["state"] for m in h("repository_index")] == ["READY"] * 3
    h("infer", "plain", {"a": np.ones((1, 4)), "b": np.ones((1, 4), np.int64)})
    h("unload_model", "plain")
    assert h("is_ready", "plain") is False
    index = h("repository_index")
    assert {m["name"]: m["state"] for m in index}["plain"] == "UNAVAILABLE"
    assert [m["name"] for m in h("repository_index", ready=True)] == ["bits", "multi"]
    h("load_model", "plain", {"max_batch_size": 2})
    h("load_model", "bits", '{"max_batch_size": 4}')
    h("load_model", "multi")
    assert h.fake.load_bodies == [
        {"parameters": {"config": '{"max_batch_size": 2}'}},
        {"parameters": {"config": '{"max_batch_size": 4}'}},
        {},
    ]
    calls = h.fake.metadata_calls
    h("infer", "plain", {"a": np.ones((1, 4)), "b": np.ones((1, 4), np.int64)})
    assert h.fake.metadata_calls == calls + 1  # the spec was refetched after the reload
    with pytest.raises(ServerError, match="failed to load") as info:
        h("load_model", "nope")
    assert info.value.status == 400
    sent = h.fake.requests[-1]
    assert sent.url.path == "/v2/repository/models/nope/load"
    assert sent.headers["Content-Type"] == "application/json"
    assert sent.headers["Content-Length"] == "2"  # "{}": a plain body, not chunked
