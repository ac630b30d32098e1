"""Models with several inputs and outputs (issue 12), against the fake server's ``multi``.

The real server serves one input per model until issue 12 lands; these tests use FakeV2,
which advertises two bit-packed inputs (different bit orders and lengths) and a plain one, in
the metadata form bitserve uses for its packed input.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bitserve_client import InvalidInputError

from .conftest import Harness
from .fake_v2 import reference_multi


def inputs(n: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.random((n, 2, 10)) < 0.5,
        "b": rng.random((n, 3)) < 0.5,
        "w": rng.standard_normal((n, 2)).astype(np.float32),
    }


def check(result: Any, x: dict[str, np.ndarray[Any, Any]]) -> None:
    ref = reference_multi(x["a"], x["b"], x["w"])
    assert sorted(result) == sorted(ref)
    for name, expected in ref.items():
        np.testing.assert_array_equal(result[name], expected)
        assert result[name].dtype == expected.dtype


@pytest.mark.parametrize("binary", [True, False])
def test_each_input_is_packed_from_its_own_metadata(
    make: Callable[..., Harness], binary: bool
) -> None:
    h = make()
    x = inputs(4, seed=1)
    result = h("infer", "multi", x, binary=binary)
    check(result, x)
    sent = h.fake.requests[-1]
    if binary:
        n = int(sent.headers["Inference-Header-Content-Length"])
        head = json.loads(sent.content[:n])
        body = sent.content[n:]
        a = np.packbits(x["a"], axis=-1, bitorder="big")
        b = np.packbits(x["b"], axis=-1, bitorder="little")
        # Each input in the order given, each packed in its own bit order.
        assert body == a.tobytes() + b.tobytes() + x["w"].tobytes()
        assert [(t["name"], t["datatype"], t["shape"]) for t in head["inputs"]] == [
            ("a", "UINT8", [4, 2, 2]),
            ("b", "UINT8", [4, 1]),
            ("w", "FP32", [4, 2]),
        ]


def test_packed_unpacked_and_mixed_forms_agree(make: Callable[..., Harness]) -> None:
    h = make()
    x = inputs(3, seed=2)
    packed = {
        "a": np.packbits(x["a"], axis=-1, bitorder="big"),
        "b": np.packbits(x["b"], axis=-1, bitorder="little"),
        "w": x["w"].astype(np.float64),  # same-kind cast to FP32
    }
    check(h("infer", "multi", packed), x)
    mixed = {"w": x["w"].tolist(), "b": x["b"].astype(np.uint8), "a": x["a"].astype(np.float32)}
    check(h("infer", "multi", mixed), x)


def test_single_item_of_every_input(make: Callable[..., Harness]) -> None:
    h = make()
    x = inputs(1, seed=3)
    result = h("infer", "multi", {k: v[0] for k, v in x.items()})
    assert result["count_b"].shape == ()
    assert result["score"].shape == (2,)
    check({k: v[np.newaxis] for k, v in result.items()}, x)


def test_selected_outputs_only(make: Callable[..., Harness]) -> None:
    h = make()
    x = inputs(2, seed=4)
    result = h("infer", "multi", x, outputs=["score", "count_b"])
    assert list(result) == ["score", "count_b"]
    ref = reference_multi(x["a"], x["b"], x["w"])
    np.testing.assert_array_equal(result.as_numpy("score"), ref["score"])
    assert result.as_numpy("count_a") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x: x.pop("b"), r"takes inputs \['a', 'b', 'w'\]; missing: \['b'\]"),
        (lambda x: x.update(c=x["w"]), r"unknown: \['c'\]"),
        (lambda x: x.update(b=x["b"][:, :2]), r"input 'b' expects bits of shape \[batch, 3\]"),
        (lambda x: x.update(w=x["w"][:2]), "different batch sizes"),
        (lambda x: x.update(w=x["w"][0]), "mix single items and batches"),
        (lambda x: x.update(a=x["a"].astype(np.int8) * 2), "may only hold 0 and 1"),
    ],
)
def test_bad_inputs_are_named_before_sending(
    make: Callable[..., Harness], change: Callable[[dict[str, Any]], Any], message: str
) -> None:
    h = make()
    x: dict[str, Any] = inputs(3, seed=5)
    change(x)
    with pytest.raises(InvalidInputError, match=message):
        h("infer", "multi", x)
    with pytest.raises(InvalidInputError, match=r"has inputs \['a', 'b', 'w'\]: pass a dict"):
        h("infer", "multi", inputs(1)["a"])
    assert h.infers() == 0


def test_batch_over_max_batch_size_is_refused(make: Callable[..., Harness]) -> None:
    with pytest.raises(InvalidInputError, match="batch of 5 exceeds model 'multi'"):
        make()("infer", "multi", inputs(5))


def test_infer_many_with_a_column_per_input(make: Callable[..., Harness], tmp_path: Path) -> None:
    h = make()
    x = inputs(23, seed=6)
    np.save(tmp_path / "a.npy", x["a"])  # one input memory-mapped from a file
    data = {"a": tmp_path / "a.npy", "b": x["b"], "w": x["w"]}
    out = {name: tmp_path / f"{name}.npy" for name in ("count_a", "count_b", "score")}
    result = h("infer_many", "multi", data, out=out, concurrency=2, progress=False)
    assert result.rows == 23
    assert h.infers() == 6  # max_batch_size 4
    check({name: np.load(path) for name, path in out.items()}, x)
    check(result, x)


def test_infer_iter_of_dict_batches(make: Callable[..., Harness]) -> None:
    h = make()
    chunks = [inputs(3, seed=s) for s in range(3)]
    results = h.collect("infer_iter", "multi", iter(chunks), batch_size=2)
    assert [len(r["count_b"]) for r in results] == [2, 1] * 3
    merged = {k: np.concatenate([r[k] for r in results]) for k in results[0]}
    check(merged, {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]})
