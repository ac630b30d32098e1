"""A model version's ``config.toml``: its keys as pydantic models, read and validated.

Its ``[[inputs]]`` and ``[[outputs]]`` sections are :mod:`service.models.config_tensors`; its error
type is :mod:`service.models.config_errors` (both re-exported here). Where the files are (the
repository's layout, a version's folder) is :mod:`service.models.layout`;
reading and checking the files a config names (the operator's tensors, the model program) is
:mod:`service.models.files`.

Every problem is reported as ``<file>: <key>: <message>``, e.g.
``models/foo/config.toml: inputs[0].shape: Input should be greater than or equal to 1``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from service.batching.priority import MAX_PRIORITY_LEVELS, LevelPolicy, check_levels
from service.models.config_errors import CONFIG_FILE, ConfigError, library_error
from service.models.config_operator import COMPUTE_DTYPES, OperatorConfig, named_responses
from service.models.config_tensors import (
    CODES_DTYPE_NAMES,
    UNPACK_DTYPE_NAMES,
    HandedDtype,
    InputConfig,
    OutputConfig,
    Strict,
    relative_file,
)
from service.models.devices import parse_device
from service.text import safe_text

__all__ = [
    "CODES_DTYPE_NAMES",
    "COMPUTE_DTYPES",
    "CONFIG_FILE",
    "DEFAULT_MAX_BATCH_BYTES",
    "DEFAULT_MAX_OPERATOR_BYTES",
    "MAX_CONFIG_BYTES",
    "MAX_K",
    "SCORE_OUTPUTS",
    "UNPACK_DTYPE_NAMES",
    "ConfigError",
    "HandedDtype",
    "IndexConfig",
    "InputConfig",
    "ModelConfig",
    "ModelFileConfig",
    "OperatorConfig",
    "OutputConfig",
    "ResponseCacheConfig",
    "ScoreConfig",
    "library_error",
    "load_config",
    "named_responses",
    "parse_config",
    "patched",
]


DEFAULT_MAX_OPERATOR_BYTES = 1 << 30
"""Default of the ``max_operator_bytes`` setting (and ``check-repo --max-operator-bytes``)."""
DEFAULT_MAX_BATCH_BYTES = 4 << 30
"""Default of the ``max_batch_bytes`` setting (and ``check-repo --max-batch-bytes``)."""


MODEL_SUFFIXES = (".pt2", ".pt", ".ts", ".onnx")
"""The model file suffixes a format is known by (``service.backends.SUFFIXES``)."""
ModelFormat = Literal["torch_export", "aoti", "torchscript", "onnx"]
"""The model formats (``service.backends.FORMATS``), as ``[model] format`` names them."""


class ModelFileConfig(Strict):
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
        relative_file(value)
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


class IndexConfig(Strict):
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
        relative_file(value)
        if Path(value).suffix not in INDEX_SUFFIXES:
            raise ValueError(f"must end in one of {', '.join(INDEX_SUFFIXES)}")
        return value

    @model_validator(mode="after")
    def _k(self) -> IndexConfig:
        if self.k > self.max_k:
            raise ValueError(f"k = {self.k} is more than max_k = {self.max_k}")
        return self


class ResponseCacheConfig(Strict):
    """``[response_cache]``: whether this model's answers are kept in the server's response
    cache (``--cache-config``), as Triton's ``response_cache { enable: true }``."""

    enable: bool = False
    """Keep answers: a request equal in everything that changes the answer (the inputs'
    names, datatypes, shapes, bit orders and bytes, its parameters, the outputs asked for) is
    answered from the cache, without running the model."""


class ScoreConfig(Strict):
    """A genotype score model (``bitserve genotypes score-model`` writes it): weighted sums of
    allele dosages of the one ``packing = "codes"`` input, without a model program; outputs
    ``ALLELE_CT``, ``NAMED_ALLELE_DOSAGE_SUM``, ``SCORE_AVG`` and ``SCORE_SUM`` as plink2's
    ``--score`` prints them (see :mod:`service.models.score_model`)."""

    file: str
    """safetensors file with ``weights`` (L, S), ``flip`` (L,) uint8 (1: the weight is on
    the allele the code values do not count, its dosage ``2 - value``) and ``scored`` (L,)
    uint8 (the variants the score counts)."""
    names: list[str] = Field(default_factory=list)
    """The score columns' names, in order (documentation; default SCORE1, SCORE2, ...)."""

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        return relative_file(value)


SCORE_OUTPUTS = ("ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM", "SCORE_AVG", "SCORE_SUM")
"""The outputs of a ``[score]`` model, in this order, each FP64
(:mod:`service.models.score_model`)."""


def _check_score_config(cfg: ModelConfig) -> None:
    """A ``[score]`` config's shape: one codes input, no operator or model, the four outputs.

    Raises:
        ValueError: what does not fit (pydantic names the config).
    """
    if cfg.operator is not None or cfg.model is not None:
        raise ValueError("[score] takes no [operator] or [model]")
    if len(cfg.inputs) != 1 or cfg.inputs[0].packing != "codes" or len(cfg.inputs[0].shape) != 1:
        raise ValueError('[score] needs exactly one input, packing = "codes", shape [L]')
    got = [(o.name, o.datatype) for o in cfg.outputs]
    want = [(n, "FP64") for n in SCORE_OUTPUTS]
    if got != want:
        shown = ", ".join(f"{n} FP64" for n in SCORE_OUTPUTS)
        raise ValueError(f"[score] has the outputs {shown}, in this order")


class ModelConfig(Strict):
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
        return None if value is None else relative_file(value)

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
            _check_score_config(self)
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
            override, ``service.models.override``); messages then name the source
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
