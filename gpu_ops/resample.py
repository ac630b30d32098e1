"""Banded pseudo-continuous convolution and resampling, with autograd.

N functions sampled on a fine grid x of B points, ``f (N, B)``, convolved with a response r and
resampled at per-function coarse points ``c (N, A)``::

    out[n, a] = sum_b r(c[n, a] - x[b]) * f[n, b]

r is (cut to) compact support, so each (n, a) reads one contiguous window of fine points.
Two modules compute it:

- :class:`BandedResampler` stores the band, ``starts (N, A) int32`` and ``weights
  (N, A, W)``, never the dense ``T (N, A, B)``: ``out[n, a] = sum_j weights[n, a, j] *
  f[n, starts[n, a] + j]``. Any response (named, tabulated, a callable, or a dense T).
- :class:`OnTheFlyResampler` stores x, c and a named response's parameter (or a table) and
  evaluates the weights inside the kernels; gradients also flow to c and the parameter.

Both also take bit-packed inputs, ``forward_bits(packed)`` (:mod:`gpu_ops._bits_resample`):
the band, an event scatter or prefix sums, whichever costs least for each input's density.

Both call torch operators (``torch.ops.bitserve.*``, :mod:`gpu_ops._resample_ops`): Triton
kernels on CUDA, compiled C on the CPU, chunked torch elsewhere, each compared in the tests
with the plain references of :mod:`gpu_ops._reference`. Being torch operators, they run
under ``torch.compile(fullgraph=True)`` and in ``torch.export`` programs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from gpu_ops import _bits_resample, _events_ops, _resample_ops, _resampler_base, responses
from gpu_ops._on_the_fly import OnTheFlyResampler
from gpu_ops.responses import Response

__all__ = ["BandedResampler", "OnTheFlyResampler", "banded_resample", "load"]

_CHUNK_ITEMS = 1 << 22  # weights evaluated per chunk while building an operator
_DENSE_CHUNK_ITEMS = 1 << 20  # entries of T (or of the band) handled at once by from_dense
# from_response's default cap on the weights it stores. Past it the band is read from main
# memory (20 x 500 x 20,001 float32 = 800 MB at a 200 ms Gaussian on a 0.1 ms grid ran at
# 1.3x Elephant; 38 MiB at 10 ms: 3.8x on dense bits) while the on-the-fly module holds O(N A)
# and, on a lattice, a table of the response of some kB (bench_elephant).
MAX_BAND_BYTES = 1 << 24


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
    if weights.dtype not in _resampler_base.INPUT_DTYPES:
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
            CUDA, a host sync per call, and under ``torch.compile`` a graph break. ``False``
            skips them for hot loops and compiled code: out-of-range starts are then
            undefined behaviour (wrong values or a device fault) and the backward assumes
            unsorted rows. Shapes, dtypes and devices are always checked. A
            :class:`BandedResampler` validates once at construction and never here.

    Returns:
        (N, A) or (M, N, A) in f's dtype (accumulated in float32). Differentiable in f and in
        weights when they require grad.
    """
    if not isinstance(f, torch.Tensor):
        raise TypeError(f"f must be a torch.Tensor, got {type(f).__name__}")
    B = f.shape[-1] if f.ndim >= 1 else -1
    _check_band(starts, weights, B, values=validate)
    f3 = _resampler_base.check_input(f, starts.shape[0], B, weights.device)
    s32 = starts.to(torch.int32)
    # Sorted starts let both the CUDA and the C backward use the banded transpose.
    sorted_starts = validate and bool((s32[:, 1:] >= s32[:, :-1]).all())
    out: torch.Tensor = _resample_ops.banded_forward(f3, s32, weights, sorted_starts)
    return out if f.ndim == 3 else out.squeeze(0)


def load(
    path: str | Path, device: torch.device | str | None = None
) -> BandedResampler | OnTheFlyResampler:
    """Read a file written by either module's ``save`` (safetensors, no pickle)."""
    meta, _ = _resampler_base.read(path, None, tensors=False)
    if meta.get("mode") == "on_the_fly":
        return OnTheFlyResampler.load(path, device)
    return BandedResampler.load(path, device)


