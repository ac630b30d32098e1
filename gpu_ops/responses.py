"""Response functions for the resamplers and the windows they cut.

A response r maps offsets ``d = c - x`` to weights and is zero outside ``[lo, hi]``. Three
forms are accepted: a callable with an explicit half-width ``support``; a table ``(xs, ys)``
interpolated linearly and zero outside ``[xs[0], xs[-1]]`` (may be asymmetric); or a name.
Named shapes have unit peak; each has a width parameter of its own and also accepts
``sigma``, its standard deviation (Elephant's convention, ``elephant.kernels``):

================  ===============================  ===========  ============  ==============
name              r(d), u = d / p                  parameter p  from sigma    support default
================  ===============================  ===========  ============  ==============
``gaussian``      ``exp(-u² / 2)``                 ``sigma``    sigma         4 sigma
``boxcar``        ``1`` for ``|u| <= 1``           half_width   √3 sigma      compact
``triangle``      ``max(0, 1 - |u|)``              half_width   √6 sigma      compact
``epanechnikov``  ``max(0, 1 - u²)``               half_width   √5 sigma      compact
``lorentzian``    ``1 / (1 + u²)``                 ``gamma``    (no sigma)    10 gamma
``laplacian``     ``exp(-|u|)``                    ``tau``      sigma / √2    5 sigma
``exponential``   ``exp(-u)`` for ``u >= 0``       ``tau``      sigma         5 sigma
``alpha``         ``u exp(1 - u)`` for ``u >= 0``  ``tau``      sigma / √2    5 sigma
================  ===============================  ===========  ============  ==============

``support`` is in units of the parameter passed (sigma when ``sigma=`` was given). The
exponential and alpha responses are causal (zero before the event); :class:`Options` says
how they are centred (by default on their median, as Elephant's ``center_kernel=True``),
normalised to unit area (``normalize``: x in seconds gives rates in Hz), scaled, and whether
each output is divided by the response's mass inside the recording (``border="correct"``,
Elephant's ``border_correction``). The cut of a centred response is ``[-support, support]``
around its centre, as Elephant cuts at ``cutoff`` sigmas around the median.

A table takes the same options: ``normalize`` divides by its area, ``center="median"`` or
``"peak"`` moves its median or its largest value to ``d = 0`` (by default a table is used as
given), ``border`` and ``scale`` as above. On the fly the ops take a table as
:class:`KernelResponse` says (:data:`TABULATED`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

Evaluator = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
# (dr/dd, dr/dp) at offsets d for parameter p, as tensors broadcast like d.
Derivatives = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# The fraction of a named shape's mass at offsets <= u * p (its normalised CDF in u).
Cdf = Callable[[torch.Tensor], torch.Tensor]


def _gaussian(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(-0.5 * (d / params["sigma"]) ** 2)


def _boxcar(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return (d.abs() <= params["half_width"]).to(d.dtype)


def _triangle(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.clamp(1.0 - d.abs() / params["half_width"], min=0.0)


def _lorentzian(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return 1.0 / (1.0 + (d / params["gamma"]) ** 2)


def _epanechnikov(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.clamp(1.0 - (d / params["half_width"]) ** 2, min=0.0)


def _laplacian(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(-d.abs() / params["tau"])


def _causal(d: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return torch.where(d >= 0, r, torch.zeros_like(r))


def _exponential(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return _causal(d, torch.exp(-d.clamp(min=0) / params["tau"]))


def _alpha(d: torch.Tensor, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    u = d.clamp(min=0) / params["tau"]
    return _causal(d, u * torch.exp(1.0 - u))


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


def _d_epanechnikov(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = d / p
    on = u.abs() < 1
    zero = torch.zeros_like(d)
    return torch.where(on, -2.0 * u / p, zero), torch.where(on, 2.0 * u * u / p, zero)


def _d_laplacian(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.exp(-d.abs() / p)
    return -torch.sign(d) / p * r, d.abs() / (p * p) * r


def _d_exponential(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = _causal(d, torch.exp(-d.clamp(min=0) / p))
    return -r / p, d.clamp(min=0) / (p * p) * r


def _d_alpha(d: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = d.clamp(min=0) / p
    e = _causal(d, torch.exp(1.0 - u))
    return (1.0 - u) * e / p, -u * (1.0 - u) * e / p


def _cdf_gaussian(u: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(u / math.sqrt(2.0)))


def _cdf_boxcar(u: torch.Tensor) -> torch.Tensor:
    return ((u + 1.0) / 2.0).clamp(0.0, 1.0)


def _cdf_triangle(u: torch.Tensor) -> torch.Tensor:
    t = u.clamp(-1.0, 1.0)
    return torch.where(t < 0, 0.5 * (1.0 + t) ** 2, 1.0 - 0.5 * (1.0 - t) ** 2)


def _cdf_epanechnikov(u: torch.Tensor) -> torch.Tensor:
    t = u.clamp(-1.0, 1.0)
    return 0.5 + 0.75 * (t - t**3 / 3.0)


def _cdf_lorentzian(u: torch.Tensor) -> torch.Tensor:
    return 0.5 + torch.atan(u) / math.pi


def _cdf_laplacian(u: torch.Tensor) -> torch.Tensor:
    return torch.where(
        u < 0, 0.5 * torch.exp(u.clamp(max=0)), 1.0 - 0.5 * torch.exp(-u.clamp(min=0))
    )


def _cdf_exponential(u: torch.Tensor) -> torch.Tensor:
    return 1.0 - torch.exp(-u.clamp(min=0))


def _cdf_alpha(u: torch.Tensor) -> torch.Tensor:
    t = u.clamp(min=0)
    return 1.0 - torch.exp(-t) * (1.0 + t)


# The median of the alpha shape u exp(1 - u) in units of tau: 1 - exp(-u) (1 + u) = 1/2.
ALPHA_MEDIAN = 1.6783469900166608


@dataclass(frozen=True)
class NamedResponse:
    """A named analytic response: its formula, parameter and how support scales with it.

    Attributes:
        name, param: the response's name and its width parameter's name (``p`` below).
        evaluate: r(d) with unit peak.
        default_support: the cut in units of p, None for a compact response (then the window
            is the response's own: ``|d| <= p``).
        derivatives: (dr/dd, dr/dp).
        code: the response's number in the compiled and Triton kernels.
        sigma_ratio: ``p = sigma_ratio * sigma`` (None: no finite standard deviation).
        area: the integral of r over d, in units of p (unit area: divide by ``area * p``).
        cdf: the fraction of r's mass at offsets ``<= u * p``.
        causal: zero for ``d < 0``; the window is then ``[0, support * p]``.
        median, mode: where half the mass lies before, and the peak, in units of p.
    """

    name: str
    param: str
    evaluate: Evaluator
    default_support: float | None
    derivatives: Derivatives
    code: int
    sigma_ratio: float | None
    area: float
    cdf: Cdf
    causal: bool = False
    median: float = 0.0
    mode: float = 0.0

    def bind(self, params: Mapping[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """r(d) with the parameter fixed to ``params[self.param]``."""
        return lambda d: self.evaluate(d, params)

    def extent(self, support: float | None) -> float:
        """The window's length from the origin in units of p (the op's ``support``)."""
        if self.default_support is None:
            if support is not None:
                raise ValueError(f"{self.name!r} has a compact support; do not pass `support`")
            return 1.0
        return self.default_support if support is None else support

    def window(self, value: float, support: float | None) -> tuple[float, float]:
        """``(lo, hi)``, the offsets the window of parameter ``value`` reaches, in units of x."""
        hi = self.extent(support) * value
        return (0.0 if self.causal else -hi), hi

    @property
    def tie_ends(self) -> tuple[bool, bool]:
        """Which ends of the window count an offset exactly there whatever its rounding
        (:func:`inclusive`): a cut where the response goes on (not a compact response's own
        end, where it drops to 0 or jumps, nor a causal response's start)."""
        cut = self.default_support is not None
        return cut and not self.causal, cut


_SQRT2 = math.sqrt(2.0)
NAMED: dict[str, NamedResponse] = {
    r.name: r
    for r in (
        NamedResponse("gaussian", "sigma", _gaussian, 4.0, _d_gaussian, 0, 1.0,
                      math.sqrt(2 * math.pi), _cdf_gaussian),
        NamedResponse("boxcar", "half_width", _boxcar, None, _d_boxcar, 1, math.sqrt(3.0),
                      2.0, _cdf_boxcar),
        NamedResponse("triangle", "half_width", _triangle, None, _d_triangle, 2,
                      math.sqrt(6.0), 1.0, _cdf_triangle),
        NamedResponse("lorentzian", "gamma", _lorentzian, 10.0, _d_lorentzian, 3, None,
                      math.pi, _cdf_lorentzian),
        NamedResponse("laplacian", "tau", _laplacian, 5.0 * _SQRT2, _d_laplacian, 4,
                      1.0 / _SQRT2, 2.0, _cdf_laplacian),
        NamedResponse("exponential", "tau", _exponential, 5.0, _d_exponential, 5, 1.0, 1.0,
                      _cdf_exponential, causal=True, median=math.log(2.0)),
        NamedResponse("alpha", "tau", _alpha, 5.0 * _SQRT2, _d_alpha, 6, 1.0 / _SQRT2, math.e,
                      _cdf_alpha, causal=True, median=ALPHA_MEDIAN, mode=1.0),
        NamedResponse("epanechnikov", "half_width", _epanechnikov, None, _d_epanechnikov, 7,
                      math.sqrt(5.0), 4.0 / 3.0, _cdf_epanechnikov),
    )
}  # fmt: skip


# Piecewise polynomial responses (the prefix-sum path): breakpoints in u = d / p and, per
# piece, the coefficients of 1, u, u².
PIECES: dict[str, tuple[tuple[float, ...], tuple[tuple[float, float, float], ...]]] = {
    "boxcar": ((-1.0, 1.0), ((1.0, 0.0, 0.0),)),
    "triangle": ((-1.0, 0.0, 1.0), ((1.0, 1.0, 0.0), (1.0, -1.0, 0.0))),
    "epanechnikov": ((-1.0, 1.0), ((1.0, 0.0, -1.0),)),
}


def pieces(name: str, p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A piecewise polynomial response's pieces at parameter p: breakpoints ``t (P + 1,)`` in
    offsets d, increasing, and ``coef (P, 3)``, ``r(d) = coef[k] . (1, d, d²)`` for d in
    ``[t[k], t[k + 1]]`` (float64); None for other responses."""
    if name not in PIECES:
        return None
    breaks, coefs = PIECES[name]
    t = torch.tensor(breaks, dtype=torch.float64) * p
    scale = torch.tensor([1.0, 1.0 / p, 1.0 / (p * p)], dtype=torch.float64)
    return t, torch.tensor(coefs, dtype=torch.float64) * scale


def named(name: str) -> NamedResponse:
    """The named response ``name``; a ValueError lists the known names otherwise."""
    try:
        return NAMED[name]
    except KeyError:
        raise ValueError(f"unknown response {name!r}; known: {sorted(NAMED)}") from None


Response = Callable[[torch.Tensor], torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | str
CENTERS = ("median", "peak", "none")
TABULATED = "tabulated"  # the on-the-fly ops' name for a table (see :class:`KernelResponse`)
TABLE_CODE = 8  # a table's number in the compiled and Triton kernels
BORDERS = ("none", "correct")


@dataclass(frozen=True)
class Options:
    """How a response is centred, normalised, scaled and corrected at the borders.

    Attributes:
        normalize: unit area in x's units (x in seconds: spikes give rates in Hz).
        center: where a causal response's or a table's origin goes: ``"median"``
            (Elephant's ``center_kernel=True``: half its mass before the event, half after),
            ``"peak"`` (its mode: a table's largest value) or ``"none"`` (the event: strictly
            causal; a table as given). None (the default): ``"median"`` for a named response,
            ``"none"`` for a table. Symmetric named responses are centred in every case;
            callables are used as given.
        border: ``"correct"`` divides each output by the fraction of the (cut) response's
            mass inside the recording, as Elephant's ``border_correction`` does (without its
            rescaling of each train to its spike count, which depends on the data).
        scale: a constant factor.
        recording: ``(start, stop)`` of the recording for ``border``; default: x's points
            are the starts of equal bins, ``(x[0], x[-1] + (x[-1] - x[-2]))``.
    """

    normalize: bool = False
    center: str | None = None
    border: str = "none"
    scale: float = 1.0
    recording: tuple[float, float] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.center is not None and self.center not in CENTERS:
            raise ValueError(f"center must be one of {CENTERS}, got {self.center!r}")
        if self.border not in BORDERS:
            raise ValueError(f"border must be one of {BORDERS}, got {self.border!r}")
        if not math.isfinite(self.scale) or self.scale == 0:
            raise ValueError(f"scale must be finite and non-zero, got {self.scale}")
        if self.recording is not None:
            a, b = (float(v) for v in self.recording)
            if not (math.isfinite(a) and math.isfinite(b) and a < b):
                raise ValueError(
                    f"recording must be (start, stop) with start < stop, got {self.recording}"
                )

    def bounds(self, x: torch.Tensor) -> tuple[float, float]:
        """The recording's ``(start, stop)`` for the fine grid x (B,)."""
        if self.recording is not None:
            return float(self.recording[0]), float(self.recording[1])
        step = float(x[-1] - x[-2]) if x.numel() > 1 else 0.0
        return float(x[0]), float(x[-1]) + step


@dataclass(frozen=True)
class Shape:
    """A named response with its parameter, cut and options resolved.

    The kernels see the response at its own origin, with coarse points moved by ``shift * p``
    (``c + shift * p``) and the window ``[lo, hi] = spec.window(p, support)``; the output is
    then multiplied by :meth:`gain` and, with ``border="correct"``, divided by :meth:`mass`.
    """

    spec: NamedResponse
    value: float  # p, the native parameter
    support: float | None  # the op's support (see NamedResponse.extent), in units of p
    shift: float  # in units of p
    options: Options
    cut: float | None = None  # the support as given, in units of p (None: the default)

    @property
    def plain(self) -> bool:
        """No shift, gain or border correction: the kernels' output is the result."""
        o = self.options
        return self.shift == 0 and o.scale == 1 and not o.normalize and o.border == "none"

    def gain(self, p: torch.Tensor) -> torch.Tensor:
        """The output's factor: ``scale``, over ``area * p`` when normalised (0-d, like p)."""
        g = torch.full_like(p, self.options.scale)
        return g / (self.spec.area * p) if self.options.normalize else g

    def window(self, value: float) -> tuple[float, float]:
        """The op's window (offsets from the moved coarse points), in units of x."""
        return self.spec.window(value, self.support)

    def mass(self, x: torch.Tensor, c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """(N, A): the fraction of the cut response's mass inside the recording at each c."""
        start, stop = self.options.bounds(x)
        lo, hi = (v / self.value for v in self.window(self.value))
        cs = c + self.shift * p
        u0 = ((cs - stop) / p).clamp(min=lo, max=hi)
        u1 = ((cs - start) / p).clamp(min=lo, max=hi)
        F = self.spec.cdf
        total = F(torch.tensor(hi, dtype=p.dtype)) - F(torch.tensor(lo, dtype=p.dtype))
        return (F(u1) - F(u0)) / total.to(p.device)

    def inverse_mass(self, x: torch.Tensor, c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """(N, A): 1 / :meth:`mass`, 0 where the response misses the recording entirely."""
        m = self.mass(x, c.to(p.dtype), p)
        return torch.where(m > 0, 1.0 / m.clamp(min=1e-300), torch.zeros_like(m))

    def apply(
        self, out: torch.Tensor, x: torch.Tensor, c: torch.Tensor, p: torch.Tensor
    ) -> torch.Tensor:
        """``out (..., N, A)`` times the gain, divided by the mass inside with ``border``."""
        out = out * self.gain(p).to(out.dtype)
        if self.options.border == "correct":
            out = out * self.inverse_mass(x, c, p).to(out.dtype)
        return out

    def evaluate(self, d: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The full response at offsets ``d = c - x`` (gain included, border not)."""
        r = self.spec.evaluate(d + self.shift * p, {self.spec.param: p})
        return r * self.gain(p).to(r.dtype)


@dataclass(frozen=True)
class Cut:
    """A response ready to evaluate: r(d), zero outside ``[lo, hi]``; with ``factor``, each
    coarse point's weights are multiplied by ``factor(c)`` (N, A) (border correction)."""

    r: Callable[[torch.Tensor], torch.Tensor]
    lo: float
    hi: float
    factor: Callable[[torch.Tensor], torch.Tensor] | None = None


def parse_named(
    name: str, support: float | None, params: Mapping[str, float], options: Options | None = None
) -> Shape:
    """The named response ``name`` with its parameter and options, checked.

    Args:
        name: a name from :data:`NAMED`.
        support: the cut in units of the parameter given (sigma's when ``sigma=``), around
            the response's centre; None: the default (must be None for compact responses).
        params: exactly one of the response's own parameter and ``sigma``.
        options: centring, normalisation, scale, border correction (default: none of them;
            causal responses centred on their median).

    Raises:
        ValueError: an unknown name, missing or extra parameters, a value <= 0, a
            ``support`` for a compact response, or ``sigma`` for the lorentzian.
    """
    spec = named(name)
    opts = options or Options()
    accepted = {spec.param, "sigma"} if spec.sigma_ratio is not None else {spec.param}
    if len(params) != 1 or not set(params) <= accepted:
        names = " or ".join(f"{k}=..." for k in sorted(accepted))
        raise ValueError(f"{name!r} takes exactly one parameter: {names}")
    ((key, given),) = params.items()
    given = float(given)
    if not given > 0 or not math.isfinite(given):
        raise ValueError(f"{key} must be finite and > 0, got {given}")
    ratio = spec.sigma_ratio if key == "sigma" and key != spec.param else 1.0
    assert ratio is not None
    value = given * ratio
    if support is not None and not (support > 0 and math.isfinite(support)):
        raise ValueError(f"support must be finite and > 0, got {support}")
    cut = None if support is None else float(support) / ratio
    spec.extent(cut)  # refuses a support for a compact response
    shift = 0.0
    given_cut = cut
    if spec.causal:
        shift = {"median": spec.median, "peak": spec.mode, "none": 0.0}[opts.center or "median"]
        cut = spec.extent(cut) + shift
    return Shape(spec, value, cut, shift, opts, given_cut)


def _table_cdf(xs: torch.Tensor, ys: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The integral of the linear interpolation of (xs, ys) from xs[0] to d (any shape)."""
    seg = 0.5 * (ys[1:] + ys[:-1]) * (xs[1:] - xs[:-1])
    cum = torch.cat([seg.new_zeros(1), torch.cumsum(seg, 0)])

    def area(d: torch.Tensor) -> torch.Tensor:
        t = d.clamp(float(xs[0]), float(xs[-1]))
        i = torch.searchsorted(xs, t.detach().contiguous(), right=True).clamp(1, xs.numel() - 1)
        x0, y0 = xs[i - 1], ys[i - 1]
        slope = (ys[i] - y0) / (xs[i] - x0)
        h = t - x0
        return cum[i - 1] + h * (y0 + 0.5 * slope * h)

    return area


def _table_median(xs: torch.Tensor, ys: torch.Tensor) -> float:
    """Where a non-negative table's integral reaches half its area (float64, on the CPU)."""
    xs, ys = xs.cpu(), ys.cpu()
    seg = 0.5 * (ys[1:] + ys[:-1]) * (xs[1:] - xs[:-1])
    cum = torch.cumsum(seg, 0)
    half = float(cum[-1]) / 2
    k = int(torch.searchsorted(cum, torch.tensor([half], dtype=cum.dtype)))  # first cum >= half
    rest = half - (float(cum[k - 1]) if k > 0 else 0.0)  # area still needed inside segment k
    x0, y0 = float(xs[k]), float(ys[k])
    slope = (float(ys[k + 1]) - y0) / (float(xs[k + 1]) - x0)
    # h (y0 + slope h / 2) = rest: the root in [0, xs[k + 1] - x0], written without
    # cancellation (y0 >= 0, rest > 0, and the segment's area is at least rest).
    root = math.sqrt(max(y0 * y0 + 2.0 * slope * rest, 0.0))
    return x0 + 2.0 * rest / (y0 + root)


@dataclass(frozen=True)
class Table:
    """A tabulated response, checked and centred: linear between its points, 0 outside.

    Attributes:
        xs, ys: (K,) float64, the breakpoints (moved by the centring: the given ones minus
            ``shift``) and the values as given.
        shift: how far the breakpoints moved (the table's median or peak; 0 as given).
        area: the table's integral (over d, in x's units).
        options: see :class:`Options`.
    """

    xs: torch.Tensor
    ys: torch.Tensor
    shift: float
    area: float
    options: Options

    @property
    def plain(self) -> bool:
        """No gain or border correction: the kernels' output is the result."""
        o = self.options
        return o.scale == 1 and not o.normalize and o.border == "none"

    @property
    def gain(self) -> float:
        """The output's factor: ``scale``, over the area when normalised."""
        o = self.options
        return o.scale / self.area if o.normalize else o.scale

    def window(self) -> tuple[float, float]:
        """``(lo, hi)``: the offsets ``d = c - x`` the table reaches (its first and last xs)."""
        return float(self.xs[0]), float(self.xs[-1])

    def given(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table as it was given (float64): what ``save`` writes."""
        return self.xs + self.shift, self.ys

    def evaluate(self, d: torch.Tensor) -> torch.Tensor:
        """The table at offsets d, gain included (border not)."""
        return interpolate(self.xs, self.ys, d) * self.gain

    def inverse_mass(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """(N, A): 1 / the fraction of the table's area inside the recording at each c,
        0 where the table misses the recording entirely (``border="correct"``)."""
        start, stop = self.options.bounds(x)
        cdf = _table_cdf(self.xs, self.ys)
        c64 = c.detach().to(torch.float64)
        m = (cdf(c64 - start) - cdf(c64 - stop)) / self.area
        return torch.where(m > 0, 1.0 / m.clamp(min=1e-300), torch.zeros_like(m))


def parse_table(
    response: tuple[torch.Tensor, torch.Tensor], options: Options, device: torch.device
) -> Table:
    """A table ``(xs, ys)`` with its options, checked and centred.

    Raises:
        ValueError: xs and ys not 1-D of one length >= 2, xs not strictly increasing, values
            not finite; ``normalize``, ``border`` or ``center="median"`` on a table whose area
            is not positive; ``center="median"`` on a table with negative values (its
            integral is then not monotone: no one median).
    """
    xs = torch.as_tensor(response[0]).to(device=device, dtype=torch.float64)
    ys = torch.as_tensor(response[1]).to(device=device, dtype=torch.float64)
    check_table(xs, ys)
    if not bool(torch.isfinite(xs).all() & torch.isfinite(ys).all()):
        raise ValueError("a tabulated response needs finite xs and ys")
    area = float(_table_cdf(xs, ys)(xs[-1:])[0])
    center = options.center or "none"
    if (options.normalize or options.border != "none" or center == "median") and not area > 0:
        raise ValueError("normalize, border and center='median' need a table with a positive area")
    shift = 0.0
    if center == "median":
        if bool((ys < 0).any()):
            raise ValueError("center='median' needs a table without negative values")
        shift = _table_median(xs, ys)
    elif center == "peak":
        shift = float(xs[int(torch.argmax(ys))])
    return Table(xs - shift, ys, shift, area, options)


@dataclass(frozen=True)
class KernelResponse:
    """The response the on-the-fly ops evaluate, from their ``response`` and ``param``.

    ``response`` is a name from :data:`NAMED` with ``param`` its parameter (0-d), or
    :data:`TABULATED` with ``param`` the table ``(2, K)``: its breakpoints (strictly
    increasing, the offsets ``d = c - x``) then its values, linear between them, 0 outside.
    A table has no width: the ops give it no gradient.
    """

    name: str
    param: torch.Tensor

    @property
    def tabulated(self) -> bool:
        return self.name == TABULATED

    @property
    def code(self) -> int:
        """The response's number in the compiled and Triton kernels."""
        return TABLE_CODE if self.tabulated else named(self.name).code

    @property
    def value(self) -> float:
        """The named response's parameter; 0 for a table (the kernels do not read it)."""
        return 0.0 if self.tabulated else float(self.param)

    def window(self, support: float | None) -> tuple[float, float]:
        """``(lo, hi)`` in x's units: the named response's cut, the table's ends.

        A float32 parameter knows its cut only to float32's precision: the ends in
        :attr:`tie_ends` are widened by that (2 ulp), so that an offset exactly at the cut as
        given (a spike exactly 5 sigma away) counts in float32 as in float64 (see
        :func:`inclusive`).
        """
        if self.tabulated:
            return float(self.param[0, 0]), float(self.param[0, -1])
        lo, hi = named(self.name).window(float(self.param), support)
        if self.param.dtype == torch.float64:
            return lo, hi
        tol = 2 * torch.finfo(self.param.dtype).eps * max(abs(lo), abs(hi))
        widen_lo, widen_hi = self.tie_ends
        return lo - tol * widen_lo, hi + tol * widen_hi

    @property
    def tie_ends(self) -> tuple[bool, bool]:
        """See :attr:`NamedResponse.tie_ends`; a table's ends: neither."""
        return (False, False) if self.tabulated else named(self.name).tie_ends

    def evaluate(self, d: torch.Tensor) -> torch.Tensor:
        """r(d), in d's dtype (unit peak for a named response, the values for a table)."""
        p = self.param.to(d.dtype)
        if self.tabulated:
            return interpolate(p[0], p[1], d)
        spec = named(self.name)
        return spec.evaluate(d, {spec.param: p})

    def derivatives(self, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dr/dd, dr/dparam) at d, in d's dtype; a table's slope and zeros."""
        p = self.param.to(d.dtype)
        if self.tabulated:
            return slope(p[0], p[1], d), torch.zeros_like(d)
        return named(self.name).derivatives(d, p)


def parse(
    response: Response,
    support: float | None,
    params: Mapping[str, float],
    device: torch.device,
    options: Options | None = None,
    x: torch.Tensor | None = None,
) -> Cut:
    """Any accepted form of a response (see the module docstring) as a :class:`Cut`.

    Args:
        response: a name, a table ``(xs, ys)`` or a callable on offsets.
        support: a callable's half-width (required); a named response's cut in units of its
            parameter (optional); must be None for a table.
        params: the named response's parameter, e.g. ``{"sigma": 2.0}``; empty otherwise.
        device: where a table's tensors go.
        options: see :class:`Options`; a callable takes only ``scale``.
        x: (B,) float64 fine grid: needed for ``border="correct"`` (the recording).

    Raises:
        ValueError: a parameter, support or option that does not fit the response.
        TypeError: ``response`` is none of the accepted forms.
    """
    opts = options or Options()
    if isinstance(response, str):
        shape = parse_named(response, support, params, opts)
        p = torch.tensor(shape.value, dtype=torch.float64, device=device)
        lo, hi = shape.window(shape.value)
        s = shape.shift * shape.value
        factor = None
        if opts.border == "correct":
            assert x is not None
            grid = x

            def factor(c: torch.Tensor) -> torch.Tensor:
                return shape.inverse_mass(grid, c, p)

        return Cut(lambda d: shape.evaluate(d, p), lo - s, hi - s, factor)
    if params:
        raise ValueError(f"unexpected parameters {sorted(params)} for this response")
    if isinstance(response, tuple):
        if support is not None:
            raise ValueError("a tabulated response implies its support; omit `support`")
        table = parse_table(response, opts, device)
        lo, hi = table.window()
        table_factor = None
        if opts.border == "correct":
            assert x is not None
            grid = x

            def table_factor(c: torch.Tensor) -> torch.Tensor:
                return table.inverse_mass(grid, c)

        return Cut(table.evaluate, lo, hi, table_factor)
    if opts.center not in (None, "none"):
        raise ValueError(
            "center applies to named and tabulated responses; a callable is used as given"
        )
    if callable(response):
        if support is None or not support > 0:
            raise ValueError("a callable response needs `support` > 0 (its half-width)")
        if opts.normalize or opts.border != "none":
            raise ValueError("normalize and border need a named or tabulated response (its area)")
        scale = opts.scale
        return Cut(lambda d: response(d) * scale, -float(support), float(support))
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


def check_table(xs: torch.Tensor, ys: torch.Tensor) -> None:
    """Raise ValueError unless xs and ys are 1-D of one length >= 2 and xs strictly increases."""
    if xs.ndim != 1 or ys.shape != xs.shape or xs.numel() < 2:
        raise ValueError(
            f"a tabulated response needs 1-D xs and ys of equal length >= 2, got "
            f"{tuple(xs.shape)} and {tuple(ys.shape)}"
        )
    if not bool((xs[1:] > xs[:-1]).all()):
        raise ValueError("a tabulated response needs strictly increasing xs")


def _segment(xs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Per offset, the index i of its segment ``[xs[i - 1], xs[i]]`` (1 <= i < K)."""
    return torch.searchsorted(xs, d.detach().contiguous()).clamp(1, xs.numel() - 1)


def interpolate(xs: torch.Tensor, ys: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The table (xs, ys) at offsets d: linear between its points, 0 outside ``[xs[0],
    xs[-1]]`` (no checks; xs, ys in d's dtype and device)."""
    i = _segment(xs, d)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = ys[i - 1], ys[i]
    val = y0 + (y1 - y0) * (d - x0) / (x1 - x0)
    return torch.where((d >= xs[0]) & (d <= xs[-1]), val, torch.zeros_like(val))


def slope(xs: torch.Tensor, ys: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """dr/dd of the table (xs, ys) at offsets d: its segment's slope inside, 0 outside."""
    i = _segment(xs, d)
    val = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    return torch.where((d >= xs[0]) & (d <= xs[-1]), val, torch.zeros_like(val))


def tabulated(xs: torch.Tensor, ys: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """r(d) by linear interpolation of ``ys`` at ``xs`` (sorted, >= 2 points), 0 outside."""
    check_table(xs, ys)
    return lambda d: interpolate(xs.to(d), ys.to(d), d)


def inclusive(
    x: torch.Tensor, c: torch.Tensor, lo: float, hi: float, ties: tuple[bool, bool] = (True, True)
) -> tuple[float, float]:
    """The cut ``[lo, hi]``, its ends named in ``ties`` widened by the rounding of the offsets
    ``c - x`` and of the cut.

    An offset that equals a cut in exact arithmetic (a spike exactly 5 sigma, a whole number
    of fine steps, from a coarse point) then counts whichever way the float64 roundings of
    ``c - x``, of ``c - hi`` and of ``hi`` fell, as Elephant's kernel array includes its ends.
    Without it such a tie fell either way (by 1 ulp), leaving out a spike whose weight at a
    causal response's far end is a few thousandths of its peak. The widening, 8 ulp of the
    largest magnitude involved, moves no offset that is not a tie. Only where the response
    goes on past the cut (:attr:`NamedResponse.tie_ends`): at a compact response's own end or
    a causal start the value at the rounded offset decides, as before.
    """
    tol = float(_tolerance(x, c, lo, hi))
    return lo - tol * ties[0], hi + tol * ties[1]


def _tolerance(x: torch.Tensor, c: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """0-d: 8 ulp of float64 at the largest magnitude of x, c and the cut (tensor ops only:
    no host sync on CUDA, and it runs on meta tensors)."""
    scale = torch.tensor(max(abs(lo), abs(hi)), dtype=torch.float64, device=x.device)
    if x.numel():
        scale = scale + x[[0, -1]].detach().abs().amax().to(torch.float64)
    if c.numel():
        scale = scale + c.detach().abs().amax().to(torch.float64)
    return 8 * torch.finfo(torch.float64).eps * scale


def windows(
    x: torch.Tensor, c: torch.Tensor, lo: float, hi: float, ties: tuple[bool, bool] = (False, False)
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The fine points each coarse point reaches: ``lo <= c - x[b] <= hi``, at the ends named
    in ``ties`` a tie counted whichever way its rounding fell (:func:`inclusive`).

    Args:
        x: (B,) sorted fine grid.
        c: (N, A) coarse points.
        lo, hi: the response's support, ``lo <= hi``.
        ties: (lo's, hi's): whether that end counts a tie (:attr:`NamedResponse.tie_ends`).

    Returns:
        ``first (N, A)`` and ``last (N, A)`` int64 (the window is ``[first, last)``, empty when
        equal) and the band width W (the longest window, at least 1, at most B).
    """
    first, last = bounds(x, c, lo, hi, ties)
    W = int((last - first).max().item()) if c.numel() else 1
    return first, last, min(max(W, 1), x.numel())


def bounds(
    x: torch.Tensor, c: torch.Tensor, lo: float, hi: float, ties: tuple[bool, bool] = (False, False)
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`windows` without the band width: ``first, last (N, A)`` int64, no host sync."""
    c_ = c.detach().to(x.dtype).contiguous()
    if any(ties):
        tol = _tolerance(x, c_, lo, hi).to(x.dtype)
        first = torch.searchsorted(x, c_ - (hi + tol * ties[1]), side="left")
        last = torch.searchsorted(x, c_ - (lo - tol * ties[0]), side="right")
    else:
        first = torch.searchsorted(x, c_ - hi, side="left")
        last = torch.searchsorted(x, c_ - lo, side="right")
    return first, last


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
