"""The on-the-fly resampler: a named response or a table evaluated inside the kernels, nothing
stored.

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
    _lattice,
    _resample_c,
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
        lattice: the response tabulated on x's and c's lattice, for the event path's
            compiled kernel (:mod:`gpu_ops._lattice`); None: no lattice, or no such kernel
            here (the event path then evaluates the response per event).
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
    lattice: _lattice.Lattice | None


def _version(t: torch.Tensor) -> int:
    """t's in-place version counter; -1 for an inference tensor (which has none)."""
    return -1 if t.is_inference() else int(t._version)


class OnTheFlyResampler(_resampler_base.Resampler):
    """``out[..., n, a] = sum_b r(c[n, a] - x[b]) * f[..., n, b]`` with no stored weights.

    Keeps only ``x (B,)`` (a float64 buffer), ``c (N, A)`` (float64: the offsets ``c - x``
    of a long recording and a narrow response need its precision) and the response: a named
    response's parameter as an ``nn.Parameter`` (named after it: ``.sigma``, ``.gamma``,
    ``.half_width`` or ``.tau``, whichever is the response's own, also when built from
    ``sigma=``), or a table ``(xs, ys)`` as the buffer ``.table (2, K)`` (its breakpoints,
    moved by ``center``, then its values). The kernels evaluate the weights of each window as
    they use it, in the forward and in the backward, so memory is O(N A) whatever the band
    width. Gradients flow to f always, and, when asked (``trainable=True``, or
    ``requires_grad_()`` on the module or on ``c`` / the parameter), to ``c`` and to a named
    response's parameter (analytic derivatives of the response; the movement of the window
    edges with the parameter is not counted: the cut declares the response negligible there).
    A table gets no gradient: it has no width to learn, and its values are data (``c`` gets
    the table's slopes). Frozen by default, so that :meth:`forward_bits` in a plain script
    (grad mode on) takes the same fast event, lattice or prefix path as under
    ``torch.inference_mode()``; a trainable module's :meth:`forward_bits` takes the band path,
    which has the backward.
    ``.half()``/``.to(torch.bfloat16)`` move the module but keep x, c and the parameter (or
    table) at their precision: in half precision the offsets ``c - x`` would be wrong by
    whole fine points. Inputs may still be float16 or bfloat16 (computed in float32).

    Args:
        x: (B,) fine grid, sorted, evenly spaced or not.
        c: (N, A) coarse points, any order (the output keeps it).
        response: a name from :data:`gpu_ops.responses.NAMED`, or a table ``(xs, ys)``:
            (K,) breakpoints, strictly increasing, and their values, linear in between and
            zero outside ``[xs[0], xs[-1]]`` (may be asymmetric), as
            :meth:`BandedResampler.from_response` takes it.
        support: the cut in units of the parameter given (gaussian default 4 sigma,
            lorentzian 10 gamma, laplacian, exponential and alpha 5 sigma); None for the
            compact ``boxcar``, ``triangle`` and ``epanechnikov`` and for a table.
        dtype: float32 (default) computes in float32 (a table's breakpoints and values are
            then rounded to float32); float64 keeps the parameter or table in float64 and
            computes in float64 (for gradcheck).
        device: where the module lives (default: x's device).
        normalize, center, border, scale, recording: see :class:`gpu_ops.responses.Options`
            (gradients flow through the normalisation, the centring and the border
            correction too). A table: ``normalize`` divides by its area, ``center`` moves its
            median or peak to 0 (default: as given).
        trainable: make ``c`` and the parameter require gradients (default False: both are
            ``nn.Parameter`` objects that require none until asked, as ``requires_grad_()``
            does later).
        **params: the named response's parameter, e.g. ``sigma=2.0``.

    Raises:
        ValueError: an unsorted or non-finite grid, a bad ``c`` shape, parameters that do not
            fit the response, or a table that is not one (see
            :func:`gpu_ops.responses.parse_table`).
        TypeError: a response that is neither a name nor a table.
    """

    x: torch.Tensor
    c: torch.Tensor
    table: torch.Tensor | None

    def __init__(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        response: str | tuple[torch.Tensor, torch.Tensor],
        support: float | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        normalize: bool = False,
        center: str | None = None,
        border: str = "none",
        scale: float = 1.0,
        recording: tuple[float, float] | None = None,
        trainable: bool = False,
        **params: float,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else torch.as_tensor(x).device
        x64, c64 = responses.check_grid(x, c, dev)
        options = responses.Options(normalize, center, border, scale, recording)
        geometry = torch.float64 if dtype == torch.float64 else torch.float32
        self.num_fine = x64.numel()
        self.register_buffer("x", x64)
        # float64 always: c - x is formed in float64
        self.c = nn.Parameter(c64, requires_grad=trainable)
        self.shape: responses.Shape | responses.Table
        self.spec: responses.NamedResponse | None
        if isinstance(response, tuple):
            if support is not None:
                raise ValueError("a tabulated response implies its support; omit `support`")
            if params:
                raise ValueError(f"unexpected parameters {sorted(params)} for a table")
            self.shape = responses.parse_table(response, options, dev)
            table = torch.stack([self.shape.xs, self.shape.ys]).to(geometry)
            if not bool((table[0, 1:] > table[0, :-1]).all()):
                raise ValueError(
                    f"the table's breakpoints are closer than {geometry} resolves; "
                    "use dtype=torch.float64"
                )
            self.spec, self.response, self.support = None, responses.TABULATED, None
            self.register_buffer("table", table)
        elif isinstance(response, str):
            self.shape = responses.parse_named(response, support, params, options)
            self.spec, self.response = self.shape.spec, self.shape.spec.name
            self.support = self.shape.support  # the kernels' support (includes a causal shift)
            value = torch.tensor(self.shape.value, dtype=geometry, device=dev)
            param = nn.Parameter(value, requires_grad=trainable)
            self.register_parameter(self.spec.param, param)
            self.register_buffer("table", None)
        else:
            raise TypeError(
                f"response must be a name or a table (xs, ys), got {type(response).__name__} "
                "(a callable: BandedResampler.from_response takes one)"
            )
        self._geo: _Geometry | None = None

    @classmethod
    def from_response(cls, *args: Any, **kwargs: Any) -> OnTheFlyResampler:
        """The constructor (same arguments), under the name BandedResampler's has."""
        return cls(*args, **kwargs)

    @property
    def param(self) -> torch.Tensor:
        """What the kernels take for the response: a named response's parameter (0-d
        ``nn.Parameter``, also reachable by its name), or the table (2, K) buffer."""
        if self.table is not None:
            return self.table
        assert self.spec is not None
        p: torch.Tensor = getattr(self, self.spec.param)
        return p

    @property
    def on_lattice(self) -> bool:
        """Whether :meth:`forward_bits`' event path adds runs of a table of the response
        (x and each row of c evenly spaced, a whole number of fine steps apart; on the CPU,
        in float32: see :mod:`gpu_ops._lattice`) instead of evaluating it per event."""
        with torch.no_grad():
            return self._geometry().lattice is not None

    def _kernel(self) -> responses.KernelResponse:
        """The response as the ops take it (detached)."""
        return responses.KernelResponse(self.response, self.param.detach())

    def _input_layout(self) -> tuple[int, torch.device]:
        return self.c.shape[0], self.x.device

    def _kernel_c(self) -> torch.Tensor:
        """The coarse points the kernels see: moved by a causal response's centring shift (a
        table's centring moved its breakpoints instead)."""
        shape = self.shape
        if isinstance(shape, responses.Table) or shape.shift == 0:
            return self.c
        return self.c + shape.shift * self.param

    def _gain(self) -> torch.Tensor:
        """The output's constant factor (0-d; differentiable in a named response's parameter)."""
        if isinstance(self.shape, responses.Table):
            return torch.tensor(self.shape.gain, dtype=torch.float64, device=self.x.device)
        return self.shape.gain(self.param)

    def _inverse_mass(self) -> torch.Tensor:
        """(N, A): 1 / the response's mass inside the recording at c (``border``)."""
        if isinstance(self.shape, responses.Table):
            return self.shape.inverse_mass(self.x, self.c)
        return self.shape.inverse_mass(self.x, self.c, self.param)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        """The kernels' output (M, N, A) with the gain and border correction applied."""
        if self.shape.plain:
            return out
        out = out * self._gain().to(out.dtype)
        if self.shape.options.border == "correct":
            out = out * self._inverse_mass().to(out.dtype)
        return out

    def _resample(self, f: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _resample_ops.on_the_fly_forward(
            f, self.x, self._kernel_c(), self.param, self.response, self.support
        )
        return self._finish(out)

    def _needs_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.c.requires_grad or self.param.requires_grad)

    def _plan(self, packed3: torch.Tensor) -> _bits_resample.Plan:
        M = packed3.shape[0]
        if self._needs_grad():  # gradients to c and the parameter: the band path
            return _bits_resample.Plan(("band",) * M, (-1,) * M)
        A, B = self.c.shape[1], self.num_fine
        lo, hi = self._kernel().window(self.support)
        span = float(self.x[-1] - self.x[0])
        width = (hi - lo) / span * (B - 1) if span > 0 else float(B)
        pieces = _bits_resample.pieces_of(self.response)
        lattice = self._geometry().lattice is not None
        return _bits_resample.plan(
            packed3, B, A, min(width, B), on_the_fly=True, pieces=pieces, lattice=lattice
        )

    def _check_bits_path(self, path: str) -> torch.dtype:
        if path not in ("auto", "band") and self._needs_grad():
            raise ValueError(
                f"path={path!r} has no backward: c or the parameter require gradients "
                "(use path='band', torch.no_grad(), or requires_grad_(False))"
            )
        if path == "prefix" and _bits_resample.pieces_of(self.response) is None:
            raise ValueError(f"{self.response!r} is not piecewise polynomial: no prefix path")
        return self.param.dtype

    def _sparse(self, name: str, items: torch.Tensor, big: bool) -> torch.Tensor:
        """The event or prefix path on ``items (M, N, nbytes)``: (M, N, A)."""
        geo = self._geometry()
        out: torch.Tensor
        if name == "event" and geo.lattice is not None:
            lat = geo.lattice
            out = _events_ops.events_lattice_forward(
                items, geo.first, geo.last, lat.tables, lat.tid, lat.jmin, lat.walk,
                self.num_fine, big,
            )  # fmt: skip
        elif name == "event":
            out = _events_ops.events_otf_forward(
                items, self.x, geo.c, geo.first, geo.last, self.param.detach(),
                self.response, big,
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
            resp = self._kernel()
            c_sorted, order = torch.sort(self._kernel_c(), dim=1, stable=True)
            c_sorted = c_sorted.contiguous()
            identity = bool((order == torch.arange(order.shape[1], device=order.device)).all())
            lo, hi = resp.window(self.support)
            first, last, _ = responses.windows(self.x, c_sorted, lo, hi, resp.tie_ends)
            bounds = coef = None
            got = responses.pieces(self.response, resp.value)
            if got is not None:
                t, coef = got
                bounds = _events_torch.piece_bounds(self.x, c_sorted, t.to(self.x.device))
                coef = coef.to(device=self.x.device, dtype=p_.dtype)
            inverse_mass = None
            if self.shape.options.border == "correct":
                inverse_mass = self._inverse_mass()
            lattice = None
            if self._lattice_kernel():
                window = responses.inclusive(self.x, c_sorted, lo, hi, resp.tie_ends)
                lattice = _lattice.find(self.x, c_sorted, first, last, resp, window)
            self._geo = _Geometry(
                key, resp.value, c_sorted, first.contiguous(), last.contiguous(),
                None if identity else torch.argsort(order, dim=1), bounds, coef,
                float(self._gain()), inverse_mass, lattice,
            )  # fmt: skip
        return self._geo

    def _lattice_kernel(self) -> bool:
        """The lattice's compiled kernel runs here: on the CPU, in float32, where built (on
        CUDA the event kernel evaluates the response per event: arithmetic is cheap there)."""
        return (
            self.x.device.type == "cpu"
            and self.param.dtype != torch.float64
            and _resample_c.kernels() is not None
        )

    def _windows(self) -> _resample_torch.Windows:
        """The windows of the current c and parameter (as the kernels find them)."""
        c = self._kernel_c().detach()
        return _resample_torch.Windows(self.x, c, self._kernel(), self.support)

    def band(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts (N, A) int32, weights (N, A, W))`` built from the current c and parameter."""
        win = self._windows()
        c = self._kernel_c().detach()
        r = self._kernel().evaluate
        w = responses.evaluate_band(self.x, c, r, win.first, win.last, win.starts, win.W)
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
        return f"response={self.response}, N={N}, A={A}, B={self.num_fine}"

    def save(self, path: str | Path) -> None:
        """Write x, c and the parameter (or the table as given) to a safetensors file
        (format in the README)."""
        o = self.shape.options
        meta = {
            "mode": "on_the_fly",
            "response": self.response,
            "normalize": str(o.normalize).lower(),
            "center": o.center or "",
            "border": o.border,
            "scale": repr(o.scale),
            "recording": "" if o.recording is None else repr([float(v) for v in o.recording]),
            "dtype": str(self.param.dtype).removeprefix("torch."),
        }
        tensors = {"x": self.x, "c": self.c}
        if isinstance(self.shape, responses.Table):
            meta["support"] = ""
            tensors["response_x"], tensors["response_y"] = self.shape.given()
        else:
            meta["support"] = "" if self.shape.cut is None else repr(self.shape.cut)
            tensors["param"] = self.param.reshape(1)
        _resampler_base.write(path, self.num_fine, meta, tensors)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> OnTheFlyResampler:
        """Read a module written by :meth:`save` (safetensors, no pickle) onto ``device``;
        frozen, as the constructor makes it by default (``requires_grad_()`` to train it).

        Raises:
            ValueError: not such a file (a stored band: use ``BandedResampler.load``).
        """
        meta, t = _resampler_base.read(path, device)
        if meta.get("mode") != "on_the_fly":
            raise ValueError(f"{path}: a stored band; read it with BandedResampler.load")
        try:
            rec = meta.get("recording", "")
            recording = tuple(float(v) for v in rec.strip("[]").split(",")) if rec else None
            options: dict[str, Any] = {
                "normalize": meta.get("normalize", "false") == "true",
                "center": meta.get("center") or None, "border": meta.get("border", "none"),
                "scale": float(meta.get("scale", "1.0")), "recording": recording,
            }  # fmt: skip
            if meta["response"] == responses.TABULATED:
                dtype = getattr(torch, meta.get("dtype", "float32"))
                table = (t["response_x"], t["response_y"])
                return cls(t["x"], t["c"], table, dtype=dtype, device=device, **options)
            spec = responses.named(meta["response"])
            support = float(meta["support"]) if meta["support"] else None
            value = float(t["param"][0])
            params: dict[str, Any] = {spec.param: value}
            return cls(
                t["x"], t["c"], spec.name, support, dtype=t["param"].dtype, device=device,
                **options, **params,
            )  # fmt: skip
        except KeyError as exc:
            raise ValueError(f"{path}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{path}: {exc}") from None
