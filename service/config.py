"""A model version's ``config.toml``: its keys as pydantic models, read and validated.

Where the files are (the repository's layout, a version's folder) is :mod:`service.layout`;
reading and checking the files a config names (the operator's tensors, the model program) is
:mod:`service.model_files`.

Every problem is reported as ``<file>: <key>: <message>``, e.g.
``models/foo/config.toml: inputs[0].shape: Input should be greater than or equal to 1``.
"""

from __future__ import annotations

import math
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from service.devices import parse_device
from service.priority import MAX_PRIORITY_LEVELS, LevelPolicy, check_levels
from service.protocol.types import MODEL_INPUT_DATATYPES, MODEL_OUTPUT_DATATYPES, REGISTRY
from service.text import clean_reason, safe_text


def library_error(
    where: str, what: str, exc: BaseException, folder: Path | None = None, shown: str = ""
) -> ConfigError:
    """A load problem a library raised, with the library's own message, cleaned for a client.

    The message (``where: what: ExceptionClass: text``) is the same for ``/load``, the
    repository index and ``bitserve check-repo``: the exception's first paragraph, without
    its traceback, each line's whitespace folded, cut to 300 characters; the model folder's
    absolute path is shown as ``shown`` (the folder as the repository names it) and any
    other absolute path as ``<server path>``. Raise it ``from exc`` so the server log keeps
    the traceback.
    """
    return ConfigError([f"{where}: {what}: {clean_reason(exc, folder, shown)}"])


CONFIG_FILE = "config.toml"
DEFAULT_MAX_OPERATOR_BYTES = 1 << 30
"""Default of the ``max_operator_bytes`` setting (and ``check-repo --max-operator-bytes``)."""
DEFAULT_MAX_BATCH_BYTES = 4 << 30
"""Default of the ``max_batch_bytes`` setting (and ``check-repo --max-batch-bytes``)."""


def _one_of(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """A check that a value is one of ``allowed`` (a view of the datatype registry)."""

    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"Input should be one of {', '.join(allowed)}")
        return value

    return check


