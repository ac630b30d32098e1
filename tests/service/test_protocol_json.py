"""JSON tensor ``data``: the fast path of ``from_json`` (one ``np.asarray``, then shape and
dtype checks) against a plain element-by-element reference on random valid and broken data."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import InvalidInput
from service.protocol.tensors import from_json
from service.protocol.types import DATATYPES

NUMERIC = ["BOOL", "UINT8", "INT8", "INT16", "UINT32", "INT32", "INT64", "FP32", "FP64"]


def reference(data: Any, datatype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """Plain Python: walk the nesting (or take a flat list), check each element, convert."""
    count = math.prod(shape)
    if isinstance(data, list) and data and all(isinstance(v, list) for v in data):

        def walk(node: Any, depth: int) -> list[Any]:
            if depth == len(shape):
                if isinstance(node, list):
                    raise InvalidInput("deeper than the shape")
                return [node]
            if not isinstance(node, list) or len(node) != shape[depth]:
                raise InvalidInput("layout")
            return [v for child in node for v in walk(child, depth + 1)]

        flat = walk(data, 0)
    else:
        if not isinstance(data, list) or any(isinstance(v, list) for v in data):
            raise InvalidInput("mixed")
        flat = data
    if len(flat) != count:
        raise InvalidInput("count")
    dtype = DATATYPES[datatype]
    for v in flat:
        if datatype == "BOOL":
            ok = isinstance(v, bool) or (type(v) is int and v in (0, 1))
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
            ok = type(v) in (int, bool) and info.min <= v <= info.max
        else:
            ok = type(v) in (int, float, bool)
        if not ok:
            raise InvalidInput(f"bad element {v!r}")
    return np.array(flat, dtype=dtype).reshape(shape)


def values(datatype: str) -> st.SearchStrategy[Any]:
    if datatype == "BOOL":
        return st.booleans() | st.sampled_from([0, 1])
    dtype = DATATYPES[datatype]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return st.integers(int(info.min), int(info.max))
    return st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-1000, 1000)


def nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0] if shape[0] else 0
    return [nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


BAD = [None, "1", 1.5, 2, -1, 2**70, [0], {"a": 1}, True]


@st.composite
def cases(draw: st.DrawFn) -> tuple[Any, str, tuple[int, ...]]:
    datatype = draw(st.sampled_from(NUMERIC))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    flat = draw(st.lists(values(datatype), min_size=math.prod(shape), max_size=math.prod(shape)))
    how = draw(st.sampled_from(["ok", "bad", "drop", "extra"]))
    if how == "bad":
        flat[draw(st.integers(0, len(flat) - 1))] = draw(st.sampled_from(BAD))
    elif how == "drop":
        flat.pop()
    elif how == "extra":
        flat.append(flat[0])
    nested = how in ("ok", "bad") and draw(st.booleans())
    return (nest(flat, shape) if nested else flat), datatype, shape


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_from_json_matches_the_reference(case: tuple[Any, str, tuple[int, ...]]) -> None:
    data, datatype, shape = case
    try:
        want = reference(data, datatype, shape)
    except InvalidInput:
        with pytest.raises(InvalidInput, match=r"^x: "):
            from_json(data, datatype, shape, "x")
        return
    got = from_json(data, datatype, shape, "x")
    assert got.dtype == DATATYPES[datatype]
    assert got.shape == shape
    np.testing.assert_array_equal(got, want)


def test_large_bool_body_flat_and_nested() -> None:
    bits = np.random.default_rng(0).random((2, 20, 500)) < 0.1
    for data in (bits.tolist(), bits.reshape(-1).tolist(), bits.astype(int).tolist()):
        np.testing.assert_array_equal(from_json(data, "BOOL", (2, 20, 500), "x"), bits)
    broken = bits.tolist()
    broken[1][3] = broken[1][3][:-1]  # one row one element short, deep inside
    with pytest.raises(InvalidInput, match="expected 500 items at depth 2, got 499"):
        from_json(broken, "BOOL", (2, 20, 500), "x")
    ints = bits.astype(int)
    ints[1, 2, 3] = 2
    with pytest.raises(InvalidInput, match="BOOL data must be true/false"):
        from_json(ints.tolist(), "BOOL", (2, 20, 500), "x")


@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
def test_integers_past_int64_are_large_floats(datatype: str) -> None:
    # NumPy makes an object array of them; found by the reference comparison above.
    got = from_json([2**70, 1], datatype, (2,), "x")
    np.testing.assert_array_equal(got, np.array([2.0**70, 1.0], dtype=DATATYPES[datatype]))
    with pytest.raises(InvalidInput, match=r"^x: FP\d+ data out of range"):
        from_json([2**2000, 1], datatype, (2,), "x")


def test_integers_past_the_float_range_are_refused() -> None:
    with pytest.raises(InvalidInput, match=r"^x: FP16 data out of range"):
        from_json([2**70, 1], "FP16", (2,), "x")
