"""Property tests: arbitrary bodies never crash the decoder; binary framing round-trips.

Hostile bodies (lone surrogates and control characters in every text field, huge and odd
timeouts, header lengths Python's ``int`` would take, compressed garbage) may only raise the
decoder's 4xx errors, whose ``{"error": ...}`` body must encode; what is accepted must encode
back into a response. ``FUZZ_EXAMPLES`` sets the number of cases per hostile test (default
300; the issue's full run is 10,000).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import zlib
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from service.errors import InvalidInput, PayloadTooLarge, ServiceError, UnsupportedMediaType
from service.protocol import (
    WIRE_DTYPES,
    InferRequest,
    decode_infer_request,
    decompress,
    parse_header_length,
)
from service.protocol.response import dumps, encode_infer_response
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


# --- hostile bodies ------------------------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
BAD_CHARS = ["\ud800", "\udbff", "\udc00", "\udfff", "\x00", "\x1b", "\n", "\x7f", "\x85"]
# Any code point, surrogates included, and strings that surely hold a bad one.
any_text = st.text(st.characters(exclude_categories=()), max_size=6)
hostile_text = any_text | st.builds(
    lambda a, bad, b: a + bad + b, any_text, st.sampled_from(BAD_CHARS), any_text
)
text_field = hostile_text | st.sampled_from(["x", "", "o" * 257, "i" * 1025]) | json_values
timeouts = (
    st.integers()
    | st.integers(2**62, 2**64)
    | st.sampled_from([10**400, -(10**400), 1e309, -1e309, 0.5, True, "100", None])
    | st.floats()
)
header_lengths = st.one_of(
    hostile_text,
    st.integers(-5, 300).map(str),
    # signs, spaces, separators, Arabic-Indic and full-width digits: int() takes them all
    st.sampled_from(["+110", " 110 ", "1_10", "-0", "\u0661\u0661\u0660", "\uff11\uff11\uff10"]),
    st.sampled_from(["110\x00", "9" * 400, "0" * 30 + "1"]),
)


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[bytes, str | None, str | None]:
    """(body, Inference-Header-Content-Length, Content-Encoding) of a hostile V2 request."""
    datatype = draw(st.sampled_from(["UINT8", "UINT8", "BYTES", "BOOL", "FP32", "BF16"]))
    name = draw(st.just("x") | text_field)  # "x" is the model's input: some are accepted
    inp: dict[str, Any] = {"name": name, "datatype": datatype, "shape": [1, 3]}
    binary = draw(st.booleans())
    tail = b""
    if binary:
        tail = draw(st.binary(min_size=0, max_size=16))
        inp["parameters"] = {"binary_data_size": len(tail)}
    elif datatype == "BYTES":
        inp["data"] = draw(st.lists(hostile_text, min_size=0, max_size=3))
    else:
        inp["data"] = draw(st.lists(st.integers(0, 1), min_size=3, max_size=3))
    doc: dict[str, Any] = {"inputs": draw(st.lists(st.just(inp), min_size=1, max_size=2))}
    if draw(st.booleans()):
        doc["id"] = draw(text_field)
    params = draw(st.dictionaries(hostile_text, json_values, max_size=2))
    if draw(st.booleans()):
        params["timeout"] = draw(timeouts)
    if params:
        doc["parameters"] = params
    if draw(st.booleans()):
        doc["outputs"] = draw(
            st.lists(
                st.fixed_dictionaries({"name": st.just("y") | text_field}), min_size=1, max_size=2
            )
        )
    if draw(st.booleans()):
        head = json.dumps(doc).encode()  # surrogates as \\ud800 escapes: valid JSON
    else:  # surrogates as raw (CESU) bytes: not UTF-8
        head = json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")
    body = head + tail
    hlen = str(len(head)) if binary else None
    if draw(st.integers(0, 4)) == 0:
        hlen = draw(header_lengths)
    encoding = draw(st.sampled_from([None, None, "gzip", "deflate", "br", "gzip, gzip", "\x1b"]))
    if encoding == "gzip":
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    if draw(st.integers(0, 9)) == 0:  # truncated compressed or plain bodies
        body = body[: draw(st.integers(0, len(body)))]
    return body, hlen, encoding


def _decode_as_the_server(body: bytes, hlen: str | None, encoding: str | None) -> InferRequest:
    """The decoding steps of an infer request, in the server's order, against a real model
    signature (whose messages echo names as given)."""
    data = decompress(body, encoding, limit=1 << 16)
    n = parse_header_length(hlen, len(data))
    request = decode_infer_request(data, n, MODEL)
    MODEL.bind(request)
    return request


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(case=hostile_requests())
def test_hostile_requests_are_4xx_with_encodable_errors(
    case: tuple[bytes, str | None, str | None],
) -> None:
    try:
        req = _decode_as_the_server(*case)
    except ServiceError as e:  # anything else fails the test with its traceback
        error: ServiceError | None = e
    else:
        error = None
    if error is not None:
        assert isinstance(error, InvalidInput | PayloadTooLarge | UnsupportedMediaType), error
        assert 400 <= error.status_code < 500
        dumps({"error": error.message})  # the error body: must encode as UTF-8
        return
    # Accepted: every text it would echo encodes, and the response frames.
    names = [o.name for o in req.outputs or []] or [req.inputs[0].name]
    outs = [ResponseOutput(n, "UINT8", (1,), np.zeros(1, np.uint8)) for n in names]
    encode_infer_response(InferResponse("m", "1", req.id, outs), req)
    for text in [req.id or "", *names, *(i.name for i in req.inputs)]:
        assert not any(ch in text for ch in BAD_CHARS), ascii(text)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(value=header_lengths, body_length=st.integers(0, 10**6))
def test_header_length_takes_ascii_digits_only(value: str, body_length: int) -> None:
    try:
        n = parse_header_length(value, body_length)
    except InvalidInput as e:
        message: str | None = e.message
    else:
        message = None
    if message is not None:
        dumps({"error": message})
        return
    assert value.isascii()
    assert value.isdigit()
    assert n == int(value) <= body_length
