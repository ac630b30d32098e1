"""A model's ``[operator]`` section in its ``config.toml``: the banded response operator (its
response, widths, support, compute dtype, which input it applies to). Re-exported by
:mod:`service.models.config`, which reads the whole file."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from service.models.config_tensors import Strict, one_of, relative_file

__all__ = ["COMPUTE_DTYPES", "OperatorConfig", "named_responses"]


COMPUTE_DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The operator's compute dtypes (``[operator] dtype``), by torch's names: the one list
(``service.models.pipeline`` makes them torch dtypes)."""
ComputeDtype = Annotated[str, AfterValidator(one_of(COMPUTE_DTYPES))]


def named_responses() -> dict[str, tuple[str, bool, bool]]:
    """The named responses ``gpu_ops.responses.NAMED`` defines (the one list): each one's
    width parameter, whether it takes a ``support`` (in units of the width given) and whether
    it also takes ``sigma`` (its standard deviation).

    gpu_ops is imported here, not with this module: the ``--workers`` supervisor reads
    settings without torch, and only code that reads a model's config gets here.
    """
    from gpu_ops.responses import NAMED

    return {
        name: (r.param, r.default_support is not None, r.sigma_ratio is not None)
        for name, r in NAMED.items()
    }


def _response(value: str) -> str:
    allowed = [*named_responses(), "tabulated"]
    if value not in allowed:
        raise ValueError(f"Input should be one of {', '.join(allowed)}")
    return value


Response = Annotated[str, AfterValidator(_response)]
"""A named response of ``gpu_ops.responses`` or ``"tabulated"``."""


_WIDTHS = ("sigma", "gamma", "half_width", "tau")
"""The width fields of ``[operator]`` (every named response's parameter has one)."""


class OperatorConfig(Strict):
    """The banded response operator applied to one (unpacked) input."""

    input: str | None = None
    """The input it applies to (default: the first); the other inputs reach the model as
    they are."""
    file: str
    """safetensors file with ``x`` (B,), ``c`` (N, A) and, if tabulated, ``response_x``/``_y``."""
    response: Response
    """A named shape (its width parameter below) or ``"tabulated"`` (``response_x``/``_y``)."""
    sigma: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """The response's standard deviation (every response but the lorentzian), in x's units."""
    gamma: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Lorentzian ``1/(1 + (d/gamma)²)`` half-width, in the units of ``x``."""
    half_width: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Boxcar / triangle / epanechnikov half-width, in the units of ``x``."""
    tau: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Laplacian / exponential / alpha time constant, in the units of ``x``."""
    support: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Cut-off in units of the width given (gaussian 4, lorentzian 10, others 5 sigma)."""
    normalize: bool = False
    """Unit area in x's units (x in seconds: rates in Hz); default unit peak."""
    center: Literal["median", "peak", "none"] | None = None
    """Where a causal response (exponential, alpha) or a table is centred: on its median
    (Elephant's default), its peak, or not at all (strictly causal; a table as given).
    Default: a named response on its median, a table as given."""
    border: Literal["none", "correct"] = "none"
    """``"correct"``: divide by the response's mass inside the recording (Elephant's
    border_correction)."""
    scale: float = Field(default=1.0, allow_inf_nan=False)
    """A constant factor on the output."""
    on_the_fly: bool = False
    """Evaluate the response (named or tabulated) inside the kernels instead of storing the
    band: O(N A) memory whatever the width (wide kernels), at some compute per call."""
    dtype: ComputeDtype = "float32"
    """Compute dtype: bits are unpacked straight into it and the operator runs in it."""

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        return relative_file(value)

    @model_validator(mode="after")
    def _parameters(self) -> OperatorConfig:
        given = {k for k in (*_WIDTHS, "support") if getattr(self, k)}
        if self.scale == 0:
            raise ValueError("scale must be non-zero")
        if self.response == "tabulated":
            allowed: set[str] = set()
        else:
            param, has_support, has_sigma = named_responses()[self.response]
            widths = {param, "sigma"} if has_sigma else {param}
            allowed = widths | {"support"} if has_support else widths
        extra = sorted(given - allowed)
        if extra:
            raise ValueError(f"response = {self.response!r} takes no {', '.join(extra)}")
        if self.response != "tabulated" and len(given & widths) != 1:
            names = " or ".join(sorted(widths))
            raise ValueError(f"response = {self.response!r} needs exactly one of {names}")
        return self

    @property
    def parameters(self) -> dict[str, float]:
        """The named response's width parameter as given, e.g. ``{"sigma": 125.0}``."""
        if self.response == "tabulated":
            return {}
        return {k: float(getattr(self, k)) for k in _WIDTHS if getattr(self, k) is not None}

    @property
    def options(self) -> dict[str, Any]:
        """The keywords of ``from_response`` for the shape options (normalize, center, ...)."""
        return {
            "normalize": self.normalize, "center": self.center, "border": self.border,
            "scale": self.scale,
        }  # fmt: skip
