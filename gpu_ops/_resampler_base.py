"""What the two resampler modules share: input checks, the dense picture, the file format.

:class:`gpu_ops.resample.BandedResampler` stores a band; :class:`gpu_ops.OnTheFlyResampler`
computes it inside the kernels. Both take f (N, B) or (M, N, B) and give (N, A) or (M, N, A),
and both save to one safetensors format (``format=bitserve.BandedResampler``, ``version=1``,
``mode`` = ``stored`` or ``on_the_fly``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_ops import _bits_resample, _reference

FORMAT = "bitserve.BandedResampler"
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_input(f: torch.Tensor, N: int, B: int, device: torch.device) -> torch.Tensor:
    """f (N, B) or (M, N, B) -> (M, N, B), with errors that say what was expected."""
    if not isinstance(f, torch.Tensor):
        raise TypeError(f"f must be a torch.Tensor, got {type(f).__name__}")
    if f.ndim not in (2, 3) or tuple(f.shape[-2:]) != (N, B):
        raise ValueError(
            f"f must have shape (N, B) or (M, N, B) with N={N}, B={B}; got {tuple(f.shape)}"
        )
    if f.dtype not in INPUT_DTYPES:
        raise TypeError(f"f must be float32, bfloat16, float16 or float64; got {f.dtype}")
    if f.device != device:
        raise ValueError(f"f is on {f.device} but the operator is on {device}")
    return f if f.ndim == 3 else f.unsqueeze(0)


class Resampler(nn.Module):
    """The shared part: ``forward(f)`` checks f and hands (M, N, B) to :meth:`_resample`."""

    num_fine: int

    def _resample(self, f: torch.Tensor) -> torch.Tensor:
        """(M, N, A) from the checked f (M, N, B)."""
        raise NotImplementedError

    def _input_layout(self) -> tuple[int, torch.device]:
        """N and the operator's device."""
        raise NotImplementedError

    def band(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts (N, A) int32, weights (N, A, W))`` in the caller's row order."""
        raise NotImplementedError

    def _plan(self, packed3: torch.Tensor) -> _bits_resample.Plan:
        """Each item's path for ``packed3 (M, N, nbytes)`` (see :mod:`gpu_ops._bits_resample`)."""
        raise NotImplementedError

    def _band_bits(self, items: torch.Tensor, bitorder: str, dtype: torch.dtype) -> torch.Tensor:
        """The ``band`` path on ``items (M, N, nbytes)``: unpacked into ``dtype``, then the
        module (with its autograd): (M, N, A)."""
        return self._resample(_bits_resample.unpack(items, self.num_fine, bitorder, dtype))

    def _sparse(self, name: str, items: torch.Tensor, big: bool) -> torch.Tensor:
        """The ``event`` or ``prefix`` path on ``items (M, N, nbytes)``: (M, N, A)."""
        raise NotImplementedError

    def _check_bits_path(self, path: str) -> torch.dtype:
        """Refuse a forced path the module cannot take; the default output dtype."""
        raise NotImplementedError

    def plan_bits(self, packed: torch.Tensor, bitorder: str = "big") -> _bits_resample.Plan:
        """The path :meth:`forward_bits` would take for each item of ``packed``."""
        N, device = self._input_layout()
        packed3, _ = _bits_resample.check_packed(packed, N, self.num_fine, device, bitorder, "auto")
        return self._plan(packed3)

    def forward_bits(
        self,
        packed: torch.Tensor,
        bitorder: str = "big",
        *,
        path: str = "auto",
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The module on bit-packed inputs: ``self(unpackbits(packed, dim=-1, count=B))``.

        Args:
            packed: ``[..., N, ceil(B / 8)]`` uint8, packed along the last axis.
            bitorder: ``"big"`` (NumPy's default) or ``"little"``.
            path: ``"auto"`` (per input item, by :mod:`gpu_ops._bits_resample`'s cost
                model, from the set bits counted in ``packed``), ``"band"``, ``"event"``,
                or on the fly for boxcar, triangle and epanechnikov ``"prefix"``.
            dtype: the output dtype (default: the weights' for a stored band, the
                parameter's on the fly).

        Returns:
            ``[..., N, A]``. When the module's own tensors require gradients (stored weights
            made to; c or the width of an ``OnTheFlyResampler(..., trainable=True)``) and
            grad mode is on, ``"auto"`` takes the band path
            and gradients reach them as in :meth:`forward`; the event and prefix paths have
            no backward (run them under ``torch.no_grad()`` or ``torch.inference_mode()``).

        Raises:
            ValueError: a shape, device, bit order or path that does not fit (``"prefix"`` on
                a stored band or a response that is not piecewise polynomial; ``"event"`` or
                ``"prefix"`` with gradients wanted).
        """
        N, device = self._input_layout()
        B = self.num_fine
        packed3, lead = _bits_resample.check_packed(packed, N, B, device, bitorder, path)
        out_dtype = dtype or self._check_bits_path(path)
        M = packed3.shape[0]
        plan = self._plan(packed3) if path == "auto" else _bits_resample.Plan((path,) * M, ())

        def run(name: str, items: torch.Tensor) -> torch.Tensor:
            if name == "band":
                return self._band_bits(items, bitorder, out_dtype)
            return self._sparse(name, items, bitorder == "big")

        out = _bits_resample.run(plan, packed3, run)
        return _bits_resample.shape_out(out.to(out_dtype), lead)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """Resample f.

        Args:
            f: (N, B) or (M, N, B), float32, bfloat16 or float16 (float64 for gradcheck), on
                the operator's device.

        Returns:
            (N, A) or (M, N, A) in f's dtype (accumulated in float32), in the order of the
            coarse points the operator was built from.
        """
        N, device = self._input_layout()
        out = self._resample(check_input(f, N, self.num_fine, device))
        return out if f.ndim == 3 else out.squeeze(0)

    def to_dense(self) -> torch.Tensor:
        """The dense operator ``T (N, A, B)`` (for checks and small sizes only)."""
        starts, weights = self.band()
        return _reference.banded_to_dense(starts, weights, self.num_fine)

    @property
    def nbytes(self) -> int:
        """Bytes the operator keeps resident (buffers and parameters)."""
        tensors = [*self.buffers(), *self.parameters()]
        return sum(t.numel() * t.element_size() for t in tensors)


def write(path: str | Path, num_fine: int, meta: dict[str, str], tensors: dict[str, Any]) -> None:
    """Save ``tensors`` (moved to the CPU) with the format's metadata plus ``meta``."""
    from safetensors.torch import save_file

    head = {"format": FORMAT, "version": "1", "num_fine": str(num_fine)}
    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(data, str(path), metadata=head | meta)


def read(
    path: str | Path, device: torch.device | str | None, *, tensors: bool = True
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors on ``device``) of a resampler file; safetensors, never pickle.

    With ``tensors=False`` only the metadata is read (the tensors dict is empty).

    Raises:
        ValueError: the file is not a resampler file of a version this code reads.
    """
    from safetensors import safe_open

    dev = str(torch.device(device)) if device is not None else "cpu"
    with safe_open(str(path), framework="pt", device=dev) as fh:
        meta: dict[str, str] = fh.metadata() or {}
        if meta.get("format") != FORMAT or meta.get("version") != "1":
            raise ValueError(f"{path}: not a {FORMAT} v1 file (metadata {meta})")
        keys = fh.keys() if tensors else []
        return meta, {k: fh.get_tensor(k) for k in keys}
