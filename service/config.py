"""The model repository on disk: ``config.toml`` models, layout scanning and ``check_repository``.

A repository is a folder with one sub-folder per model. A model folder holds either a
``config.toml`` (one version, ``"1"``) or numbered version folders ``1/``, ``2/``, ... each with
its own ``config.toml``. Files named in a config are relative to the folder of that config and
may not leave the model's folder.

Every problem is reported as ``<file>: <key>: <message>``, e.g.
``models/foo/config.toml: inputs[0].shape: Input should be greater than or equal to 1``.
"""

from __future__ import annotations

import logging
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from service.protocol.types import DATATYPES

log = logging.getLogger("bitserve.repository")


def hidden_error(where: str, what: str, exc: BaseException) -> str:
    """A load problem for ``/load`` and the index without the exception's own text.

    Library exceptions (torch's loaders above all) carry absolute server paths, TorchScript
    tracebacks and code locations: those go to the server log; the client sees where the
    problem is (``where``: file and key, relative to the repository), ``what`` failed, and the
    exception class.
    """
    log.error("%s: %s: %s: %s", where, what, type(exc).__name__, exc, exc_info=exc)
    return f"{where}: {what} ({type(exc).__name__}; details in the server log)"


CONFIG_FILE = "config.toml"
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64",
]  # fmt: skip
ComputeDtype = Literal["float32", "float16", "bfloat16", "float64"]
Response = Literal["gaussian", "lorentzian", "boxcar", "triangle", "tabulated"]
# Suffix of a [model] file -> how it is loaded (never with pickle).
MODEL_FORMATS = {".pt2": "torch_export", ".pt": "torchscript", ".ts": "torchscript"}

assert set(Datatype.__args__) == set(DATATYPES)  # type: ignore[attr-defined]


