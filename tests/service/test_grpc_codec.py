"""gRPC framing (``service.grpc.codec``) against REST's: the same request sent as a V2 binary
body, as gRPC raw contents and as gRPC typed contents decodes to the same tensors, each input
checked by the model exactly once; the same mistakes get the same messages; responses read back
with tritonclient's own result class; malformed messages are only ever InvalidInput."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import InvalidInput
from service.grpc import codec
from service.grpc.proto import grpc_service_pb2 as pb
from service.grpc.servicer import _stream_frame
from service.models.config import ModelConfig
from service.models.signature import Signature
from service.protocol import decode_infer_request
from service.protocol.tensors import float_to_bf16_bits
from service.protocol.types import REGISTRY, InferRequest, InferResponse, ResponseOutput
from tests.service.app_fakes import FakeHandle

CONFIG = ModelConfig.model_validate(
    {
        "max_batch_size": 8,
        "inputs": [
            {"name": "bits", "datatype": "BOOL", "shape": [3, 13], "packing": "bits"},
            {"name": "small", "datatype": "INT16", "shape": [5]},
            {"name": "u8", "datatype": "UINT8", "shape": [2, 2]},
            {"name": "wide", "datatype": "FP64", "shape": [3]},
            {"name": "flag", "datatype": "BOOL", "shape": [2]},
        ],
        "model": {"file": "never-loaded.pt"},
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
    }
)
WIRE = {  # input -> (wire datatype, item shape, numpy dtype)
    "bits": ("UINT8", (3, 2), np.uint8),
    "small": ("INT16", (5,), np.int16),
    "u8": ("UINT8", (2, 2), np.uint8),
    "wide": ("FP64", (3,), np.float64),
    "flag": ("BOOL", (2,), np.bool_),
}
TYPED_FIELD = {"UINT8": "uint_contents", "INT16": "int_contents", "FP64": "fp64_contents",
               "BOOL": "bool_contents"}  # fmt: skip


class CountingSignature(Signature):
    """The real signature, counting ``check_input`` calls per input."""

    def __init__(self) -> None:
        super().__init__("m", CONFIG, [[4]])
        self.calls: list[str] = []

    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> int:
        self.calls.append(name)
        return super().check_input(name, datatype, shape)


def random_inputs(rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:  # type: ignore[type-arg]
    out = {}
    for name, (_, item, dtype) in WIRE.items():
        shape = (batch, *item)
        if dtype == np.float64:
            out[name] = rng.standard_normal(shape)
        elif dtype == np.bool_:
            out[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            info = np.iinfo(dtype)
            out[name] = rng.integers(info.min, int(info.max) + 1, shape, dtype=dtype)
    return out


def rest_body(data: dict[str, np.ndarray], **top: Any) -> tuple[bytes, int]:  # type: ignore[type-arg]
    inputs = [
        {
            "name": name,
            "datatype": WIRE[name][0],
            "shape": list(arr.shape),
            "parameters": {"binary_data_size": arr.nbytes},
        }
        for name, arr in data.items()
    ]
    head = json.dumps({"inputs": inputs, **top}).encode()
    return head + b"".join(a.tobytes() for a in data.values()), len(head)


def grpc_message(data: dict[str, np.ndarray], *, typed: bool, **top: Any) -> pb.ModelInferRequest:  # type: ignore[type-arg]
    msg = pb.ModelInferRequest(model_name="m", **top)
    for name, arr in data.items():
        t = msg.inputs.add(name=name, datatype=WIRE[name][0], shape=list(arr.shape))
        if typed:
            getattr(t.contents, TYPED_FIELD[WIRE[name][0]]).extend(arr.reshape(-1).tolist())
        else:
            msg.raw_input_contents.append(arr.tobytes())
    return msg


def assert_same(a: InferRequest, b: InferRequest) -> None:
    assert (a.id, a.timeout_us) == (b.id, b.timeout_us)
    assert [(t.name, t.datatype, t.shape) for t in a.inputs] == [
        (t.name, t.datatype, t.shape) for t in b.inputs
    ]
    for x, y in zip(a.inputs, b.inputs, strict=True):
        assert x.data.dtype == y.data.dtype, x.name
        np.testing.assert_array_equal(x.data, y.data)
    outs = [(o.name, o.parameters) for o in a.outputs] if a.outputs else None
    assert outs == ([(o.name, o.parameters) for o in b.outputs] if b.outputs else None)


@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 4), timeout=st.integers(0, 2**40))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_raw_and_typed_decode_like_rest(seed: int, batch: int, timeout: int) -> None:
    data = random_inputs(np.random.default_rng(seed), batch)
    sig = CountingSignature()
    body, n = rest_body(data, id="r1", parameters={"timeout": timeout}, outputs=[{"name": "y"}])
    rest = decode_infer_request(body, n, sig)
    assert sig.calls == list(WIRE)  # once per input
    for typed in (False, True):
        msg = grpc_message(data, typed=typed, id="r1")
        msg.parameters["timeout"].int64_param = timeout
        msg.outputs.add(name="y")
        sig.calls.clear()
        got = codec.decode_infer_request(
            pb.ModelInferRequest.FromString(msg.SerializeToString()), sig
        )
        assert sig.calls == list(WIRE), typed
        assert_same(got, rest)
        sig.bind(got)  # and the data plane's bind accepts it


def test_raw_data_are_views_over_the_message() -> None:
    data = random_inputs(np.random.default_rng(0), 2)
    got = codec.decode_infer_request(grpc_message(data, typed=False), CountingSignature())
    assert not got.inputs[0].data.flags.writeable
    assert not got.inputs[0].data.flags.owndata


# --- the same mistakes, the same messages -------------------------------------------------


def _rest_error(mutate: Any) -> str:
    data = random_inputs(np.random.default_rng(1), 1)
    inputs = [
        {"name": k, "datatype": WIRE[k][0], "shape": list(v.shape),
         "parameters": {"binary_data_size": v.nbytes}}
        for k, v in data.items()
    ]  # fmt: skip
    header: dict[str, Any] = {"inputs": inputs}
    blobs = [v.tobytes() for v in data.values()]
    mutate(header, blobs)
    head = json.dumps(header).encode()
    with pytest.raises(InvalidInput) as e:
        decode_infer_request(head + b"".join(blobs), len(head), CountingSignature())
    return e.value.message


def _grpc_error(mutate: Any) -> str:
    data = random_inputs(np.random.default_rng(1), 1)
    msg = grpc_message(data, typed=False)
    mutate(msg)
    with pytest.raises(InvalidInput) as e:
        codec.decode_infer_request(msg, CountingSignature())
    return e.value.message


def _set(field: str, value: Any, index: int = 0) -> tuple[Any, Any]:
    def rest(header: dict[str, Any], blobs: list[bytes]) -> None:
        header["inputs"][index][field] = value

    def grpc_(msg: pb.ModelInferRequest) -> None:
        t = msg.inputs[index]
        if field == "shape":
            del t.shape[:]
            t.shape.extend(value)
        else:
            setattr(t, field, value)

    return rest, grpc_


MISTAKES = {
    "unknown input": _set("name", "nope"),
    "bad datatype": _set("datatype", "FLOAT"),
    "datatype the model refuses": _set("datatype", "INT32", 1),
    "wrong shape": _set("shape", [1, 4], 1),
    "negative dimension": _set("shape", [1, -5], 1),
    "control character in a name": _set("name", "a\nb"),
    "duplicate input": _set("name", "small", 2),
    "batch too large": _set("shape", [9, 5], 1),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistakes_have_rest_messages(mistake: str) -> None:
    rest, grpc_ = MISTAKES[mistake]
    assert _grpc_error(grpc_) == _rest_error(rest)


def test_request_level_mistakes_have_rest_messages() -> None:
    def rest_param(key: str, value: Any) -> Any:
        return lambda header, blobs: header.update(parameters={key: value})

    def grpc_param(key: str, value: int) -> Any:
        return lambda msg: setattr(msg.parameters[key], "int64_param", value)

    assert _grpc_error(grpc_param("timeout", -1)) == _rest_error(rest_param("timeout", -1))
    assert _grpc_error(grpc_param("triton_x", 1)) == _rest_error(rest_param("triton_x", 1))
    rest_id = _rest_error(lambda header, blobs: header.update(id="x\x07"))
    assert _grpc_error(lambda msg: setattr(msg, "id", "x\x07")) == rest_id
    rest_out = _rest_error(lambda h, b: h.update(outputs=[{"name": "y"}, {"name": "y"}]))
    assert _grpc_error(lambda msg: msg.outputs.add(name="y") and msg.outputs.add(name="y")) == (
        rest_out
    )


def test_raw_byte_count_message_is_rests() -> None:
    def rest(header: dict[str, Any], blobs: list[bytes]) -> None:
        header["inputs"][1]["parameters"]["binary_data_size"] = 9
        blobs[1] = blobs[1][:9]

    def grpc_(msg: pb.ModelInferRequest) -> None:
        msg.raw_input_contents[1] = msg.raw_input_contents[1][:9]

    assert "needs 10 bytes" in _grpc_error(grpc_)
    assert "needs 10 bytes" in _rest_error(rest)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda m: m.raw_input_contents.pop(), "input 'flag' has no data"),
        (lambda m: m.raw_input_contents.append(b"x"), "6 raw_input_contents for 5 inputs"),
        (lambda m: m.inputs[1].contents.int_contents.append(1), "must not give any input's"),
        (lambda m: m.ClearField("inputs"), "'inputs' must be a non-empty list"),
        (
            lambda m: m.raw_input_contents.__setitem__(4, b"\x02\x00"),
            "BOOL data must be bytes 0 or 1",
        ),
        (
            lambda m: m.outputs.add(
                name="y", parameters={"classification": pb.InferParameter(int64_param=2)}
            ),
            "classification",
        ),
    ],
)
def test_grpc_only_mistakes(mutate: Any, expected: str) -> None:
    assert expected in _grpc_error(mutate)


@pytest.mark.parametrize(
    ("datatype", "field", "values", "expected"),
    [
        ("INT16", "int_contents", [1, 2, 3, 4, 40000], "INT16 data out of range [-32768, 32767]"),
        ("INT16", "int_contents", [1, 2, 3], "has 3 elements, shape [1, 5] needs 5"),
        ("INT16", "fp32_contents", [1, 2, 3, 4, 5], "INT16 data go in contents.int_contents"),
    ],
)
def test_typed_contents_mistakes(
    datatype: str, field: str, values: list[Any], expected: str
) -> None:
    msg = pb.ModelInferRequest(model_name="m")
    for name, (wire, item, dtype) in WIRE.items():
        t = msg.inputs.add(name=name, datatype=wire, shape=[1, *item])
        arr = np.zeros((1, *item), dtype)
        if name == "small":
            getattr(t.contents, field).extend(values)
        else:
            getattr(t.contents, TYPED_FIELD[wire]).extend(arr.reshape(-1).tolist())
    with pytest.raises(InvalidInput, match=expected.replace("[", r"\[").replace("]", r"\]")):
        codec.decode_infer_request(msg, CountingSignature())


def test_uint8_typed_out_of_range_and_fp16_needs_raw() -> None:
    contents = pb.InferTensorContents(uint_contents=[1, 256])
    with pytest.raises(InvalidInput, match=r"UINT8 data out of range \[0, 255\]"):
        codec.from_contents(contents, "UINT8", (2,), "input 'u'")
    with pytest.raises(InvalidInput, match="send its bytes in raw_input_contents"):
        codec.from_contents(pb.InferTensorContents(), "FP16", (0,), "input 'h'")
    strings = codec.from_contents(
        pb.InferTensorContents(bytes_contents=[b"a", b""]), "BYTES", (2,), "s"
    )
    assert strings.tolist() == [b"a", b""]


# --- fuzz: a client's bytes never make anything but InvalidInput ---------------------------


@given(st.binary(max_size=400))
@settings(max_examples=300, deadline=None)
def test_random_bytes_are_invalid_input_or_decode(raw: bytes) -> None:
    try:
        msg = codec.parse(pb.ModelInferRequest, raw)
        codec.decode_infer_request(msg, CountingSignature())
    except InvalidInput:
        pass


@given(seed=st.integers(0, 2**32 - 1), flips=st.lists(st.integers(0, 10**6), max_size=6))
@settings(max_examples=300, deadline=None)
def test_mutated_valid_messages_are_invalid_input_or_decode(seed: int, flips: list[int]) -> None:
    rng = np.random.default_rng(seed)
    raw = bytearray(grpc_message(random_inputs(rng, 2), typed=bool(seed % 2)).SerializeToString())
    for f in flips:
        raw[f % len(raw)] = (raw[f % len(raw)] + 1 + f) % 256
    try:
        msg = codec.parse(pb.ModelInferRequest, bytes(raw))
        codec.decode_infer_request(msg, CountingSignature())
    except InvalidInput:
        pass


# --- responses ------------------------------------------------------------------------------


def test_response_reads_back_with_tritonclient() -> None:
    rng = np.random.default_rng(3)
    f32 = rng.standard_normal((2, 3)).astype(np.float32)
    i64 = rng.integers(-(2**62), 2**62, (2,), dtype=np.int64)
    bf16 = float_to_bf16_bits(rng.standard_normal((2, 2)))
    strings = np.array([b"ab", b"", b"\xff"], dtype=object)
    response = InferResponse(
        model_name="m",
        model_version="3",
        id="abc",
        outputs=[
            ResponseOutput("f", "FP32", f32.shape, f32),
            ResponseOutput("i", "INT64", i64.shape, i64),
            ResponseOutput("h", "BF16", bf16.shape, bf16),
            ResponseOutput("s", "BYTES", strings.shape, strings),
        ],
        parameters={"batch_size": 2, "big": 2**64 - 1, "ratio": 0.5, "tag": "t", "ok": True},
    )
    wire = codec.encode_infer_response(response).SerializeToString()
    theirs = tgrpc.service_pb2.ModelInferResponse.FromString(wire)
    result = tgrpc.InferResult(theirs)
    np.testing.assert_array_equal(result.as_numpy("f"), f32)
    np.testing.assert_array_equal(result.as_numpy("i"), i64)
    assert result.as_numpy("s").tolist() == strings.tolist()
    assert bytes(theirs.raw_output_contents[2]) == bf16.tobytes()
    assert (theirs.model_name, theirs.model_version, theirs.id) == ("m", "3", "abc")
    params = codec.parameters_from_proto(theirs.parameters)
    assert params == {"batch_size": 2, "big": 2**64 - 1, "ratio": 0.5, "tag": "t", "ok": True}


def test_model_config_and_metadata_keep_every_field() -> None:
    handle = FakeHandle("m", "1", CONFIG)
    rest = handle.config()
    got = json_format.MessageToDict(
        codec.model_config(rest).config,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,  # zero enums (timeout_action REJECT) too
    )
    for entry in rest["input"]:
        params = entry.pop("parameters", {})
        for key, value in params.items():
            text = value if isinstance(value, str) else json.dumps(value)
            assert got["parameters"][f"{entry['name']}.{key}"] == {"string_value": text}
    got.pop("parameters")
    assert _loosely_equal(got, rest), (got, rest)
    meta = codec.model_metadata(handle.metadata())
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        (e["name"], e["datatype"], e["shape"]) for e in handle.metadata()["inputs"]
    ]


def _loosely_equal(proto_json: Any, rest: Any) -> bool:
    """Equal but for proto3 JSON's ways: int64 as strings, zero values left out."""
    if isinstance(rest, dict):
        return all(
            _loosely_equal(proto_json.get(k), v) for k, v in rest.items() if v not in (0, [], {})
        )
    if isinstance(rest, list):
        return len(proto_json) == len(rest) and all(
            _loosely_equal(a, b) for a, b in zip(proto_json, rest, strict=True)
        )
    return str(proto_json) == str(rest)


