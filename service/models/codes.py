"""Inputs of n-bit codes (``packing = "codes"``): their config checks, their code tables on
the device, and how the metadata advertises them.

A codes input travels as UINT8 ``[batch, ..., ceil(L * code_bits / 8)]`` (the codes packed
along the last axis in the input's ``bitorder``) and reaches the model decoded through
``code_values`` into its dtype (:func:`gpu_ops.decode_codes`), a missing code (``nan`` in the
table) replaced by ``missing``: a number, or one value per feature from a safetensors file
(mean imputation). A ``[score]`` model keeps the codes packed (:mod:`service.models.score_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from service.models.config import ConfigError, InputConfig, ModelConfig
from service.models.layout import VersionSource
from service.text import safe_text


@dataclass(frozen=True)
class CodeTable:
    """What decoding one codes input needs, on the host until :meth:`to` a device.

    Attributes:
        code_bits: bits per code.
        count: L, the codes along the last axis.
        bitorder: ``"little"`` or ``"big"``.
        table: (2**code_bits,) float64, NaN for a missing code.
        missing: (1,) or (L,) float64: a missing code's value.
    """

    code_bits: int
    count: int
    bitorder: str
    table: torch.Tensor
    missing: torch.Tensor

    def to(self, device: torch.device) -> CodeTable:
        return CodeTable(self.code_bits, self.count, self.bitorder, self.table.to(device),
                         self.missing.to(device))  # fmt: skip

    def decode_into(self, packed: torch.Tensor, dst: torch.Tensor) -> None:
        """packed (n, ..., nb) uint8 -> ``dst`` (n, ..., L) in dst's dtype."""
        dst.copy_(
            torch.ops.bitserve.decode_codes(
                packed, self.code_bits, self.count, self.table, self.bitorder, self.missing,
                dst.dtype,
            )
        )  # fmt: skip


def read_code_tables(src: VersionSource, cfg: ModelConfig) -> dict[int, CodeTable]:
    """Each codes input's :class:`CodeTable`, its ``missing`` tensor read and checked.

    Raises:
        ConfigError: naming ``inputs[i].missing_file`` and what is wrong with the tensor.
    """
    from safetensors import safe_open

    out: dict[int, CodeTable] = {}
    problems: list[str] = []
    for i, spec in enumerate(cfg.inputs):
        if spec.packing != "codes":
            continue
        assert spec.code_bits is not None
        assert spec.code_values is not None
        L = spec.shape[-1]
        table = torch.tensor(spec.code_values, dtype=torch.float64)
        if spec.missing_file is not None and isinstance(spec.missing, str):
            where = f"{src.source}: inputs[{i}].missing_file"
            path = src.resolve(spec.missing_file, f"inputs[{i}].missing_file")
            try:
                with safe_open(str(path), framework="pt", device="cpu") as fh:
                    names = list(fh.keys())
                    if spec.missing not in names:
                        problems.append(f"{where}: {safe_text(spec.missing_file)} has no tensor "
                                        f"{safe_text(spec.missing)!r}")  # fmt: skip
                        continue
                    miss = fh.get_tensor(spec.missing)
            except Exception as exc:  # safetensors raises several types for a corrupt file
                raise src.error(where, "not a readable safetensors file", exc) from exc
            if list(miss.shape) != [L] or not miss.dtype.is_floating_point:
                problems.append(f"{where}: {safe_text(spec.missing)!r} must be a float tensor "
                                f"of shape [{L}], is {miss.dtype} {list(miss.shape)}")  # fmt: skip
                continue
            miss = miss.to(torch.float64)
            if not bool(torch.isfinite(miss).all()):
                problems.append(f"{where}: {safe_text(spec.missing)!r} has non-finite values")
                continue
        elif isinstance(spec.missing, float):
            miss = torch.tensor([spec.missing], dtype=torch.float64)
        else:
            miss = torch.tensor([math.nan], dtype=torch.float64)
        out[i] = CodeTable(spec.code_bits, L, spec.bitorder, table, miss)
    if problems:
        raise ConfigError(problems)
    return out


def wire_parameters(spec: InputConfig) -> dict[str, Any]:
    """The metadata ``parameters`` of a codes input (JSON: ``nan`` is written as null)."""
    params: dict[str, Any] = {
        "packing": "codes",
        "code_bits": spec.code_bits,
        "bitorder": spec.bitorder,
        "code_values": [None if math.isnan(v) else v for v in spec.code_values or []],
        "logical_shape": list(spec.shape),
        "logical_datatype": spec.datatype,
    }
    if spec.ids_sha256 is not None:
        params["ids_sha256"] = spec.ids_sha256
    return params
