"""The header cache (``service.protocol.header_cache``) against the plain decoder: fresh random
requests decode to equal requests whether their header was kept or not; data-dependent checks
(BOOL bytes, the data part's size) still run on a kept header; what cannot be reused is not
kept; the cache stays within its bounds."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from service.errors import InvalidInput
from service.models.config import ModelConfig
from service.models.signature import Signature
from service.protocol import InferRequest, decode_infer_request
from service.protocol.header_cache import HeaderCache

INPUTS = [
    {"name": "a", "datatype": "UINT8", "shape": [2, 3]},
    {"name": "b", "datatype": "FP32", "shape": [4]},
    {"name": "c", "datatype": "BOOL", "shape": [5]},
]
SIG = Signature(
    "m",
    ModelConfig.model_validate(
        {
            "max_batch_size": 8,
            "inputs": INPUTS,
            "model": {"file": "m.pt"},
            "outputs": [{"name": "y", "datatype": "FP32"}, {"name": "z", "datatype": "FP32"}],
        }
    ),
    [[2], [3]],
)
DTYPES = {"UINT8": np.uint8, "FP32": np.float32, "BOOL": np.bool_}


def request(rng: np.random.Generator, batch: int, **extra: Any) -> tuple[bytes, int]:
    """A binary V2 request for SIG with random data, and its header's length."""
    arrays = []
    inputs = []
    for spec in INPUTS:
        shape = [batch, *spec["shape"]]
        dtype = DTYPES[spec["datatype"]]
        if dtype is np.float32:
            arr = rng.standard_normal(shape).astype(np.float32)
        else:
            arr = rng.integers(0, 2 if dtype is np.bool_ else 256, shape).astype(dtype)
        arrays.append(arr)
        inputs.append(
            {
                "name": spec["name"],
                "datatype": spec["datatype"],
                "shape": shape,
                "parameters": {"binary_data_size": arr.nbytes},
            }
        )
    header = {"inputs": inputs, **extra}
    head = json.dumps(header).encode()
    return head + b"".join(a.tobytes() for a in arrays), len(head)


def same(a: InferRequest, b: InferRequest) -> None:
    assert (a.id, a.outputs, a.parameters) == (b.id, b.outputs, b.parameters)
    assert (a.binary_data_output, a.timeout_us) == (b.binary_data_output, b.timeout_us)
    assert len(a.inputs) == len(b.inputs)
    for x, y in zip(a.inputs, b.inputs, strict=True):
        assert (x.name, x.datatype, x.shape, x.parameters) == (
            y.name,
            y.datatype,
            y.shape,
            y.parameters,
        )
        assert x.data.dtype == y.data.dtype
        assert not x.data.flags.writeable
        np.testing.assert_array_equal(x.data, y.data)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"id": "r1", "parameters": {"timeout": 5000, "binary_data_output": True}},
        {"outputs": [{"name": "z", "parameters": {"binary_data": True}}, {"name": "y"}]},
    ],
)
def test_kept_headers_decode_as_the_plain_decoder_does(extra: dict[str, Any]) -> None:
    rng = np.random.default_rng(0)
    cache = HeaderCache()
    for i in range(40):
        body, n = request(rng, batch=1 + i % 3, **extra)
        same(cache.decode(body, n, SIG, None), decode_infer_request(body, n, SIG, None))
    assert cache.hits == 40 - 3  # three header shapes, each decoded in full once


def test_data_dependent_checks_run_on_a_kept_header() -> None:
    rng = np.random.default_rng(1)
    cache = HeaderCache()
    body, n = request(rng, batch=1)
    cache.decode(body, n, SIG, None)
    bad = bytearray(body)
    bad[-1] = 7  # a BOOL byte that is neither 0 nor 1
    with pytest.raises(InvalidInput, match="input 'c': BOOL data must be bytes 0 or 1"):
        cache.decode(bytes(bad), n, SIG, None)
    for wrong in (body[:-1], body + b"\0"):  # the data part shorter or longer than declared
        with pytest.raises(InvalidInput) as kept:
            cache.decode(wrong, n, SIG, None)
        with pytest.raises(InvalidInput) as plain:
            decode_infer_request(wrong, n, SIG, None)
        assert kept.value.message == plain.value.message
    assert cache.hits == 1


def test_headers_that_cannot_be_reused_are_not_kept() -> None:
    cache = HeaderCache()
    json_data = json.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "UINT8", "shape": [1, 2, 3], "data": [1] * 6},
                {"name": "b", "datatype": "FP32", "shape": [1, 4], "data": [0.5] * 4},
                {"name": "c", "datatype": "BOOL", "shape": [1, 5], "data": [True] * 5},
            ]
        }
    ).encode()
    for _ in range(3):
        cache.decode(json_data, len(json_data), SIG, None)  # no binary data: JSON each time
        cache.decode(json_data, None, SIG, None)  # no header length: JSON only
    assert cache.hits == 0
    assert not cache._plans


def test_the_cache_is_bounded() -> None:
    rng = np.random.default_rng(2)
    cache = HeaderCache(capacity=4, max_header_bytes=10_000)
    for i in range(10):
        body, n = request(rng, batch=1, id=f"request-{i}")
        cache.decode(body, n, SIG, None)
    assert len(cache._plans) == 4
    long = HeaderCache(max_header_bytes=16)
    body, n = request(rng, batch=1)
    for _ in range(3):
        long.decode(body, n, SIG, None)
    assert not long._plans


def test_a_kept_header_holds_no_requests_bytes() -> None:
    import gc
    import weakref

    class Body(bytearray):
        """A body that can be watched for its release."""

    rng = np.random.default_rng(3)
    cache = HeaderCache()
    raw, n = request(rng, batch=2)
    body = Body(raw)
    watch = weakref.ref(body)
    decoded = cache.decode(body, n, SIG, None)
    assert cache._plans  # kept
    del body, decoded
    gc.collect()
    assert watch() is None  # the cache keeps what the header said, not the request's data