def test_registry_names_every_typed_contents_field() -> None:
    fields = {f.name for f in pb.InferTensorContents.DESCRIPTOR.fields}
    named = {d.contents for d in REGISTRY.values() if d.contents is not None}
    assert named == fields
    assert {n for n, d in REGISTRY.items() if d.contents is None} == {"FP16", "BF16"}


def test_the_one_triton_parameter_grpc_accepts() -> None:
    data = random_inputs(np.random.default_rng(2), 1)
    msg = grpc_message(data, typed=False)
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    msg.parameters["n"].int64_param = 3
    assert codec.decode_infer_request(msg, CountingSignature()).parameters == {"n": 3}
    msg.parameters["triton_enable_empty_final_response"].int64_param = 1
    with pytest.raises(InvalidInput, match="must be a boolean"):
        codec.decode_infer_request(msg, CountingSignature())
    del msg.parameters["triton_enable_empty_final_response"]
    msg.parameters["triton_other"].bool_param = True
    with pytest.raises(InvalidInput, match="the triton_ prefix is reserved"):
        codec.decode_infer_request(msg, CountingSignature())


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 40_078, 2**21 + 5])
def test_stream_frame_is_protobufs_encoding(size: int) -> None:
    inner = pb.ModelInferResponse(raw_output_contents=[bytes(size)]).SerializeToString()
    expected = pb.ModelStreamInferResponse(
        infer_response=pb.ModelInferResponse.FromString(inner)
    ).SerializeToString()
    assert _stream_frame(inner) == expected
