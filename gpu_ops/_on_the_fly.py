"""The on-the-fly resampler: a named response evaluated inside the kernels, nothing stored.

Re-exported as :class:`gpu_ops.OnTheFlyResampler` (and from :mod:`gpu_ops.resample`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_ops import (
    _bits_resample,
    _events_ops,
    _events_torch,
    _resample_ops,
    _resample_torch,
    _resampler_base,
    responses,
)


@dataclass(frozen=True)
class _Geometry:
    """What the bit-input paths need of the current c and parameter (cached between calls).

    Attributes:
        key: the versions and storages of c, the parameter and x it was found for.
        value: the parameter's value then.
        c: (N, A) float64, the kernels' coarse points sorted along each row.
        first, last: (N, A) int64, each window ``[first, last)``.
        inverse: (N, A) int64, sorted position of each caller's column; None: c was sorted.
        bounds, coef: the polynomial pieces' fine bounds (P + 1, N, A) and coefficients
            (P, 3) for the prefix path; None for other responses.
        gain: the output's constant factor (scale, normalisation).
        inverse_mass: (N, A) in the caller's order: 1 / the mass inside (``border``); None.
    """

    key: tuple[int, ...]
    value: float
    c: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    inverse: torch.Tensor | None
    bounds: torch.Tensor | None
    coef: torch.Tensor | None
    gain: float
    inverse_mass: torch.Tensor | None


def _version(t: torch.Tensor) -> int:
    """t's in-place version counter; -1 for an inference tensor (which has none)."""
    return -1 if t.is_inference() else int(t._version)


