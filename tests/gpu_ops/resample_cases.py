"""Random problems and the float64 dense reference shared by the resample and op tests."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch

from gpu_ops._reference import dense_response_operator

_EXP_SHIFT = math.log(2.0) * 1.2  # the exponential's median (tau = 1.2)
_ALPHA_SHIFT = 1.6783469900166608 * 0.9  # the alpha's median (tau = 0.9)


def _alpha(d: torch.Tensor) -> torch.Tensor:
    u = (d + _ALPHA_SHIFT) / 0.9
    return u * torch.exp(1 - u) * ((u >= 0) & (d <= 5 * math.sqrt(2) * 0.9))


# Named response -> (its parameter, the same response written densely, cut where it is cut by
# default: causal responses centred on their median, cut at 5 sigma around it).
RESPONSES: dict[str, tuple[dict[str, float], Callable[[torch.Tensor], torch.Tensor]]] = {
    "gaussian": ({"sigma": 1.5}, lambda d: torch.exp(-0.5 * (d / 1.5) ** 2) * (d.abs() <= 6.0)),
    "boxcar": ({"half_width": 2.5}, lambda d: (d.abs() <= 2.5).double()),
    "triangle": ({"half_width": 3.0}, lambda d: (1 - d.abs() / 3.0).clamp(min=0)),
    "lorentzian": ({"gamma": 0.7}, lambda d: (d.abs() <= 7.0) / (1 + (d / 0.7) ** 2)),
    "laplacian": (
        {"tau": 0.8},
        lambda d: torch.exp(-d.abs() / 0.8) * (d.abs() <= 5 * math.sqrt(2) * 0.8),
    ),
    "exponential": (
        {"tau": 1.2},
        lambda d: torch.exp(-(d + _EXP_SHIFT) / 1.2) * ((d >= -_EXP_SHIFT) & (d <= 6.0)),
    ),
    "alpha": ({"tau": 0.9}, _alpha),
    "epanechnikov": ({"half_width": 2.0}, lambda d: (1 - (d / 2.0) ** 2).clamp(min=0)),
}

PARAMS = {name: params for name, (params, _) in RESPONSES.items()}


def grid(B: int, gen: torch.Generator) -> torch.Tensor:
    """An uneven sorted fine grid on [0, 100]."""
    return torch.sort(torch.rand(B, generator=gen, dtype=torch.float64) * 100).values


def coarse(N: int, A: int, gen: torch.Generator) -> torch.Tensor:
    """Unsorted coarse points that reach past both grid edges (clipped windows)."""
    return torch.rand(N, A, generator=gen, dtype=torch.float64) * 120 - 10


def dense_ref(
    x: torch.Tensor, c: torch.Tensor, r: Callable[[torch.Tensor], torch.Tensor], f: torch.Tensor
) -> torch.Tensor:
    """The users' computation in float64: T = r(c - x) densely, then an einsum."""
    T = dense_response_operator(x, c, r).double()
    return torch.einsum("nab,...nb->...na", T, f.double())


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """out == ref to ``rtol`` of the output's scale (an isolated near-zero sum cannot meet
    rtol alone)."""
    scale = ref.abs().max().clamp(min=1e-12)
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=rtol * float(scale))


def seed(*parts: object) -> int:
    """A seed from a test's parameters, the same in every process (``hash`` of a string is
    salted per process: a failure it drew would not come back)."""
    return zlib.crc32(repr(parts).encode())
