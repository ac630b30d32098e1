"""V2 framing against hand-computed bodies, and malformed responses."""

from __future__ import annotations

import contextlib
import json
import struct

import numpy as np
import pytest
from bitserve_client import DecodeError
from bitserve_client._framing import decode_response, encode_request, error_message
from bitserve_client._spec import WireTensor
from hypothesis import given, settings
from hypothesis import strategies as st


def test_binary_request_body_is_header_then_raw_bytes() -> None:
    x = np.array([[1, 2, 3]], dtype=np.uint8)
    y = np.array([[1.5, -2.0]], dtype=np.float32)
    body = encode_request(
        [WireTensor("x", "UINT8", x), WireTensor("y", "FP32", y)],
        ["out"],
        request_id="r1",
        deadline_s=0.25,
    )
    head = json.dumps(
        {
            "id": "r1",
            "parameters": {"timeout": 250000, "binary_data_output": True},
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 3],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": 3},
                },
                {
                    "name": "y",
                    "shape": [1, 2],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 8},
                },
            ],
            "outputs": [{"name": "out", "parameters": {"binary_data": True}}],
        },
        separators=(",", ":"),
    ).encode()
    expected = head + b"\x01\x02\x03" + struct.pack("<2f", 1.5, -2.0)
    assert body.to_bytes() == expected
    assert body.length == len(expected)
    assert body.headers["Inference-Header-Content-Length"] == str(len(head))
    assert body.headers["Content-Type"] == "application/octet-stream"


def test_tensor_chunks_are_views_not_copies() -> None:
    x = np.arange(12, dtype=np.int32).reshape(1, 12)
    body = encode_request([WireTensor("x", "INT32", x)])
    chunk = body.chunks[1]
    assert isinstance(chunk, memoryview)
    assert np.shares_memory(np.frombuffer(chunk, dtype=np.uint8), x)


def test_json_request_has_data_and_no_binary_header() -> None:
    x = np.array([[True, False]])
    body = encode_request([WireTensor("x", "BOOL", x)], binary=False)
    assert "Inference-Header-Content-Length" not in body.headers
    parsed = json.loads(body.to_bytes())
    assert parsed == {
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "BOOL", "data": [True, False]}]
    }


def test_bytes_tensor_is_length_prefixed() -> None:
    x = np.array([[b"ab", b""]], dtype=object)
    body = encode_request([WireTensor("s", "BYTES", x)])
    assert body.to_bytes().endswith(b"\x02\x00\x00\x00ab\x00\x00\x00\x00")


def _response(outputs: list[dict[str, object]], blobs: bytes, **extra: object) -> tuple[bytes, int]:
    head = json.dumps(
        {"model_name": "m", "model_version": "3", "outputs": outputs, **extra}
    ).encode()
    return head + blobs, len(head)


def test_binary_outputs_are_readonly_views_over_the_body() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[1, -1]], dtype=np.int64)
    body, n = _response(
        [
            {
                "name": "a",
                "datatype": "FP32",
                "shape": [2, 3],
                "parameters": {"binary_data_size": 24},
            },
            {
                "name": "b",
                "datatype": "INT64",
                "shape": [1, 2],
                "parameters": {"binary_data_size": 16},
            },
        ],
        a.tobytes() + b.tobytes(),
        id="r9",
        parameters={"batch_size": 2},
    )
    result = decode_response(body, n, single=False)
    np.testing.assert_array_equal(result["a"], a)
    np.testing.assert_array_equal(result["b"], b)
    assert not result["a"].flags.writeable
    assert np.shares_memory(result["a"], np.frombuffer(body, dtype=np.uint8))
    assert (result.model_name, result.model_version, result.id) == ("m", "3", "r9")
    assert result.parameters == {"batch_size": 2}
    with pytest.raises(KeyError, match="outputs"):
        result["nope"]


def test_json_outputs_and_single_item() -> None:
    body, _ = _response([{"name": "y", "datatype": "FP64", "shape": [1, 2], "data": [0.5, 2]}], b"")
    result = decode_response(body, None, single=True)
    np.testing.assert_array_equal(result["y"], np.array([0.5, 2.0]))
    assert result["y"].dtype == np.float64


def test_bytes_output_decodes() -> None:
    blob = b"\x01\x00\x00\x00z\x03\x00\x00\x00abc"
    body, n = _response(
        [
            {
                "name": "s",
                "datatype": "BYTES",
                "shape": [2],
                "parameters": {"binary_data_size": len(blob)},
            }
        ],
        blob,
    )
    assert list(decode_response(body, n, single=False)["s"]) == [b"z", b"abc"]


@pytest.mark.parametrize(
    ("outputs", "blobs", "message"),
    [
        (
            [
                {
                    "name": "a",
                    "datatype": "FP32",
                    "shape": [2],
                    "parameters": {"binary_data_size": 4},
                }
            ],
            b"1234",
            "needs 8",
        ),
        (
            [
                {
                    "name": "a",
                    "datatype": "FP32",
                    "shape": [1],
                    "parameters": {"binary_data_size": 8},
                }
            ],
            b"1234",
            "too short",
        ),
        (
            [
                {
                    "name": "a",
                    "datatype": "FP32",
                    "shape": [1],
                    "parameters": {"binary_data_size": 4},
                }
            ],
            b"12345",
            "after the last",
        ),
        ([{"name": "a", "datatype": "WAT", "shape": [1], "data": [1]}], b"", "unknown datatype"),
        ([{"name": "a", "datatype": "FP32", "shape": [3], "data": [1]}], b"", "1 values"),
        ([{"name": "a", "datatype": "FP32", "shape": [1]}], b"", "neither"),
    ],
)
def test_malformed_responses_raise_decode_error(
    outputs: list[dict[str, object]], blobs: bytes, message: str
) -> None:
    body, n = _response(outputs, blobs)
    with pytest.raises(DecodeError, match=message):
        decode_response(body, n, single=False)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200), header_length=st.one_of(st.none(), st.integers(-5, 250)))
def test_garbage_never_raises_anything_but_decode_error(
    body: bytes, header_length: int | None
) -> None:
    with contextlib.suppress(DecodeError):
        decode_response(body, header_length, single=False)


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, 60))
def test_truncated_bodies_raise_decode_error(cut: int) -> None:
    a = np.arange(8, dtype=np.int32)
    body, n = _response(
        [{"name": "a", "datatype": "INT32", "shape": [8], "parameters": {"binary_data_size": 32}}],
        a.tobytes(),
    )
    truncated = body[: len(body) - 1 - cut]
    with pytest.raises(DecodeError):
        decode_response(truncated, n, single=False)


def test_error_message_prefers_the_v2_error_field() -> None:
    assert error_message(b'{"error": "queue full"}') == "queue full"
    assert error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert error_message(b"") == "(empty body)"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
_entries = st.fixed_dictionaries(
    {},
    optional={
        "name": st.text(max_size=3),
        "datatype": st.sampled_from(["FP32", "INT8", "BYTES", "BOOL", "X"]) | _json_values,
        "shape": st.lists(st.integers(-2, 4), max_size=3) | _json_values,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-2, 20) | _json_values}
        ),
        "data": _json_values,
    },
)


@settings(max_examples=300, deadline=None)
@given(outputs=st.lists(_entries | _json_values, max_size=3), blob=st.binary(max_size=40))
def test_structured_garbage_raises_only_decode_error(outputs: list[object], blob: bytes) -> None:
    head = json.dumps({"outputs": outputs}).encode()
    with contextlib.suppress(DecodeError):
        decode_response(head + blob, len(head), single=False)
