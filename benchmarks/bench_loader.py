"""Training on float32, int8 and bit-packed features: bytes moved per epoch and batches/s.

The same small training loop (an MLP with one hidden layer, BCE loss, SGD) is fed the same
binary features three ways, each through a ``DataLoader`` and :class:`DevicePrefetcher`:

* ``float32``: dense float32 rows, copied as they are;
* ``int8``: dense int8 rows, copied, then converted to float32 on the device;
* ``packed``: ``np.packbits`` rows, copied, then unpacked on the device straight into float32
  (``gpu_ops.unpackbits(..., out=...)`` into a reused buffer).

For each: host-to-device bytes per epoch (features and labels, as the loader hands them to
the device), epochs as batches/s for the loader alone and for the whole training step, and
ratios against int8 measured in the same run. On the CPU nothing crosses a bus, so there the
columns show what packing costs or saves in gather and conversion work.

    python -m benchmarks.bench_loader [--smoke] [--device cpu|cuda]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks._common import markdown_table, parse_args, report, synchronize
from gpu_ops.data import DevicePrefetcher, PackedBatch, PackedBitsDataset, collate_packed


class DenseDataset(Dataset[PackedBatch]):
    """Dense rows in a :class:`PackedBatch` (``bits`` holds the dense features), the baseline."""

    def __init__(self, features: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]) -> None:
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int) -> PackedBatch:
        return self.__getitems__([i])

    def __getitems__(self, idx: Sequence[int]) -> PackedBatch:
        i = np.asarray(idx)
        return PackedBatch(torch.from_numpy(self.features[i]), torch.from_numpy(self.labels[i]), ())


def _sizes(smoke: bool, device: str) -> tuple[int, int, int, int]:
    """rows, L, batch size, hidden width."""
    if smoke:
        return 512, 256, 64, 16
    if device == "cuda":
        return 32768, 8192, 1024, 256
    return 8192, 4096, 512, 32


def _epoch_time(
    loader: DataLoader[PackedBatch], device: str, unpack: bool, step: Any, epochs: int
) -> float:
    """Median seconds per epoch of the prefetched loader, with ``step`` run on each batch."""
    times = []
    for e in range(epochs + 1):  # the first epoch warms up (allocations, kernels)
        synchronize(device)
        t0 = time.perf_counter()
        for x, y, _ in DevicePrefetcher(loader, device, unpack=unpack):
            step(x, y)
        synchronize(device)
        if e:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(device: str, smoke: bool) -> list[list[object]]:
    rows, L, B, hidden = _sizes(smoke, device)
    rng = np.random.default_rng(0)
    dense = rng.integers(0, 2, (rows, L), dtype=np.int8)
    labels = rng.integers(0, 2, rows).astype(np.float32)
    datasets: dict[str, tuple[Dataset[PackedBatch], bool]] = {
        "float32": (DenseDataset(dense.astype(np.float32), labels), False),
        "int8": (DenseDataset(dense, labels), False),
        "packed": (PackedBitsDataset(np.packbits(dense, axis=-1), L, labels=labels), True),
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(L, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def train(x: torch.Tensor, y: torch.Tensor | None) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x).squeeze(-1), y).backward()
        opt.step()

    def touch(x: torch.Tensor, y: torch.Tensor | None) -> None:
        pass

    epochs = 1 if smoke else 3
    results: dict[str, tuple[int, float, float]] = {}
    for name, (ds, unpack) in datasets.items():
        loader = DataLoader(
            ds,
            batch_size=B,
            shuffle=True,
            collate_fn=collate_packed,
            pin_memory=device == "cuda",
            generator=torch.Generator().manual_seed(0),
        )
        # Feature bytes only: the labels (4 bytes a row) are the same in every pipeline.
        moved = sum(b.bits.nbytes for b in loader)
        n_batches = len(loader)
        load = n_batches / _epoch_time(loader, device, unpack, touch, epochs)
        fit = n_batches / _epoch_time(loader, device, unpack, train, epochs)
        results[name] = (moved, load, fit)

    base_bytes, base_load, base_fit = results["int8"]
    f32_bytes = results["float32"][0]
    out: list[list[object]] = []
    for name, (moved, load, fit) in results.items():
        out.append(
            [
                name,
                device,
                f"{rows} x {L}, batch {B}",
                f"{moved / 2**20:.2f}",
                f32_bytes / moved,
                base_bytes / moved,
                load,
                load / base_load,
                fit,
                fit / base_fit,
            ]
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0] if __doc__ else "bench_loader", argv)
    table: list[list[object]] = []
    for device in args.device:
        table += bench(device, args.smoke)
    headers = [
        "features",
        "device",
        "data",
        "feature MiB to device / epoch",
        "x fewer than float32",
        "x fewer than int8",
        "loader batches/s",
        "vs int8",
        "train batches/s",
        "vs int8",
    ]
    body = markdown_table(headers, table) + (
        "\n\nMedian epoch of a shuffled DataLoader (num_workers=0, pin_memory on CUDA) through "
        "DevicePrefetcher; 'loader' does nothing with a batch, 'train' runs one SGD step of a "
        "Linear(L, h)-ReLU-Linear(h, 1) model. Bytes count the features (the float32 labels, "
        "4 bytes a row, are the same for all three). Targets: "
        "8x fewer bytes than int8 and 32x fewer than float32, with batches/s at least as high "
        "as int8."
    )
    report(
        "loader",
        "Training loader: float32 vs int8 vs packed features",
        body,
        smoke=args.smoke,
        devices=args.device,
    )


if __name__ == "__main__":
    main()
