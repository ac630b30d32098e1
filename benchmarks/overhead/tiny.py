"""The tiny model: one packed byte in, one float out, a trivial operator.

Logical input ``bits`` BOOL [1, 8] packed big-endian (UINT8 [batch, 1, 1] on the wire); the
operator is a boxcar of half-width 4 over the fine grid 0..7 read at the one coarse point 3.5,
so every bit has weight 1 and the output ``count`` FP32 [1, 1] is the number of ones in the
byte. Written as a bitserve repository by :func:`write_repository`; the baselines compute the
same number with NumPy (:func:`count_ones`) and answer a binary V2 request the same way
(:func:`infer_binary`), each in its own framework.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

NAME = "tiny"
INPUT = "bits"
OUTPUT = "count"
MAX_BATCH_SIZE = 64

CONFIG_TOML = f"""\
max_batch_size = {MAX_BATCH_SIZE}
max_queue_delay_us = 0
max_queue_size = 1024

[[inputs]]
name = "{INPUT}"
datatype = "BOOL"
shape = [1, 8]
packing = "bits"

[operator]
file = "operator.safetensors"
response = "boxcar"
half_width = 4.0

[[outputs]]
name = "{OUTPUT}"
datatype = "FP32"
shape = [1, 1]
"""

SERVER: dict[str, Any] = {"name": "baseline", "version": "0", "extensions": ["binary_tensor_data"]}
# The V2 description the baselines serve (what bitserve's metadata and config say).
METADATA: dict[str, Any] = {
    "name": NAME,
    "versions": ["1"],
    "platform": "baseline",
    "inputs": [{"name": INPUT, "datatype": "UINT8", "shape": [-1, 1, 1]}],
    "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, 1, 1]}],
}
CONFIG: dict[str, Any] = {
    "name": NAME,
    "platform": "baseline",
    "max_batch_size": MAX_BATCH_SIZE,
    "input": [{"name": INPUT, "data_type": "TYPE_UINT8", "dims": [1, 1]}],
    "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": [1, 1]}],
}

_WEIGHTS = np.ones(8, dtype=np.float32)


def write_repository(root: Path) -> Path:
    """Write the tiny model as ``root/tiny/{config.toml, operator.safetensors}``; returns root."""
    from safetensors.numpy import save_file

    folder = root / NAME
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(CONFIG_TOML)
    x = np.arange(8, dtype=np.float32)
    c = np.array([[3.5]], dtype=np.float32)
    save_file({"x": x, "c": c}, str(folder / "operator.safetensors"))
    return root


def count_ones(packed: bytes | memoryview) -> np.ndarray[Any, Any]:
    """The model's maths on a batch of packed bytes: FP32 (batch, 1, 1) counts of ones."""
    bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8)).reshape(-1, 8)
    out: np.ndarray[Any, Any] = (bits.astype(np.float32) @ _WEIGHTS).reshape(-1, 1, 1)
    return out


def infer_binary(body: bytes, header_length: int) -> tuple[bytes, bytes]:
    """One binary V2 (Triton binary-extension) inference as the baselines answer it.

    The JSON header is parsed (for the request ``id``) and the answer framed: what any V2
    endpoint does, whatever carries the bytes.

    Args:
        body: the request body: its JSON header (``header_length`` bytes, the request's
            ``Inference-Header-Content-Length``), then the input UINT8 [batch, 1, 1].
        header_length: the JSON header's length in bytes.

    Returns:
        The answer's JSON header (its length goes in ``Inference-Header-Content-Length``)
        and its binary output FP32 [batch, 1, 1]; the body is the one after the other.
    """
    header = json.loads(body[:header_length])
    out = count_ones(memoryview(body)[header_length:]).tobytes()
    head = json.dumps(
        {
            "model_name": NAME,
            "outputs": [
                {
                    "name": OUTPUT,
                    "datatype": "FP32",
                    "shape": [len(out) // 4, 1, 1],
                    "parameters": {"binary_data_size": len(out)},
                }
            ],
            "id": header.get("id", ""),
        }
    ).encode()
    return head, out
