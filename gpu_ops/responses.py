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
# (dr/dd, dr/dp) at offsets d for parameter p, as tensors broadcast like d.
Derivatives = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _gaussian(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(-0.5 * (d / params["sigma"]) ** 2)


def _boxcar(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return (d.abs() <= params["half_width"]).to(d.dtype)


def _triangle(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.clamp(1.0 - d.abs() / params["half_width"], min=0.0)


def _lorentzian(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return 1.0 / (1.0 + (d / params["gamma"]) ** 2)


# Analytic derivatives, the same formulas the C and Triton on-the-fly kernels evaluate.


def _d_gaussian(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = d / p
    r = torch.exp(-0.5 * u * u)
    return -u / p * r, u * u / p * r


def _d_boxcar(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    zero = torch.zeros_like(d)  # piecewise constant: zero almost everywhere
    return zero, zero


def _d_triangle(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    on = d.abs() < p
    zero = torch.zeros_like(d)
    return torch.where(on, -torch.sign(d) / p, zero), torch.where(on, d.abs() / (p * p), zero)


def _d_lorentzian(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = d / p
    q = 1.0 / (1.0 + u * u)
    return -2.0 * u * q * q / p, 2.0 * u * u * q * q / p


@dataclass(frozen=True)
class NamedResponse:
    """A named analytic response: its formula, parameter and how support scales with it."""

    name: str
    param: str
    evaluate: Evaluator
    default_support: float | None  # in units of the parameter; None: the parameter itself
    derivatives: Derivatives  # (dr/dd, dr/dparam)
    code: int  # the response's number in the compiled and Triton kernels

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
        NamedResponse("gaussian", "sigma", _gaussian, 4.0, _d_gaussian, 0),
        NamedResponse("boxcar", "half_width", _boxcar, None, _d_boxcar, 1),
        NamedResponse("triangle", "half_width", _triangle, None, _d_triangle, 2),
        NamedResponse("lorentzian", "gamma", _lorentzian, 10.0, _d_lorentzian, 3),
    )
}


def named(name: str) -> NamedResponse:
    """The named response ``name``; a ValueError lists the known names otherwise."""
    try:
        return NAMED[name]
    except KeyError:
        raise ValueError(f"unknown response {name!r}; known: {sorted(NAMED)}") from None


Response = Callable[[torch.Tensor], torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | str


@dataclass(frozen=True)
class Cut:
    """A response ready to evaluate: r(d), zero outside ``[lo, hi]``."""

    r: Callable[[torch.Tensor], torch.Tensor]
    lo: float
    hi: float


def parse_named(
    name: str, support: float | None, params: Mapping[str, float]
) -> tuple[NamedResponse, float]:
    """The named response ``name`` and its parameter's value, checked.

    Raises:
        ValueError: an unknown name, missing or extra parameters, a value <= 0, or a
            ``support`` for a compact response.
    """
    spec = named(name)
    if spec.param not in params or set(params) - {spec.param}:
        raise ValueError(f"{name!r} takes exactly one parameter {spec.param}=...")
    value = float(params[spec.param])
    if not value > 0:
        raise ValueError(f"{spec.param} must be > 0, got {value}")
    spec.half_width(value, support)  # refuses a support for a compact response
    return spec, value


def parse(
    response: Response,
    support: float | None,
    params: Mapping[str, float],
    device: torch.device,
) -> Cut:
    """Any accepted form of a response (see the module docstring) as a :class:`Cut`.

    Args:
        response: a name, a table ``(xs, ys)`` or a callable on offsets.
        support: a callable's half-width (required); a named response's cut in units of its
            parameter (optional); must be None for a table.
        params: the named response's parameter, e.g. ``{"sigma": 2.0}``; empty otherwise.
        device: where a table's tensors go.

    Raises:
        ValueError: a parameter or support that does not fit the response.
        TypeError: ``response`` is none of the accepted forms.
    """
    if isinstance(response, str):
        spec, value = parse_named(response, support, params)
        half = spec.half_width(value, support)
        p = {spec.param: torch.tensor(value, dtype=torch.float64, device=device)}
        return Cut(spec.bind(p), -half, half)
    if params:
        raise ValueError(f"unexpected parameters {sorted(params)} for this response")
    if isinstance(response, tuple):
        if support is not None:
            raise ValueError("a tabulated response implies its support; omit `support`")
        xs = torch.as_tensor(response[0]).to(device=device, dtype=torch.float64)
        ys = torch.as_tensor(response[1]).to(device=device, dtype=torch.float64)
        return Cut(tabulated(xs, ys), float(xs[0]), float(xs[-1]))
    if callable(response):
        if support is None or not support > 0:
            raise ValueError("a callable response needs `support` > 0 (its half-width)")
        return Cut(response, -float(support), float(support))
    raise TypeError(f"unsupported response {type(response).__name__}")


def check_grid(
    x: torch.Tensor, c: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B,) and c (N, A) as float64 on ``device``, checked.

    Raises:
        ValueError: x empty, not 1-D or not sorted; c not 2-D; values not finite.
    """
    x = torch.as_tensor(x).to(device=device, dtype=torch.float64).contiguous()
    c = torch.as_tensor(c).to(device=device, dtype=torch.float64)
    if x.ndim != 1 or x.numel() < 1:
        raise ValueError(f"x must be a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    if not bool((x[1:] >= x[:-1]).all()):
        raise ValueError("x must be sorted (non-decreasing)")
    if c.ndim != 2:
        raise ValueError(f"c must have shape (N, A), got {tuple(c.shape)}")
    if not bool(torch.isfinite(c).all()) or not bool(torch.isfinite(x).all()):
        raise ValueError("x and c must be finite")
    return x, c


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


def band_offsets(
    x: torch.Tensor,
    c: torch.Tensor,
    first: torch.Tensor,
    last: torch.Tensor,
    starts: torch.Tensor,
    W: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets ``d = c - x[starts + j]`` (N, A, W) in x's dtype and where they are inside.

    ``inside[n, a, j]`` is True where fine point ``starts + j`` is in the true window
    ``[first, last)``; the band's weights are exact zeros elsewhere. Differentiable in ``c``.
    """
    cols = starts[..., None] + torch.arange(W, device=x.device)  # (N, A, W)
    inside = (cols >= first[..., None]) & (cols < last[..., None])
    d = c[..., None].to(x.dtype) - x[cols.clamp(max=x.numel() - 1)]
    return d, inside


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
    d, inside = band_offsets(x, c, first, last, starts, W)
    vals = r(d)
    return torch.where(inside, vals, torch.zeros_like(vals))
