"""The response cache's fast key against its plain reference, on fresh random inputs:
``cache_key`` (a hashed head per request form, kept on the header cache's forms) against
``reference_key`` (the whole key written out each time)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from service.models.config import ModelConfig
from service.models.response_cache import (
    cache_key,
    reference_key,
)
from service.models.signature import Signature
from service.protocol import InferRequest, decode_infer_request
from service.protocol.header_cache import HeaderCache

WIRE = {"UINT8": np.uint8, "INT16": np.int16, "INT32": np.int32, "FP16": np.float16,
        "FP32": np.float32, "FP64": np.float64, "BOOL": np.bool_}  # fmt: skip


def random_config(rng: np.random.Generator) -> ModelConfig:
    """A model of 1 to 3 inputs (some bit-packed, either bit order) and 1 to 3 outputs."""
    inputs: list[dict[str, Any]] = []
    for i in range(int(rng.integers(1, 4))):
        if rng.random() < 0.4:
            inputs.append({"name": f"in{i}", "datatype": "BOOL", "packing": "bits",
                           "shape": [int(rng.integers(1, 4)), int(rng.integers(1, 20))],
                           "bitorder": str(rng.choice(["big", "little"]))})  # fmt: skip
        else:
            shape = [int(d) for d in rng.integers(1, 4, int(rng.integers(1, 3)))]
            inputs.append({"name": f"in{i}", "datatype": str(rng.choice(list(WIRE))),
                           "shape": shape})  # fmt: skip
    outputs = [{"name": f"out{i}", "datatype": "FP32"} for i in range(int(rng.integers(1, 4)))]
    return ModelConfig.model_validate(
        {"max_batch_size": 8, "inputs": inputs, "model": {"file": "m.pt"}, "outputs": outputs}
    )


def version(cfg: ModelConfig, name: str, v: str) -> SimpleNamespace:
    """What a key reads of a model version (a signature of its own, as a handle has)."""
    shapes = [[1] for _ in cfg.outputs]
    return SimpleNamespace(name=name, version=v, cfg=cfg, signature=Signature(name, cfg, shapes))


def random_form(rng: np.random.Generator, cfg: ModelConfig) -> dict[str, Any]:
    """How a client asks: its batch, each input's wire form and parameters, the outputs it
    names (or none), and request parameters; some change the answer (``k``, ``threshold``),
    some do not (``priority``, ``timeout``, the binary forms)."""

    def params(*choices: tuple[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in choices if rng.random() < 0.3}

    inputs = []
    for spec in cfg.inputs:
        packed = spec.packing == "bits" and rng.random() < 0.7
        extra = params(("k", int(rng.integers(1, 4))), ("threshold", 0.5))
        if packed and rng.random() < 0.5:
            extra["bitorder"] = str(rng.choice(["big", "little"]))
        inputs.append((packed, extra))
    names = [o.name for o in cfg.outputs]
    outputs = None
    if rng.random() < 0.6:
        chosen = rng.permutation(names)[: int(rng.integers(1, len(names) + 1))]
        outputs = [{"name": str(n), "parameters": {"binary_data": True,
                    **params(("k", int(rng.integers(1, 4))))}} for n in chosen]  # fmt: skip
    top = params(("priority", 1), ("timeout", 50_000), ("k", int(rng.integers(1, 4))),
                 ("threshold", float(rng.random())), ("binary_data_output", True))  # fmt: skip
    return {"batch": int(rng.integers(1, 4)), "inputs": inputs, "outputs": outputs,
            "parameters": top}  # fmt: skip


def body_of(rng: np.random.Generator, cfg: ModelConfig, form: dict[str, Any]) -> tuple[bytes, int]:
    """A binary V2 request of ``form`` with fresh random data, and its header's length."""
    heads, arrays = [], []
    for spec, (packed, extra) in zip(cfg.inputs, form["inputs"], strict=True):
        if packed:
            datatype, shape = "UINT8", spec.packed_shape
            arr = rng.integers(0, 256, [form["batch"], *shape]).astype(np.uint8)
        else:
            datatype, shape = spec.datatype, spec.shape
            dtype = WIRE[datatype]
            full = [form["batch"], *shape]
            arr = (rng.integers(0, 2, full).astype(dtype) if dtype is np.bool_
                   else (rng.standard_normal(full) * 50).astype(dtype))  # fmt: skip
        arrays.append(arr)
        heads.append({"name": spec.name, "datatype": datatype, "shape": list(arr.shape),
                      "parameters": {"binary_data_size": arr.nbytes, **extra}})  # fmt: skip
    header: dict[str, Any] = {"inputs": heads, "parameters": form["parameters"]}
    if form["outputs"] is not None:
        header["outputs"] = form["outputs"]
    head = json.dumps(header).encode()
    return head + b"".join(a.tobytes() for a in arrays), len(head)


@pytest.mark.parametrize("seed", range(4))
def test_cache_key_is_the_reference_key_on_fresh_random_requests(seed: int) -> None:
    rng = np.random.default_rng(seed)
    formed = 0
    for _ in range(15):
        cfg = random_config(rng)
        # Two versions of one config (a reload): a form's head must follow the version.
        versions = [version(cfg, "m", "1"), version(cfg, "m", "2")]
        headers = HeaderCache()
        forms = [random_form(rng, cfg) for _ in range(3)]
        for i in range(12):
            body, n = body_of(rng, cfg, forms[i % 3])
            kept = headers.decode(body, n, versions[0].signature, None)
            plain = decode_infer_request(body, n, versions[0].signature, None)
            assert plain.form is None
            formed += kept.form is not None
            keys = set()
            for h in versions if rng.random() < 0.5 else versions[::-1]:
                for req in (kept, plain, kept):
                    bound = h.signature.bind(req)
                    key = cache_key(h, req, bound)
                    assert key == reference_key(h, req, bound)
                    keys.add(key)
            assert len(keys) == 2  # one per version; the same with a form or without
    assert formed > 0  # the forms' path ran


def test_a_form_is_shared_by_a_kept_headers_requests_only() -> None:
    rng = np.random.default_rng(9)
    cfg = random_config(rng)
    sig = version(cfg, "m", "1").signature
    headers = HeaderCache()
    one, other = random_form(rng, cfg), random_form(rng, cfg)
    first = [headers.decode(*body_of(rng, cfg, one), sig, None) for _ in range(3)]
    second = [headers.decode(*body_of(rng, cfg, other), sig, None) for _ in range(2)]
    assert first[0].form is None  # decoded in full: its header kept from now on
    assert first[1].form is not None
    assert first[1].form is first[2].form
    assert second[1].form is not None
    assert second[1].form is not first[1].form


def test_plain_request_objects_carry_no_form() -> None:
    assert InferRequest(id=None, inputs=[]).form is None
