"""A model's tensors in its ``config.toml``: the ``[[inputs]]`` and ``[[outputs]]`` sections
(their datatypes, shapes, bit-packing and codes keys), and the base every section shares.

:mod:`service.models.config` holds the rest of the file (operator, model, index, score, the model's
own keys) and reads it.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from service.protocol.types import MODEL_INPUT_DATATYPES, MODEL_OUTPUT_DATATYPES, REGISTRY

__all__ = [
    "CODES_DTYPE_NAMES",
    "UNPACK_DTYPE_NAMES",
    "HandedDtype",
    "InputConfig",
    "InputDatatype",
    "OutputConfig",
    "OutputDatatype",
    "Strict",
    "one_of",
    "relative_file",
]


def one_of(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """A check that a value is one of ``allowed`` (a view of the datatype registry)."""

    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"Input should be one of {', '.join(allowed)}")
        return value

    return check


InputDatatype = Annotated[str, AfterValidator(one_of(MODEL_INPUT_DATATYPES))]
OutputDatatype = Annotated[str, AfterValidator(one_of(MODEL_OUTPUT_DATATYPES))]
# The dtypes bits unpack straight into (gpu_ops.UNPACK_DTYPES), by name.
UNPACK_DTYPE_NAMES = ("uint8", "bool", "float16", "bfloat16", "float32", "float64")
# The dtypes codes decode straight into (gpu_ops.codes.DECODE_DTYPES), by name.
CODES_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
HandedDtype = Literal[
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"
]


class Strict(BaseModel):
    """A config section: unknown keys are refused, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def relative_file(value: str) -> str:
    """A file name relative to the config's folder (a key naming a file), else ValueError."""
    p = Path(value)
    if not value or p.is_absolute() or ".." in p.parts or "\\" in value or "\x00" in value:
        raise ValueError("must be a file name relative to the config's folder, without '..'")
    return value


_FLOAT_DATATYPES = ("FP16", "BF16", "FP32", "FP64")


def _check_codes_fields(spec: InputConfig) -> None:
    """The ``packing = "codes"`` keys of one input, together (pydantic's after-validator).

    Raises:
        ValueError: naming the key; pydantic prefixes the input's location.
    """
    codes_keys = ("code_bits", "code_values", "missing", "missing_file", "ids_sha256")
    if spec.packing != "codes":
        given = [k for k in codes_keys if getattr(spec, k) is not None]
        if given:
            raise ValueError(f'{", ".join(given)} only apply to packing = "codes"')
        return
    if spec.datatype not in _FLOAT_DATATYPES:
        raise ValueError(
            f'packing = "codes" needs a floating-point datatype ({", ".join(_FLOAT_DATATYPES)}), '
            f"not {spec.datatype!r}"
        )
    if spec.code_bits is None:
        raise ValueError('packing = "codes" needs code_bits (1, 2 or 4)')
    n = 1 << spec.code_bits
    if spec.code_values is None or len(spec.code_values) != n:
        got = "none" if spec.code_values is None else f"{len(spec.code_values)}"
        raise ValueError(
            f"code_values needs {n} values for code_bits = {spec.code_bits} (one per code, "
            f"nan for missing); got {got}"
        )
    if any(math.isinf(v) for v in spec.code_values):
        raise ValueError("code_values must be finite or nan")
    if isinstance(spec.missing, str) != (spec.missing_file is not None):
        raise ValueError(
            "missing names a tensor of missing_file: give both (or missing as a number)"
        )
    if isinstance(spec.missing, float) and not math.isfinite(spec.missing):
        raise ValueError("missing must be a finite number")


