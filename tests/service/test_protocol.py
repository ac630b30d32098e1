"""V2 request/response framing against hand-computed bodies, and every malformed-body path."""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from service.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from service.models.config import ModelConfig
from service.models.signature import Signature
from service.protocol import (
    DATATYPES,
    InferRequest,
    InferResponse,
    RawInputSpec,
    RequestOutput,
    ResponseOutput,
    choose_encoding,
    decode_infer_request,
    decompress,
    encode_infer_response,
    parse_header_length,
)
from service.protocol.response import compress_response


def binary_body(header: dict[str, Any], *payloads: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + b"".join(payloads), len(head)


# ---- requests: JSON data ------------------------------------------------------------------


def test_json_flat_and_nested_data_give_the_same_array() -> None:
    flat = {
        "inputs": [{"name": "x", "datatype": "INT32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}]
    }
    nested = {
        "inputs": [
            {"name": "x", "datatype": "INT32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6]]}
        ]
    }
    a = decode_infer_request(json.dumps(flat).encode(), None).inputs[0]
    b = decode_infer_request(json.dumps(nested).encode(), None).inputs[0]
    expected = np.arange(1, 7, dtype=np.int32).reshape(2, 3)
    for inp in (a, b):
        assert inp.data.dtype == np.int32
        np.testing.assert_array_equal(inp.data, expected)
        assert inp.shape == (2, 3)


def test_json_request_fields() -> None:
    body = {
        "id": "r-1",
        "parameters": {"timeout": 2500, "binary_data_output": True, "custom": 1},
        "inputs": [{"name": "b", "datatype": "BOOL", "shape": [3], "data": [True, False, True]}],
        "outputs": [{"name": "o", "parameters": {"binary_data": False}}, {"name": "p"}],
    }
    req = decode_infer_request(json.dumps(body).encode(), None)
    assert req.id == "r-1"
    assert req.timeout_us == 2500
    assert req.binary_data_output is True
    assert req.parameters["custom"] == 1
    assert req.outputs == [RequestOutput("o", False, {"binary_data": False}), RequestOutput("p")]
    np.testing.assert_array_equal(req.inputs[0].data, [True, False, True])


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("UINT8", [0, 255]),
        ("INT8", [-128, 127]),
        ("UINT16", [0, 65535]),
        ("INT64", [-(2**63), 2**63 - 1]),
        ("UINT64", [0, 2**64 - 1]),
        ("FP16", [0.5, -2.0]),
        ("FP32", [1.5, 3]),
        ("FP64", [1e300, -1]),
        ("BOOL", [0, 1]),
    ],
)
def test_json_every_datatype(datatype: str, values: list[Any]) -> None:
    body = {"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": values}]}
    inp = decode_infer_request(json.dumps(body).encode(), None).inputs[0]
    assert inp.data.dtype == DATATYPES[datatype]
    np.testing.assert_array_equal(inp.data, np.array(values, dtype=DATATYPES[datatype]))


def test_json_bytes_data() -> None:
    body = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["ab", "ü"]}]}
    inp = decode_infer_request(json.dumps(body).encode(), None).inputs[0]
    assert list(inp.data) == [b"ab", "ü".encode()]


def bad_json(inp: dict[str, Any] | None = None, **top: Any) -> bytes:
    body: dict[str, Any] = {"inputs": [inp] if inp is not None else []}
    body.update(top)
    return json.dumps(body).encode()


