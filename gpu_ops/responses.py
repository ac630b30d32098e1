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
BORDERS = ("none", "correct")


@dataclass(frozen=True)
class Options:
    """How a response is centred, normalised, scaled and corrected at the borders.

    Attributes:
        normalize: unit area in x's units (x in seconds: spikes give rates in Hz).
        center: where a causal response's origin goes: ``"median"`` (Elephant's
            ``center_kernel=True``: half its mass before the event, half after), ``"peak"``
            (its mode) or ``"none"`` (the event: strictly causal). Symmetric responses are
            centred in every case; tables and callables are used as given.
        border: ``"correct"`` divides each output by the fraction of the (cut) response's
            mass inside the recording, as Elephant's ``border_correction`` does (without its
            rescaling of each train to its spike count, which depends on the data).
        scale: a constant factor.
        recording: ``(start, stop)`` of the recording for ``border``; default: x's points
            are the starts of equal bins, ``(x[0], x[-1] + (x[-1] - x[-2]))``.
    """

    normalize: bool = False
    center: str = "median"
    border: str = "none"
    scale: float = 1.0
    recording: tuple[float, float] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.center not in CENTERS:
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
        shift = {"median": spec.median, "peak": spec.mode, "none": 0.0}[opts.center]
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
    if opts.center not in ("median", "none") and not isinstance(response, str):
        raise ValueError(
            "center applies to named responses; tables and callables are used as given"
        )
    if isinstance(response, tuple):
        if support is not None:
            raise ValueError("a tabulated response implies its support; omit `support`")
        xs = torch.as_tensor(response[0]).to(device=device, dtype=torch.float64)
        ys = torch.as_tensor(response[1]).to(device=device, dtype=torch.float64)
        r = tabulated(xs, ys)
        cdf = _table_cdf(xs, ys)
        total = float(cdf(xs[-1:])[0])
        if (opts.normalize or opts.border != "none") and not total > 0:
            raise ValueError("normalize and border need a table with a positive area")
        gain = opts.scale / total if opts.normalize else opts.scale
        table_factor = None
        if opts.border == "correct":
            assert x is not None
            start, stop = opts.bounds(x)

            def table_factor(c: torch.Tensor) -> torch.Tensor:
                m = (cdf(c - start) - cdf(c - stop)) / total
                return torch.where(m > 0, 1.0 / m.clamp(min=1e-300), torch.zeros_like(m))

        return Cut(lambda d: r(d) * gain, float(xs[0]), float(xs[-1]), table_factor)
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
