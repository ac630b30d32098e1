"""Searching an index model (bitserve's ``[index]`` kind): queries in, ``(ids, scores)`` out.

I/O-free, shared by ``Client.search`` and ``AsyncClient.search``. An index model has one
bit-packed input (the query, L bits) and two outputs, the ids (INT64) and the scores (FP32)
of the ``k`` best corpus rows per query. Queries may come as:

- bits: a bool or 0/1 array ``(Q, L)`` (packed here in the model's bit order);
- packed bytes: uint8 ``(Q, ceil(L / 8))`` (``np.packbits`` rows, or RDKit's
  ``BitVectToBinaryText`` with ``bitorder="little"``);
- float embeddings ``(Q, L)``: binarised by sign, ``x > 0``, as sentence-transformers'
  ``quantize_embeddings(..., precision="ubinary")`` does (``np.packbits(x > 0)``).

A single query without the batch axis gives ``(k,)`` answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._exceptions import InvalidInputError
from ._spec import ModelSpec


@dataclass(frozen=True)
class SearchOutputs:
    """The names of an index model's two outputs."""

    ids: str
    scores: str


def search_outputs(spec: ModelSpec, model: str) -> tuple[str, SearchOutputs]:
    """The query input's name and the outputs of an index model.

    Raises:
        InvalidInputError: the model is not an index (one bit-packed input, INT64 ids and
            FP32 scores).
    """
    inputs = list(spec.inputs.values())
    by_type = {o.datatype: o.name for o in spec.outputs.values()}
    if (
        len(inputs) != 1
        or inputs[0].packing is None
        or len(spec.outputs) != 2
        or set(by_type) != {"INT64", "FP32"}
    ):
        raise InvalidInputError(
            f"model {model!r} is not an index (one bit-packed input; outputs INT64 ids and "
            f"FP32 scores): inputs {list(spec.inputs)}, outputs {list(spec.outputs)}"
        )
    return inputs[0].name, SearchOutputs(by_type["INT64"], by_type["FP32"])


def search_queries(arr: np.ndarray[Any, Any], name: str) -> np.ndarray[Any, Any]:
    """Queries as ``prepare_inputs`` takes them: float embeddings binarised by sign (> 0);
    bits and packed bytes as they are (``prepare_inputs`` tells them apart by width).

    Raises:
        InvalidInputError: not a numeric array of 1 or 2 dimensions.
    """
    if arr.ndim not in (1, 2):
        raise InvalidInputError(
            f"queries for {name!r} must be (Q, bits), (Q, packed bytes) or one query; got "
            f"shape {list(arr.shape)}"
        )
    if arr.dtype.kind == "f":
        return arr > 0
    if arr.dtype.kind not in "biu":
        raise InvalidInputError(f"queries for {name!r}: dtype {arr.dtype} is not bits or bytes")
    return arr