class ConfigError(Exception):
    """A model configuration is invalid; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


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
    datatype: Datatype
    """Logical V2 datatype; ``"BOOL"`` with ``packing = "bits"`` for bit-packed features."""
    shape: list[int] = Field(min_length=1, max_length=8)
    """Logical shape of one item, without the batch dimension, e.g. ``[20, 50000]``."""
    packing: Literal["none", "bits"] = "none"
    """``"bits"``: on the wire UINT8 packed along the last axis (BOOL logical also accepted)."""
    bitorder: Literal["big", "little"] = "big"
    """Bit order of the packed bytes (NumPy's ``bitorder``)."""

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: list[int]) -> list[int]:
        for i, d in enumerate(shape):
            if d < 1:
                raise ValueError(f"dimension {i} is {d}; every dimension must be >= 1")
        if math.prod(shape) > 2**31:
            raise ValueError(f"{shape} has more than 2**31 elements per item")
        return shape

    @model_validator(mode="after")
    def _packing_needs_bool(self) -> InputConfig:
        if self.packing == "bits" and self.datatype != "BOOL":
            raise ValueError(f'packing = "bits" needs datatype = "BOOL", not {self.datatype!r}')
        return self

    @property
    def packed_shape(self) -> list[int]:
        """The wire shape of one packed item: the last axis becomes ``ceil(L / 8)`` bytes."""
        return [*self.shape[:-1], (self.shape[-1] + 7) // 8]


# Named response -> its width parameter and whether it takes a ``support`` (in those units).
RESPONSE_PARAMS: dict[str, tuple[str, bool]] = {
    "gaussian": ("sigma", True),
    "lorentzian": ("gamma", True),
    "boxcar": ("half_width", False),
    "triangle": ("half_width", False),
}


class OperatorConfig(_Strict):
    """The banded response operator applied to one (unpacked) input."""

    input: str | None = None
    """The input it applies to (default: the first); the other inputs reach the model as
    they are."""
    file: str
    """safetensors file with ``x`` (B,), ``c`` (N, A) and, if tabulated, ``response_x``/``_y``."""
    response: Response
    """A named shape (its width parameter below) or ``"tabulated"`` (``response_x``/``_y``)."""
    sigma: float | None = Field(default=None, gt=0)
    """Gaussian ``exp(-d²/(2 sigma²))`` width, in the units of ``x``."""
    gamma: float | None = Field(default=None, gt=0)
    """Lorentzian ``1/(1 + (d/gamma)²)`` half-width, in the units of ``x``."""
    half_width: float | None = Field(default=None, gt=0)
    """Boxcar / triangle half-width, in the units of ``x``."""
    support: float | None = Field(default=None, gt=0)
    """Cut-off of a gaussian (in sigmas, default 4) or lorentzian (in gammas, default 10)."""
    dtype: ComputeDtype = "float32"
    """Compute dtype: bits are unpacked straight into it and the operator runs in it."""

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        return _relative_file(value)

    @model_validator(mode="after")
    def _parameters(self) -> OperatorConfig:
        given = {k for k in ("sigma", "gamma", "half_width", "support") if getattr(self, k)}
        if self.response == "tabulated":
            allowed: set[str] = set()
        else:
            param, has_support = RESPONSE_PARAMS[self.response]
            if param not in given:
                raise ValueError(f"response = {self.response!r} needs {param}")
            allowed = {param, "support"} if has_support else {param}
        extra = sorted(given - allowed)
        if extra:
            raise ValueError(f"response = {self.response!r} takes no {', '.join(extra)}")
        return self

    @property
    def parameters(self) -> dict[str, float]:
        """The named response's width parameter, e.g. ``{"sigma": 125.0}``."""
        if self.response == "tabulated":
            return {}
        param = RESPONSE_PARAMS[self.response][0]
        return {param: float(getattr(self, param))}


class ModelFileConfig(_Strict):
    """An optional model applied to the operator's (batch, N, A) output."""

    file: str
    """A ``torch.export`` program (``.pt2``) or TorchScript (``.pt``, ``.ts``)."""

    @field_validator("file")
    @classmethod
    def _suffix(cls, value: str) -> str:
        _relative_file(value)
        if Path(value).suffix not in MODEL_FORMATS:
            raise ValueError(f"must end in one of {sorted(MODEL_FORMATS)} (no pickle files)")
        return value

    @property
    def format(self) -> str:
        """``"torch_export"`` or ``"torchscript"``."""
        return MODEL_FORMATS[Path(self.file).suffix]


class OutputConfig(_Strict):
    """One output tensor; its shape is found at load time when not given."""

    name: str = Field(min_length=1, max_length=128)
    datatype: Literal["FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8"]
    shape: list[int] | None = None
    """Shape of one item without the batch dimension; checked against the warm-up run."""


class ModelConfig(_Strict):
    """A model's ``config.toml``."""

    max_batch_size: int = Field(default=0, ge=0, le=65536)
    """Largest merged batch; 0 = no batching and no batch dimension (Triton's meaning)."""
    max_queue_delay_us: int = Field(default=0, ge=0, le=10_000_000)
    """How long the first request of a batch waits for others to join."""
    max_queue_size: int = Field(default=128, ge=0)
    """Requests allowed to wait; beyond it the answer is 503 with Retry-After. 0 = unbounded."""
    device: str = "auto"
    """``"auto"`` (cuda when available, else cpu), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    inputs: list[InputConfig] = Field(min_length=1, max_length=64)
    """The inputs, passed to the model positionally in this order."""
    operator: OperatorConfig | None = None
    model: ModelFileConfig | None = None
    outputs: list[OutputConfig] = Field(min_length=1)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE_RE.fullmatch(value):
            raise ValueError(f'{value!r} is not "auto", "cpu", "cuda" or "cuda:N"')
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.operator is None and self.model is None:
            raise ValueError("needs an [operator], a [model] or both")
        names = [t.name for t in self.inputs] + [t.name for t in self.outputs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tensor names must be unique; repeated: {dup}")
        if self.model is None and len(self.outputs) != 1:
            raise ValueError("without a [model] there is exactly one output (the operator's)")
        if self.model is None and len(self.inputs) != 1:
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
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
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


def load_config(path: Path, source: str | None = None) -> ModelConfig:
    """Read and validate one ``config.toml``; ``source`` names it in messages (default: path)."""
    source = source or str(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read: {exc.strerror}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: invalid TOML: {exc}"]) from None
    return parse_config(data, source)


def valid_model_name(name: str) -> bool:
    """Whether ``name`` may name a model: ``[A-Za-z0-9_.-]``, no leading dot, <= 128 chars."""
    return _NAME_RE.fullmatch(name) is not None


def valid_version(version: str) -> bool:
    """Whether ``version`` is a version folder name: a positive integer without leading zeros."""
    return re.fullmatch(r"[1-9][0-9]{0,17}", version) is not None


@dataclass(frozen=True)
class VersionSource:
    """Where one model version lives."""

    name: str
    version: str
    folder: Path
    """The folder of its ``config.toml``; the config's file names are relative to it."""
    model_folder: Path
    source: str
    """The config's path as shown in messages (relative to the repository's parent)."""

    @property
    def config_path(self) -> Path:
        """The version's ``config.toml``."""
        return self.folder / CONFIG_FILE

    def resolve(self, file: str, key: str) -> Path:
        """A file named by the config, refused when it resolves outside the model's folder.

        Raises:
            ConfigError: naming ``key`` when it escapes (through symlinks) or does not exist.
        """
        path = (self.folder / file).resolve()
        if not path.is_relative_to(self.model_folder.resolve()):
            raise ConfigError([f"{self.source}: {key}: {file!r} resolves outside the model"])
        if not path.is_file():
            raise ConfigError([f"{self.source}: {key}: file {file!r} not found"])
        return path


def model_versions(root: Path, name: str) -> dict[str, VersionSource]:
    """The versions of model ``name`` in repository ``root``, by version string.

    Raises:
        ConfigError: the name is not allowed, the folder is missing or outside ``root``, or
            its layout is ambiguous (a top-level ``config.toml`` and version folders both).
    """
    shown = f"{root.name}/{name}"
    if not valid_model_name(name):
        raise ConfigError(
            [f"{shown}: invalid model name (allowed: [A-Za-z0-9_.-], no leading dot)"]
        )
    folder = root / name
    if not folder.is_dir():
        raise ConfigError([f"{shown}: no such model folder"])
    if not folder.resolve().is_relative_to(root.resolve()):
        raise ConfigError([f"{shown}: resolves outside the repository"])
    numbered = sorted(
        (p for p in folder.iterdir() if p.is_dir() and valid_version(p.name)),
        key=lambda p: int(p.name),
    )
    top = folder / CONFIG_FILE
    if top.is_file():
        if numbered:
            versions = [p.name for p in numbered]
            raise ConfigError([f"{shown}: has both {CONFIG_FILE} and version folders {versions}"])
        return {"1": VersionSource(name, "1", folder, folder, f"{shown}/{CONFIG_FILE}")}
    if not numbered:
        raise ConfigError([f"{shown}: no {CONFIG_FILE} and no numbered version folder"])
    out: dict[str, VersionSource] = {}
    problems = []
    for p in numbered:
        src = f"{shown}/{p.name}/{CONFIG_FILE}"
        if not (p / CONFIG_FILE).is_file():
            problems.append(f"{src}: missing")
        else:
            out[p.name] = VersionSource(name, p.name, p, folder, src)
    if problems:
        raise ConfigError(problems)
    return out


def model_names(root: Path) -> list[str]:
    """Sub-folder names of ``root`` that look like models (hidden entries are skipped), sorted."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def check_repository(root: Path) -> list[str]:
    """Validate a repository without loading anything onto a device.

    Checks each config, that its files exist inside the model, and that the operator's
    safetensors file holds the tensors the config needs with consistent shapes.

    Returns:
        Human-readable problems, each naming the file and the key; empty when valid.
    """
    if not root.is_dir():
        return [f"{root}: not a directory"]
    names = model_names(root)
    if not names:
        return [f"{root}: no model folders"]
    problems: list[str] = []
    for name in names:
        try:
            versions = model_versions(root, name)
        except ConfigError as exc:
            problems += exc.problems
            continue
        for src in versions.values():
            try:
                cfg = load_config(src.config_path, src.source)
                check_version_files(src, cfg)
            except ConfigError as exc:
                problems += exc.problems
    return problems


def _tensor_shapes(path: Path, source: str, key: str) -> dict[str, tuple[list[int], str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            out = {}
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = fh.get_slice(k)
                out[k] = (list(sl.get_shape()), str(sl.get_dtype()))
            return out
    except Exception as exc:  # safetensors raises several types for a corrupt header
        reason = hidden_error(f"{source}: {key}", "not a readable safetensors file", exc)
        raise ConfigError([reason]) from None


def check_version_files(src: VersionSource, cfg: ModelConfig) -> None:
    """Check the files a config names: present, inside the model, tensors of the right shapes.

    Raises:
        ConfigError: one problem per mismatch, naming the config's key.
    """
    problems: list[str] = []
    if cfg.model is not None:
        try:
            src.resolve(cfg.model.file, "model.file")
        except ConfigError as exc:
            problems += exc.problems
    op = cfg.operator
    if op is not None:
        path = src.resolve(op.file, "operator.file")
        shapes = _tensor_shapes(path, src.source, "operator.file")
        op_input = cfg.operator_input or 0
        N, B = cfg.inputs[op_input].shape
        need: dict[str, int] = {"x": 1, "c": 2}
        if op.response == "tabulated":
            need |= {"response_x": 1, "response_y": 1}
        where = f"{src.source}: operator.file"
        for k, ndim in need.items():
            if k not in shapes:
                problems.append(f"{where}: {op.file} has no tensor {k!r} (has {sorted(shapes)})")
            elif len(shapes[k][0]) != ndim:
                problems.append(f"{where}: tensor {k!r} has shape {shapes[k][0]}; needs {ndim}-D")
            elif not shapes[k][1].startswith(("F", "BF")):
                problems.append(f"{where}: tensor {k!r} is {shapes[k][1]}; needs floating point")
        if problems:
            raise ConfigError(problems)
        if shapes["x"][0] != [B]:
            problems.append(
                f"{where}: x has shape {shapes['x'][0]}; inputs[{op_input}].shape needs [{B}]"
            )
        c_shape = shapes["c"][0]
        if c_shape[0] != N:
            problems.append(
                f"{where}: c has shape {c_shape}; inputs[{op_input}].shape needs [{N}, A]"
            )
        if op.response == "tabulated":
            rx, ry = shapes["response_x"][0], shapes["response_y"][0]
            if rx != ry or rx[0] < 2:
                problems.append(f"{where}: response_x {rx} and response_y {ry} differ or < 2 long")
        out = cfg.outputs[0]
        if cfg.model is None and out.shape is not None and out.shape != c_shape:
            problems.append(
                f"{src.source}: outputs[0].shape: {out.shape}, but the operator gives {c_shape}"
            )
    if problems:
        raise ConfigError(problems)
