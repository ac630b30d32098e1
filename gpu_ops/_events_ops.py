"""The resamplers' bit-input paths as torch operators (``torch.ops.bitserve.*``).

``forward_bits`` (:mod:`gpu_ops._bits_resample`) chooses among three exact paths; the band
path is ``unpackbits`` then the band ops of :mod:`gpu_ops._resample_ops`. These are the
other two, and the bit count that the choice reads:

==========================  ==================================================================
op                          computes
==========================  ==================================================================
``bit_counts``              set bits per row of packed (R, nbytes): int64 (R,)
``events_band_forward``     out (M, N, A): each event adds its stored weights to the windows
                            that hold it
``events_otf_forward``      the same, the response evaluated per event (on the fly)
``prefix_forward``          out (M, N, A) of a piecewise polynomial response (boxcar,
                            triangle, epanechnikov) by prefix sums over the events
==========================  ==================================================================

===========  ==============================================================================
device       kernel
===========  ==============================================================================
CPU          compiled C (:mod:`gpu_ops._resample_c`); torch where none is built
CUDA         Triton (:mod:`gpu_ops._triton.events`), registered when Triton imports
any other    plain torch (:mod:`gpu_ops._events_torch`): the event ops unpack and run the
             band kernels (the same sums), the prefix op sums over the fine grid
fake / meta  shapes and dtypes only
===========  ==============================================================================

Packed inputs are ``(M, N, nbytes)`` uint8, bit ``b`` of a row in byte ``b // 8`` (``big``:
from the top bit down, as NumPy's default), ``nbytes >= ceil(B / 8)``; the output is float32
(float64 when the weights or the parameter are). No autograd: the input is bits.
``forward_bits`` takes the band path when the operator's own parameters need gradients. The
ops trust their arguments: :mod:`gpu_ops._bits_resample` checks them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpu_ops import _events_torch, _resample_c, _resample_torch, responses
from gpu_ops._library import Op

try:  # Triton is optional: without it CUDA tensors take the torch kernels.
    from gpu_ops._triton import events as _triton_events
except ImportError:  # pragma: no cover - depends on the environment
    _triton_events = None  # type: ignore[assignment]


def _out_dtype(*ts: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _wide(*ts: Tensor) -> bool:
    return _out_dtype(*ts) == torch.float64


# --- bit counts ---------------------------------------------------------------------------------

bit_counts = Op("bit_counts(Tensor packed) -> Tensor")


@bit_counts.register_kernel(None)
def _torch_bit_counts(packed: Tensor) -> Tensor:
    """Set bits per row of ``packed (R, nbytes)`` uint8: int64 ``(R,)``."""
    return _events_torch.bit_counts(packed)


@bit_counts.register_kernel("cpu")
def _(packed: Tensor) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None:
        return _torch_bit_counts(packed)
    return _resample_c.bit_counts(lib, packed.contiguous())


@bit_counts.register_fake
def _(packed: Tensor) -> Tensor:
    return packed.new_empty(packed.shape[:1], dtype=torch.int64)


# --- event scatter, stored band -----------------------------------------------------------------

events_band_forward = Op(
    "events_band_forward(Tensor packed, Tensor starts, Tensor weights, SymInt num_fine, "
    "bool big) -> Tensor"
)


@events_band_forward.register_kernel(None)
def _torch_events_band(
    packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool
) -> Tensor:
    """out (M, N, A) float32 (float64 weights: float64) from packed (M, N, nbytes).

    ``starts (N, A)`` int32, non-decreasing along each row, in ``[0, B - W]``; ``weights
    (N, A, W)``.
    """
    ct = _out_dtype(weights)
    f = _events_torch.unpacked(packed, num_fine, big, ct)
    return _resample_torch.forward(f, starts, weights).to(ct)


@events_band_forward.register_kernel("cpu")
def _(packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None or _wide(weights):
        return _torch_events_band(packed, starts, weights, num_fine, big)
    s, w = starts.contiguous(), weights.contiguous()
    return _resample_c.events_band(lib, packed.contiguous(), big, s, w, num_fine)


@events_band_forward.register_fake
def _(packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool) -> Tensor:
    return weights.new_empty((packed.shape[0], *starts.shape), dtype=_out_dtype(weights))


# --- event scatter, on the fly ------------------------------------------------------------------

events_otf_forward = Op(
    "events_otf_forward(Tensor packed, Tensor x, Tensor c, Tensor param, str response, "
    "float? support, bool big) -> Tensor"
)


@events_otf_forward.register_kernel(None)
def _torch_events_otf(
    packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    big: bool,
) -> Tensor:  # fmt: skip
    """out (M, N, A) float32 (float64 param: float64): the named response on the events.

    Args as :data:`gpu_ops._resample_ops.on_the_fly_forward`'s, with ``packed (M, N,
    nbytes)`` for f and c in any order.
    """
    ct = _out_dtype(param)
    f = _events_torch.unpacked(packed, x.numel(), big, ct)
    spec = responses.named(response)
    return _resample_torch.otf_forward(f, x, c, spec, param, support).to(ct)


def _sorted_windows(
    x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None
) -> tuple[_resample_c.Windows, Tensor]:
    """The C kernels' windows of c sorted per row, and the inverse order (N, A)."""
    spec = responses.named(response)
    value = float(param)
    c_sorted, order = torch.sort(c.detach(), dim=1, stable=True)
    win = _resample_c.Windows(x, c_sorted, spec.code, value, *spec.window(value, support))
    return win, torch.argsort(order, dim=1)


