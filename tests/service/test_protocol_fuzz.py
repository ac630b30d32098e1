"""Property tests: arbitrary bodies never crash the decoder; binary framing round-trips."""

from __future__ import annotations

import contextlib
import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from service.errors import InvalidInput
from service.protocol import WIRE_DTYPES, InferRequest, decode_infer_request
from service.protocol.response import encode_infer_response
from service.protocol.types import InferResponse, ResponseOutput
from tests.service.test_protocol import signature

MODEL = signature([{"name": "x", "datatype": "UINT8", "shape": [3]}], max_batch_size=65536)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200), header_length=st.none() | st.integers(0, 200))
def test_random_bytes_only_raise_invalid_input(body: bytes, header_length: int | None) -> None:
    if header_length is not None and header_length > len(body):
        header_length = len(body)
    with contextlib.suppress(InvalidInput):
        decode_infer_request(body, header_length, MODEL)


@settings(max_examples=200, deadline=None)
@given(
    inputs=st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "name": st.sampled_from(["x", "y", "", 3]),
                "datatype": st.sampled_from([*WIRE_DTYPES, "BYTES", "NOPE", 1]),
                "shape": st.lists(st.integers(-2, 2**40), max_size=3) | json_values,
                "data": json_values,
                "parameters": st.dictionaries(
                    st.sampled_from(["binary_data_size", "triton_x", "other"]),
                    st.integers(-5, 40) | json_values,
                ),
            },
        ),
        max_size=3,
    ),
    tail=st.binary(max_size=40),
    top=st.dictionaries(st.sampled_from(["id", "parameters", "outputs"]), json_values),
)
def test_random_headers_only_raise_invalid_input(
    inputs: list[dict[str, object]], tail: bytes, top: dict[str, object]
) -> None:
    head = json.dumps({"inputs": inputs, **top}).encode()
    try:
        req = decode_infer_request(head + tail, len(head))
    except InvalidInput:
        return
    for inp in req.inputs:  # what was accepted is consistent with its declaration
        assert inp.data.shape == inp.shape


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(sorted(WIRE_DTYPES)).flatmap(
        lambda dt: arrays(WIRE_DTYPES[dt], st.lists(st.integers(0, 4), max_size=3).map(tuple)).map(
            lambda a: (dt, a)
        )
    )
)
def test_binary_output_framing_round_trips(case: tuple[str, np.ndarray]) -> None:  # type: ignore[type-arg]
    datatype, arr = case
    resp = InferResponse("m", "1", None, [ResponseOutput("o", datatype, arr.shape, arr)])
    enc = encode_infer_response(resp, InferRequest(id=None, inputs=[], binary_data_output=True))
    n = int(enc.headers["Inference-Header-Content-Length"])
    out = json.loads(enc.body[:n])["outputs"][0]
    # Decode the response body with the request decoder: the framing is the same both ways.
    req_head = json.dumps({"inputs": [{**out, "name": "o"}]}).encode()
    back = decode_infer_request(req_head + enc.body[n:], len(req_head)).inputs[0]
    np.testing.assert_array_equal(back.data, arr)
    assert back.data.dtype == arr.dtype
