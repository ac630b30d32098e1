"""A slow TorchScript model for shutdown tests, written by the tests (Triton's "simple" model
is in ``tests/e2e/triton_simple.py``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import torch

from harness.paced import Paced as SlowByInput
from harness.repo_utils import model_toml, tensor, torchscript, write_model_folder

SLOW_CONFIG = model_toml(
    max_batch_size=8,
    max_queue_delay_us=0,
    inputs=[tensor("x", "INT32", [1])],
    model={"file": "model.pt"},
    outputs=[tensor("y", "FP32", [1])],
)


class Slow(torch.nn.Module):
    """``x -> float(x)``, after ``rounds`` 300x300 matrix products (a batch in flight for a
    while, for shutdown tests)."""

    def __init__(self, rounds: int) -> None:
        super().__init__()
        self.rounds = rounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ones(300, 300)
        for _ in range(self.rounds):
            y = torch.tanh(y @ y / 300.0)
        return x.float() + 0.0 * y.sum()


def write_slow_model(root: Path, rounds: int | None, name: str = "slow") -> Path:
    """Write :class:`Slow` (``rounds`` given) or :class:`SlowByInput` (``rounds=None``) as
    ``root/<name>/{config.toml, model.pt}``; returns ``root``."""
    folder = write_model_folder(root / name, SLOW_CONFIG)
    module = SlowByInput() if rounds is None else Slow(rounds)
    torchscript(module).save(str(folder / "model.pt"))
    return root


def slow_request(url: str, x: int) -> tuple[int, object]:
    """``slow``(x) on a new connection: (status, y as nested lists, or the error); with
    :class:`SlowByInput`, x matrix products long."""
    body = {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 1], "data": [x]}]}
    try:
        r = httpx.post(url + "/v2/models/slow/infer", json=body, timeout=300)
    except httpx.HTTPError as e:
        return 0, repr(e)
    if r.status_code != 200:
        return r.status_code, r.text
    (out,) = r.json()["outputs"]
    return 200, np.reshape(out["data"], out["shape"]).tolist()