@events_otf_forward.register_kernel("cpu")
def _(
    packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    big: bool,
) -> Tensor:  # fmt: skip
    lib = _resample_c.kernels()
    if lib is None or _wide(param):
        return _torch_events_otf(packed, x, c, param, response, support, big)
    win, inverse = _sorted_windows(x, c, param, response, support)
    out = _resample_c.events_otf(lib, packed.contiguous(), big, win, x.numel())
    return out.gather(-1, inverse.expand(out.shape[0], -1, -1))


@events_otf_forward.register_fake
def _(
    packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    big: bool,
) -> Tensor:  # fmt: skip
    return c.new_empty((packed.shape[0], *c.shape), dtype=_out_dtype(param))


# --- prefix sums --------------------------------------------------------------------------------

prefix_forward = Op(
    "prefix_forward(Tensor packed, Tensor x, Tensor c, Tensor param, str response, "
    "float? support, bool big) -> Tensor"
)


def _pieces(response: str, param: Tensor, support: float | None) -> tuple[Tensor, Tensor]:
    spec = responses.named(response)
    spec.extent(support)  # compact responses only: refuses a support
    got = responses.pieces(response, float(param))
    if got is None:
        raise ValueError(f"{response!r} is not piecewise polynomial: no prefix-sum path")
    return got


@prefix_forward.register_kernel(None)
def _torch_prefix(
    packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    big: bool,
) -> Tensor:  # fmt: skip
    """out (M, N, A) float32 (float64 param: float64) of a boxcar, triangle or epanechnikov
    response on the events, by prefix sums (arguments as :data:`events_otf_forward`'s)."""
    t, coef = _pieces(response, param, support)
    bits = _events_torch.unpacked(packed, x.numel(), big, torch.float64)
    c64 = c.detach().to(torch.float64)
    return _events_torch.prefix(bits, x, c64, t.to(x.device), coef).to(_out_dtype(param))


@prefix_forward.register_kernel("cpu")
def _(
    packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    big: bool,
) -> Tensor:  # fmt: skip
    lib = _resample_c.kernels()
    if lib is None or _wide(param):
        return _torch_prefix(packed, x, c, param, response, support, big)
    t, coef = _pieces(response, param, support)
    c_sorted, order = torch.sort(c.detach().to(torch.float64), dim=1, stable=True)
    c_sorted = c_sorted.contiguous()
    bounds = _events_torch.piece_bounds(x, c_sorted, t).contiguous()
    out = _resample_c.prefix(lib, packed.contiguous(), big, x.contiguous(), c_sorted, bounds, coef)
    return out.gather(-1, torch.argsort(order, dim=1).expand(out.shape[0], -1, -1))


@prefix_forward.register_fake
def _(
    packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str, support: float | None,
    big: bool,
) -> Tensor:  # fmt: skip
    return c.new_empty((packed.shape[0], *c.shape), dtype=_out_dtype(param))


# --- CUDA: Triton --------------------------------------------------------------------------------

if _triton_events is not None:
    _ev = _triton_events

    @bit_counts.register_kernel("cuda")
    def _(packed: Tensor) -> Tensor:
        return _ev.bit_counts(packed.contiguous())

    @events_band_forward.register_kernel("cuda")
    def _(packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool) -> Tensor:
        if _wide(weights):
            return _torch_events_band(packed, starts, weights, num_fine, big)
        s, w = starts.contiguous(), weights.contiguous()
        return _ev.events_band(packed.contiguous(), big, s, w, num_fine)

    @events_otf_forward.register_kernel("cuda")
    def _(
        packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str,
        support: float | None, big: bool,
    ) -> Tensor:  # fmt: skip
        if _wide(param):
            return _torch_events_otf(packed, x, c, param, response, support, big)
        spec = responses.named(response)
        value = float(param)
        lo, hi = spec.window(value, support)
        return _ev.events_otf(packed.contiguous(), big, x, c, spec.code, value, lo, hi)

    @prefix_forward.register_kernel("cuda")
    def _(
        packed: Tensor, x: Tensor, c: Tensor, param: Tensor, response: str,
        support: float | None, big: bool,
    ) -> Tensor:  # fmt: skip
        if _wide(param):
            return _torch_prefix(packed, x, c, param, response, support, big)
        _pieces(response, param, support)  # a clear error for other responses
        return _ev.prefix(packed.contiguous(), big, x, c, response, float(param))
