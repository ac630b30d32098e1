"""Client and AsyncClient over httpx.MockTransport: framing, errors, retries, caching.

Each behaviour runs for both clients through the ``make`` fixture (conftest.py).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable

import httpx
import numpy as np
import pytest
from bitserve_client import (
    BitserveError,
    ConnectError,
    DeadlineExceeded,
    InvalidInputError,
    ModelNotFound,
    Retry,
    ServerError,
    TimeoutException,
    TransportError,
    Unavailable,
)

from .conftest import Harness
from .fake_v2 import FakeV2, reference_bits


def error(status: int, message: str, **headers: str) -> httpx.Response:
    return httpx.Response(status, json={"error": message}, headers=headers)


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("binary", [True, False])
def test_infer_round_trip_equals_reference(
    make: Callable[..., Harness], bitorder: str, binary: bool
) -> None:
    h = make(FakeV2(bitorder=bitorder))
    bits = np.random.default_rng(1).random((5, 3, 13)) < 0.5
    result = h("infer", "bits", {"x": bits}, request_id="abc", binary=binary)
    for name, ref in reference_bits(bits).items():
        np.testing.assert_array_equal(result[name], ref)
        assert result[name].dtype == ref.dtype
    assert (result.model_name, result.model_version, result.id) == ("bits", "1", "abc")
    infer = h.fake.requests[-1]
    assert infer.headers["Content-Type"] == (
        "application/octet-stream" if binary else "application/json"
    )
    assert int(infer.headers["Content-Length"]) == len(infer.content)


def test_packed_and_unpacked_inputs_give_identical_results(make: Callable[..., Harness]) -> None:
    h = make()
    bits = np.random.default_rng(2).random((4, 3, 13)) < 0.3
    a = h("infer", "bits", bits)
    b = h("infer", "bits", {"x": np.packbits(bits, axis=-1)})
    c = h("infer", "bits", {"x": bits.astype(np.float64)})
    for name in ("count", "first"):
        np.testing.assert_array_equal(a[name], b[name])
        np.testing.assert_array_equal(a[name], c[name])


def test_single_item_comes_back_without_batch_dim(make: Callable[..., Harness]) -> None:
    h = make()
    bits = np.random.default_rng(3).random((3, 13)) < 0.5
    result = h("infer", "bits", {"x": bits})
    assert result["count"].shape == (3,)
    np.testing.assert_array_equal(result["count"], reference_bits(bits)["count"])
    sent = json.loads(
        h.fake.requests[-1].content[
            : int(h.fake.requests[-1].headers["Inference-Header-Content-Length"])
        ]
    )
    assert sent["inputs"][0]["shape"] == [1, 3, 2]


def test_plain_v2_model_without_config(make: Callable[..., Harness]) -> None:
    h = make()
    a = np.arange(8, dtype=np.float64).reshape(2, 4)
    b = np.arange(8).reshape(2, 4)
    result = h("infer", "plain", {"a": a, "b": b}, outputs=["y"])
    np.testing.assert_array_equal(result["y"], a.astype(np.float32) * b)


def test_metadata_fetched_once_and_refetched_after_a_400(make: Callable[..., Harness]) -> None:
    h = make()
    bits = np.zeros((1, 3, 13), bool)
    h("infer", "bits", bits)
    h("infer", "bits", bits)
    assert h.fake.metadata_calls == 1
    h.fake.script.append(error(400, "model reloaded"))
    with pytest.raises(ServerError, match="model reloaded") as info:
        h("infer", "bits", bits)
    assert info.value.status == 400
    assert info.value.message == "model reloaded"
    h("infer", "bits", bits)
    assert h.fake.metadata_calls == 2


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compressed_request_bodies(make: Callable[..., Harness], compression: str) -> None:
    h = make(compression=compression)
    bits = np.random.default_rng(4).random((2, 3, 13)) < 0.5
    result = h("infer", "bits", bits)
    np.testing.assert_array_equal(result["count"], reference_bits(bits)["count"])
    req = h.fake.requests[-1]
    assert req.headers["Content-Encoding"] == compression
    raw = gzip.decompress(req.content) if compression == "gzip" else zlib.decompress(req.content)
    assert len(raw) > 0
    assert int(req.headers["Content-Length"]) == len(req.content)


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compression_level_is_1_by_default_and_settable(
    make: Callable[..., Harness], compression: str
) -> None:
    bits = np.random.default_rng(5).random((8, 3, 13)) < 0.1
    sizes = {}
    for level in (None, 1, 9, 0):
        h = (
            make(compression=compression)
            if level is None
            else make(compression=compression, compression_level=level)
        )
        h("infer", "bits", bits)
        body = h.fake.requests[-1].content
        sizes[level] = len(body)
        # The body is what zlib makes at that level (gzip: the same deflate stream inside).
        raw = gzip.decompress(body) if compression == "gzip" else zlib.decompress(body)
        if compression == "deflate":
            assert body == zlib.compress(raw, 1 if level is None else level)
    assert sizes[None] == sizes[1]
    assert sizes[9] <= sizes[1] < sizes[0]
    with pytest.raises(ValueError, match=r"compression_level must be an int 0\.\.9"):
        make(compression=compression, compression_level=10)


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_responses_are_asked_uncompressed_unless_compression_is_set(
    make: Callable[..., Harness], compression: str | None
) -> None:
    # Binary float tensors barely compress: by default the client asks for identity so the
    # server spends no CPU on gzip; with compression set it accepts that encoding.
    h = make(compression=compression)
    h("infer", "bits", np.zeros((1, 3, 13), dtype=bool))
    assert h.fake.requests[-1].headers["Accept-Encoding"] == (compression or "identity")


def test_token_and_headers_are_sent(make: Callable[..., Harness]) -> None:
    h = make(token="s3cret", headers={"X-Team": "a"})
    assert h("is_live") is True
    req = h.fake.requests[-1]
    assert req.headers["Authorization"] == "Bearer s3cret"
    assert req.headers["X-Team"] == "a"
    assert req.headers["User-Agent"].startswith("bitserve-client/")


def test_health_and_metadata(make: Callable[..., Harness]) -> None:
    h = make()
    assert h("is_ready") is True
    assert h("is_ready", "bits") is True
    assert h("server_metadata")["name"] == "fake"
    assert h("model_metadata", "bits")["inputs"][0]["parameters"]["packing"] == "bits"
    assert h("model_config", "bits")["max_batch_size"] == 8
    h.fake.script.append(error(503, "loading"))
    assert h("is_ready", "bits") is False
    assert h.sleeps == []  # health checks are not retried


def test_names_are_escaped_in_urls(make: Callable[..., Harness]) -> None:
    h = make()
    with pytest.raises(ModelNotFound, match="unknown model") as info:
        h("model_metadata", "../x", version="1")
    assert info.value.status == 404
    assert h.fake.requests[-1].url.raw_path == b"/v2/models/..%2Fx/versions/1"


def test_retry_on_503_honours_retry_after(make: Callable[..., Harness]) -> None:
    h = make()
    bits = np.zeros((1, 3, 13), bool)
    h("infer", "bits", bits)  # spec cached; now script the infer answers
    h.fake.script += [error(503, "queue full", **{"Retry-After": "2"}), error(503, "queue full")]
    result = h("infer", "bits", bits)
    assert result["count"].shape == (1, 3)
    assert len(h.sleeps) == 2
    assert 2.0 <= h.sleeps[0] <= 2.0 + 0.01  # Retry-After plus at most one backoff step
    assert 0.005 <= h.sleeps[1] <= 0.02  # second retry: backoff 0.01 * 2, jittered in [0.5, 1]


def test_503_gives_up_after_the_retries(make: Callable[..., Harness]) -> None:
    h = make()
    bits = np.zeros((1, 3, 13), bool)
    h("infer", "bits", bits)
    h.fake.script += [error(503, "queue full")] * 4
    with pytest.raises(Unavailable, match="queue full"):
        h("infer", "bits", bits)
    assert len(h.sleeps) == 3


def test_retry_after_longer_than_allowed_is_raised(make: Callable[..., Harness]) -> None:
    h = make(retries=Retry(retries=3, max_retry_after=5))
    h.fake.script.append(error(503, "busy", **{"Retry-After": "60"}))
    with pytest.raises(Unavailable) as info:
        h("model_metadata", "bits")
    assert info.value.retry_after == 60.0
    assert h.sleeps == []


@pytest.mark.parametrize("status", [400, 401, 404, 413, 429, 500, 504])
def test_other_statuses_are_not_retried(make: Callable[..., Harness], status: int) -> None:
    h = make()
    h.fake.script.append(error(status, f"status {status}"))
    with pytest.raises(ServerError, match=f"status {status}") as info:
        h("model_metadata", "bits")
    assert info.value.status == status
    assert h.sleeps == []
    assert isinstance(info.value, DeadlineExceeded) == (status == 504)
    assert isinstance(info.value, TimeoutError) == (status == 504)


@pytest.mark.mock_transport
def test_connect_errors_are_retried_then_raised(make: Callable[..., Harness]) -> None:
    h = make()
    h.fake.script += [httpx.ConnectError("refused"), httpx.RemoteProtocolError("closed")]
    assert h("model_metadata", "bits")["name"] == "bits"
    assert len(h.sleeps) == 2
    h.fake.script += [httpx.ConnectError("refused")] * 4
    with pytest.raises(ConnectError, match="refused") as info:
        h("model_metadata", "bits")
    assert isinstance(info.value, TransportError)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


@pytest.mark.parametrize(
    "error",
    [httpx.ReadError("reset"), httpx.WriteError("broken pipe"), httpx.RemoteProtocolError("x")],
)
def test_stale_keep_alive_errors_are_retried_for_inference(
    make: Callable[..., Harness], error: httpx.TransportError
) -> None:
    # V2 inference has no side effects, so sending it again after a broken connection is safe.
    h = make()
    bits = np.random.default_rng(5).random((2, 3, 13)) < 0.5
    h.fake.script.append(error)
    result = h("infer", "bits", bits)
    assert len(h.sleeps) == 1
    assert (result["count"] == reference_bits(bits)["count"]).all()


def test_default_keepalive_expiry_is_under_the_servers_keep_alive() -> None:
    from bitserve_client._base import DEFAULT_LIMITS

    # The server's default BITSERVE_TIMEOUT_KEEP_ALIVE_S is 5 (these tests run without the
    # server package installed, so the number is written here).
    assert DEFAULT_LIMITS.keepalive_expiry is not None
    assert DEFAULT_LIMITS.keepalive_expiry < 5


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e9", "1.5", "+3", " ", "soon"])
def test_retry_after_that_is_not_delta_seconds_or_a_date_is_ignored(value: str) -> None:
    from bitserve_client._base import parse_retry_after

    assert parse_retry_after(value) is None


def test_retry_after_dates_without_a_zone_are_gmt() -> None:
    import email.utils
    import time

    from bitserve_client._base import parse_retry_after

    assert parse_retry_after("7") == 7.0
    when = time.time() + 3600
    gmt = email.utils.formatdate(when, usegmt=True)  # "... GMT"
    for text in (gmt, gmt.replace("GMT", "-0000"), gmt.replace(" GMT", "")):
        got = parse_retry_after(text)
        assert got is not None
        assert 3590 < got <= 3600, (text, got)


@pytest.mark.mock_transport
def test_read_timeout_is_not_retried(make: Callable[..., Harness]) -> None:
    h = make()
    h.fake.script.append(httpx.ReadTimeout("slow"))
    with pytest.raises(TimeoutException) as info:
        h("model_metadata", "bits")
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, BitserveError)
    assert h.sleeps == []


def test_server_deadline_is_sent_in_microseconds(make: Callable[..., Harness]) -> None:
    h = make()
    h("infer", "bits", np.zeros((1, 3, 13), bool), deadline=0.5)
    req = h.fake.requests[-1]
    head = json.loads(req.content[: int(req.headers["Inference-Header-Content-Length"])])
    assert head["parameters"]["timeout"] == 500000


def test_bad_inputs_are_refused_before_sending(make: Callable[..., Harness]) -> None:
    h = make()
    with pytest.raises(InvalidInputError, match=r"expects bits of shape \[batch, 3, 13\]"):
        h("infer", "bits", np.zeros((2, 3, 12), bool))
    with pytest.raises(InvalidInputError, match="no outputs"):
        h("infer", "bits", np.zeros((2, 3, 13), bool), outputs=["nope"])
    with pytest.raises(InvalidInputError, match="pass a dict"):
        h("infer", "plain", np.zeros((2, 4)))
    assert [r.method for r in h.fake.requests] == ["GET"] * 4  # metadata + config, twice
