"""Banded pseudo-continuous convolution and resampling, with autograd.

N functions sampled on a fine grid x of B points, ``f (N, B)``, convolved with a response r and
resampled at per-function coarse points ``c (N, A)``::

    out[n, a] = sum_b r(c[n, a] - x[b]) * f[n, b]

r is (cut to) compact support, so each (n, a) reads one contiguous window of fine points. The
operator is stored as ``starts (N, A) int32`` and ``weights (N, A, W)``, never as the dense
``T (N, A, B)``; ``out[n, a] = sum_j weights[n, a, j] * f[n, starts[n, a] + j]``.

Kernels: Triton on CUDA, compiled C on the CPU (chunked torch where no compiler is found), a
plain-torch reference elsewhere (``gpu_ops._reference``). See ``BandedResampler`` for storage.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_ops import _reference, responses
from gpu_ops._resample_autograd import banded_apply
from gpu_ops._resample_otf import OnTheFlyFunction

Response = Callable[[torch.Tensor], torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | str
_FORMAT = "bitserve.BandedResampler"
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CHUNK_ITEMS = 1 << 22  # weights evaluated per chunk while building an operator


def _check_input(f: torch.Tensor, N: int, B: int, device: torch.device) -> torch.Tensor:
    """f (N, B) or (M, N, B) -> (M, N, B), with clear errors."""
    if not isinstance(f, torch.Tensor):
        raise TypeError(f"f must be a torch.Tensor, got {type(f).__name__}")
    if f.ndim not in (2, 3) or tuple(f.shape[-2:]) != (N, B):
        raise ValueError(
            f"f must have shape (N, B) or (M, N, B) with N={N}, B={B}; got {tuple(f.shape)}"
        )
    if f.dtype not in _INPUT_DTYPES:
        raise TypeError(f"f must be float32, bfloat16, float16 or float64; got {f.dtype}")
    if f.device != device:
        raise ValueError(f"f is on {f.device} but the operator is on {device}")
    return f if f.ndim == 3 else f.unsqueeze(0)


def _check_band(
    starts: torch.Tensor, weights: torch.Tensor, B: int, *, values: bool = True
) -> None:
    """Shapes, dtypes and devices; with ``values`` also the start range (a host sync)."""
    for name, t in (("starts", starts), ("weights", weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if starts.ndim != 2 or weights.ndim != 3 or tuple(weights.shape[:2]) != tuple(starts.shape):
        raise ValueError(
            f"starts must be (N, A) and weights (N, A, W); got {tuple(starts.shape)} and "
            f"{tuple(weights.shape)}"
        )
    if starts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"starts must be int32 (or int64); got {starts.dtype}")
    if weights.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"weights must be float32, bfloat16, float16 or float64; got {weights.dtype}"
        )
    if starts.device != weights.device:
        raise ValueError(f"starts are on {starts.device} but weights on {weights.device}")
    W = weights.shape[-1]
    if W < 1 or W > B:
        raise ValueError(f"band width W={W} must be between 1 and B={B}")
    if values and starts.numel() and (int(starts.min()) < 0 or int(starts.max()) > B - W):
        raise ValueError(f"starts must lie in [0, B - W] = [0, {B - W}] so windows stay inside f")


def _check_permutation(inverse_order: torch.Tensor, starts: torch.Tensor) -> None:
    if not isinstance(inverse_order, torch.Tensor) or inverse_order.dtype != torch.int64:
        got = getattr(inverse_order, "dtype", type(inverse_order).__name__)
        raise TypeError(f"inverse_order must be an int64 tensor; got {got}")
    if inverse_order.shape != starts.shape:
        raise ValueError(
            f"inverse_order must have the shape of starts {tuple(starts.shape)}; "
            f"got {tuple(inverse_order.shape)}"
        )
    if inverse_order.device != starts.device:
        raise ValueError(
            f"inverse_order is on {inverse_order.device} but starts on {starts.device}"
        )
    A = starts.shape[1]
    expect = torch.arange(A, device=starts.device)
    if not bool((inverse_order.sort(dim=1).values == expect).all()):
        raise ValueError(f"each row of inverse_order must be a permutation of 0..{A - 1}")


def banded_resample(
    f: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor, *, validate: bool = True
) -> torch.Tensor:
    """``out[..., n, a] = sum_j weights[n, a, j] * f[..., n, starts[n, a] + j]``.

    Args:
        f: (N, B) or (M, N, B) float32, bfloat16 or float16 (float64 for gradcheck).
        starts: (N, A) int32 window starts in ``[0, B - W]``, any order.
        weights: (N, A, W) float32, bfloat16 or float16 on f's device.
        validate: check that the starts lie in ``[0, B - W]`` and whether each row is sorted
            (sorted rows take the faster banded backward). Those checks read values: on
            CUDA, a host sync per call. ``False`` skips them for hot loops: out-of-range
            starts are then undefined behaviour (wrong values or a device fault) and the
            backward assumes unsorted rows. Shapes, dtypes and devices are always checked.
            A :class:`BandedResampler` validates once at construction and never here.

    Returns:
        (N, A) or (M, N, A) in f's dtype (accumulated in float32). Differentiable in f and in
        weights when they require grad.
    """
    if not isinstance(f, torch.Tensor):
        raise TypeError(f"f must be a torch.Tensor, got {type(f).__name__}")
    B = f.shape[-1] if f.ndim >= 1 else -1
    _check_band(starts, weights, B, values=validate)
    f3 = _check_input(f, starts.shape[0], B, weights.device)
    s32 = starts.to(torch.int32).contiguous()
    # Sorted starts let both the CUDA and the C backward use the banded transpose.
    sorted_starts = validate and bool((s32[:, 1:] >= s32[:, :-1]).all())
    out = banded_apply(f3, s32, weights.contiguous(), sorted_starts=sorted_starts)
    return out if f.ndim == 3 else out.squeeze(0)


class BandedResampler(nn.Module):
    """The banded response operator as a module: ``forward(f)`` resamples f at c.

    Stored mode keeps ``starts (N, A) int32`` and ``weights (N, A, W)`` (rows sorted by window
    start, so the transposed band is banded too) plus ``inverse_order (N, A)`` when c was not
    sorted, so the output keeps the caller's order. On-the-fly mode (named responses only)
    keeps ``x (B,)``, ``c (N, A)`` and the response parameter as ``nn.Parameter``s, computes
    the weights inside the forward and backward, and gives gradients w.r.t. c and the
    parameter; ``.half()``/``.to(torch.bfloat16)`` leave those at their precision (they only
    move devices): half or bfloat16 inputs are computed in float32 either way. Build with
    :meth:`from_response`, :meth:`from_dense` or :meth:`load`.
    """

    starts: torch.Tensor
    weights: torch.Tensor
    inverse_order: torch.Tensor | None
    x: torch.Tensor  # on-the-fly mode: the fine grid (B,), float64
    c: torch.Tensor  # on-the-fly mode: the coarse points (N, A), an nn.Parameter

    def __init__(
        self,
        starts: torch.Tensor,
        weights: torch.Tensor,
        num_fine: int,
        *,
        inverse_order: torch.Tensor | None = None,
    ) -> None:
        """Stored mode from a band whose starts are sorted along each row.

        Args:
            starts: (N, A) int32 window starts, non-decreasing along each row.
            weights: (N, A, W) weights on starts' device.
            num_fine: B, the number of fine points.
            inverse_order: (N, A) int64 on starts' device, a permutation of ``0..A-1`` per
                row: output column ``a`` is band row ``inverse_order[n, a]``; ``None`` keeps
                the band's order.

        Raises:
            ValueError: unsorted starts, or an ``inverse_order`` that is not a permutation.

        Everything is checked here, once, so :meth:`forward` can trust it (the kernels rely
        on sorted rows; a bad permutation would gather garbage or trip a device assert).
        """
        super().__init__()
        _check_band(starts, weights, num_fine)
        if starts.shape[1] > 1 and not bool((starts[:, 1:] >= starts[:, :-1]).all()):
            row = int((starts[:, 1:] < starts[:, :-1]).any(1).nonzero()[0])
            raise ValueError(
                f"starts must be sorted (non-decreasing) along each row; row {row} is not "
                "(sort the rows and pass inverse_order to keep the caller's order)"
            )
        if inverse_order is not None:
            _check_permutation(inverse_order, starts)
        self.num_fine = int(num_fine)
        self.register_buffer("starts", starts.to(torch.int32).contiguous())
        self.register_buffer("weights", weights.contiguous())
        self.register_buffer("inverse_order", inverse_order)
        self._otf: tuple[responses.NamedResponse, float | None] | None = None

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_response(
        cls,
        x: torch.Tensor,
        c: torch.Tensor,
        response: Response,
        support: float | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        on_the_fly: bool = False,
        **params: float,
    ) -> BandedResampler:
        """Build the operator ``T[n, a, b] = r(c[n, a] - x[b])`` as a band.

        Args:
            x: (B,) fine grid, non-decreasing, evenly spaced or not.
            c: (N, A) coarse points, any order (the output keeps it).
            response: a callable on offsets ``c - x`` (then ``support`` is required: r counts
                as zero where ``|c - x| > support``); a table ``(xs, ys)`` interpolated
                linearly, zero outside ``[xs[0], xs[-1]]``; or a name from
                :data:`gpu_ops.responses.NAMED` with its parameter as a keyword
                (``sigma=``, ``half_width=`` or ``gamma=``), ``support`` then in units of
                that parameter (gaussian default 4, lorentzian default 10).
            support: see ``response``.
            dtype: weight dtype (float32, bfloat16, float16); on-the-fly: f32 compute.
            device: where the operator lives (default: x's device).
            on_the_fly: named responses only; store no weights (see the class docstring).
            **params: the named response's parameter.

        Returns:
            The operator; windows are clipped at the grid edges, empty windows give 0.
        """
        device = torch.device(device) if device is not None else x.device
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
        if isinstance(response, str):
            spec = responses.named(response)
            unknown = set(params) - {spec.param}
            if spec.param not in params or unknown:
                raise ValueError(f"{response!r} takes exactly one parameter {spec.param}=...")
            value = float(params[spec.param])
            if value <= 0:
                raise ValueError(f"{spec.param} must be > 0, got {value}")
            half = spec.half_width(value, support)
            if on_the_fly:
                return cls._on_the_fly(x, c, spec, value, support, dtype)
            p = {spec.param: torch.tensor(value, dtype=torch.float64, device=device)}
            r: Callable[[torch.Tensor], torch.Tensor] = lambda d: spec.evaluate(d, p)  # noqa: E731
            lo, hi = -half, half
        else:
            if on_the_fly:
                raise ValueError("on_the_fly=True needs a named response")
            if params:
                raise ValueError(f"unexpected parameters {sorted(params)} for this response")
            if isinstance(response, tuple):
                if support is not None:
                    raise ValueError("a tabulated response implies its support; omit `support`")
                xs = torch.as_tensor(response[0]).to(device=device, dtype=torch.float64)
                ys = torch.as_tensor(response[1]).to(device=device, dtype=torch.float64)
                r = responses.tabulated(xs, ys)
                lo, hi = float(xs[0]), float(xs[-1])
            elif callable(response):
                if support is None or not support > 0:
                    raise ValueError("a callable response needs `support` > 0 (its half-width)")
                r, lo, hi = response, -float(support), float(support)
            else:
                raise TypeError(f"unsupported response {type(response).__name__}")
        c_sorted, order = torch.sort(c, dim=1, stable=True)
        first, last, W = responses.windows(x, c_sorted, lo, hi)
        starts = responses.clipped_starts(first, W, x.numel())
        N, A = c.shape
        weights = torch.empty(N, A, W, dtype=dtype, device=device)
        step = max(1, _CHUNK_ITEMS // max(1, N * W))
        for a0 in range(0, A, step):
            sl = slice(a0, a0 + step)
            band = responses.evaluate_band(
                x, c_sorted[:, sl], r, first[:, sl], last[:, sl], starts[:, sl], W
            )
            weights[:, sl] = band.to(dtype)
        identity = bool((order == torch.arange(A, device=device)).all())
        inverse = None if identity else torch.argsort(order, dim=1)
        return cls(starts, weights, x.numel(), inverse_order=inverse)

    @classmethod
    def _on_the_fly(
        cls, x: torch.Tensor, c: torch.Tensor, spec: responses.NamedResponse, value: float,
        support: float | None, dtype: torch.dtype,
    ) -> BandedResampler:  # fmt: skip
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.num_fine = x.numel()
        self._otf = (spec, support)
        self.register_buffer("x", x)
        self.c = nn.Parameter(c.to(torch.float64 if dtype == torch.float64 else torch.float32))
        self.register_parameter(
            spec.param, nn.Parameter(torch.tensor(value, dtype=self.c.dtype, device=x.device))
        )
        self.register_buffer("inverse_order", None)
        return self

    @classmethod
    def from_dense(cls, T: torch.Tensor, tol: float = 0.0) -> BandedResampler:
        """Find each row's band in a dense ``T (N, A, B)``; entries ``|T| <= tol`` count as 0.

        Raises:
            ValueError: a row whose entries above tol are not one contiguous window (named).
        """
        if T.ndim != 3:
            raise ValueError(f"T must have shape (N, A, B), got {tuple(T.shape)}")
        N, A, B = T.shape
        mask = T.abs() > tol
        count = mask.sum(-1)
        first = mask.to(torch.uint8).argmax(-1)
        last = B - mask.flip(-1).to(torch.uint8).argmax(-1)
        bad = (count > 0) & (count != last - first)
        if bool(bad.any()):
            n, a = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"row (n={n}, a={a}) of T has entries above tol={tol} that are not one contiguous "
                f"window: {int(count[n, a])} of them spread over columns "
                f"{int(first[n, a])}..{int(last[n, a]) - 1}"
            )
        last = torch.where(count > 0, last, first)
        W = max(1, int((last - first).max())) if T.numel() else 1
        starts = responses.clipped_starts(first, W, B)
        starts, order = torch.sort(starts, dim=1, stable=True)
        first, last = first.gather(1, order), last.gather(1, order)
        cols = starts[..., None] + torch.arange(W, device=T.device)
        weights = T.gather(1, order[..., None].expand(N, A, B)).gather(-1, cols)
        inside = (cols >= first[..., None]) & (cols < last[..., None])
        weights = torch.where(inside, weights, torch.zeros_like(weights))
        identity = bool((order == torch.arange(A, device=T.device)).all())
        inverse = None if identity else torch.argsort(order, dim=1)
        return cls(starts, weights, B, inverse_order=inverse)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to()``/``.cuda()``/``.half()``...: on-the-fly mode keeps its dtypes, moves only.

        x (float64), c and the response parameter are the geometry, not weights: in half
        precision the window search and the offsets ``c - x`` would be wrong by whole fine
        points. The inputs may still be half or bfloat16 (computed in float32).
        """
        if self._otf is None:
            return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]

        def move_only(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.dtype != t.dtype and t.is_floating_point():
                return t.to(device=out.device)  # from the original: no rounding on the way
            return out

        return super()._apply(move_only, recurse)  # type: ignore[no-untyped-call]

    # --- use ------------------------------------------------------------------------------

    @property
    def on_the_fly(self) -> bool:
        """True when no weights are stored (see the class docstring)."""
        return self._otf is not None

    def _param(self) -> torch.Tensor:
        assert self._otf is not None
        p: torch.Tensor = getattr(self, self._otf[0].param)
        return p

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """Resample f.

        Args:
            f: (N, B) or (M, N, B), float32, bfloat16 or float16, on the operator's device.

        Returns:
            (N, A) or (M, N, A) in f's dtype, in the order of the c the operator was built from.
        """
        if self._otf is not None:
            x: torch.Tensor = self.x
            f3 = _check_input(f, self.c.shape[0], self.num_fine, x.device)
            spec, support = self._otf
            ct = torch.float64 if torch.float64 in (f.dtype, self.c.dtype) else torch.float32
            out: torch.Tensor = OnTheFlyFunction.apply(  # type: ignore[no-untyped-call]
                f3, self.c, self._param(), x, spec, support, ct
            )
        else:
            f3 = _check_input(f, self.starts.shape[0], self.num_fine, self.starts.device)
            out = banded_apply(f3, self.starts, self.weights, sorted_starts=True)
            if self.inverse_order is not None:
                out = out.gather(-1, self.inverse_order.expand(out.shape[0], -1, -1))
        return out if f.ndim == 3 else out.squeeze(0)

    def band(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts (N, A), weights (N, A, W))`` in the caller's row order (on-the-fly: built)."""
        if self._otf is None:
            starts, weights = self.starts, self.weights
            if self.inverse_order is not None:
                inv = self.inverse_order
                starts = starts.gather(1, inv)
                weights = weights.gather(1, inv[..., None].expand_as(weights))
            return starts, weights
        spec, support = self._otf
        x: torch.Tensor = self.x
        p = self._param().detach()
        half = spec.half_width(float(p), support)
        first, last, W = responses.windows(x, self.c, -half, half)
        starts = responses.clipped_starts(first, W, x.numel())
        pd = {spec.param: p.to(x.dtype)}
        w = responses.evaluate_band(
            x, self.c.detach(), lambda d: spec.evaluate(d, pd), first, last, starts, W
        )
        return starts.to(torch.int32), w.to(self.c.dtype)

    def to_dense(self) -> torch.Tensor:
        """The dense operator ``T (N, A, B)`` (for checks and small sizes only)."""
        starts, weights = self.band()
        return _reference.banded_to_dense(starts, weights, self.num_fine)

    @property
    def band_width(self) -> int:
        """W, the longest window in fine points."""
        return int(self.weights.shape[-1]) if self._otf is None else int(self.band()[1].shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes the operator keeps resident (buffers and parameters)."""
        tensors = [*self.buffers(), *self.parameters()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        if self._otf is not None:
            N, A = self.c.shape
            return f"on_the_fly={self._otf[0].name}, N={N}, A={A}, B={self.num_fine}"
        N, A, W = self.weights.shape
        return f"N={N}, A={A}, B={self.num_fine}, W={W}, dtype={self.weights.dtype}"

    # --- files ----------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the operator to a safetensors file (format described in the README)."""
        from safetensors.torch import save_file

        meta = {"format": _FORMAT, "version": "1", "num_fine": str(self.num_fine)}
        tensors: dict[str, torch.Tensor]
        if self._otf is not None:
            spec, support = self._otf
            meta |= {
                "mode": "on_the_fly",
                "response": spec.name,
                "support": "" if support is None else repr(support),
            }
            tensors = {
                "x": self.x,
                "c": self.c.detach(),
                "param": self._param().detach().reshape(1),
            }
        else:
            meta["mode"] = "stored"
            tensors = {"starts": self.starts, "weights": self.weights}
            if self.inverse_order is not None:
                tensors["inverse_order"] = self.inverse_order
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> BandedResampler:
        """Read an operator written by :meth:`save` (safetensors, no pickle) onto ``device``."""
        from safetensors import safe_open

        dev = str(torch.device(device)) if device is not None else "cpu"
        with safe_open(str(path), framework="pt", device=dev) as fh:
            meta: dict[str, Any] = fh.metadata() or {}
            if meta.get("format") != _FORMAT or meta.get("version") != "1":
                raise ValueError(f"{path}: not a {_FORMAT} v1 file (metadata {meta})")
            t = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open has no __iter__
        try:
            if meta.get("mode") == "on_the_fly":
                spec = responses.named(meta["response"])
                support = float(meta["support"]) if meta["support"] else None
                op = cls._on_the_fly(
                    t["x"], t["c"], spec, float(t["param"][0]), support, t["c"].dtype
                )
                return op
            return cls(
                t["starts"],
                t["weights"],
                int(meta["num_fine"]),
                inverse_order=t.get("inverse_order"),
            )
        except KeyError as exc:
            raise ValueError(f"{path}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:  # a band that fails __init__'s checks
            raise type(exc)(f"{path}: {exc}") from None
