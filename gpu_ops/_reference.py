"""Slow, obviously correct implementations that the tests compare the fast paths with.

Nothing here is meant to be fast; everything here is meant to be easy to check by eye.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# --- bits: numpy.packbits / numpy.unpackbits semantics, in plain torch ---------------------

# --- resample: the banded response operator, densely ---------------------------------------


def banded_to_dense(starts: torch.Tensor, weights: torch.Tensor, num_fine: int) -> torch.Tensor:
    """The dense operator T (N, A, B) of a band: T[n, a, starts[n, a] + j] = weights[n, a, j]."""
    N, A, W = weights.shape
    T = torch.zeros(N, A, num_fine + W, dtype=weights.dtype, device=weights.device)
    cols = starts.long()[..., None] + torch.arange(W, device=weights.device)
    T.scatter_(-1, cols, weights)
    return T[..., :num_fine]


def banded_resample_reference(
    f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """out[..., n, a] = sum_j weights[n, a, j] * f[..., n, starts[n, a] + j], via gathered windows.

    Args:
        f: (N, B) or (M, N, B).
        starts: (N, A) integer.
        weights: (N, A, W).

    Returns:
        (N, A) or (M, N, A) in the promoted dtype of f and weights; autograd works throughout.
    """
    N, _, W = weights.shape
    cols = starts.long()[..., None] + torch.arange(W, device=f.device)  # (N, A, W)
    rows = torch.arange(N, device=f.device)[:, None, None]
    windows = f[..., rows, cols]  # (..., N, A, W)
    return (windows * weights).sum(-1)


def dense_response_operator(
    x: torch.Tensor, c: torch.Tensor, response: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """T[n, a, b] = response(c[n, a] - x[b]) for every fine point, shape (N, A, B)."""
    return response(c[..., None] - x)