X = {"name": "x", "datatype": "UINT8", "shape": [2], "data": [1, 2]}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "request JSON is malformed"),
        (b"[1, 2]", "request JSON must be an object"),
        (b"\xff\xfe", "request JSON is malformed"),
        (b"[" * 100000 + b"]" * 100000, "request JSON is malformed"),
        (bad_json(), "'inputs' must be a non-empty list"),
        (bad_json({**X, "name": ""}), "'name' must be a non-empty string"),
        (bad_json({**X, "datatype": "FLOAT"}), "unknown datatype 'FLOAT'"),
        (bad_json({**X, "shape": [-1]}), "negative dimension -1"),
        (bad_json({**X, "shape": [1.5]}), "non-integer dimension 1.5"),
        (bad_json({**X, "shape": [True]}), "non-integer dimension True"),
        (bad_json({**X, "shape": "2"}), "'shape' must be a list"),
        (bad_json({**X, "shape": [10**12]}), "'data' has 2 elements, shape [1000000000000] needs"),
        (bad_json({**X, "shape": [2**31, 2**31]}), "too many"),
        (bad_json({**X, "data": [1, 2, 3]}), "'data' has 3 elements, shape [2] needs 2"),
        (bad_json({**X, "data": [1, 256]}), "UINT8 data out of range [0, 255]"),
        (bad_json({**X, "data": [1, -1]}), "UINT8 data out of range"),
        (bad_json({**X, "data": [1, 2.5]}), "UINT8 data must be integers"),
        (bad_json({**X, "data": ["a", "b"]}), "UINT8 data must be integers"),
        (bad_json({**X, "data": [[1], 2]}), "nested 'data' is deeper than shape [2]"),
        (bad_json({**X, "data": [1, [2]]}), "'data' mixes lists and scalars"),
        (
            bad_json({**X, "shape": [1, 2], "data": [[1, 2, 3]]}),
            "expected 2 items at depth 1, got 3",
        ),
        (bad_json({**X, "data": {"a": 1}}), "'data' must be a list"),
        (bad_json({**X, "datatype": "BOOL", "data": [0, 2]}), "BOOL data must be true/false"),
        (bad_json({**X, "datatype": "BYTES", "data": [1, 2]}), "BYTES data must be strings"),
        (bad_json({**X, "datatype": "FP32", "data": ["1", "2"]}), "FP32 data must be numbers"),
        (bad_json({**X, "datatype": "FP16", "data": [1, 1e300]}), "FP16 data out of range"),
        (bad_json({"name": "x", "datatype": "UINT8", "shape": [2]}), "neither 'data' nor"),
        (bad_json([1]), "inputs[0] must be an object"),  # type: ignore[arg-type]
        (bad_json(X, id=5), "'id' must be a string"),
        (bad_json(X, parameters=[1]), "'parameters' must be an object"),
        (bad_json(X, parameters={"triton_enable_empty_final_response": True}), "triton_ prefix"),
        (bad_json({**X, "parameters": {"triton_x": 1}}), "unknown parameter 'triton_x'"),
        (bad_json(X, parameters={"timeout": "soon"}), "'timeout' must be an integer"),
        (bad_json(X, parameters={"timeout": -5}), "'timeout' must be between 0 and"),
        (bad_json(X, parameters={"timeout": 2**63}), "between 0 and 9223372036854775807 µs, got"),
        (bad_json(X, parameters={"timeout": 10**400}), "got a 401-digit number"),
        (bad_json(X, parameters={"timeout": 1e309}), "'timeout' must be an integer (µs), got inf"),
        (bad_json(X, id="\ud800"), "request 'id' contains a lone surrogate (U+D800) at position 0"),
        (bad_json(X, id="ok\udfffok"), "request 'id' contains a lone surrogate (U+DFFF) at pos"),
        (bad_json(X, id="a\x1b[2J"), "request 'id' contains a control character (U+001B) at "),
        (bad_json(X, id="a\nb"), "request 'id' contains a control character (U+000A)"),
        (bad_json(X, id="a\x85"), "request 'id' contains a control character (U+0085)"),
        (bad_json(X, id="i" * 1025), "request 'id' is 1025 characters long; at most 1024"),
        (bad_json({**X, "name": "\ud800"}), "inputs[0]: 'name' contains a lone surrogate"),
        (bad_json({**X, "name": "x\x00"}), "inputs[0]: 'name' contains a control character"),
        (bad_json({**X, "name": "n" * 257}), "inputs[0]: 'name' is 257 characters long"),
        (bad_json(X, outputs=[{"name": "\udbff"}]), "outputs[0]: 'name' contains a lone surr"),
        (bad_json(X, outputs=[{"name": "y\x7f"}]), "outputs[0]: 'name' contains a control char"),
        (
            bad_json({**X, "datatype": "BYTES", "data": ["ok", "a\ud800"]}),
            "input 'x': BYTES element 1 contains a lone surrogate (U+D800) at position 1",
        ),
        (bad_json(X, parameters={"binary_data_output": "yes"}), "must be a boolean"),
        (bad_json(X, outputs={"name": "y"}), "'outputs' must be a list"),
        (
            bad_json(X, outputs=[{"name": "y"}, {"name": "y"}]),
            "output 'y' is requested more than once",
        ),
        (bad_json(X, outputs=[{"name": 3}]), "outputs[0]: 'name' must be a non-empty string"),
        (
            bad_json(X, outputs=[{"name": "y", "parameters": {"classification": 2}}]),
            "classification",
        ),
        (bad_json(X, outputs=[{"name": "y", "parameters": {"triton_y": 2}}]), "triton_ prefix"),
        (
            bad_json(
                {
                    "name": "x",
                    "datatype": "UINT8",
                    "shape": [2],
                    "parameters": {"binary_data_size": 2},
                }
            ),
            "binary_data_size given but the request has no Inference-Header-Content-Length",
        ),
    ],
)
def test_malformed_json_requests(body: bytes, message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        decode_infer_request(body, None)
    assert message in info.value.message


def test_text_fields_may_be_any_printable_unicode() -> None:
    # Refused are only control characters and lone surrogates: other scripts, emoji (a
    # surrogate *pair* in JSON) and the longest allowed lengths pass, and encode as UTF-8.
    name = "entrée-名前-\U0001f600"
    body = json.dumps(
        {"id": "r\u00e9q " + "i" * 1020, "inputs": [{**X, "name": name}],
         "outputs": [{"name": "o" * 256}], "parameters": {"timeout": 2**63 - 1}}
    ).encode()  # fmt: skip
    assert b"\\ud83d\\ude00" in body
    req = decode_infer_request(body, None)
    assert req.inputs[0].name == name
    assert req.id is not None
    assert len(req.id) == 1024
    assert req.timeout_us == 2**63 - 1
    assert req.outputs is not None
    for text in (req.id, name, req.outputs[0].name):
        text.encode()


def test_duplicate_input_names() -> None:
    body = json.dumps({"inputs": [X, X]}).encode()
    with pytest.raises(InvalidInput, match="input 'x' appears more than once"):
        decode_infer_request(body, None)


@pytest.mark.parametrize("shape", [[0, 2**70], [2**70, 0], [0, 2**63], [2**41, 0, 3]])
def test_zero_element_shape_with_a_huge_dimension_is_refused(shape: list[int]) -> None:
    # The product is 0, so only a per-dimension bound catches what NumPy cannot describe.
    json_body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": []}]}
    )
    with pytest.raises(InvalidInput, match=r"input 'x': shape .* has a dimension \d+ past"):
        decode_infer_request(json_body.encode(), None)
    head = {"name": "x", "datatype": "FP32", "shape": shape, "parameters": {"binary_data_size": 0}}
    body, n = binary_body({"inputs": [head]})
    with pytest.raises(InvalidInput, match="has a dimension"):
        decode_infer_request(body, n)


