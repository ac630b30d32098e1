"""The resamplers' bit-input paths as torch operators (``torch.ops.bitserve.*``).

``forward_bits`` (:mod:`gpu_ops._bits_resample`) chooses among three exact paths; the band
path is ``unpackbits`` then the band ops of :mod:`gpu_ops._resample_ops`. These are the
other two, and the bit count that the choice reads:

==========================  ==================================================================
op                          computes
==========================  ==================================================================
``bit_counts``              set bits per row of packed (R, nbytes): int64 (R,)
``banded_bits_forward``     out (M, N, A): the band path, the stored band on the bits (each
                            row unpacked into a per-thread buffer on the CPU)
``events_band_forward``     out (M, N, A): each event adds its stored weights to the windows
                            that hold it
``events_otf_forward``      the same, the response (named, or a table) evaluated per event
                            (on the fly)
``events_lattice_forward``  the same on a lattice (:mod:`gpu_ops._lattice`): the response
                            tabulated once per geometry, each event adds a run of the table
``prefix_forward``          out (M, N, A) of a piecewise polynomial response (boxcar,
                            triangle, epanechnikov) by prefix sums over the events
==========================  ==================================================================

===========  ==============================================================================
device       kernel
===========  ==============================================================================
CPU          compiled C (:mod:`gpu_ops._resample_c`); torch where none is built
CUDA         Triton (:mod:`gpu_ops._triton.events`), registered when Triton is installed
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

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gpu_ops import _events_torch, _lattice, _resample_c, _resample_torch, responses
from gpu_ops._lazy_triton import triton_kernels
from gpu_ops._library import Op

# Triton is optional (without it CUDA tensors take the torch kernels) and imported at the
# first CUDA call (gpu_ops._lazy_triton).
if TYPE_CHECKING:
    from gpu_ops._triton import events as _triton_events
else:
    _triton_events = triton_kernels("events")


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
    (N, A, W)``. Without an event kernel: the band on the unpacked bits (the same sums).
    """
    return _torch_banded_bits(packed, starts, weights, num_fine, big)


