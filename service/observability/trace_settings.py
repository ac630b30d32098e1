"""Triton's trace extension over OpenTelemetry sampling: which requests are traced.

``GET``/``POST /v2/trace/setting`` and ``/v2/models/{m}/trace/setting`` (and gRPC
``TraceSetting``) read and change these settings, with Triton's names, string values and
rules (``docs/protocol/extension_trace.md``, Triton's ``TraceManager``):

- ``trace_level``: ``["OFF"]`` or ``["TIMESTAMPS"]`` (a request's spans); ``TENSORS`` is
  refused, as in Triton's OpenTelemetry mode.
- ``trace_rate``: one request in every ``trace_rate`` is traced (a counter, as Triton's);
  ``"0"`` traces only requests whose caller's ``traceparent`` says they are sampled.
- ``trace_count``: how many more requests are traced; ``"-1"`` is no limit. It counts down.
- ``log_frequency``: after every ``log_frequency`` traces the exporter is flushed (Triton
  writes its trace file then); ``"0"``: spans leave on the batch processor's schedule
  (``OTEL_BSP_SCHEDULE_DELAY``) and at shutdown. The traces are flushed too when
  ``trace_count`` reaches 0.
- ``trace_file`` can not be set over the network (Triton's answer), and is not reported.

A model's settings fall back to the global ones for every setting it does not give, and
follow later global changes; ``null`` clears a setting (a model's then follows the global
one, the global one returns to its start value); a model whose settings are all cleared
follows the global settings entirely. Every change starts fresh counters, as in Triton.

The start values come from ``OTEL_TRACES_SAMPLER`` and its ``_ARG`` (:func:`sampler_defaults`);
``parentbased_*`` samplers (the default) make a request whose caller sent a valid
``traceparent`` follow the caller's sampled flag, whatever the rate and count.

Under ``--workers`` every worker applies every change
(``service.cluster.changes.UpdateTraceSettings``); each keeps its own counters, so ``trace_count``
counts per worker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from service.errors import InvalidInput

log = logging.getLogger(__name__)

NAMES = ("trace_level", "trace_rate", "trace_count", "log_frequency")
"""The settings, in the order they are answered."""
_LIMITS = {  # name -> (lowest, highest): Triton's uint32 and int32 ranges
    "trace_rate": (0, 2**32 - 1),
    "trace_count": (-1, 2**31 - 1),
    "log_frequency": (0, 2**32 - 1),
}


@dataclass(frozen=True)
class Values:
    """One scope's settings, typed."""

    on: bool
    """``trace_level`` is ``TIMESTAMPS`` (else ``OFF``)."""
    rate: int
    count: int
    log_frequency: int

    def with_(self, given: Mapping[str, Any]) -> Values:
        """These values with the (checked, non-null) settings ``given`` in their place."""
        changes: dict[str, Any] = {}
        if "trace_level" in given:
            changes["on"] = given["trace_level"] == ["TIMESTAMPS"]
        for name, field in (("trace_rate", "rate"), ("trace_count", "count"),
                            ("log_frequency", "log_frequency")):  # fmt: skip
            if name in given:
                changes[field] = given[name]
        return replace(self, **changes)

    def triton(self) -> dict[str, Any]:
        """Triton's JSON form (strings; the level a list)."""
        return {
            "trace_level": ["TIMESTAMPS" if self.on else "OFF"],
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
            "log_frequency": str(self.log_frequency),
            "trace_mode": "opentelemetry",
        }


class Sampler:
    """One scope's live settings and counters: whether the next request is traced."""

    __slots__ = ("collected", "count", "log_frequency", "on", "rate", "seen", "taken")

    def __init__(self, values: Values) -> None:
        self.on = values.on
        self.rate = values.rate
        self.count = values.count
        self.log_frequency = values.log_frequency
        self.seen = 0
        self.taken = 0
        self.collected = 0

    def take(self) -> bool:
        """Whether a request of this scope without a caller's decision is traced (one in
        every ``rate``, while ``count`` lasts); counts it."""
        if not self.rate:
            return False
        self.seen += 1
        if self.seen % self.rate or not self.count:
            return False
        if self.count > 0:
            self.count -= 1
        self.taken += 1
        return True

    def collected_one(self) -> bool:
        """A traced request ended; whether its spans should be flushed now (every
        ``log_frequency`` traces, and when the last of ``trace_count`` has ended)."""
        self.collected += 1
        if self.log_frequency and self.collected % self.log_frequency == 0:
            return True
        return self.count == 0 and self.collected >= self.taken


def sampler_defaults(environ: Mapping[str, str]) -> tuple[Values, bool]:
    """The start values that ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` mean,
    and whether a caller's sampled flag decides (the ``parentbased_*`` samplers).

    ``always_on`` traces every request (rate 1), ``always_off`` none (level OFF),
    ``traceidratio`` with ratio p one in every ``round(1/p)`` (p = 0: rate 0), the
    ``parentbased_`` forms the same for requests without a caller's ``traceparent``
    (``parentbased_always_off``: rate 0). The default is ``parentbased_always_on``.
    """
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    known = ("always_on", "always_off", "traceidratio")
    base = name.removeprefix("parentbased_")
    if base not in known:
        log.warning("OTEL_TRACES_SAMPLER=%r is not one bitserve knows: parentbased_always_on",
                    name[:60])  # fmt: skip
        name, base = "parentbased_always_on", "always_on"
    follow = name.startswith("parentbased_")
    on, rate = True, 1
    if base == "always_off":
        on, rate = follow, 0  # parentbased_always_off: only what callers sampled
    elif base == "traceidratio":
        text = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = min(max(float(text), 0.0), 1.0)
        except ValueError:
            log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a number: 1.0", text[:60])
            ratio = 1.0
        rate = 0 if ratio <= 0 else max(1, round(1 / ratio))
    return Values(on=on, rate=rate, count=-1, log_frequency=0), follow


