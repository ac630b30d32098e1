"""Triton's "simple" example model as a bitserve repository, written by the tests.

Triton's client examples (``simple_grpc_*``, ``simple_http_*``) call a model ``simple``: two
INT32 ``[16]`` inputs ``INPUT0`` and ``INPUT1`` (batched), outputs ``OUTPUT0 = INPUT0 +
INPUT1`` and ``OUTPUT1 = INPUT0 - INPUT1``. Here it is TorchScript (no pickle), saved by
:func:`write_simple_repository`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

CONFIG = """\
max_batch_size = 8
max_queue_delay_us = 0

[[inputs]]
name = "INPUT0"
datatype = "INT32"
shape = [16]

[[inputs]]
name = "INPUT1"
datatype = "INT32"
shape = [16]

[model]
file = "model.pt"

[[outputs]]
name = "OUTPUT0"
datatype = "INT32"
shape = [16]

[[outputs]]
name = "OUTPUT1"
datatype = "INT32"
shape = [16]
"""


class Simple(torch.nn.Module):
    """``(INPUT0, INPUT1) -> (INPUT0 + INPUT1, INPUT0 - INPUT1)``, shapes (batch, 16) int32."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


def write_simple_repository(root: Path, name: str = "simple") -> Path:
    """Write the model as ``root/<name>/{config.toml, model.pt}``; returns ``root``."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript: still served
        scripted = torch.jit.script(Simple())  # type: ignore[no-untyped-call]
    scripted.save(str(folder / "model.pt"))
    return root


SLOW_CONFIG = """\
max_batch_size = 8
max_queue_delay_us = 0

[[inputs]]
name = "x"
datatype = "INT32"
shape = [1]

[model]
file = "model.pt"

[[outputs]]
name = "y"
datatype = "FP32"
shape = [1]
"""


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
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(SLOW_CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(Slow(rounds))  # type: ignore[no-untyped-call]
    scripted.save(str(folder / "model.pt"))
    return root
