"""``forward_bits``: the resamplers applied to bit-packed inputs, by the cheapest exact path.

``op.forward_bits(packed)`` equals ``op(unpackbits(packed, dim=-1, count=B))`` (within float
tolerance) and reads each packed byte once. Three paths compute it:

- ``band``: unpack into the compute dtype, then the band kernels. Cost ~ M N A W (every fine
  point of every window), whatever the density; best for dense inputs and narrow windows, and
  the path whenever the operator's own tensors need gradients (the bits have none). A stored
  band on the CPU reads the bits itself (``banded_bits_forward``: each row unpacked into a
  per-thread buffer, then the same dot kernels).
- ``event``: each set bit adds its response to the coarse points whose window holds it. Cost
  ~ the events times the coarse points per window, plus one pass over the bytes.
- ``prefix``: for piecewise polynomial responses (boxcar, triangle, epanechnikov, on the fly),
  sliding sums over the events of ``(c - x)^j``: ~ events + M N A, whatever the width.

All three cut the response at the same window, so they agree with each other and with the
float64 reference. The choice is made per input item (the N rows of one ``m``) from its
measured density (its set bits, one pass over the bytes) and the response, by
:func:`choose`, whose cost model is calibrated on the kernels (see
``benchmarks/bench_elephant.py``); ``path=`` forces one. Per item, not per batch: an item's
result then depends on the item alone, not on what else a server batched with it (every
path is deterministic). Where the band costs less per item than counting and choosing would
(a light operator: a few fine points and coarse points), every item takes the band and
nothing is counted: the choice then follows from the operator's shape alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_ops import _events_ops, responses

PATHS = ("band", "event", "prefix")

# Cost model, in nanoseconds on one CPU thread, fitted to the C kernels' times (AMD EPYC,
# float32; N = 20, A = 500, B = 50,000, W = 160 and 1000, densities 1-30 %, M = 1 and 16):
# - band, per row: B fine points unpacked (cheap while one row's floats stay in cache, about
#   0.6 ns each when a batch's do not) and A W weights, each multiply-add shared by the M
#   inputs of the batch as weight loads are; on the fly each weight is also evaluated once
#   per batch;
# - event, per row: its packed bytes scanned, then per event a fixed cost and one per coarse
#   point whose window holds it (a gathered or an evaluated weight; on a lattice, see
#   gpu_ops._lattice, a float of a tabulated run added: measured on the demo workload of
#   benchmarks/bench_elephant.py, 10% density, sigma 1-200 ms);
# - prefix, per row: its bytes, then per event and per coarse point one step per piece.
_UNPACK_NS = (0.1, 0.5)  # (alone, the batch's share)
_FMA_NS = (0.08, 0.31)  # (shared, per input / M)
_EVAL_NS = 0.8
_SCAN_NS = 0.5
_EVENT_NS = {False: 15.0, True: 21.0}  # fixed per event: stored, on the fly
_PAIR_NS = 3.5
_LATTICE_NS = (6.0, 0.05)  # per event, per coarse point it reaches
_PREFIX_NS = 5.0
# Counting an item's set bits and choosing its path cost a few microseconds of host time
# (a kernel call, a sync on CUDA, Python per item): where the band costs less than this per
# item whatever the density, every item takes the band without being counted.
_CHOICE_NS = 1000.0


@dataclass(frozen=True)
class Choice:
    """The path :func:`choose` picked, and the estimated costs (ns) it compared."""

    path: str
    events: int
    costs: dict[str, float]


@dataclass(frozen=True)
class Plan:
    """The path of each input item (``m``), and its set bits (-1: not counted)."""

    paths: tuple[str, ...]
    events: tuple[int, ...]

    @property
    def path(self) -> str:
        """The one path every item takes, or ``"mixed"``."""
        return self.paths[0] if len(set(self.paths)) == 1 else "mixed"


def choose(
    events: int,
    rows: int,
    num_fine: int,
    num_coarse: int,
    width: float,
    *,
    on_the_fly: bool,
    pieces: int | None,
    batch: int = 1,
    lattice: bool = False,
) -> Choice:
    """The cheapest path for ``events`` set bits in ``rows`` rows of ``num_fine`` bits.

    Args:
        events: set bits in those rows.
        rows: input rows (N for one item).
        num_fine: B; num_coarse: A.
        width: the window's length in fine points (W).
        on_the_fly: weights computed per use (else stored).
        pieces: the response's polynomial pieces (prefix path), None when it has none.
        batch: items in the call (M): the band shares its weight loads among them.
        lattice: the event path adds tabulated runs (:mod:`gpu_ops._lattice`).
    """
    B, A, W, M = num_fine, num_coarse, max(width, 1.0), max(batch, 1)
    unpack = _UNPACK_NS[0] + _UNPACK_NS[1] * (1 - 1 / M)
    per_weight = _FMA_NS[0] + _FMA_NS[1] / M + (_EVAL_NS / M if on_the_fly else 0.0)
    costs = {"band": rows * (B * unpack + A * W * per_weight)}
    scan = rows * math.ceil(B / 8) * _SCAN_NS
    coarse_per_event = min(float(A), A * W / B)  # coarse points whose window holds a point
    per_event, per_pair = _LATTICE_NS if lattice else (_EVENT_NS[on_the_fly], _PAIR_NS)
    costs["event"] = scan + events * (per_event + coarse_per_event * per_pair)
    if pieces is not None:
        costs["prefix"] = scan + (events + rows * A) * pieces * _PREFIX_NS
    return Choice(min(costs, key=costs.__getitem__), events, costs)


def check_packed(
    packed: torch.Tensor, N: int, B: int, device: torch.device, bitorder: str, path: str
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``packed [..., N, ceil(B / 8)]`` as (M, N, nbytes) and its leading shape.

    Raises:
        TypeError: not a uint8 tensor.
        ValueError: a shape, device, bit order or path that does not fit.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = getattr(packed, "dtype", type(packed).__name__)
        raise TypeError(f"packed must be a uint8 tensor, got {got}")
    nbytes = math.ceil(B / 8)
    if packed.ndim < 2 or tuple(packed.shape[-2:]) != (N, nbytes):
        raise ValueError(
            f"packed must have shape [..., N, ceil(B / 8)] = [..., {N}, {nbytes}]; got "
            f"{list(packed.shape)}"
        )
    if packed.device != device:
        raise ValueError(f"packed is on {packed.device} but the operator is on {device}")
    if bitorder not in ("big", "little"):
        raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")
    if path not in ("auto", *PATHS):
        raise ValueError(f"path must be 'auto' or one of {PATHS}, got {path!r}")
    lead = tuple(packed.shape[:-2])
    return packed.reshape(-1, N, nbytes), lead


def item_events(packed3: torch.Tensor) -> list[int]:
    """Set bits of each item of ``packed3 (M, N, nbytes)`` (one pass over the bytes; a sync
    on CUDA)."""
    M, N, nbytes = packed3.shape
    if packed3.numel() == 0:
        return [0] * M
    counts: torch.Tensor = _events_ops.bit_counts(packed3.reshape(M * N, nbytes))
    per_item: list[int] = counts.view(M, N).sum(1).tolist()
    return per_item


def plan(
    packed3: torch.Tensor, B: int, A: int, width: float, *, on_the_fly: bool,
    pieces: int | None, lattice: bool = False,
) -> Plan:  # fmt: skip
    """Each item's cheapest path (see :func:`choose`); every item's is the band, uncounted,
    where the band costs less per item than counting and choosing would (``_CHOICE_NS``:
    the choice then depends on the operator's shape alone, never on the data)."""
    M, N = packed3.shape[:2]
    band = choose(0, N, B, A, width, on_the_fly=on_the_fly, pieces=pieces).costs["band"]
    if band < _CHOICE_NS:
        return Plan(("band",) * M, (-1,) * M)
    events = item_events(packed3)
    paths = [
        choose(e, N, B, A, width, on_the_fly=on_the_fly, pieces=pieces, lattice=lattice).path
        for e in events
    ]
    return Plan(tuple(paths), tuple(events))


def run(
    plan_: Plan,
    packed3: torch.Tensor,
    path: Callable[[str, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``path(name, items)`` for each group of items that take the same path, reassembled
    in the items' order: (M, N, A)."""
    names = sorted(set(plan_.paths))
    if len(names) == 1:
        return path(names[0], packed3)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name in names:
        rows = [m for m, p in enumerate(plan_.paths) if p == name]
        index = torch.tensor(rows, device=packed3.device)
        parts.append((index, path(name, packed3[index])))
    out = parts[0][1].new_empty((packed3.shape[0], *parts[0][1].shape[1:]))
    for index, part in parts:
        out[index] = part.to(out.dtype)
    return out


def unpack(packed3: torch.Tensor, B: int, bitorder: str, dtype: torch.dtype) -> torch.Tensor:
    """The band path's input: (M, N, B) in ``dtype``."""
    out: torch.Tensor = torch.ops.bitserve.unpackbits(packed3, 2, B, bitorder, dtype)
    return out


def shape_out(out: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """(M, N, A) back to the caller's leading dims ``lead`` + (N, A)."""
    return out.reshape(*lead, *out.shape[1:])


def pieces_of(response: str) -> int | None:
    """Polynomial pieces of an on-the-fly response, by name (None: not piecewise polynomial)."""
    got = responses.PIECES.get(response)
    return None if got is None else len(got[1])
