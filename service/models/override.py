"""A load's config override: Triton's ``parameters.config`` (model configuration JSON) in our terms.

``POST /v2/repository/models/{m}/load`` with ``{"parameters": {"config": "<json>"}}`` loads the
model with the override's fields in place of the ``config.toml`` keys of the same meaning,
for that load only (a later load without an override reads the files again):

======================================================  ===================================
Triton's field                                          ``config.toml`` key
======================================================  ===================================
``max_batch_size``                                      ``max_batch_size``
``dynamic_batching.max_queue_delay_microseconds``       ``max_queue_delay_us``
``dynamic_batching.default_queue_policy.max_queue_size``  ``max_queue_size``
``....default_queue_policy.default_timeout_microseconds``  ``queue_timeout_us``
``dynamic_batching.priority_levels``                    ``priority_levels``
``dynamic_batching.default_priority_level``             ``default_priority_level``
``dynamic_batching.priority_queue_policy.N`` (``max_queue_size``)  ``[priority_queue_policy.N]``
``instance_group[0].kind`` (+ ``gpus[0]``)              ``device`` (``cpu``, ``cuda:N``, ``auto``)
======================================================  ===================================

Integers may be JSON numbers or strings of digits, as protobuf's JSON mapping allows (Triton's
own example sends ``{"max_batch_size": "16"}``). What ``GET .../config`` returns can be sent
back as it is: ``name``, ``platform``, ``backend``, ``input`` and ``output`` are accepted when
they agree with the model (inputs and outputs are the repository's to say, and are checked once
the model is built), ``dynamic_batching.preferred_batch_size`` is accepted and has no
effect (batches close at ``max_batch_size``), and the queue policy's ``timeout_action`` and
``allow_timeout_override`` are accepted with the values bitserve has (``REJECT``, ``true``: a
request's own timeout can only shorten its wait). Any other field is refused, naming it. The
patched configuration then goes through the same validation as a ``config.toml``
(:func:`service.models.config.load_config`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.errors import InvalidInput
from service.models.config import ConfigError
from service.text import safe_text

_DIGITS = re.compile(r"-?[0-9]{1,20}")
_TOP = {"name", "platform", "backend", "max_batch_size", "dynamic_batching", "instance_group",
        "input", "output"}  # fmt: skip
_BATCHING = {"max_queue_delay_microseconds", "default_queue_policy", "preferred_batch_size",
             "priority_levels", "default_priority_level", "priority_queue_policy"}  # fmt: skip
_POLICY = {"max_queue_size", "default_timeout_microseconds", "timeout_action",
           "allow_timeout_override"}  # fmt: skip
_KINDS = {"KIND_CPU": "cpu", "KIND_GPU": "cuda", "KIND_AUTO": "auto"}
MAX_OVERRIDE_CHARS = 64 << 10
"""A config override is a few hundred bytes; a longer one is refused unread."""


@dataclass(frozen=True)
class ConfigOverride:
    """A parsed override.

    Attributes:
        patch: ``config.toml`` keys and their new values.
        inputs, outputs: Triton-style ``input``/``output`` entries the built model must
            agree with (name, ``data_type``, ``dims``), or None when not given.
    """

    patch: dict[str, Any] = field(default_factory=dict)
    inputs: list[dict[str, Any]] | None = None
    outputs: list[dict[str, Any]] | None = None

    def check_io(
        self, source: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]
    ) -> None:
        """Check the override's ``input``/``output`` against the built model's (the
        ``GET .../config`` entries of ``service.models.signature.Signature``).

        Raises:
            ConfigError: they differ.
        """
        problems = []
        for key, given, actual in (
            ("input", self.inputs, inputs),
            ("output", self.outputs, outputs),
        ):
            if given is not None and _io_keys(given) != _io_keys(actual):
                problems.append(
                    f"{source}: config override: {key} {_io_keys(given)} differs from the "
                    f"model's {_io_keys(actual)} (inputs and outputs come from the repository)"
                )
        if problems:
            raise ConfigError(problems)


def _io_keys(entries: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
    return [(e.get("name"), e.get("data_type"), e.get("dims")) for e in entries]


def _integer(value: object, where: str) -> int:
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError([f"config override: {where}: must be an integer, got {_shown(value)}"])
    return value


def _shown(value: object) -> str:
    return safe_text(json.dumps(value) if not isinstance(value, str) else repr(value), 60)


def _object(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError([f"config override: {where} must be an object"])
    return value


def _unknown(given: Mapping[str, Any], known: set[str], where: str) -> None:
    extra = sorted(k for k in given if k not in known)
    if extra:
        shown = [safe_text(k, 60) for k in extra[:5]]
        raise ConfigError(
            [f"config override: unknown field(s) {shown} in {where} (bitserve takes: "
             f"{sorted(known)})"]
        )  # fmt: skip


def parse_override(text: str, model: str) -> ConfigOverride:
    """Parse ``parameters.config`` of a load request for model ``model``.

    Raises:
        ConfigError: not JSON, not an object, an unknown field, a value of the wrong type, or
            a name, platform or backend that is not this model's.
    """
    if len(text) > MAX_OVERRIDE_CHARS:
        raise ConfigError([f"config override: longer than {MAX_OVERRIDE_CHARS} characters"])
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError([f"config override: not JSON ({safe_text(str(exc), 120)})"]) from None
    top = _object(doc, "the config")
    _unknown(top, _TOP, "the config")
    patch: dict[str, Any] = {}
    if top.get("name") not in (None, "", model):
        raise ConfigError([f"config override: name {_shown(top['name'])} is not '{model}'"])
    for key in ("platform", "backend"):
        if top.get(key) not in (None, "", "bitserve"):
            raise ConfigError(
                [f"config override: {key} {_shown(top[key])}: this server's is 'bitserve'"]
            )
    if "max_batch_size" in top:
        patch["max_batch_size"] = _integer(top["max_batch_size"], "max_batch_size")
    if "dynamic_batching" in top:
        batching = _object(top["dynamic_batching"], "dynamic_batching")
        _unknown(batching, _BATCHING, "dynamic_batching")
        if "max_queue_delay_microseconds" in batching:
            patch["max_queue_delay_us"] = _integer(
                batching["max_queue_delay_microseconds"],
                "dynamic_batching.max_queue_delay_microseconds",
            )
        for key in ("priority_levels", "default_priority_level"):
            if key in batching:
                patch[key] = _integer(batching[key], f"dynamic_batching.{key}")
        if "priority_queue_policy" in batching:
            patch["priority_queue_policy"] = _level_policies(batching["priority_queue_policy"])
        if "default_queue_policy" in batching:
            policy = _object(batching["default_queue_policy"], "default_queue_policy")
            where = "dynamic_batching.default_queue_policy"
            _unknown(policy, _POLICY, where)
            for key, ours in (("max_queue_size", "max_queue_size"),
                              ("default_timeout_microseconds", "queue_timeout_us")):  # fmt: skip
                if key in policy:
                    patch[ours] = _integer(policy[key], f"{where}.{key}")
            for key, only in (("timeout_action", "REJECT"), ("allow_timeout_override", True)):
                if key in policy and policy[key] != only:
                    raise ConfigError(
                        [f"config override: {where}.{key}: bitserve has only {json.dumps(only)}, "
                         f"got {_shown(policy[key])}"]
                    )  # fmt: skip
    if "instance_group" in top:
        patch["device"] = _device(top["instance_group"])
    io: dict[str, list[dict[str, Any]] | None] = {"input": None, "output": None}
    for key in io:
        if key in top:
            entries = top[key]
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise ConfigError([f"config override: {key} must be a list of objects"])
            io[key] = entries
    return ConfigOverride(patch, io["input"], io["output"])


def _level_policies(given: object) -> dict[str, dict[str, int]]:
    """``priority_queue_policy`` (level -> Triton's ``ModelQueuePolicy``): each level's
    ``max_queue_size`` (the one field of a level's policy bitserve has)."""
    where = "dynamic_batching.priority_queue_policy"
    out: dict[str, dict[str, int]] = {}
    for level, policy in _object(given, where).items():
        at = f"{where}.{safe_text(str(level), 20)}"
        _unknown(_object(policy, at), {"max_queue_size"}, at)
        out[str(_integer(level, at))] = {
            "max_queue_size": _integer(policy.get("max_queue_size", 0), f"{at}.max_queue_size")
        }
    return out


def _device(groups: object) -> str:
    if not isinstance(groups, list) or len(groups) != 1:
        raise ConfigError(["config override: instance_group must hold exactly one group"])
    group = _object(groups[0], "instance_group[0]")
    _unknown(group, {"name", "kind", "count", "gpus"}, "instance_group[0]")
    if _integer(group.get("count", 1), "instance_group[0].count") != 1:
        raise ConfigError(["config override: instance_group[0].count: one instance per model"])
    kind = group.get("kind", "KIND_AUTO")
    if kind not in _KINDS:
        raise ConfigError(
            [f"config override: instance_group[0].kind {_shown(kind)}: one of {sorted(_KINDS)}"]
        )
    gpus = group.get("gpus")
    if gpus is None:
        return _KINDS[kind]
    if kind != "KIND_GPU" or not isinstance(gpus, list) or len(gpus) != 1:
        raise ConfigError(["config override: instance_group[0].gpus: one GPU, with KIND_GPU"])
    index = _integer(gpus[0], "instance_group[0].gpus[0]")
    if index < 0:
        raise ConfigError(["config override: instance_group[0].gpus[0] must be >= 0"])
    return f"cuda:{index}"


def load_parameters(name: str, body: Mapping[str, Any]) -> str | None:
    """The config override of a V2 load request body (``parameters.config``), or None.

    Raises:
        InvalidInput: ``parameters`` is not an object, ``config`` not a string, or another
            parameter is given (Triton's ``file:`` parameters included: model files come
            from the repository); the message starts ``failed to load``, as Triton's.
    """
    failed = f"failed to load '{safe_text(name, 128)}'"
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidInput(f"{failed}: 'parameters' must be an object")
    other = sorted(k for k in params if k != "config")
    if other:
        shown = [safe_text(k, 64) for k in other[:5]]
        raise InvalidInput(
            f"{failed}: unsupported parameters {shown} (only 'config'; model files come from "
            "the repository)"
        )
    config = params.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidInput(f"{failed}: parameters.config must be a string of JSON")
    return config
