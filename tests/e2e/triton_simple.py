"""Triton's "simple" example model, written as a bitserve repository by the tests.

``simple``: two INT32 inputs ``INPUT0`` and ``INPUT1`` of 16 elements; ``OUTPUT0`` is their
sum and ``OUTPUT1`` their difference (INT32), batched up to ``max_batch_size`` 8, as in
Triton's example model repository. The model is TorchScript, made here (no file is fetched).
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.repo_utils import model_toml, tensor, torchscript, write_model_folder

SIMPLE_CONFIG = model_toml(
    max_batch_size=8,
    max_queue_delay_us=0,
    device="cpu",
    inputs=[tensor(name, "INT32", [16]) for name in ("INPUT0", "INPUT1")],
    model={"file": "model.pt"},
    outputs=[tensor(name, "INT32", [16]) for name in ("OUTPUT0", "OUTPUT1")],
)


class SumAndDifference(torch.nn.Module):
    """``(INPUT0 + INPUT1, INPUT0 - INPUT1)``, element by element."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


def write_simple(root: Path, name: str = "simple") -> Path:
    """Write the model as ``root/name/1/`` (config.toml and model.pt); returns its folder."""
    folder = write_model_folder(root / name / "1", SIMPLE_CONFIG)
    torchscript(SumAndDifference()).save(str(folder / "model.pt"))
    return folder
