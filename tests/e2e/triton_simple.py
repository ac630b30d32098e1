"""Triton's "simple" example model, written as a bitserve repository by the tests.

``simple``: two INT32 inputs ``INPUT0`` and ``INPUT1`` of 16 elements; ``OUTPUT0`` is their
sum and ``OUTPUT1`` their difference (INT32), batched up to ``max_batch_size`` 8, as in
Triton's example model repository. The model is TorchScript, made here (no file is fetched).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

SIMPLE_CONFIG = """\
max_batch_size = 8
max_queue_delay_us = 0
device = "cpu"

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


class SumAndDifference(torch.nn.Module):
    """``(INPUT0 + INPUT1, INPUT0 - INPUT1)``, element by element."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


def write_simple(root: Path, name: str = "simple") -> Path:
    """Write the model as ``root/name/1/`` (config.toml and model.pt); returns its folder."""
    folder = root / name / "1"
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(SIMPLE_CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is still served
        scripted = torch.jit.script(SumAndDifference())  # type: ignore[no-untyped-call]
        scripted.save(str(folder / "model.pt"))
    return folder
