"""A model whose requests say how long their batch takes, for tests and benchmarks of queues
(priorities, requests dropped when their client goes away, tracing): a long request holds
its worker while short ones queue behind it."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.repo_utils import model_toml, tensor, torchscript, write_model_folder


class Paced(torch.nn.Module):
    """``x -> float(x)``, after ``max(x)`` 300x300 matrix products (a few ms each on one
    core): the dry runs at load (zero batches) take no time, ``x = 800`` takes seconds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ones(300, 300)
        for _ in range(int(x.max())):
            y = torch.tanh(y @ y / 300.0)
        return x.float() + 0.0 * y.sum()


def write_paced_model(root: Path, name: str = "paced", **settings: object) -> Path:
    """Write :class:`Paced` as ``root/<name>/{config.toml, model.pt}`` (input ``x`` INT32
    ``[1]``, output ``y`` FP32 ``[1]``, one request a batch unless ``settings`` say otherwise:
    they are more top-level config keys, e.g. ``priority_levels``); returns ``root``."""
    config = model_toml(
        inputs=[tensor("x", "INT32", [1])],
        model={"file": "model.pt"},
        outputs=[tensor("y", "FP32", [1])],
        **{"max_batch_size": 1, "max_queue_delay_us": 0, **settings},
    )
    folder = write_model_folder(root / name, config)
    torchscript(Paced()).save(str(folder / "model.pt"))
    return root
