"""The one small interface every model format implements, and the signature it reports.

A format is a subclass of :class:`ModelFile` in its own module of this package:

- ``__init__(path)`` loads the file on the host (never with pickle) and refuses a file it
  cannot read;
- :meth:`ModelFile.signature` says what the file itself states about its inputs and outputs
  (dtypes, static dims, dynamic dims and their bounds), or nothing where the format keeps
  no such record;
- :meth:`ModelFile.to` moves it to a device and returns the callable the pipeline calls
  with one tensor per input, batch first, in config order (outputs: a tensor, a sequence,
  or a dict by output name).

The dry run (a zero batch through the whole pipeline at batch 1 and at ``max_batch_size``)
and the signature check against ``config.toml`` are the same for every format
(:mod:`service.models.checks` and :class:`service.models.pipeline.Pipeline`), so a format only says
what it knows, and whether a failing call can abort the process
(:attr:`ModelFile.dry_run_in_child`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Dim:
    """One dimension of a tensor as a model file states it.

    Attributes:
        size: the size of a static dimension; None for a dynamic one.
        low: the least size of a dynamic dimension (0 when the file gives none).
        high: the largest size of a dynamic dimension; None when unbounded.
        name: a dynamic dimension's name in the file (``"batch"``), for messages.
    """

    size: int | None
    low: int = 0
    high: int | None = None
    name: str = ""

    def fits(self, n: int) -> bool:
        """Whether a size ``n`` is allowed here."""
        if self.size is not None:
            return n == self.size
        return n >= self.low and (self.high is None or n <= self.high)

    def fits_range(self, lo: int, hi: int) -> bool:
        """Whether every size from ``lo`` to ``hi`` is allowed (a batch dimension)."""
        if self.size is not None:
            return lo == hi == self.size
        return lo >= self.low and (self.high is None or hi <= self.high)

    def shown(self, role: str = "") -> str:
        """``2048``, ``batch <= 64``, ``batch in 2..64`` or ``batch`` (dynamic, unbounded)."""
        if self.size is not None:
            return str(self.size)
        label = role or self.name or "dynamic"
        if self.high is None:
            return label if self.low <= 1 else f"{label} >= {self.low}"
        return f"{label} <= {self.high}" if self.low <= 1 else f"{label} in {self.low}..{self.high}"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as a model file states it.

    Attributes:
        name: its name in the file (positional formats: the argument's name there).
        dtype: its dtype, or None when the file does not say.
        dims: its dimensions (the batch dimension first, where the model has one); None
            when the file does not say.
        used: whether the program reads it at all (False: the graph never does, as when
            one example tensor was passed for two inputs at export); None: not known.
    """

    name: str
    dtype: torch.dtype | None
    dims: tuple[Dim, ...] | None
    used: bool | None = None


@dataclass(frozen=True)
class FileSignature:
    """What a model file states about its inputs (and outputs): None where it says nothing.

    ``inputs`` are in the order the model takes them (positionally).
    """

    inputs: tuple[TensorSpec, ...] | None = None
    outputs: tuple[TensorSpec, ...] | None = None


class ModelFile(ABC):
    """A model file of one format, loaded on the host.

    Args:
        path: the file (inside the model's folder; checked by the caller).

    Raises:
        Exception: whatever the format's loader raises for a file it cannot read; the
            caller reports it against ``[model] file``.
    """

    format: ClassVar[str]
    """The format's name, as ``[model] format`` gives it."""
    suffixes: ClassVar[tuple[str, ...]]
    """The file suffixes that select this format (without ``[model] format``)."""
    dtype_from_file: ClassVar[bool]
    """Whether :meth:`signature` gives the inputs' dtypes (else ``[[inputs]] dtype`` does)."""
    dry_run_in_child: ClassVar[bool] = False
    """Whether a failing call can abort the whole process (code compiled for this model
    that throws where no exception can pass, as an AOTInductor kernel inside an OpenMP
    region does): its dry run is then made first in a child process
    (:mod:`service.models.dry_run_child`), where a crash is a refusal."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def signature(self) -> FileSignature:
        """What the file states about its inputs and outputs."""

    @abstractmethod
    def to(self, device: torch.device) -> Callable[..., Any]:
        """The model on ``device``, as the callable the pipeline runs.

        Raises:
            ValueError: the file cannot run on ``device`` (an AOTInductor package compiled
                for another kind of device); the message says why.
        """

    def device_bytes(self, runner: Callable[..., Any]) -> int:
        """Bytes of weights ``runner`` keeps on its device, where known (else 0)."""
        if not isinstance(runner, torch.nn.Module):
            return 0
        tensors = list(runner.parameters()) + list(runner.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)


def dims_of(shape: Sequence[Any], ranges: Any = None) -> tuple[Dim, ...]:
    """:class:`Dim` s of a traced shape: ints are static, symbols dynamic (bounds from
    ``ranges``, a ``{symbol: ValueRanges}`` map such as ``ExportedProgram.range_constraints``)."""
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(Dim(d))
            continue
        node = getattr(d, "node", None)
        expr = getattr(node, "expr", d)
        vr = (ranges or {}).get(expr)
        low = int(vr.lower) if vr is not None and _finite(vr.lower) else 0
        high = int(vr.upper) if vr is not None and _finite(vr.upper) else None
        out.append(Dim(None, low, high, str(expr)))
    return tuple(out)


def _finite(value: Any) -> bool:
    try:
        return abs(float(value)) < 2**62
    except (TypeError, ValueError):
        return False
