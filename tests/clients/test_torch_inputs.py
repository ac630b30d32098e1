"""torch tensors are accepted when torch is installed (skipped in the client-only venv)."""

from __future__ import annotations

import numpy as np
import pytest
from bitserve_client._spec import parse_model_spec, prepare_inputs

torch = pytest.importorskip("torch")


def test_torch_tensors_are_converted_and_packed() -> None:
    metadata = {
        "name": "m",
        "inputs": [
            {
                "name": "x",
                "datatype": "UINT8",
                "shape": [-1, 2, 2],
                "parameters": {"packing": "bits", "logical_shape": [2, 11]},
            }
        ],
    }
    spec = parse_model_spec(metadata, {"max_batch_size": 4})
    bits = torch.rand(3, 2, 11) < 0.5
    (t,) = prepare_inputs(spec, {"x": bits.float().requires_grad_()}).tensors
    np.testing.assert_array_equal(t.array, np.packbits(bits.numpy(), axis=-1))


def test_bfloat16_is_refused_with_a_hint() -> None:
    spec = parse_model_spec(
        {"name": "m", "inputs": [{"name": "a", "datatype": "FP32", "shape": [-1, 2]}]}
    )
    with pytest.raises(ValueError, match="float"):
        prepare_inputs(spec, {"a": torch.ones(1, 2, dtype=torch.bfloat16)})
