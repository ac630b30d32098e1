"""Model specs from metadata/config, local checks and packing against np.packbits."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from bitserve_client import DecodeError, InvalidInputError
from bitserve_client._spec import ModelSpec, parse_model_spec, prepare_inputs
from hypothesis import assume, given, settings
from hypothesis import strategies as st


def bits_metadata(L: int, rows: int = 2, bitorder: str = "big") -> dict[str, Any]:
    return {
        "name": "m",
        "inputs": [
            {
                "name": "x",
                "datatype": "UINT8",
                "shape": [-1, rows, -(-L // 8)],
                "parameters": {
                    "packing": "bits",
                    "bitorder": bitorder,
                    "logical_shape": [rows, L],
                    "logical_datatype": "BOOL",
                },
            }
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, rows]}],
    }


def bits_spec(L: int, rows: int = 2, bitorder: str = "big", max_batch_size: int = 16) -> ModelSpec:
    return parse_model_spec(bits_metadata(L, rows, bitorder), {"max_batch_size": max_batch_size})


def test_parse_bitserve_metadata() -> None:
    spec = bits_spec(50, rows=3, bitorder="little")
    assert spec.batched
    assert spec.max_batch_size == 16
    x = spec.inputs["x"]
    assert (x.datatype, x.shape) == ("UINT8", (3, 7))
    assert x.packing is not None
    assert (x.packing.bitorder, x.packing.logical_shape) == ("little", (3, 50))
    assert spec.outputs["y"].shape == (3,)


def test_packing_info_from_a_triton_style_config() -> None:
    metadata = {"name": "m", "inputs": [{"name": "x", "datatype": "UINT8", "shape": [-1, 4]}]}
    config = {
        "max_batch_size": 4,
        "input": [
            {
                "name": "x",
                "parameters": {
                    "packing": {"string_value": "bits"},
                    "bitorder": {"string_value": "little"},
                    "logical_shape": {"string_value": "[30]"},
                },
            }
        ],
    }
    x = parse_model_spec(metadata, config).inputs["x"]
    assert x.packing is not None
    assert x.packing.logical_shape == (30,)
    assert x.packing.bitorder == "little"


def test_plain_v2_metadata_without_config() -> None:
    spec = parse_model_spec(
        {
            "name": "p",
            "inputs": [{"name": "a", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [],
        }
    )
    assert spec.batched
    assert spec.max_batch_size == 0
    assert spec.inputs["a"].packing is None
    assert spec.inputs["a"].shape == (4,)
    unbatched = parse_model_spec(
        {"name": "u", "inputs": [{"name": "a", "datatype": "FP32", "shape": [4]}]}
    )
    assert not unbatched.batched


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"packing": "bits", "bitorder": "middle", "logical_shape": [2, 9]}, "bitorder"),
        ({"packing": "bits", "logical_shape": [2, 30]}, "do not pack"),
        ({"packing": "bits", "logical_shape": [9]}, "logical_shape"),
    ],
)
def test_inconsistent_packing_metadata_raises(params: dict[str, Any], message: str) -> None:
    metadata = {
        "name": "m",
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [-1, 2, 2], "parameters": params}],
    }
    with pytest.raises(DecodeError, match=message):
        parse_model_spec(metadata, {"max_batch_size": 4})


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 40),
    batch=st.integers(1, 5),
    bitorder=st.sampled_from(["big", "little"]),
    kind=st.sampled_from(["bool", "uint8", "int64", "float32"]),
    single=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_packing_matches_np_packbits(
    L: int, batch: int, bitorder: str, kind: str, single: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    bits = rng.random((batch, 2, L)) < 0.5
    given_arr = bits.astype(kind)
    if single:
        bits, given_arr = bits[:1], given_arr[0]
    spec = bits_spec(L, bitorder=bitorder)
    # uint8 with L=1 is indistinguishable from packed bytes, so it passes through as packed.
    assume(not (kind == "uint8" and L == 1))
    prepared = prepare_inputs(spec, {"x": given_arr})
    (t,) = prepared.tensors
    expected = np.packbits(bits, axis=-1, bitorder=bitorder)  # type: ignore[arg-type]
    assert t.datatype == "UINT8"
    np.testing.assert_array_equal(t.array, expected)
    assert t.array.flags.c_contiguous
    assert prepared.single is single
    assert prepared.batch_size == (1 if single else batch)


def test_packed_uint8_passes_through_unchanged() -> None:
    packed = np.random.default_rng(0).integers(0, 256, size=(3, 2, 4), dtype=np.uint8)
    (t,) = prepare_inputs(bits_spec(30), {"x": packed}).tensors
    assert t.array is packed or np.shares_memory(t.array, packed)


def test_non_contiguous_and_big_endian_inputs_are_made_wire_ready() -> None:
    spec = parse_model_spec(
        {"name": "p", "inputs": [{"name": "a", "datatype": "FP32", "shape": [-1, 3]}]}
    )
    a = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::-1][:, :3]
    (t,) = prepare_inputs(spec, {"a": a}).tensors
    assert t.array.dtype == np.dtype("<f4")
    assert t.array.flags.c_contiguous
    np.testing.assert_array_equal(t.array, a.astype(np.float32))


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"x": np.zeros((2, 2, 29), bool)}, r"expects bits of shape \[batch, 2, 30\]"),
        ({"x": np.zeros((2, 2, 30), np.float32) + 0.5}, "only hold 0 and 1"),
        ({"x": np.full((2, 2, 30), 2, np.int16)}, "only hold 0 and 1"),
        ({"x": np.zeros((2, 2, 30), complex)}, "bool or 0/1"),
        ({"x": np.zeros((17, 2, 30), bool)}, "max_batch_size 16"),
        ({"x": np.zeros((0, 2, 30), bool)}, "empty"),
        ({}, "missing"),
        ({"x": np.zeros((1, 2, 30), bool), "z": 1}, "unknown"),
    ],
)
def test_local_checks_name_what_is_wrong(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        prepare_inputs(bits_spec(30), inputs)


def plain_spec() -> ModelSpec:
    return parse_model_spec(
        {
            "name": "p",
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [-1, 4]},
                {"name": "b", "datatype": "INT32", "shape": [-1, -1]},
            ],
        },
        {"max_batch_size": 8},
    )


def test_plain_inputs_cast_same_kind_and_check_shapes() -> None:
    prepared = prepare_inputs(plain_spec(), {"a": np.ones((2, 4)), "b": np.ones((2, 7), np.int64)})
    assert [t.array.dtype for t in prepared.tensors] == [np.float32, np.int32]
    with pytest.raises(InvalidInputError, match="expects INT32"):
        prepare_inputs(plain_spec(), {"a": np.ones((2, 4)), "b": np.ones((2, 7))})
    with pytest.raises(InvalidInputError, match=r"expects shape \[batch, 4\], got \[2, 5\]"):
        prepare_inputs(plain_spec(), {"a": np.ones((2, 5)), "b": np.ones((2, 7), np.int32)})
    with pytest.raises(InvalidInputError, match="different batch sizes"):
        prepare_inputs(plain_spec(), {"a": np.ones((2, 4)), "b": np.ones((3, 7), np.int32)})
    with pytest.raises(InvalidInputError, match="mix single items and batches"):
        prepare_inputs(plain_spec(), {"a": np.ones(4), "b": np.ones((3, 7), np.int32)})


def test_without_a_spec_arrays_go_as_given() -> None:
    prepared = prepare_inputs(
        None, {"a": np.ones((2, 3), np.float16), "s": np.array([b"x"], dtype=object)}
    )
    assert [t.datatype for t in prepared.tensors] == ["FP16", "BYTES"]


def test_import_does_not_import_torch() -> None:
    code = "import sys, bitserve_client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
