"""The one workload every peer serves, and the float64 reference every answer is checked with.

An item is 20 functions x 50000 fine points of 0/1 features (about 10% ones). Each function is
convolved with a Gaussian response (sigma = 125 fine points, cut at 4 sigma) and resampled at
500 sorted random coarse points of its own (fixed seed):

    out[n, a] = sum_b r(c[n, a] - x[b]) * f[n, b],   r(d) = exp(-d² / (2 sigma²)), |d| <= 4 sigma

Every peer computes this with the same torch code (:class:`TorchWorkload`, which is
``gpu_ops.BandedResampler``, the operator bitserve runs), so only the serving differs. The
answers are checked against :func:`reference`, a float64 NumPy sum over each window that shares
no code with the operator.

This module needs only NumPy at import time (the load generator imports it); torch and gpu_ops
are imported where the compute is built, inside the server processes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

N_FUNCTIONS = 20
"""N: functions per item."""
N_FINE = 50_000
"""B: fine points per function (bits per function on the wire before packing)."""
N_COARSE = 500
"""A: coarse points per function (the output length)."""
SIGMA = 125.0
"""Gaussian width in fine-grid steps."""
SUPPORT_SIGMAS = 4.0
"""The response is cut (zero) beyond this many sigmas."""
DENSITY = 0.1
"""Fraction of ones in the features."""
SEED = 20_240_607
"""Seed of the coarse points; the items use ``SEED + 1 + i``."""

INPUT_NAME = "spikes"
OUTPUT_NAME = "resampled"
MODEL_NAME = "e2e"
"""Name under which every peer serves the workload."""
PACKED_LEN = (N_FINE + 7) // 8
"""Bytes per function once packed (6250)."""

RTOL = 1e-4
"""Answers must match the float64 reference to this relative tolerance (float32 sums of up
to ~1000 terms, accumulated in a different order than the reference)."""


def fine_grid() -> np.ndarray[Any, np.dtype[np.float64]]:
    """The fine grid x: (B,) float64, the integers 0 .. B-1."""
    return np.arange(N_FINE, dtype=np.float64)


def coarse_points() -> np.ndarray[Any, np.dtype[np.float64]]:
    """The coarse points c: (N, A) float64, sorted per function, drawn once from ``SEED``.

    They are rounded to float32 so that the float32 operator and the float64 reference see
    exactly the same positions.
    """
    rng = np.random.default_rng(SEED)
    c = np.sort(rng.uniform(0.0, N_FINE - 1, size=(N_FUNCTIONS, N_COARSE)), axis=1)
    return c.astype(np.float32).astype(np.float64)


def make_items(count: int, *, seed: int = SEED + 1) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """``count`` random items: (count, N, B) bool with about ``DENSITY`` ones."""
    rng = np.random.default_rng(seed)
    return rng.random((count, N_FUNCTIONS, N_FINE)) < DENSITY


def pack(items: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Pack (..., B) 0/1 features along the last axis, big-endian: (..., ceil(B/8)) uint8."""
    return np.packbits(items.astype(np.bool_), axis=-1, bitorder="big")


@functools.cache
def _windows() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Each coarse point's window: indices (N, A, W) int64 and float64 weights (N, A, W).

    Windows past the grid's edges are padded with index 0 and weight 0.
    """
    x = fine_grid()
    c = coarse_points()
    half = SUPPORT_SIGMAS * SIGMA
    width = int(2 * half) + 2
    lo = np.ceil(c - half).astype(np.int64)
    idx = lo[..., None] + np.arange(width)
    inside = (idx >= 0) & (idx < N_FINE)
    idx = np.where(inside, idx, 0)
    d = c[..., None] - x[idx]
    w = np.where(inside & (np.abs(d) <= half), np.exp(-0.5 * (d / SIGMA) ** 2), 0.0)
    return idx, w


def reference(items: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The float64 answer for (M, N, B) 0/1 items: (M, N, A), a plain sum over each window."""
    idx, w = _windows()
    items = np.asarray(items, dtype=np.bool_)
    out = np.empty((len(items), N_FUNCTIONS, N_COARSE))
    for n in range(N_FUNCTIONS):
        gathered = items[:, n, :][:, idx[n]]  # (M, A, W) bool: each window's features
        out[:, n, :] = np.einsum("maw,aw->ma", gathered, w[n])
    return out


def check(answer: np.ndarray[Any, Any], expected: np.ndarray[Any, Any]) -> str | None:
    """None when ``answer`` matches ``expected`` (the reference), else what is wrong."""
    if answer.shape != expected.shape:
        return f"shape {answer.shape} != {expected.shape}"
    atol = RTOL * float(np.abs(expected).max())
    bad = ~np.isclose(answer, expected, rtol=RTOL, atol=atol)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        return f"{int(bad.sum())} values differ, e.g. at {i}: {answer[i]} vs {expected[i]}"
    return None


@dataclass
class Pool:
    """A fixed set of items the load generator cycles through, with their references."""

    items: np.ndarray[Any, np.dtype[np.bool_]]
    """(P, N, B) bool."""
    packed: np.ndarray[Any, np.dtype[np.uint8]]
    """(P, N, ceil(B/8)) uint8."""
    expected: np.ndarray[Any, np.dtype[np.float64]]
    """(P, N, A) float64 references."""

    @classmethod
    def make(cls, size: int) -> Pool:
        """``size`` fresh items and their float64 references."""
        items = make_items(size)
        return cls(items=items, packed=pack(items), expected=reference(items))


class TorchWorkload:
    """The torch code every peer runs: unpacked 0/1 features in, (M, N, A) float32 out.

    It is ``gpu_ops.BandedResampler`` built from the same grid, coarse points and Gaussian as
    the reference; bitserve's pipeline runs the same operator.
    """

    def __init__(self, device: str = "cpu") -> None:
        import torch

        from gpu_ops import BandedResampler

        self.device = torch.device(device)
        x = torch.from_numpy(fine_grid()).to(torch.float32)
        c = torch.from_numpy(coarse_points()).to(torch.float32)
        self.op = BandedResampler.from_response(
            x,
            c,
            lambda d: torch.exp(-0.5 * (d / SIGMA) ** 2),
            support=SUPPORT_SIGMAS * SIGMA,
            dtype=torch.float32,
            device=self.device,
            max_band_bytes=None,  # the band bitserve's pipeline runs (40 MB)
        )

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """Resample (M, N, B) 0/1 features (bool or uint8, any device) to (M, N, A) float32."""
        import torch

        with torch.inference_mode():
            f = features.to(self.device, non_blocking=True).to(torch.float32)
            out: torch.Tensor = self.op(f)
            return out