class TraceSettings:
    """The global and per-model trace settings of one process.

    Args:
        start: the global settings' start values (what ``null`` returns them to).
        follow_parent: a caller's valid ``traceparent`` decides with its sampled flag.
        off_reason: why the server cannot trace (no exporter configured, no SDK), or None
            when it can; while it cannot, turning tracing on is refused with this reason.
    """

    def __init__(
        self, start: Values, *, follow_parent: bool = True, off_reason: str | None = None
    ) -> None:
        self.start = start
        self.follow_parent = follow_parent
        self.off_reason = off_reason
        self._global: dict[str, Any] = {}  # the settings given, by name
        self._models: dict[str, dict[str, Any]] = {}
        self._global_sampler = Sampler(start)
        self._samplers: dict[str, Sampler] = {}

    @classmethod
    def off(cls, reason: str) -> TraceSettings:
        """Settings of a server that cannot trace: level OFF, and it cannot be turned on."""
        return cls(Values(on=False, rate=1, count=-1, log_frequency=0), off_reason=reason)

    def sampler(self, model: str) -> Sampler:
        """The live settings that decide for a request of ``model``."""
        return self._samplers.get(model, self._global_sampler)

    def values(self, model: str | None = None) -> Values:
        """The settings in force for ``model`` (None: the global ones)."""
        values = self.start.with_(self._global)
        if model is not None and model in self._models:
            values = values.with_(self._models[model])
        return values

    def get(self, model: str | None = None) -> dict[str, Any]:
        """Triton's answer: the settings in force for ``model`` (None: the global ones)."""
        return self.values(model).triton()

    def check(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """The settings ``changes`` gives, typed: ``trace_level`` a list, the others
        integers, None to clear one (Triton's strings of digits or plain integers).

        Raises:
            InvalidInput: an unknown setting, ``trace_file``, a bad value, or turning
                tracing on where the server cannot trace.
        """
        if "trace_file" in changes:
            raise InvalidInput("trace file location can not be updated through network protocol")
        unknown = sorted(k for k in changes if k not in NAMES)
        if unknown:
            shown = [ascii(k[:64])[1:-1] for k in unknown[:5]]
            raise InvalidInput(f"trace setting: unknown settings {shown} (known: {list(NAMES)})")
        out: dict[str, Any] = {}
        for name, value in changes.items():
            out[name] = None if value is None else _checked(name, value)
        if out.get("trace_level") == []:  # no value (gRPC's empty SettingValue): clear it
            out["trace_level"] = None
        if self.off_reason is not None and out.get("trace_level") == ["TIMESTAMPS"]:
            raise InvalidInput(f"trace setting: tracing can not be turned on: {self.off_reason}")
        return out

    def update(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply checked settings (:meth:`check`) to ``model`` (None: globally); returns
        Triton's answer for that scope. Every sampler affected starts afresh."""
        given = self._global if model is None else dict(self._models.get(model, {}))
        for name, value in changes.items():
            if value is None:
                given.pop(name, None)
            else:
                given[name] = value
        if model is None:
            self._global_sampler = Sampler(self.values())
            self._samplers = {m: Sampler(self.values(m)) for m in self._models}
        elif given:
            self._models[model] = given
            self._samplers[model] = Sampler(self.values(model))
        else:  # nothing of its own: the model follows the global settings
            self._models.pop(model, None)
            self._samplers.pop(model, None)
        return self.get(model)


def _checked(name: str, value: Any) -> Any:
    if name == "trace_level":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidInput("trace setting: trace_level must be a list of strings")
        levels = list(dict.fromkeys(value))
        if "OFF" in levels and len(levels) > 1:
            raise InvalidInput("Expect only one trace level 'OFF' is specified")
        if "TENSORS" in levels:
            raise InvalidInput(
                "trace setting: trace_level TENSORS is not supported (traces are OpenTelemetry "
                "spans of timestamps, as in Triton's opentelemetry mode)"
            )
        bad = [v for v in levels if v not in ("OFF", "TIMESTAMPS")]
        if bad:
            raise InvalidInput(
                f"trace setting: unknown trace_level {bad[0][:40]!a}: OFF or TIMESTAMPS"
            )
        return levels
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidInput(f"Unable to parse '{name}', got: {ascii(value)[:40]}")
    text = str(value)
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
        raise InvalidInput(f"Unable to parse '{name}', got: {ascii(text[:40])[1:-1]}")
    number = int(text)
    lo, hi = _LIMITS[name]
    if not lo <= number <= hi:
        raise InvalidInput(
            f"Unable to parse '{name}', value is out of range [ {lo}, {hi} ], got: {number}"
        )
    return number