def _dense_windows(T: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of T (N, A, B): ``[first, last)`` of its entries above tol (empty: first).

    Rows are examined a block at a time, so the temporaries stay a few MB whatever T's size
    (peak memory about T plus ``_DENSE_CHUNK_ITEMS`` x 8 bytes).

    Raises:
        ValueError: a row whose entries above tol are not one contiguous window (named).
    """
    N, A, B = T.shape
    first = torch.zeros(N, A, dtype=torch.int64, device=T.device)
    last = torch.zeros_like(first)
    count = torch.zeros_like(first)
    k = max(1, _DENSE_CHUNK_ITEMS // max(1, B))
    for n in range(N):
        for a0 in range(0, A, k):
            mask = T[n, a0 : a0 + k].abs() > tol  # (k, B) bool
            count[n, a0 : a0 + k] = mask.sum(-1)
            first[n, a0 : a0 + k] = mask.to(torch.uint8).argmax(-1)
            last[n, a0 : a0 + k] = B - mask.flip(-1).to(torch.uint8).argmax(-1)
    bad = (count > 0) & (count != last - first)
    if bool(bad.any()):
        n, a = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"row (n={n}, a={a}) of T has entries above tol={tol} that are not one contiguous "
            f"window: {int(count[n, a])} of them spread over columns "
            f"{int(first[n, a])}..{int(last[n, a]) - 1}"
        )
    return first, torch.where(count > 0, last, first)


class BandedResampler(_resampler_base.Resampler):
    """The banded response operator as a module, stored as a band: ``forward(f)``.

    Keeps ``starts (N, A) int32`` and ``weights (N, A, W)`` as buffers, rows sorted by window
    start (so the transposed band of the backward is banded too), plus ``inverse_order
    (N, A)`` when c was not sorted, so the output keeps the caller's order. Gradients flow
    to f, and to ``weights`` if you make them require grad. Build with
    :meth:`from_response` (which gives an :class:`OnTheFlyResampler` instead of a band over
    its ``max_band_bytes``), :meth:`from_dense` or :meth:`load`; for a band whose weights are
    computed in the kernels (and gradients w.r.t. the coarse points and the response's
    width), see :class:`OnTheFlyResampler`.

    Args:
        starts: (N, A) int32 window starts, non-decreasing along each row.
        weights: (N, A, W) weights on starts' device.
        num_fine: B, the number of fine points.
        inverse_order: (N, A) int64 on starts' device, a permutation of ``0..A-1`` per row:
            output column ``a`` is band row ``inverse_order[n, a]``; ``None`` keeps the
            band's order.

    Raises:
        ValueError: unsorted starts, starts outside ``[0, B - W]``, or an ``inverse_order``
            that is not a permutation.

    Everything is checked here, once, so :meth:`forward` can trust it (the kernels rely on
    sorted rows; a bad permutation would gather garbage or trip a device assert).
    """

    starts: torch.Tensor
    weights: torch.Tensor
    inverse_order: torch.Tensor | None

    def __init__(
        self,
        starts: torch.Tensor,
        weights: torch.Tensor,
        num_fine: int,
        *,
        inverse_order: torch.Tensor | None = None,
    ) -> None:
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
        normalize: bool = False,
        center: str | None = None,
        border: str = "none",
        scale: float = 1.0,
        recording: tuple[float, float] | None = None,
        max_band_bytes: int | None = MAX_BAND_BYTES,
        **params: float,
    ) -> BandedResampler | OnTheFlyResampler:
        """Build the operator ``T[n, a, b] = r(c[n, a] - x[b])`` as a band.

        A band that would take more than ``max_band_bytes`` is not built: a named or
        tabulated response then gives the :class:`OnTheFlyResampler` of the same arguments
        (the same sums, the weights evaluated in the kernels, O(N A) memory; frozen, outputs
        in float32 unless ``dtype`` is float64), a callable (which only a band can hold) its
        band with a ``UserWarning``.

        Args:
            x: (B,) fine grid, non-decreasing, evenly spaced or not.
            c: (N, A) coarse points, any order (the output keeps it).
            response: a callable on offsets ``c - x`` (then ``support`` is required: r counts
                as zero where ``|c - x| > support``); a table ``(xs, ys)`` interpolated
                linearly, zero outside ``[xs[0], xs[-1]]``; or a name from
                :data:`gpu_ops.responses.NAMED` with its parameter as a keyword (its own,
                ``half_width=``, ``gamma=``, ``tau=``, or ``sigma=`` its standard deviation),
                ``support`` then in units of that parameter (gaussian default 4, lorentzian
                10, laplacian, exponential and alpha 5 sigma).
            support: see ``response``.
            dtype: weight dtype (float32, bfloat16, float16; float64 for gradcheck).
            device: where the operator lives (default: x's device).
            normalize, center, border, scale, recording: see
                :class:`gpu_ops.responses.Options` (a callable takes only ``scale``).
            max_band_bytes: the most bytes of weights ``(N, A, W)`` to store (default
                :data:`MAX_BAND_BYTES`, 16 MiB); None: the band whatever its size (e.g. to
                learn its weights).
            **params: the named response's parameter.

        Returns:
            The operator; windows are clipped at the grid edges, empty windows give 0.
            Windows and weights are found in float64, then stored in ``dtype``. Past
            ``max_band_bytes``: see above.
        """
        if "on_the_fly" in params:
            raise TypeError("on_the_fly= is gone: use OnTheFlyResampler.from_response")
        dev = torch.device(device) if device is not None else torch.as_tensor(x).device
        x64, c64 = responses.check_grid(x, c, dev)
        options = responses.Options(normalize, center, border, scale, recording)
        cut = responses.parse(response, support, params, dev, options, x64)
        c_sorted, order = torch.sort(c64, dim=1, stable=True)
        ties = responses.named(response).tie_ends if isinstance(response, str) else (False, False)
        first, last, W = responses.windows(x64, c_sorted, cut.lo, cut.hi, ties)
        N, A = c64.shape
        band_bytes = N * A * W * dtype.itemsize
        if max_band_bytes is not None and band_bytes > max_band_bytes:
            if isinstance(response, str | tuple):
                otf = torch.float64 if dtype == torch.float64 else torch.float32
                named: dict[str, Any] = dict(params)  # the parameter, e.g. sigma=0.2
                return OnTheFlyResampler(
                    x64, c64, response, support, dtype=otf, device=dev, normalize=normalize,
                    center=center, border=border, scale=scale, recording=recording, **named,
                )  # fmt: skip
            warnings.warn(
                f"a band of {band_bytes / 2**20:.0f} MiB (N={N}, A={A}, W={W}), more than "
                f"max_band_bytes={max_band_bytes}: a named response or a table (xs, ys) is "
                "computed in the kernels instead (OnTheFlyResampler), storing nothing",
                stacklevel=2,
            )
        starts = responses.clipped_starts(first, W, x64.numel())
        weights = torch.empty(N, A, W, dtype=dtype, device=dev)
        step = max(1, _CHUNK_ITEMS // max(1, N * W))
        for a0 in range(0, A, step):
            sl = slice(a0, a0 + step)
            band = responses.evaluate_band(
                x64, c_sorted[:, sl], cut.r, first[:, sl], last[:, sl], starts[:, sl], W
            )
            if cut.factor is not None:
                band = band * cut.factor(c_sorted[:, sl])[..., None]
            weights[:, sl] = band.to(dtype)
        return cls(starts, weights, x64.numel(), inverse_order=_inverse(order))

    @classmethod
    def from_dense(cls, T: torch.Tensor, tol: float = 0.0) -> BandedResampler:
        """Find each row's band in a dense ``T (N, A, B)``; entries ``|T| <= tol`` count as 0.

        Works a block of rows at a time: the peak memory is T plus the band plus a few MB.

        Raises:
            ValueError: a row whose entries above tol are not one contiguous window (named).
        """
        if T.ndim != 3:
            raise ValueError(f"T must have shape (N, A, B), got {tuple(T.shape)}")
        N, A, B = T.shape
        first, last = _dense_windows(T, tol)
        W = max(1, int((last - first).max())) if T.numel() else 1
        starts, order = torch.sort(responses.clipped_starts(first, W, B), dim=1, stable=True)
        first, last = first.gather(1, order), last.gather(1, order)
        weights = T.new_empty(N, A, W)
        j = torch.arange(W, device=T.device)
        k = max(1, _DENSE_CHUNK_ITEMS // max(1, W))
        for n in range(N):
            for a0 in range(0, A, k):
                sl = slice(a0, a0 + k)
                cols = starts[n, sl, None] + j  # (k, W)
                w = T[n][order[n, sl, None], cols]
                inside = (cols >= first[n, sl, None]) & (cols < last[n, sl, None])
                weights[n, sl] = torch.where(inside, w, torch.zeros_like(w))
        return cls(starts, weights, B, inverse_order=_inverse(order))

    # --- use ------------------------------------------------------------------------------

    def _input_layout(self) -> tuple[int, torch.device]:
        return self.starts.shape[0], self.starts.device

    def _resample(self, f: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _resample_ops.banded_forward(f, self.starts, self.weights, True)
        if self.inverse_order is not None:
            out = out.gather(-1, self.inverse_order.expand(out.shape[0], -1, -1))
        return out

    def _plan(self, packed3: torch.Tensor) -> _bits_resample.Plan:
        _, A, W = self.weights.shape
        if torch.is_grad_enabled() and self.weights.requires_grad:  # gradients to the weights
            M = packed3.shape[0]
            return _bits_resample.Plan(("band",) * M, (-1,) * M)
        B = self.num_fine
        return _bits_resample.plan(packed3, B, A, W, on_the_fly=False, pieces=None)

    def _check_bits_path(self, path: str) -> torch.dtype:
        if path == "prefix":
            raise ValueError("a stored band has no prefix-sum path (OnTheFlyResampler has)")
        return self.weights.dtype

    def _band_bits(self, items: torch.Tensor, bitorder: str, dtype: torch.dtype) -> torch.Tensor:
        """On the CPU, without gradients for the weights: the band straight from the bits
        (each row unpacked into a per-thread buffer, the same sums as on unpacked floats)."""
        if self.weights.device.type != "cpu" or (
            torch.is_grad_enabled() and self.weights.requires_grad
        ):
            return super()._band_bits(items, bitorder, dtype)
        out: torch.Tensor = _events_ops.banded_bits_forward(
            items, self.starts, self.weights, self.num_fine, bitorder == "big"
        )
        if self.inverse_order is not None:
            out = out.gather(-1, self.inverse_order.expand(out.shape[0], -1, -1))
        return out

    def _sparse(self, name: str, items: torch.Tensor, big: bool) -> torch.Tensor:
        out: torch.Tensor = _events_ops.events_band_forward(
            items, self.starts, self.weights, self.num_fine, big
        )
        if self.inverse_order is not None:
            out = out.gather(-1, self.inverse_order.expand(out.shape[0], -1, -1))
        return out

    def band(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts (N, A) int32, weights (N, A, W))`` in the caller's row order."""
        starts, weights = self.starts, self.weights
        if self.inverse_order is not None:
            inv = self.inverse_order
            starts = starts.gather(1, inv)
            weights = weights.gather(1, inv[..., None].expand_as(weights))
        return starts, weights

    @property
    def band_width(self) -> int:
        """W, the longest window in fine points."""
        return int(self.weights.shape[-1])

    def extra_repr(self) -> str:
        N, A, W = self.weights.shape
        return f"N={N}, A={A}, B={self.num_fine}, W={W}, dtype={self.weights.dtype}"

    # --- files ----------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the band to a safetensors file (format described in the README)."""
        tensors = {"starts": self.starts, "weights": self.weights}
        if self.inverse_order is not None:
            tensors["inverse_order"] = self.inverse_order
        _resampler_base.write(path, self.num_fine, {"mode": "stored"}, tensors)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None) -> BandedResampler:
        """Read a band written by :meth:`save` (safetensors, no pickle) onto ``device``.

        Raises:
            ValueError: not such a file, or a band that fails the constructor's checks (the
                message names the file). An on-the-fly file: use :func:`load`.
        """
        meta, t = _resampler_base.read(path, device)
        if meta.get("mode") == "on_the_fly":
            raise ValueError(f"{path}: an on-the-fly operator; read it with OnTheFlyResampler.load")
        try:
            num_fine = int(meta["num_fine"])
            return cls(t["starts"], t["weights"], num_fine, inverse_order=t.get("inverse_order"))
        except KeyError as exc:
            raise ValueError(f"{path}: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:  # a band that fails __init__'s checks
            raise type(exc)(f"{path}: {exc}") from None


def _inverse(order: torch.Tensor) -> torch.Tensor | None:
    """The inverse permutation of each row of ``order``; None when every row is the identity."""
    identity = bool((order == torch.arange(order.shape[1], device=order.device)).all())
    return None if identity else torch.argsort(order, dim=1)