InputDatatype = Annotated[str, AfterValidator(_one_of(MODEL_INPUT_DATATYPES))]
OutputDatatype = Annotated[str, AfterValidator(_one_of(MODEL_OUTPUT_DATATYPES))]
COMPUTE_DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The operator's compute dtypes (``[operator] dtype``), by torch's names: the one list
(``service.pipeline`` makes them torch dtypes)."""
ComputeDtype = Annotated[str, AfterValidator(_one_of(COMPUTE_DTYPES))]


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
MODEL_SUFFIXES = (".pt2", ".pt", ".ts", ".onnx")
"""The model file suffixes a format is known by (``service.backends.SUFFIXES``)."""
ModelFormat = Literal["torch_export", "aoti", "torchscript", "onnx"]
"""The model formats (``service.backends.FORMATS``), as ``[model] format`` names them."""
# The dtypes bits unpack straight into (gpu_ops.UNPACK_DTYPES), by name.
UNPACK_DTYPE_NAMES = ("uint8", "bool", "float16", "bfloat16", "float32", "float64")
# The dtypes codes decode straight into (gpu_ops.codes.DECODE_DTYPES), by name.
CODES_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
HandedDtype = Literal[
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"
]


class ConfigError(Exception):
    """A model configuration is invalid; ``problems`` holds one line per problem, each
    naming the file and key, as clients and ``bitserve check-repo`` see it."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems

    @classmethod
    def join(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error with every problem of ``errors`` (the first cause kept for the log)."""
        out = cls([p for e in errors for p in e.problems])
        out.__cause__ = next((e.__cause__ for e in errors if e.__cause__ is not None), None)
        return out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _relative_file(value: str) -> str:
    p = Path(value)
    if not value or p.is_absolute() or ".." in p.parts or "\\" in value or "\x00" in value:
        raise ValueError("must be a file name relative to the config's folder, without '..'")
    return value


class InputConfig(_Strict):
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
    ``code_values`` into a float datatype (see :mod:`service.codes_input`)."""
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
        return None if value is None else _relative_file(value)

    @model_validator(mode="after")
    def _packing_needs_bool(self) -> InputConfig:
        from service.codes_input import check_codes_fields

        check_codes_fields(self)
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


_WIDTHS = ("sigma", "gamma", "half_width", "tau")
"""The width fields of ``[operator]`` (every named response's parameter has one)."""


class OperatorConfig(_Strict):
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
        return _relative_file(value)

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


class ModelFileConfig(_Strict):
    """An optional model, given the inputs (the operator's one as its (batch, N, A) output)."""

    format: ModelFormat | None = None
    """The file's format; by default its suffix says (a ``.pt2`` holding
    ``data/aotinductor/`` is an AOTInductor package)."""
    file: str
    """A ``torch.export`` program or AOTInductor package (``.pt2``), TorchScript (``.pt``,
    ``.ts``) or ONNX (``.onnx``)."""

    @field_validator("file")
    @classmethod
    def _suffix(cls, value: str, info: ValidationInfo) -> str:
        _relative_file(value)
        if info.data.get("format") is None and Path(value).suffix not in MODEL_SUFFIXES:
            raise ValueError(
                f"must end in one of {', '.join(MODEL_SUFFIXES)}, or [model] format must say "
                "what it is (no pickle files)"
            )
        return value


INDEX_SUFFIXES = (".safetensors", ".npy")
"""The corpus file suffixes of ``[index] file``."""
MAX_K = 1 << 20
"""The largest ``max_k`` a config may declare (the answer is ``[batch, k]`` per output)."""


class IndexConfig(_Strict):
    """A packed corpus searched by popcount (``[index]``): the model's one bit-packed input
    is the query, its two outputs the ids and scores of the nearest rows."""

    file: str
    """safetensors with ``corpus`` (N, W) uint8 packed rows and optional ``ids`` (N,) int64
    (unique external ids; default the row numbers), or an ``.npy`` of the (N, W) uint8 rows."""
    metric: Literal["tanimoto", "hamming"]
    """``"tanimoto"``: similarity ``|a & b| / |a | b|``, best first (scores FP32 in [0, 1]);
    ``"hamming"``: distance ``|a ^ b|``, nearest first (scores FP32 whole numbers)."""
    k: int = Field(default=10, ge=1, le=MAX_K)
    """Hits per query by default; a request's ``parameters.k`` overrides it."""
    max_k: int = Field(default=1000, ge=1, le=MAX_K)
    """The largest ``parameters.k`` a request may ask for."""

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        _relative_file(value)
        if Path(value).suffix not in INDEX_SUFFIXES:
            raise ValueError(f"must end in one of {', '.join(INDEX_SUFFIXES)}")
        return value

    @model_validator(mode="after")
    def _k(self) -> IndexConfig:
        if self.k > self.max_k:
            raise ValueError(f"k = {self.k} is more than max_k = {self.max_k}")
        return self


class OutputConfig(_Strict):
    """One output tensor; its shape is found at load time when not given."""

    name: str = Field(min_length=1, max_length=128)
    datatype: OutputDatatype
    shape: list[int] | None = None
    """Shape of one item without the batch dimension; checked by the dry run at load."""


class ResponseCacheConfig(_Strict):
    """``[response_cache]``: whether this model's answers are kept in the server's response
    cache (``--cache-config``), as Triton's ``response_cache { enable: true }``."""

    enable: bool = False
    """Keep answers: a request equal in everything that changes the answer (the inputs'
    names, datatypes, shapes, bit orders and bytes, its parameters, the outputs asked for) is
    answered from the cache, without running the model."""


class ScoreConfig(_Strict):
    """A genotype score model (``bitserve genotypes score-model`` writes it): weighted sums of
    allele dosages of the one ``packing = "codes"`` input, without a model program; outputs
    ``ALLELE_CT``, ``NAMED_ALLELE_DOSAGE_SUM``, ``SCORE_AVG`` and ``SCORE_SUM`` as plink2's
    ``--score`` prints them (see :mod:`service.score_model`)."""

    file: str
    """safetensors file with ``weights`` (L, S), ``flip`` (L,) uint8 (1: the weight is on
    the allele the code values do not count, its dosage ``2 - value``) and ``scored`` (L,)
    uint8 (the variants the score counts)."""
    names: list[str] = Field(default_factory=list)
    """The score columns' names, in order (documentation; default SCORE1, SCORE2, ...)."""

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        return _relative_file(value)


class ModelConfig(_Strict):
    """A model's ``config.toml``."""

    max_batch_size: int = Field(default=0, ge=0, le=65536)
    """Largest merged batch; 0 = no batching and no batch dimension (Triton's meaning)."""
    max_queue_delay_us: int = Field(default=0, ge=0, le=10_000_000)
    """How long the first request of a batch waits for others to join."""
    max_queue_size: int = Field(default=128, ge=0)
    """Requests allowed to wait; beyond it the answer is 503 with Retry-After. 0 = unbounded."""
    queue_timeout_us: int = Field(default=0, ge=0, le=3_600_000_000)
    """Most microseconds a request may wait in the queue: one still waiting then is answered
    503 with Retry-After and never computed, and a new one is refused from its headers when
    the batches ahead of it would take longer (at the pace of recent batches). Triton's
    ``dynamic_batching.default_queue_policy.default_timeout_microseconds`` with
    ``timeout_action: REJECT``. 0 = no bound (requests wait their turn, however long)."""
    priority_levels: int = Field(default=0, ge=0, le=MAX_PRIORITY_LEVELS)
    """Priority levels, 1 the highest (Triton's ``dynamic_batching.priority_levels``): a
    request's ``parameters.priority`` picks its level; requests of a higher level are batched
    first, FIFO within a level. 0 = no levels (every request FIFO)."""
    default_priority_level: int = Field(default=0, ge=0, le=MAX_PRIORITY_LEVELS)
    """The level of a request whose priority is 0, absent or above ``priority_levels`` (as in
    Triton); must be 1 .. ``priority_levels`` when there are levels, else 0."""
    priority_queue_policy: dict[int, LevelPolicy] = Field(default_factory=dict)
    """Per level (``[priority_queue_policy.1]``, ...): its own queue bound."""
    device: str = "auto"
    """``"auto"`` (cuda when available, else cpu), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    inputs: list[InputConfig] = Field(min_length=1, max_length=64)
    """The inputs, passed to the model positionally in this order."""
    operator: OperatorConfig | None = None
    model: ModelFileConfig | None = None
    index: IndexConfig | None = None
    """A packed corpus searched by Hamming or Tanimoto top-k (instead of an operator and a
    model)."""
    score: ScoreConfig | None = None
    """A genotype score model instead of ``[operator]`` and ``[model]``."""
    outputs: list[OutputConfig] = Field(min_length=1)
    warmup_file: str | None = None
    """A safetensors file whose tensors (one per input, named as it, batch first, in a wire
    form: UINT8 packed or the logical datatype) replace the zeros of the dry run at load."""
    pinned: bool = False
    """Never evicted to make room under ``--device-memory-budget``: its versions stay
    resident from their load to their unload."""
    response_cache: ResponseCacheConfig = Field(default_factory=ResponseCacheConfig)
    """Whether its answers go to the response cache (``[response_cache] enable = true``)."""

    @field_validator("warmup_file")
    @classmethod
    def _warmup_file(cls, value: str | None) -> str | None:
        return None if value is None else _relative_file(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        parse_device(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        check_levels(self.priority_levels, self.default_priority_level, self.priority_queue_policy)
        if self.index is not None:
            self._check_index(self.index)
            return self
        if self.score is not None:
            from service.score_model import check_score_config

            check_score_config(self)
        elif self.operator is None and self.model is None:
            raise ValueError("needs an [operator], a [model], both, or an [index]")
        names = [t.name for t in self.inputs] + [t.name for t in self.outputs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tensor names must be unique; repeated: {dup}")
        if self.model is None and self.score is None and len(self.outputs) != 1:
            raise ValueError("without a [model] there is exactly one output (the operator's)")
        if self.model is None and self.score is None and len(self.inputs) != 1:
            raise ValueError("without a [model] there is exactly one input (the operator's)")
        if self.operator is not None:
            i = self.operator_input
            if i is None:
                names = [t.name for t in self.inputs]
                raise ValueError(f"operator.input {self.operator.input!r} is not one of {names}")
            if len(self.inputs[i].shape) != 2:
                raise ValueError(
                    f"the operator's input has the logical shape [N, B]; "
                    f"inputs[{i}].shape is {self.inputs[i].shape}"
                )
        return self

    def _check_index(self, index: IndexConfig) -> None:
        """An index: one bit-packed 1-D input, the outputs ids INT64 and scores FP32 [k]."""
        if self.operator is not None or self.model is not None:
            raise ValueError("an [index] takes no [operator] or [model]")
        if self.warmup_file is not None:
            raise ValueError("an [index] takes no warmup_file (its dry run uses corpus rows)")
        names = [t.name for t in self.inputs] + [t.name for t in self.outputs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tensor names must be unique; repeated: {dup}")
        query = self.inputs[0]
        if len(self.inputs) != 1 or query.packing != "bits" or len(query.shape) != 1:
            raise ValueError(
                'an [index] has exactly one input, the query: datatype = "BOOL", '
                'packing = "bits", shape = [L] (its bit count)'
            )
        kinds = sorted(o.datatype for o in self.outputs)
        if kinds != ["FP32", "INT64"]:
            got = [o.datatype for o in self.outputs]
            raise ValueError(
                f"an [index] has two outputs, the ids (INT64) and the scores (FP32); got {got}"
            )
        for o in self.outputs:
            if o.shape is not None and o.shape != [index.k]:
                raise ValueError(
                    f"output '{o.name}' has shape {o.shape}; an index answers [k] = "
                    f"[{index.k}] per query (a request's parameters.k changes it)"
                )

    @property
    def index_outputs(self) -> tuple[int, int]:
        """The positions of an index's ids (INT64) and scores (FP32) among the outputs."""
        kinds = [o.datatype for o in self.outputs]
        return kinds.index("INT64"), kinds.index("FP32")

    @property
    def operator_input(self) -> int | None:
        """The index of the input the operator applies to (None: no operator, or a name that
        is not an input)."""
        if self.operator is None:
            return None
        if self.operator.input is None:
            return 0
        names = [t.name for t in self.inputs]
        return names.index(self.operator.input) if self.operator.input in names else None


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        key = safe_text(str(part), 64)
        out += f"[{part}]" if isinstance(part, int) else (f".{key}" if out else key)
    return out or "(top level)"


def parse_config(data: dict[str, Any], source: str) -> ModelConfig:
    """Validate a parsed ``config.toml``.

    Args:
        data: the TOML document as a dict.
        source: the file name used in messages.

    Raises:
        ConfigError: one problem per invalid key, each ``"<source>: <key>: <message>"``.
    """
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            msg = str(err["msg"]).removeprefix("Value error, ")
            problems.append(f"{source}: {_loc(tuple(err['loc']))}: {msg}")
        raise ConfigError(problems) from None
    except RecursionError:
        raise ConfigError([f"{source}: nested too deeply"]) from None


MAX_CONFIG_BYTES = 1 << 20
"""A ``config.toml`` is a few hundred bytes; a bigger file than this is refused unread."""


def load_config(
    path: Path, source: str | None = None, *, patch: Mapping[str, Any] | None = None
) -> ModelConfig:
    """Read and validate one ``config.toml``; ``source`` names it in messages (default: path).

    Args:
        path: the file.
        source: its name in messages.
        patch: top-level keys that replace the file's before validation (a load's config
            override, ``service.config_override``); messages then name the source
            ``"<source> + config override"``.

    Raises:
        ConfigError: unreadable, larger than :data:`MAX_CONFIG_BYTES`, not UTF-8, not TOML
            (nesting too deep included), or invalid; never another exception.
    """
    source = source or str(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            [f"{source}: cannot read: {exc.strerror or type(exc).__name__}"]
        ) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{source}: larger than {MAX_CONFIG_BYTES} bytes"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            [f"{source}: not UTF-8: byte {raw[exc.start]:#04x} on line {line}"]
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: invalid TOML: {safe_text(str(exc))}"]) from None
    except RecursionError:
        raise ConfigError([f"{source}: invalid TOML: nested too deeply"]) from None
    return parse_config(*patched(data, source, patch))


def patched(
    data: dict[str, Any], source: str, patch: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """``data`` with ``patch``'s top-level keys in place of its own, and the source name for
    messages (see :func:`load_config`)."""
    if not patch:
        return data, source
    return {**data, **patch}, f"{source} + config override"
