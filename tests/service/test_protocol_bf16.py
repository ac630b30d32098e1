"""BF16 in the V2 framing: binary and JSON inputs, JSON and binary outputs, hand-computed bodies.

NumPy has no bfloat16, so the framing carries BF16 elements as their raw bits (``<u2``).
Bit patterns used below (bfloat16 is the upper half of a float32):
``0x3F80`` = 1.0, ``0xC020`` = -2.5, ``0x3F82`` = 1.015625, ``0x7F80`` = +inf,
``0x7F7F`` = 3.3895314e38 (the largest finite bfloat16).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.errors import InvalidInput
from service.models.repository import ModelRepository
from service.protocol import (
    BF16,
    DATATYPES,
    WIRE_DTYPES,
    InferRequest,
    InferResponse,
    ResponseOutput,
    decode_infer_request,
    encode_infer_response,
)
from service.protocol.tensors import bf16_bits_to_float32, float_to_bf16_bits
from service.server import in_process_app
from service.settings import Settings
from tests.service.test_repository import B, N, cfg_text, write


def binary_body(header: dict[str, Any], payload: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + payload, len(head)


def bf16_reference(x: float) -> int:
    """Round-to-nearest-even float32 -> bfloat16 in plain Python integers (finite ``x``)."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    upper, lower = u >> 16, u & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper


# ---- the datatype tables ------------------------------------------------------------------


def test_bf16_is_a_wire_datatype_only() -> None:
    # Model configs and the pipeline build reverse maps from DATATYPES: BF16 and UINT16 would
    # both be <u2 there, so BF16 lives in WIRE_DTYPES alone.
    assert BF16 not in DATATYPES
    assert WIRE_DTYPES[BF16] == np.dtype("<u2")
    assert {k: v for k, v in WIRE_DTYPES.items() if k != BF16} == DATATYPES


# ---- rounding -----------------------------------------------------------------------------


def test_rounding_matches_a_plain_reference_on_random_floats() -> None:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, size=4000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < np.float32(3.38e38))]
    # Ties (lower half exactly 0x8000) are rare in random bits: add some on purpose.
    ties = (rng.integers(0, 0x7F00, size=200).astype(np.uint32) << 16) | 0x8000
    x = np.concatenate([x, ties.view(np.float32)])
    got = float_to_bf16_bits(x)
    assert got.dtype == np.dtype("<u2")
    assert got.tolist() == [bf16_reference(float(v)) for v in x]


def test_rounding_special_values() -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1.00390625], np.float32)
    # 1 + 2**-8 is halfway between 0x3F80 and 0x3F81: nearest-even gives 0x3F80.
    assert float_to_bf16_bits(x).tolist() == [0, 0x8000, 0x7F80, 0xFF80, 0x7F80, 0xFF80, 0x3F80]
    nan_bits = np.array([0x7FC00000, 0xFFFFFFFF, 0x7F800001], np.uint32).view(np.float32)
    back = bf16_bits_to_float32(float_to_bf16_bits(nan_bits))
    assert np.isnan(back).all()  # never rounded into infinity or into -0.0
    assert np.signbit(back).tolist() == [False, True, False]


def test_bits_to_float32_is_exact() -> None:
    bits = np.array([0x3F80, 0xC020, 0x3F82, 0x7F7F, 0x0001], np.uint16)
    got = bf16_bits_to_float32(bits)
    assert got.dtype == np.float32
    want = [1.0, -2.5, 1.015625, 3.3895313892515355e38, 2.0**-133]
    assert got.tolist() == pytest.approx(want, rel=0, abs=0)
    assert float_to_bf16_bits(got).tolist() == bits.tolist()


# ---- requests -----------------------------------------------------------------------------


def test_binary_bf16_input_is_a_view_of_the_raw_bits() -> None:
    payload = bytes.fromhex("803f20c0823f807f")  # 0x3F80 0xC020 0x3F82 0x7F80, little-endian
    spec = {"name": "x", "datatype": "BF16", "shape": [2, 2]}
    body, n = binary_body({"inputs": [{**spec, "parameters": {"binary_data_size": 8}}]}, payload)
    inp = decode_infer_request(body, n).inputs[0]
    assert (inp.datatype, inp.shape, inp.data.dtype) == ("BF16", (2, 2), np.dtype("<u2"))
    assert inp.data.tolist() == [[0x3F80, 0xC020], [0x3F82, 0x7F80]]
    assert not inp.data.flags.writeable
    np.testing.assert_array_equal(bf16_bits_to_float32(inp.data), [[1, -2.5], [1.015625, np.inf]])


def test_binary_bf16_size_is_two_bytes_per_element() -> None:
    spec = {"name": "x", "datatype": "BF16", "shape": [3]}
    body, n = binary_body({"inputs": [{**spec, "parameters": {"binary_data_size": 3}}]}, b"\0" * 3)
    with pytest.raises(InvalidInput, match=r"shape \[3\] of BF16 needs 6 bytes"):
        decode_infer_request(body, n)


