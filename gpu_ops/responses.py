"""Response functions for :class:`gpu_ops.BandedResampler` and the windows they cut.

A response r maps offsets ``d = c - x`` to weights and is zero outside ``[lo, hi]``. Three
forms are accepted: a callable with an explicit half-width ``support``; a table ``(xs, ys)``
interpolated linearly and zero outside ``[xs[0], xs[-1]]`` (may be asymmetric); or a name:

==============  ==========================================  ==========  ======================
name            r(d)                                        parameter   support (default)
==============  ==========================================  ==========  ======================
``gaussian``    ``exp(-d² / (2 sigma²))``                   ``sigma``   in sigmas (4.0)
``boxcar``      ``1`` for ``|d| <= half_width``             half_width  ``half_width``
``triangle``    ``max(0, 1 - |d| / half_width)``            half_width  ``half_width``
``lorentzian``  ``1 / (1 + (d / gamma)²)``                  ``gamma``   in gammas (10.0)
==============  ==========================================  ==========  ======================

Named shapes have unit peak; scale the weights (or the output) for another normalisation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Evaluator = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


def _gaussian(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(-0.5 * (d / params["sigma"]) ** 2)


def _boxcar(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return (d.abs() <= params["half_width"]).to(d.dtype)


def _triangle(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.clamp(1.0 - d.abs() / params["half_width"], min=0.0)


def _lorentzian(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return 1.0 / (1.0 + (d / params["gamma"]) ** 2)


@dataclass(frozen=True)
class NamedResponse:
    """A named analytic response: its formula, parameter and how support scales with it."""

    name: str
    param: str
    evaluate: Evaluator
    default_support: float | None  # in units of the parameter; None: the parameter itself

    def bind(self, params: Mapping[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """r(d) with the parameter fixed to ``params[self.param]``."""
        return lambda d: self.evaluate(d, params)

    def half_width(self, value: float, support: float | None) -> float:
        """Half-width of the window in units of x for parameter ``value``."""
        if self.default_support is None:
            if support is not None:
                raise ValueError(f"{self.name!r} has a compact support; do not pass `support`")
            return value
        return (self.default_support if support is None else support) * value


NAMED: dict[str, NamedResponse] = {
    r.name: r
    for r in (
        NamedResponse("gaussian", "sigma", _gaussian, 4.0),
        NamedResponse("boxcar", "half_width", _boxcar, None),
        NamedResponse("triangle", "half_width", _triangle, None),
        NamedResponse("lorentzian", "gamma", _lorentzian, 10.0),
    )
}


def named(name: str) -> NamedResponse:
    """The named response ``name``; a ValueError lists the known names otherwise."""
    try:
        return NAMED[name]
    except KeyError:
        raise ValueError(f"unknown response {name!r}; known: {sorted(NAMED)}") from None


def tabulated(xs: torch.Tensor, ys: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """r(d) by linear interpolation of ``ys`` at ``xs`` (sorted, >= 2 points), 0 outside."""
    if xs.ndim != 1 or ys.shape != xs.shape or xs.numel() < 2:
        raise ValueError(
            f"a tabulated response needs 1-D xs and ys of equal length >= 2, got "
            f"{tuple(xs.shape)} and {tuple(ys.shape)}"
        )
    if not bool((xs[1:] > xs[:-1]).all()):
        raise ValueError("a tabulated response needs strictly increasing xs")

    def r(d: torch.Tensor) -> torch.Tensor:
        t_x = xs.to(d)
        t_y = ys.to(d)
        i = torch.searchsorted(t_x, d.detach().contiguous()).clamp(1, t_x.numel() - 1)
        x0, x1 = t_x[i - 1], t_x[i]
        y0, y1 = t_y[i - 1], t_y[i]
        val = y0 + (y1 - y0) * (d - x0) / (x1 - x0)
        return torch.where((d >= t_x[0]) & (d <= t_x[-1]), val, torch.zeros_like(val))

    return r


def windows(
    x: torch.Tensor, c: torch.Tensor, lo: float, hi: float
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The fine points each coarse point reaches: ``lo <= c - x[b] <= hi``.

    Args:
        x: (B,) sorted fine grid.
        c: (N, A) coarse points.
        lo, hi: the response's support, ``lo <= hi``.

    Returns:
        ``first (N, A)`` and ``last (N, A)`` int64 (the window is ``[first, last)``, empty when
        equal) and the band width W (the longest window, at least 1, at most B).
    """
    c_ = c.detach().to(x.dtype).contiguous()
    first = torch.searchsorted(x, c_ - hi, side="left")
    last = torch.searchsorted(x, c_ - lo, side="right")
    W = int((last - first).max().item()) if c.numel() else 1
    return first, last, min(max(W, 1), x.numel())


def clipped_starts(first: torch.Tensor, W: int, B: int) -> torch.Tensor:
    """Window starts moved inside ``[0, B - W]`` so a W-wide window never leaves the grid."""
    return first.clamp(0, B - W)


def evaluate_band(
    x: torch.Tensor,
    c: torch.Tensor,
    r: Callable[[torch.Tensor], torch.Tensor],
    first: torch.Tensor,
    last: torch.Tensor,
    starts: torch.Tensor,
    W: int,
) -> torch.Tensor:
    """weights (N, A, W) = r(c - x[starts + j]) inside each true window, exact zeros outside.

    Differentiable in ``c`` and in whatever ``r`` closes over.
    """
    cols = starts[..., None] + torch.arange(W, device=x.device)  # (N, A, W)
    inside = (cols >= first[..., None]) & (cols < last[..., None])
    d = c[..., None].to(x.dtype) - x[cols.clamp(max=x.numel() - 1)]
    vals = r(d)
    return torch.where(inside, vals, torch.zeros_like(vals))
