"""A light model at high rates: a 2048-bit fingerprint MLP (2048 -> 256 -> 1).

The fingerprint ``fp`` is BOOL [2048], bit-packed on the wire (UINT8 [batch, 256]); bitserve
hands the model the unpacked bool rows (batch, 2048), which it casts to float32 (a no-op on the
baseline's float32 rows), and it returns one score per row, FP32 [1]. Written as a
bitserve repository (the model a ``torch.export`` program) by :func:`write_repository`; the
hand-written baseline (:mod:`benchmarks.overhead.fastapi_mlp`) loads the same model exported
for float32 rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NAME = "mlp"
INPUT = "fp"
OUTPUT = "score"
BITS = 2048
HIDDEN = 256
BATCH = 64
"""Rows per request (``infer_many``'s batch size)."""
FLOAT32 = "mlp-float32.pt2"
"""The float32 program's file name, in the repository's root (not a model folder)."""
MAX_BATCH_SIZE = 256
"""What the repository lets the batcher merge: up to four requests of 64 rows."""

CONFIG_TOML = f"""\
max_batch_size = {MAX_BATCH_SIZE}
max_queue_size = 1024

[[inputs]]
name = "{INPUT}"
datatype = "BOOL"
shape = [{BITS}]
packing = "bits"

[model]
file = "model.pt2"

[[outputs]]
name = "{OUTPUT}"
datatype = "FP32"
shape = [1]
"""


def _mlp() -> Any:
    import torch

    class Mlp(torch.nn.Module):
        """The fingerprint MLP; takes bool or float32 rows (batch, 2048)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(BITS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x.to(torch.float32))  # type: ignore[no-any-return]

    return Mlp()


def write_repository(root: Path, seed: int = 0) -> Path:
    """Write ``root/mlp/{config.toml, model.pt2}`` (random weights from ``seed``), and the same
    model for float32 rows beside the repository's folder; returns the float32 program's path."""
    import torch

    torch.manual_seed(seed)
    net = _mlp().eval()
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH_SIZE)
    folder = root / NAME
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(CONFIG_TOML)
    # The same weights twice: for bool rows (what bitserve hands a packed input) and for
    # float32 rows (the baseline's; a program is exported for one input dtype).
    for dtype, path in ((torch.bool, folder / "model.pt2"), (torch.float32, root / FLOAT32)):
        example = (torch.zeros(2, BITS, dtype=dtype),)
        program = torch.export.export(net, example, dynamic_shapes=({0: batch},))
        torch.export.save(program, str(path))
    return root / FLOAT32
