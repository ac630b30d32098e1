"""A slow TorchScript model for shutdown tests, written by the tests (Triton's "simple" model
is in ``tests/e2e/triton_simple.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.repo_utils import model_toml, tensor, torchscript, write_model_folder

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


def write_slow_model(root: Path, rounds: int, name: str = "slow") -> Path:
    """Write :class:`Slow` as ``root/<name>/{config.toml, model.pt}``; returns ``root``."""
    folder = write_model_folder(root / name, SLOW_CONFIG)
    torchscript(Slow(rounds)).save(str(folder / "model.pt"))
    return root


class Paced(torch.nn.Module):
    """``x -> float(x)``, after as many 300x300 matrix products as the batch's largest ``x``:
    each request sets how long its batch takes (a long one holds the queue, short ones
    queue behind it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ones(300, 300)
        for _ in range(int(x.max().item())):
            y = torch.tanh(y @ y / 300.0)
        return x.float() + 0.0 * y.sum()


def write_paced_model(root: Path, name: str = "paced", **settings: object) -> Path:
    """Write :class:`Paced` as ``root/<name>/{config.toml, model.pt}`` (input ``x`` INT32
    ``[1]``, output ``y`` FP32 ``[1]``; ``settings``: more top-level config keys, e.g.
    ``priority_levels``); returns ``root``."""
    config = model_toml(
        inputs=[tensor("x", "INT32", [1])],
        model={"file": "model.pt"},
        outputs=[tensor("y", "FP32", [1])],
        **{"max_batch_size": 1, "max_queue_delay_us": 0, **settings},
    )
    folder = write_model_folder(root / name, config)
    torchscript(Paced()).save(str(folder / "model.pt"))
    return root