class OnTheFlyResampler(_resampler_base.Resampler):
    """``out[..., n, a] = sum_b r(c[n, a] - x[b]) * f[..., n, b]`` with no stored weights.

    Keeps only ``x (B,)`` (a float64 buffer), ``c (N, A)`` (float64: the offsets ``c - x``
    of a long recording and a narrow response need its precision) and the response's
    parameter as
    ``nn.Parameter``s (named after it: ``.sigma``, ``.gamma``, ``.half_width`` or ``.tau``,
    whichever is the response's own, also when built from ``sigma=``); the
    kernels evaluate the weights of each window as they use it, in the forward and in the
    backward, so memory is O(N A) whatever the band width. Gradients flow to f, to ``c``
    and to the parameter (analytic derivatives of the response; the movement of the window
    edges with the parameter is not counted: the cut declares the response negligible
    there). ``.half()``/``.to(torch.bfloat16)`` move the module but keep x, c and the
    parameter at their precision: in half precision the offsets ``c - x`` would be wrong by
    whole fine points. Inputs may still be float16 or bfloat16 (computed in float32).

    Args:
        x: (B,) fine grid, sorted, evenly spaced or not.
        c: (N, A) coarse points, any order (the output keeps it).
        response: a name from :data:`gpu_ops.responses.NAMED`.
        support: the cut in units of the parameter given (gaussian default 4 sigma,
            lorentzian 10 gamma, laplacian, exponential and alpha 5 sigma); None for the
            compact ``boxcar``, ``triangle`` and ``epanechnikov``.
        dtype: float32 (default) computes in float32; float64 keeps the parameter in
            float64 and computes in float64 (for gradcheck).
        device: where the module lives (default: x's device).
        normalize, center, border, scale, recording: see :class:`gpu_ops.responses.Options`
            (gradients flow through the normalisation, the centring and the border
            correction too).
        **params: the response's parameter, e.g. ``sigma=2.0``.

    Raises:
        ValueError: an unsorted or non-finite grid, a bad ``c`` shape, or parameters that do
            not fit the response.
    """

    x: torch.Tensor
    c: torch.Tensor

    def __init__(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        response: str,
        support: float | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        normalize: bool = False,
        center: str = "median",
        border: str = "none",
        scale: float = 1.0,
        recording: tuple[float, float] | None = None,
        **params: float,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else torch.as_tensor(x).device
        x64, c64 = responses.check_grid(x, c, dev)
        options = responses.Options(normalize, center, border, scale, recording)
        self.shape = responses.parse_named(response, support, params, options)
        self.spec, value = self.shape.spec, self.shape.value
        self.support = self.shape.support  # the kernels' support (includes a causal shift)
        self.num_fine = x64.numel()
        geometry = torch.float64 if dtype == torch.float64 else torch.float32
        self.register_buffer("x", x64)
        self.c = nn.Parameter(c64)  # float64 always: c - x is formed in float64
        param = nn.Parameter(torch.tensor(value, dtype=geometry, device=dev))
        self.register_parameter(self.spec.param, param)
        self._geo: _Geometry | None = None

    @classmethod
    def from_response(cls, *args: Any, **kwargs: Any) -> OnTheFlyResampler:
        """The constructor (same arguments), under the name BandedResampler's has."""
        return cls(*args, **kwargs)

    @property
    def param(self) -> torch.Tensor:
        """The response's parameter (0-d ``nn.Parameter``), also reachable by its name."""
        p: torch.Tensor = getattr(self, self.spec.param)
        return p

    def _input_layout(self) -> tuple[int, torch.device]:
        return self.c.shape[0], self.x.device

    def _kernel_c(self) -> torch.Tensor:
        """The coarse points the kernels see: moved by a causal response's centring shift."""
        return self.c if self.shape.shift == 0 else self.c + self.shape.shift * self.param

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        """The kernels' output (M, N, A) with the gain and border correction applied."""
        return out if self.shape.plain else self.shape.apply(out, self.x, self.c, self.param)

    def _resample(self, f: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _resample_ops.on_the_fly_forward(
            f, self.x, self._kernel_c(), self.param, self.spec.name, self.support
        )
        return self._finish(out)

    def _needs_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.c.requires_grad or self.param.requires_grad)

    def _plan(self, packed3: torch.Tensor) -> _bits_resample.Plan:
        M = packed3.shape[0]
        if self._needs_grad():  # gradients to c and the parameter: the band path
            return _bits_resample.Plan(("band",) * M, (-1,) * M)
        A, B = self.c.shape[1], self.num_fine
        lo, hi = self.shape.window(float(self.param.detach()))
        span = float(self.x[-1] - self.x[0])
        width = (hi - lo) / span * (B - 1) if span > 0 else float(B)
        pieces = _bits_resample.pieces_of(self.shape)
        return _bits_resample.plan(packed3, B, A, min(width, B), on_the_fly=True, pieces=pieces)

    def _check_bits_path(self, path: str) -> torch.dtype:
        if path not in ("auto", "band") and self._needs_grad():
            raise ValueError(
                f"path={path!r} has no backward: c or the parameter require gradients "
                "(use path='band', torch.no_grad() or frozen parameters)"
            )
        if path == "prefix" and _bits_resample.pieces_of(self.shape) is None:
            raise ValueError(f"{self.spec.name!r} is not piecewise polynomial: no prefix path")
        return self.param.dtype

    def _sparse(self, name: str, items: torch.Tensor, big: bool) -> torch.Tensor:
        """The event or prefix path on ``items (M, N, nbytes)``: (M, N, A)."""
        geo = self._geometry()
        out: torch.Tensor
        if name == "event":
            out = _events_ops.events_otf_forward(
                items, self.x, geo.c, geo.first, geo.last, self.param.detach(),
                self.spec.name, big,
            )  # fmt: skip
        else:
            assert geo.bounds is not None
            assert geo.coef is not None
            out = _events_ops.prefix_forward(items, self.x, geo.c, geo.bounds, geo.coef, big)
        if geo.inverse is not None:
            out = out.gather(-1, geo.inverse.expand(out.shape[0], -1, -1))
        if geo.gain != 1.0:
            out = out * geo.gain
        if geo.inverse_mass is not None:
            out = out * geo.inverse_mass.to(out.dtype)
        return out

    def _geometry(self) -> _Geometry:
        """The sorted coarse points, windows and pieces of the current c and parameter.

        Found once and kept until c, the parameter or x change: replaced, or modified in
        place (tensors made under ``torch.inference_mode()`` count no versions: replace them).
        """
        c_, p_, x_ = self.c, self.param, self.x
        key = (_version(c_), _version(p_), c_.data_ptr(), p_.data_ptr(), x_.data_ptr())
        if self._geo is not None and self._geo.key == key:
            return self._geo
        with torch.no_grad():
            value = float(p_)
            c_sorted, order = torch.sort(self._kernel_c(), dim=1, stable=True)
            c_sorted = c_sorted.contiguous()
            identity = bool((order == torch.arange(order.shape[1], device=order.device)).all())
            lo, hi = self.shape.window(value)
            first, last, _ = responses.windows(self.x, c_sorted, lo, hi)
            bounds = coef = None
            got = responses.pieces(self.spec.name, value)
            if got is not None:
                t, coef = got
                bounds = _events_torch.piece_bounds(self.x, c_sorted, t.to(self.x.device))
                coef = coef.to(device=self.x.device, dtype=p_.dtype)
            inverse_mass = None
            if self.shape.options.border == "correct":
                inverse_mass = self.shape.inverse_mass(self.x, self.c, p_)
            self._geo = _Geometry(
                key, value, c_sorted, first.contiguous(), last.contiguous(),
                None if identity else torch.argsort(order, dim=1), bounds, coef,
                float(self.shape.gain(p_)), inverse_mass,
            )  # fmt: skip
        return self._geo

    def _windows(self) -> _resample_torch.Windows:
        """The windows of the current c and parameter (as the kernels find them)."""
        c = self._kernel_c().detach()
        return _resample_torch.Windows(self.x, c, self.spec, self.param.detach(), self.support)

    def band(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts (N, A) int32, weights (N, A, W))`` built from the current c and parameter."""
        win = self._windows()
        p = {self.spec.param: self.param.detach().to(self.x.dtype)}
        c = self._kernel_c().detach()
        w = responses.evaluate_band(
            self.x, c, self.spec.bind(p), win.first, win.last, win.starts, win.W
        )
        with torch.no_grad():
            w = self._finish(w.movedim(-1, 0)).movedim(0, -1)
        return win.starts.to(torch.int32), w.to(self.param.dtype)

    @property
    def band_width(self) -> int:
        """W, the longest window in fine points (from the windows alone, no weights built)."""
        return self._windows().W

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to()``/``.cuda()``/``.half()``...: moves x, c and the parameter, keeps dtypes."""

        def move_only(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.dtype != t.dtype and t.is_floating_point():
                return t.to(device=out.device)  # from the original: no rounding on the way
            return out

        return super()._apply(move_only, recurse)  # type: ignore[no-untyped-call]

    def extra_repr(self) -> str:
        N, A = self.c.shape
        return f"response={self.spec.name}, N={N}, A={A}, B={self.num_fine}"

    def save(self, path: str | Path) -> None:
        """Write x, c and the parameter to a safetensors file (format in the README)."""
        o = self.shape.options
        cut = self.shape.cut
        meta = {
            "mode": "on_the_fly",
            "response": self.spec.name,
            "support": "" if cut is None else repr(cut),
            "normalize": str(o.normalize).lower(),
            "center": o.center,
            "border": o.border,
            "scale": repr(o.scale),
            "recording": "" if o.recording is None else repr([float(v) for v in o.recording]),
        }
        tensors = {"x": self.x, "c": self.c, "param": self.param.reshape(1)}
        _resampler_base.write(path, self.num_fine, meta, tensors)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> OnTheFlyResampler:
        """Read a module written by :meth:`save` (safetensors, no pickle) onto ``device``.

        Raises:
            ValueError: not such a file (a stored band: use ``BandedResampler.load``).
        """
        meta, t = _resampler_base.read(path, device)
        if meta.get("mode") != "on_the_fly":
            raise ValueError(f"{path}: a stored band; read it with BandedResampler.load")
        try:
            spec = responses.named(meta["response"])
            support = float(meta["support"]) if meta["support"] else None
            value = float(t["param"][0])
            rec = meta.get("recording", "")
            recording = tuple(float(v) for v in rec.strip("[]").split(",")) if rec else None
            return cls(
                t["x"], t["c"], spec.name, support, dtype=t["param"].dtype, device=device,
                normalize=meta.get("normalize", "false") == "true",
                center=meta.get("center", "median"), border=meta.get("border", "none"),
                scale=float(meta.get("scale", "1.0")),
                recording=recording,  # type: ignore[arg-type]
                **{spec.param: value},
            )  # fmt: skip
        except KeyError as exc:
            raise ValueError(f"{path}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{path}: {exc}") from None