def test_json_bf16_numbers_are_rounded_nearest_even() -> None:
    data = [1, -2.5, 1.01171875, 1.00390625, 0, 1e-45]
    body = {"inputs": [{"name": "x", "datatype": "BF16", "shape": [2, 3], "data": data}]}
    inp = decode_infer_request(json.dumps(body).encode(), None).inputs[0]
    assert inp.data.dtype == np.dtype("<u2")
    # 1 + 3 * 2**-8 ties between 0x3F81 and 0x3F82: even. 1e-45 is float32's smallest
    # subnormal (0x00000001): far below half of bfloat16's, so it rounds to 0.
    assert inp.data.tolist() == [[0x3F80, 0xC020, 0x3F82], [0x3F80, 0, 0]]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (["1.0"], "BF16 data must be numbers"),
        ([None], "BF16 data must be numbers"),
        ([3.4e38], "BF16 data out of range"),  # a float32, but past bfloat16's largest
        ([1e39], "BF16 data out of range"),  # past float32 already
        ([1, 2], r"'data' has 2 elements, shape \[1\] needs 1"),
    ],
)
def test_json_bf16_refusals(data: list[Any], match: str) -> None:
    body = {"inputs": [{"name": "x", "datatype": "BF16", "shape": [1], "data": data}]}
    with pytest.raises(InvalidInput, match=match):
        decode_infer_request(json.dumps(body).encode(), None)


def test_json_bf16_infinity_and_the_largest_finite_value_are_accepted() -> None:
    body = b'{"inputs":[{"name":"x","datatype":"BF16","shape":[3],"data":[Infinity,-3.3895313892515355e38,0.5]}]}'  # noqa: E501
    assert decode_infer_request(body, None).inputs[0].data.tolist() == [0x7F80, 0xFF7F, 0x3F00]


# ---- responses ----------------------------------------------------------------------------


def _response(data: np.ndarray[Any, Any]) -> InferResponse:
    return InferResponse("m", "1", None, [ResponseOutput("y", "BF16", data.shape, data)])


def test_bf16_output_as_json_gives_the_numbers() -> None:
    bits = np.array([[0x3F80, 0xC020], [0x3F82, 0x7F7F]], np.uint16)
    enc = encode_infer_response(_response(bits), None)
    assert enc.body == (
        b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"BF16",'
        b'"shape":[2,2],"data":[1.0,-2.5,1.015625,3.3895313892515355e+38]}]}'
    )


def test_bf16_output_as_binary_gives_the_bits() -> None:
    req = InferRequest(None, [], binary_data_output=True)
    for data in (
        np.array([0x3F80, 0xC020, 0x3F82], np.uint16),
        np.array([1.0, -2.5, 1.01171875], np.float32),  # floats are rounded by the framing
        np.array([0x3F80, 0xC020, 0x3F82], ">u2"),  # big-endian bits are swapped to <u2
    ):
        enc = encode_infer_response(_response(data), req)
        head = (
            b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"BF16",'
            b'"shape":[3],"parameters":{"binary_data_size":6}}]}'
        )
        assert enc.body == head + bytes.fromhex("803f20c0823f")
        assert enc.headers["Inference-Header-Content-Length"] == str(len(head))


def test_bf16_output_of_another_dtype_is_a_server_bug() -> None:
    with pytest.raises(TypeError, match="BF16 output needs uint16 bits or floats, got int32"):
        encode_infer_response(_response(np.zeros(2, np.int32)), None)


# ---- over HTTP, in process, against a real model ------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("binary", [False, True])
async def test_bf16_input_to_a_model_without_bf16_is_a_400_naming_it(
    tmp_path: Path, binary: bool
) -> None:
    write(tmp_path / "m", cfg_text())  # input 'bits': BOOL [N, B], or UINT8 packed
    spec: dict[str, Any] = {"name": "bits", "datatype": "BF16", "shape": [1, N, B]}
    if binary:
        body, n = binary_body(
            {"inputs": [{**spec, "parameters": {"binary_data_size": 2 * N * B}}]},
            b"\x80\x3f" * (N * B),
        )
        headers = {"Inference-Header-Content-Length": str(n)}
    else:
        body = json.dumps({"inputs": [{**spec, "data": [1.0] * (N * B)}]}).encode()
        headers = {"Content-Type": "application/json"}
    repo = ModelRepository(tmp_path, warmup=False)
    app = in_process_app(Settings(access_log=False), repo)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            resp = await client.post("/v2/models/m/infer", content=body, headers=headers)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error.startswith("model 'm': input 'bits' has datatype BF16; expected UINT8"), error
    assert "BOOL" in error, error


def test_json_output_decodes_back_to_the_same_bits() -> None:
    # The numbers a BF16 JSON output carries are exact, so a client sending them back as a
    # BF16 input gets the very same bits (NaN payloads aside: JSON has only one NaN).
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**16, size=3000).astype(np.uint16)
    bits = bits[(bits & 0x7F80) != 0x7F80]  # drop NaN (and inf, tested elsewhere)
    enc = encode_infer_response(_response(bits), None)
    out = json.loads(enc.body)["outputs"][0]
    req = {"inputs": [{**out, "name": "x"}]}
    back = decode_infer_request(json.dumps(req).encode(), None).inputs[0].data
    assert back.tolist() == bits.tolist()
