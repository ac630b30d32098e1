"""``Client.search``'s I/O-free half: which models are indexes, how queries become the packed
query tensor (bits, bytes, float embeddings by sign), and the request's k and threshold.
The answers against a real server are in tests/e2e/test_index_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from bitserve_client import Client, InvalidInputError
from bitserve_client._framing import HEADER_LENGTH, EncodedBody
from bitserve_client._search import search_outputs, search_queries
from bitserve_client._spec import ModelSpec, parse_model_spec

L = 20  # 3 bytes packed, 4 padding bits

METADATA = {
    "name": "fp",
    "inputs": [{"name": "query", "datatype": "UINT8", "shape": [-1, 3],
                "parameters": {"packing": "bits", "bitorder": "big", "logical_shape": [L]}}],
    "outputs": [{"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
                {"name": "scores", "datatype": "FP32", "shape": [-1, -1]}],
}  # fmt: skip
CONFIG = {"max_batch_size": 8}


def spec() -> ModelSpec:
    return parse_model_spec(METADATA, CONFIG)


def framed(
    client: Client, queries: Any, **kwargs: Any
) -> tuple[dict[str, Any], np.ndarray[Any, Any]]:
    """The JSON header and the query tensor's bytes of the request ``search`` would send."""
    request, outputs = client._search_request(
        spec(), "fp", queries, kwargs.pop("k", None), kwargs.pop("threshold", None),
        version=None, headers=None, timeout=None, bitorder=kwargs.pop("bitorder", None),
    )  # fmt: skip
    assert (outputs.ids, outputs.scores) == ("ids", "scores")
    assert isinstance(request.body, EncodedBody)
    body = request.body.to_bytes()
    n = int(request.body.headers[HEADER_LENGTH])
    header = json.loads(body[:n])
    shape = header["inputs"][0]["shape"]
    return header, np.frombuffer(body[n:], np.uint8).reshape(shape)


def test_only_an_index_model_is_searched() -> None:
    assert search_outputs(spec(), "fp")[0] == "query"
    plain = {**METADATA, "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}]}
    with pytest.raises(InvalidInputError, match="model 'm' is not an index"):
        search_outputs(parse_model_spec(plain, CONFIG), "m")


def test_bits_bytes_and_embeddings_become_the_same_packed_queries() -> None:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((4, L)).astype(np.float32)
    bits = emb > 0
    want = np.packbits(bits, axis=1)
    with Client("http://127.0.0.1:9") as client:
        for queries in (bits, bits.astype(np.uint8), want, emb, emb.astype(np.float64)):
            header, sent = framed(client, queries, k=3, threshold=0.5)
            np.testing.assert_array_equal(sent, want)
            assert header["inputs"][0]["datatype"] == "UINT8"
            assert header["parameters"]["k"] == 3
            assert header["parameters"]["threshold"] == 0.5
        header, sent = framed(client, bits, bitorder="little")
        np.testing.assert_array_equal(sent, np.packbits(bits, axis=1, bitorder="little"))
        assert header["inputs"][0]["parameters"]["bitorder"] == "little"
        assert "k" not in header["parameters"]


def test_search_queries_binarises_floats_by_sign() -> None:
    x = np.array([[-1.0, 0.0, 2.5, -0.0]])
    np.testing.assert_array_equal(search_queries(x, "q"), [[False, False, True, False]])
    with pytest.raises(InvalidInputError, match="must be"):
        search_queries(np.zeros((2, 2, L)), "q")
    with pytest.raises(InvalidInputError, match="not bits or bytes"):
        search_queries(np.array([["a"]]), "q")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"k": 0}, "k must be an integer >= 1"),
        ({"k": 2.5}, "k must be an integer >= 1"),
        ({"threshold": 1.5}, r"threshold must be in \[0, 1\]"),
        ({"threshold": "0.5"}, "threshold must be a number"),
    ],
)
def test_bad_k_and_threshold_are_refused_before_sending(
    kwargs: dict[str, Any], needle: str
) -> None:
    with Client("http://127.0.0.1:9") as client, pytest.raises(InvalidInputError, match=needle):
        framed(client, np.zeros((1, L), bool), **kwargs)


def test_queries_of_the_wrong_width_are_refused() -> None:
    with Client("http://127.0.0.1:9") as client, pytest.raises(InvalidInputError, match="query"):
        framed(client, np.zeros((1, L + 1), bool))
