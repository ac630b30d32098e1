"""The fingerprint model of the Ray tests and benchmark: a chemist's 2048-bit MLP scorer.

A molecule's 2048-bit fingerprint travels as 256 packed bytes; the model is an MLP
(2048 -> 256 -> 1, ReLU) exported with ``torch.export`` into a model repository
(``fingerprint/1/model.pt2``, no operator), which unpacks the bits straight into float32::

    root = write_fingerprint_repository(tmp_path / "models")
    table = fingerprint_table(1000, seed=1)     # id (string), fp (binary, 256 B a row)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from harness.repo_utils import model_toml, tensor

BITS = 2048
HIDDEN = 256
PACKED = BITS // 8
MODEL = "fingerprint"


def fingerprint_config(max_batch_size: int = 1024, **settings: Any) -> str:
    """The model's ``config.toml``: input ``fp`` (bits of [2048]), output ``score`` FP32 [1]."""
    return model_toml(
        max_batch_size=max_batch_size,
        **settings,
        inputs=[tensor("fp", "BOOL", [BITS], packing="bits")],
        model={"file": "model.pt2"},
        outputs=[tensor("score", "FP32", [1])],
    )


def fingerprint_module(seed: int = 0) -> Any:
    """The MLP (2048 -> 256 -> 1) with fixed weights, in eval mode."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(BITS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    ).eval()


def write_fingerprint_repository(
    root: Path, *, max_batch_size: int = 1024, seed: int = 0, **settings: Any
) -> Path:
    """Write ``root/fingerprint/1/{config.toml, model.pt2}``; return ``root``."""
    import torch

    folder = root / MODEL / "1"
    folder.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=max(max_batch_size, 2))
    example = (torch.zeros(2, BITS),)
    ep = torch.export.export(fingerprint_module(seed), example, dynamic_shapes=({0: batch},))
    torch.export.save(ep, str(folder / "model.pt2"))
    (folder / "config.toml").write_text(fingerprint_config(max_batch_size, **settings))
    return root


def packed_fingerprints(rows: int, seed: int = 0, density: float = 0.1) -> np.ndarray:
    """``rows`` random fingerprints, packed: uint8 ``(rows, 256)``, big bit order."""
    bits = np.random.default_rng(seed).random((rows, BITS)) < density
    return np.packbits(bits, axis=-1)


def fingerprint_table(rows: int, seed: int = 0, start: int = 0) -> Any:
    """A pyarrow table of ``rows`` molecules: ``id`` (``"mol-<n>"`` from ``start``), ``fp``
    (binary, 256 packed bytes a row) and ``weight`` (float64, a column to pass through)."""
    import pyarrow as pa

    packed = packed_fingerprints(rows, seed)
    fp = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(PACKED), rows, [None, pa.py_buffer(packed.tobytes())]
    ).cast(pa.binary())
    ids = pa.array([f"mol-{start + i}" for i in range(rows)])
    weight = pa.array(np.arange(start, start + rows, dtype=np.float64) / 7)
    return pa.table({"id": ids, "fp": fp, "weight": weight})


def reference_scores(packed: np.ndarray, seed: int = 0) -> np.ndarray:
    """The MLP in float64 on the unpacked bits: ``(rows, 1)``."""
    import torch

    module = fingerprint_module(seed).double()
    bits = np.unpackbits(packed, axis=-1, count=BITS).astype(np.float64)
    with torch.no_grad():
        return np.asarray(module(torch.from_numpy(bits)).numpy())


def write_slow_fingerprint_model(root: Path, rounds: int, name: str = "slow_fingerprint") -> Path:
    """A fingerprint model that takes its time: ``score = fp @ w`` (``w = (i mod 7) / 7`` over
    the 2048 bits), after ``rounds`` 300x300 matrix products a batch (TorchScript); its config
    takes batches of 25 rows. Returns ``root``."""
    import torch

    from harness.repo_utils import torchscript

    class Slow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rounds = rounds
            self.w = torch.nn.Parameter((torch.arange(BITS) % 7 / 7.0).reshape(BITS, 1))

        def forward(self, fp: torch.Tensor) -> torch.Tensor:
            y = torch.ones(300, 300)
            for _ in range(self.rounds):
                y = torch.tanh(y @ y / 300.0)
            return fp @ self.w + 0.0 * y.sum()

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    torchscript(Slow().eval()).save(str(folder / "model.pt"))
    (folder / "config.toml").write_text(
        model_toml(
            max_batch_size=25,
            # TorchScript states no dtypes: the bits are handed over as float32
            inputs=[tensor("fp", "BOOL", [BITS], packing="bits", dtype="float32")],
            model={"file": "model.pt"},
            outputs=[tensor("score", "FP32", [1])],
        )
    )
    return root


def slow_reference(packed: np.ndarray) -> np.ndarray:
    """What :func:`write_slow_fingerprint_model`'s model answers, in float64: ``(rows, 1)``."""
    bits = np.unpackbits(packed, axis=-1, count=BITS).astype(np.float64)
    return bits @ (np.arange(BITS) % 7 / 7.0).reshape(BITS, 1)