class InputConfig(Strict):
    """One input tensor, described by its logical shape (without the batch dimension)."""

    name: str = Field(min_length=1, max_length=128)
    """Tensor name clients use."""
    datatype: InputDatatype
    """Logical V2 datatype; ``"BOOL"`` with ``packing = "bits"`` for bit-packed features."""
    shape: list[int] = Field(min_length=1, max_length=8)
    """Logical shape of one item, without the batch dimension, e.g. ``[20, 50000]``."""
    packing: Literal["none", "bits", "codes"] = "none"
    """``"bits"``: on the wire UINT8 packed along the last axis (BOOL logical also accepted);
    ``"codes"``: UINT8 of ``code_bits``-bit codes packed along the last axis, decoded through
    ``code_values`` into a float datatype (see :mod:`service.models.codes`)."""
    code_bits: Literal[1, 2, 4] | None = None
    """``packing = "codes"``: bits per code (a byte holds 8, 4 or 2 codes)."""
    code_values: list[float] | None = None
    """``packing = "codes"``: the value of each code, ``2**code_bits`` of them; ``nan`` marks
    the missing code(s), e.g. ``[2.0, nan, 1.0, 0.0]`` for PLINK's dosage of a .bed's first
    allele."""
    missing: float | str | None = None
    """``packing = "codes"``: what a missing code becomes: a number, or the name of a tensor
    of one value per feature (the logical last axis) in ``missing_file``; default NaN."""
    missing_file: str | None = None
    """safetensors file holding the ``missing`` tensor."""
    ids_sha256: str | None = Field(default=None, pattern="^[0-9a-f]{64}$")
    """The SHA-256 of the features' ids in order (a genotype model: its variants, see
    ``bitserve genotypes``), advertised in the metadata so that clients can check that
    their data's features are the model's."""
    bitorder: Literal["big", "little"] = "big"
    """Bit order of the packed bytes (NumPy's ``bitorder``); a request's input
    ``parameters.bitorder`` overrides it for that request."""
    dtype: HandedDtype | None = None
    """The torch dtype the model is handed this input in, for formats whose file does not
    say (TorchScript); where it does (torch.export, AOTInductor, ONNX) it must agree. Default:
    the file's, else the datatype's own (``bool`` for BOOL). A BOOL input may be handed in any
    numeric dtype (bit-packed: uint8, bool, float16, bfloat16, float32, float64, unpacked
    straight into it); another input only in its own datatype's."""

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: list[int]) -> list[int]:
        for i, d in enumerate(shape):
            if d < 1:
                raise ValueError(f"dimension {i} is {d}; every dimension must be >= 1")
        if math.prod(shape) > 2**31:
            raise ValueError(f"{shape} has more than 2**31 elements per item")
        return shape

    @field_validator("missing_file")
    @classmethod
    def _missing_file(cls, value: str | None) -> str | None:
        return None if value is None else relative_file(value)

    @model_validator(mode="after")
    def _packing_needs_bool(self) -> InputConfig:
        _check_codes_fields(self)
        if self.packing == "bits" and self.datatype != "BOOL":
            raise ValueError(f'packing = "bits" needs datatype = "BOOL", not {self.datatype!r}')
        if self.dtype is not None and self.dtype not in self.handed_dtypes:
            raise ValueError(
                f"dtype {self.dtype!r} is not one {self.datatype}"
                f"{' bits' if self.packing == 'bits' else ''} can be handed in "
                f"(one of {', '.join(self.handed_dtypes)})"
            )
        return self

    @property
    def handed_dtypes(self) -> tuple[str, ...]:
        """The torch dtypes (by name) this input may be handed to a model in."""
        if self.packing == "bits":
            return UNPACK_DTYPE_NAMES
        if self.packing == "codes":
            return CODES_DTYPE_NAMES
        if self.datatype == "BOOL":
            return typing.get_args(HandedDtype)
        own = REGISTRY[self.datatype].torch
        return (own,) if own is not None else ()

    @property
    def packed_shape(self) -> list[int]:
        """The wire shape of one packed item: the last axis becomes ``ceil(L / 8)`` bytes
        (codes: ``ceil(L * code_bits / 8)``)."""
        bits = self.code_bits if self.packing == "codes" and self.code_bits else 1
        return [*self.shape[:-1], (self.shape[-1] * bits + 7) // 8]


class OutputConfig(Strict):
    """One output tensor; its shape is found at load time when not given."""

    name: str = Field(min_length=1, max_length=128)
    datatype: OutputDatatype
    shape: list[int] | None = None
    """Shape of one item without the batch dimension; checked by the dry run at load."""