class _Checks:
    """An ``InputChecker`` that records the checks and refuses BYTES."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, tuple[int, ...]]] = []

    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> int:
        self.seen.append((name, datatype, shape))
        if datatype == "BYTES":
            raise InvalidInput(f"model 'm': input '{name}' cannot be BYTES")
        return shape[0]

    def raw_spec(self) -> RawInputSpec:
        raise AssertionError("not the raw form")


def test_check_input_runs_before_any_data_conversion() -> None:
    check = _Checks()

    # The BYTES data are malformed (a length past the end): the check must answer first.
    body, n = binary_body(
        {
            "inputs": [
                {
                    "name": "s",
                    "datatype": "BYTES",
                    "shape": [2],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        },
        struct.pack("<I", 99) + b"abcd",
    )
    with pytest.raises(InvalidInput, match="input 's' cannot be BYTES"):
        decode_infer_request(body, n, check)
    ok = json.dumps(
        {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}]}
    )
    assert decode_infer_request(ok.encode(), None, check).inputs[0].data.tolist() == [[1, 2]]
    assert check.seen == [("s", "BYTES", (2,)), ("x", "INT32", (1, 2))]


# ---- requests: binary tensors ---------------------------------------------------------------


def test_binary_inputs_are_zero_copy_views_in_order() -> None:
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    b = np.array([[1, 0, 1]], dtype=np.uint8)
    header = {
        "inputs": [
            {
                "name": "a",
                "datatype": "FP32",
                "shape": [2, 3],
                "parameters": {"binary_data_size": 24},
            },
            {"name": "j", "datatype": "INT16", "shape": [1], "data": [-3]},
            {
                "name": "b",
                "datatype": "BOOL",
                "shape": [1, 3],
                "parameters": {"binary_data_size": 3},
            },
        ]
    }
    body, n = binary_body(header, a.tobytes(), b.tobytes())
    buf = bytearray(body)
    req = decode_infer_request(buf, n)
    ra, rj, rb = req.inputs
    np.testing.assert_array_equal(ra.data, a)
    np.testing.assert_array_equal(rj.data, np.array([-3], dtype=np.int16))
    np.testing.assert_array_equal(rb.data, b.astype(bool))
    assert not ra.data.flags.writeable
    # The view shares memory with the body: no copy was made.
    assert np.shares_memory(ra.data, np.frombuffer(buf, dtype=np.uint8))
    buf[n] = 0xFF  # poke the body; the view sees it
    assert ra.data.reshape(-1).view(np.uint8)[0] == 0xFF


def test_binary_bytes_elements() -> None:
    payload = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 0) + struct.pack("<I", 3) + b"xyz"
    header = {
        "inputs": [
            {
                "name": "s",
                "datatype": "BYTES",
                "shape": [3],
                "parameters": {"binary_data_size": len(payload)},
            }
        ]
    }
    body, n = binary_body(header, payload)
    (inp,) = decode_infer_request(body, n).inputs
    assert list(inp.data) == [b"hi", b"", b"xyz"]


def bin_input(datatype: str, shape: list[int], size: int) -> dict[str, Any]:
    return {
        "name": "x",
        "datatype": datatype,
        "shape": shape,
        "parameters": {"binary_data_size": size},
    }


@pytest.mark.parametrize(
    ("inp", "payload", "message"),
    [
        (bin_input("FP32", [2], 4), b"\0" * 4, "needs 8 bytes, binary_data_size is 4"),
        (bin_input("UINT8", [10**12], 10**12), b"\0" * 4, "runs past the end of the body"),
        (
            bin_input("UINT8", [4], 4),
            b"\0" * 6,
            "declare 4 bytes of binary data but the body carries 6",
        ),
        (bin_input("UINT8", [4], -1), b"", "binary_data_size must be a non-negative integer"),
        (bin_input("UINT8", [4], True), b"", "binary_data_size must be a non-negative integer"),
        (bin_input("BOOL", [2], 2), b"\x01\x02", "BOOL data must be bytes 0 or 1"),
        (bin_input("BYTES", [10**9], 8), b"\0" * 8, "needs at least 4000000000 bytes"),
        (bin_input("BYTES", [1], 5), struct.pack("<I", 9) + b"a", "declares 9 bytes past the end"),
        (
            bin_input("BYTES", [2], 8),
            struct.pack("<I", 2) + b"abcd",
            "ends inside the length of element 1",
        ),
        (bin_input("BYTES", [1], 6), struct.pack("<I", 1) + b"ab", "1 bytes left after 1"),
        ({**bin_input("UINT8", [2], 2), "data": [1, 2]}, b"\0\0", "has both 'data' and"),
    ],
)
def test_malformed_binary_requests(inp: dict[str, Any], payload: bytes, message: str) -> None:
    body, n = binary_body({"inputs": [inp]}, payload)
    with pytest.raises(InvalidInput) as info:
        decode_infer_request(body, n)
    assert message in info.value.message


@pytest.mark.parametrize(
    "value",
    # Python's int() takes all but the first two; HTTP's Content-Length grammar takes none.
    ["abc", "", "+7", "-0", "-1", " 7 ", "7 ", "1_0", "\u0667", "\uff17", "7.0", "0x7", "7\x00",
     "1" * 21],
)  # fmt: skip
def test_header_length_is_strict_ascii_digits(value: str) -> None:
    with pytest.raises(InvalidInput, match="must be an integer in ASCII digits") as err:
        parse_header_length(value, 10**30)
    assert value[:32] in err.value.message or not value.isprintable()


def test_header_length_header() -> None:
    assert parse_header_length(None, 10) is None
    assert parse_header_length("7", 10) == 7
    assert parse_header_length("007", 10) == 7
    assert parse_header_length("0", 0) == 0
    assert parse_header_length("10", 10) == 10
    with pytest.raises(InvalidInput, match="outside the body of 10 bytes"):
        parse_header_length("11", 10)


# ---- requests: the raw binary form ---------------------------------------------------------


def signature(
    inputs: list[dict[str, Any]], max_batch_size: int = 8, name: str = "demo"
) -> Signature:
    """The real signature of a model with these inputs (and one output)."""
    cfg = ModelConfig.model_validate(
        {
            "max_batch_size": max_batch_size,
            "inputs": inputs,
            "model": {"file": "m.pt"},
            "outputs": [{"name": "y", "datatype": "FP32"}],
        }
    )
    return Signature(name, cfg, [[2]])


SPIKES = signature([{"name": "spikes", "datatype": "UINT8", "shape": [2, 3]}])


def test_raw_binary_form_derives_the_batch_size() -> None:
    x = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    req = decode_infer_request(x.tobytes(), 0, SPIKES)
    (inp,) = req.inputs
    assert (inp.name, inp.datatype, inp.shape) == ("spikes", "UINT8", (2, 2, 3))
    np.testing.assert_array_equal(inp.data, x)
    assert req.binary_data_output is True
    assert req.outputs is None


def test_raw_binary_form_errors() -> None:
    with pytest.raises(InvalidInput, match="not a whole number of UINT8 items of shape"):
        decode_infer_request(b"\0" * 7, 0, SPIKES)
    with pytest.raises(InvalidInput, match="needs a model with a single input"):
        decode_infer_request(b"\0" * 6, 0, None)
    with pytest.raises(InvalidInput, match="more than the model's max_batch_size 8"):
        decode_infer_request(b"\0" * 6 * 9, 0, SPIKES)
    two = signature(
        [
            {"name": "a", "datatype": "UINT8", "shape": [2, 3]},
            {"name": "b", "datatype": "UINT8", "shape": [2, 3]},
        ]
    )
    with pytest.raises(InvalidInput, match="has 2 inputs; the raw binary form"):
        decode_infer_request(b"\0" * 6, 0, two)
    fixed = signature([{"name": "x", "datatype": "FP32", "shape": [2]}], max_batch_size=0)
    with pytest.raises(InvalidInput, match="needs 8 bytes, got 4"):
        decode_infer_request(b"\0" * 4, 0, fixed)


# ---- compression ----------------------------------------------------------------------------


def test_decompress_gzip_deflate_and_raw_deflate() -> None:
    data = b"bitserve" * 1000
    assert decompress(gzip.compress(data), "gzip", limit=len(data)) == data
    assert decompress(zlib.compress(data), "deflate", limit=len(data)) == data
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert decompress(raw.compress(data) + raw.flush(), "Deflate", limit=len(data)) == data
    two = gzip.compress(b"ab") + gzip.compress(b"cd")
    assert decompress(two, "gzip", limit=4) == b"abcd"
    assert decompress(data, None, limit=1) == data  # identity: the body-size check was earlier


def test_decompression_bomb_is_413_without_inflating() -> None:
    bomb = gzip.compress(b"\0" * (50 << 20))  # ~50 KB that inflates to 50 MiB
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 1048576 bytes"):
        decompress(bomb, "gzip", limit=1 << 20)


@pytest.mark.parametrize(
    ("body", "encoding", "error", "message"),
    [
        (b"x", "br", UnsupportedMediaType, "unsupported Content-Encoding 'br'"),
        (b"x", "gzip, deflate", UnsupportedMediaType, "unsupported Content-Encoding"),
        (b"not gzip", "gzip", InvalidInput, "corrupt gzip request body"),
        (gzip.compress(b"abc", mtime=0)[:-6], "gzip", InvalidInput, "truncated"),
        (zlib.compress(b"abc") + b"zz", "deflate", InvalidInput, "trailing bytes"),
    ],
)
def test_decompress_errors(
    body: bytes, encoding: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        decompress(body, encoding, limit=1000)


@pytest.mark.parametrize(
    ("header", "chosen"),
    [
        (None, None),
        ("identity", None),
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("deflate, gzip", "gzip"),
        ("gzip;q=0.5, deflate", "deflate"),
        ("gzip;q=0, deflate;q=0", None),
        ("br, *", "gzip"),
    ],
)
def test_choose_encoding(header: str | None, chosen: str | None) -> None:
    assert choose_encoding(header) == chosen


# ---- responses ------------------------------------------------------------------------------


def response() -> InferResponse:
    return InferResponse(
        model_name="m",
        model_version="1",
        id="r-9",
        outputs=[
            ResponseOutput("f", "FP32", (2,), np.array([1.0, -2.5], dtype=np.float32)),
            ResponseOutput("b", "BOOL", (2,), np.array([True, False])),
            ResponseOutput("s", "BYTES", (1,), np.array([b"ok"], dtype=object)),
        ],
        parameters={"batch_size": 3},
    )


def test_json_response_matches_hand_computed_body() -> None:
    enc = encode_infer_response(response(), InferRequest(id="r-9", inputs=[]))
    assert enc.headers == {}
    assert enc.media_type == "application/json"
    assert enc.body == (
        b'{"model_name":"m","model_version":"1","id":"r-9","parameters":{"batch_size":3},'
        b'"outputs":[{"name":"f","datatype":"FP32","shape":[2],"data":[1.0,-2.5]},'
        b'{"name":"b","datatype":"BOOL","shape":[2],"data":[true,false]},'
        b'{"name":"s","datatype":"BYTES","shape":[1],"data":["ok"]}]}'
    )


def test_binary_response_matches_hand_computed_body() -> None:
    req = InferRequest(
        id=None,
        inputs=[],
        outputs=[RequestOutput("f"), RequestOutput("b", binary_data=False), RequestOutput("s")],
        binary_data_output=True,
    )
    enc = encode_infer_response(response(), req)
    head = (
        b'{"model_name":"m","model_version":"1","id":"r-9","parameters":{"batch_size":3},'
        b'"outputs":[{"name":"f","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}},'
        b'{"name":"b","datatype":"BOOL","shape":[2],"data":[true,false]},'
        b'{"name":"s","datatype":"BYTES","shape":[1],"parameters":{"binary_data_size":6}}]}'
    )
    assert enc.headers == {"Inference-Header-Content-Length": str(len(head))}
    assert enc.media_type == "application/octet-stream"
    assert enc.body == head + struct.pack("<ff", 1.0, -2.5) + struct.pack("<I", 2) + b"ok"


def test_compressed_response() -> None:
    req = InferRequest(id=None, inputs=[], binary_data_output=True)
    plain = encode_infer_response(response(), req)
    for enc_name, inflate in (("gzip", gzip.decompress), ("deflate", zlib.decompress)):
        enc = compress_response(encode_infer_response(response(), req), enc_name)
        assert enc.headers["Content-Encoding"] == enc_name
        # The header length describes the uncompressed body, as Triton does.
        assert (
            enc.headers["Inference-Header-Content-Length"]
            == plain.headers["Inference-Header-Content-Length"]
        )
        assert inflate(enc.body) == plain.body


def test_response_of_non_contiguous_big_endian_output() -> None:
    arr = np.arange(6, dtype=">i4").reshape(2, 3).T  # neither contiguous nor little-endian
    resp = InferResponse("m", None, None, [ResponseOutput("x", "INT32", (3, 2), arr)])
    enc = encode_infer_response(resp, InferRequest(id=None, inputs=[], binary_data_output=True))
    n = int(enc.headers["Inference-Header-Content-Length"])
    np.testing.assert_array_equal(np.frombuffer(enc.body[n:], "<i4").reshape(3, 2), arr)
    assert json.loads(enc.body[:n])["model_version"] == ""