@events_band_forward.register_kernel("cpu")
def _(packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None or _wide(weights):
        return _torch_events_band(packed, starts, weights, num_fine, big)
    s, w = starts.contiguous(), weights.contiguous()
    return _resample_c.events_band(lib, packed.contiguous(), big, s, w, num_fine)


@events_band_forward.register_fake
def _band_fake(packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool) -> Tensor:
    """The stored band's bit ops' fake kernel: (M, N, A) in the output dtype."""
    return weights.new_empty((packed.shape[0], *starts.shape), dtype=_out_dtype(weights))


# --- the band, from bits -------------------------------------------------------------------------

banded_bits_forward = Op(
    "banded_bits_forward(Tensor packed, Tensor starts, Tensor weights, SymInt num_fine, "
    "bool big) -> Tensor"
)


@banded_bits_forward.register_kernel(None)
def _torch_banded_bits(
    packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool
) -> Tensor:
    """out (M, N, A) float32 (float64 weights: float64): the stored band on the bits
    unpacked, ``banded_forward(unpackbits(packed))``.

    Args:
        packed: (M, N, nbytes) uint8.
        starts: (N, A) int32, non-decreasing along each row; weights: (N, A, W).
        num_fine: B.
        big: the bit order.
    """
    f = _events_torch.unpacked(packed, num_fine, big, _out_dtype(weights))
    out: Tensor = torch.ops.bitserve.banded_forward(f, starts, weights, True)
    return out


@banded_bits_forward.register_kernel("cpu")
def _(packed: Tensor, starts: Tensor, weights: Tensor, num_fine: int, big: bool) -> Tensor:
    lib = _resample_c.kernels()
    # Tasks are rows: with fewer rows than threads, unpacking first keeps every thread busy.
    if lib is None or _wide(weights) or starts.shape[0] < torch.get_num_threads():
        return _torch_banded_bits(packed, starts, weights, num_fine, big)
    s, w = starts.contiguous(), weights.contiguous()
    return _resample_c.forward_bits(lib, packed.contiguous(), big, s, w, num_fine)


banded_bits_forward.register_fake(_band_fake)


# --- event scatter, on the fly ------------------------------------------------------------------

events_otf_forward = Op(
    "events_otf_forward(Tensor packed, Tensor x, Tensor c, Tensor first, Tensor last, "
    "Tensor param, str response, bool big) -> Tensor"
)


@events_otf_forward.register_kernel(None)
def _torch_events_otf(
    packed: Tensor, x: Tensor, c: Tensor, first: Tensor, last: Tensor, param: Tensor,
    response: str, big: bool,
) -> Tensor:  # fmt: skip
    """out (M, N, A) float32 (float64 param: float64): the response on the events.

    Args:
        packed: (M, N, nbytes) uint8.
        x: (B,) float64, sorted.
        c: (N, A) float64, sorted along each row (the kernels' coarse points, a causal
            response's centring shift included).
        first, last: (N, A) int64, each window ``[first, last)`` in fine points.
        param: 0-d, the response's parameter; for "tabulated" the table (2, K).
        response: a name from :data:`gpu_ops.responses.NAMED`, or "tabulated" (see
            :class:`gpu_ops.responses.KernelResponse`).
        big: the bit order.
    """
    ct = _out_dtype(param)
    f = _events_torch.unpacked(packed, x.numel(), big, ct)
    resp = responses.KernelResponse(response, param)
    win = _resample_torch.Windows.given(first, last, x.numel())
    return _resample_torch.otf_forward(f, x, c, resp, None, win).to(ct)


@events_otf_forward.register_kernel("cpu")
def _(
    packed: Tensor, x: Tensor, c: Tensor, first: Tensor, last: Tensor, param: Tensor,
    response: str, big: bool,
) -> Tensor:  # fmt: skip
    lib = _resample_c.kernels()
    if lib is None or _wide(param):
        return _torch_events_otf(packed, x, c, first, last, param, response, big)
    resp = responses.KernelResponse(response, param)
    win = _resample_c.Windows.given(x, c, first, last, resp)
    return _resample_c.events_otf(lib, packed.contiguous(), big, win, x.numel())


@events_otf_forward.register_fake
def _(
    packed: Tensor, x: Tensor, c: Tensor, first: Tensor, last: Tensor, param: Tensor,
    response: str, big: bool,
) -> Tensor:  # fmt: skip
    return c.new_empty((packed.shape[0], *c.shape), dtype=_out_dtype(param))


# --- event scatter on a lattice (on the fly, the response tabulated once) -----------------------

events_lattice_forward = Op(
    "events_lattice_forward(Tensor packed, Tensor first, Tensor last, Tensor tables, "
    "Tensor tid, int jmin, bool walk, SymInt num_fine, bool big) -> Tensor"
)


@events_lattice_forward.register_kernel(None)
def _torch_events_lattice(
    packed: Tensor, first: Tensor, last: Tensor, tables: Tensor, tid: Tensor, jmin: int,
    walk: bool, num_fine: int, big: bool,
) -> Tensor:  # fmt: skip
    """out (M, N, A) float32: the events with their weights from the lattice's tables.

    Args:
        packed: (M, N, nbytes) uint8.
        first, last: (N, A) int64, each window ``[first, last)`` (coarse points sorted).
        tables: (T, step, J) float32; tid: (N,) int64; jmin, walk: see
            :class:`gpu_ops._lattice.Lattice` (the torch kernel reads the windows either way).
        num_fine: B.
        big: the bit order.
    """
    bits = _events_torch.unpacked(packed, num_fine, big, torch.float32)
    return _lattice.forward(bits, first, last, tables, tid, jmin)


@events_lattice_forward.register_kernel("cpu")
def _(
    packed: Tensor, first: Tensor, last: Tensor, tables: Tensor, tid: Tensor, jmin: int,
    walk: bool, num_fine: int, big: bool,
) -> Tensor:  # fmt: skip
    lib = _resample_c.kernels()
    if lib is None:
        return _torch_events_lattice(packed, first, last, tables, tid, jmin, walk, num_fine, big)
    args = (first.contiguous(), last.contiguous(), tables.float().contiguous(), tid.contiguous())
    return _resample_c.events_lattice(lib, packed.contiguous(), big, *args, jmin, walk, num_fine)


@events_lattice_forward.register_fake
def _(
    packed: Tensor, first: Tensor, last: Tensor, tables: Tensor, tid: Tensor, jmin: int,
    walk: bool, num_fine: int, big: bool,
) -> Tensor:  # fmt: skip
    return tables.new_empty((packed.shape[0], *first.shape), dtype=torch.float32)


# --- prefix sums --------------------------------------------------------------------------------

prefix_forward = Op(
    "prefix_forward(Tensor packed, Tensor x, Tensor c, Tensor bounds, Tensor coef, bool big) "
    "-> Tensor"
)


@prefix_forward.register_kernel(None)
def _torch_prefix(
    packed: Tensor, x: Tensor, c: Tensor, bounds: Tensor, coef: Tensor, big: bool
) -> Tensor:
    """out (M, N, A) float32 (float64 coef: float64) of a piecewise polynomial response.

    Args:
        packed: (M, N, nbytes) uint8.
        x: (B,) float64, sorted.
        c: (N, A) float64, sorted along each row.
        bounds: (P + 1, N, A) int64, the pieces' fine bounds
            (:func:`gpu_ops._events_torch.piece_bounds`).
        coef: (P, 3) float64 or float32: ``r(d) = coef[k] . (1, d, d²)`` on piece k.
        big: the bit order.
    """
    bits = _events_torch.unpacked(packed, x.numel(), big, torch.float64)
    out = _events_torch.prefix_bounds(bits, x, c, bounds, coef.to(torch.float64))
    return out.to(_out_dtype(coef))


@prefix_forward.register_kernel("cpu")
def _(packed: Tensor, x: Tensor, c: Tensor, bounds: Tensor, coef: Tensor, big: bool) -> Tensor:
    lib = _resample_c.kernels()
    if lib is None or _wide(coef):
        return _torch_prefix(packed, x, c, bounds, coef, big)
    args = (x.contiguous(), c.contiguous(), bounds.contiguous(), coef.double().contiguous())
    return _resample_c.prefix(lib, packed.contiguous(), big, *args)


@prefix_forward.register_fake
def _(packed: Tensor, x: Tensor, c: Tensor, bounds: Tensor, coef: Tensor, big: bool) -> Tensor:
    return c.new_empty((packed.shape[0], *c.shape), dtype=_out_dtype(coef))


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
        packed: Tensor, x: Tensor, c: Tensor, first: Tensor, last: Tensor, param: Tensor,
        response: str, big: bool,
    ) -> Tensor:  # fmt: skip
        if _wide(param):
            return _torch_events_otf(packed, x, c, first, last, param, response, big)
        resp = responses.KernelResponse(response, param)
        return _ev.events_otf(packed.contiguous(), big, x, c, first, last, resp)

    @prefix_forward.register_kernel("cuda")
    def _(packed: Tensor, x: Tensor, c: Tensor, bounds: Tensor, coef: Tensor, big: bool) -> Tensor:
        if _wide(coef):
            return _torch_prefix(packed, x, c, bounds, coef, big)
        return _ev.prefix(packed.contiguous(), big, x, c, bounds, coef.double())
