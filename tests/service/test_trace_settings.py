"""Triton's trace extension in bitserve's terms: the settings' start values from
``OTEL_TRACES_SAMPLER``, Triton's fallback and clearing rules between the global and a
model's settings, the checks, the sampling counters against a plain reference, and the
change that carries a setting to every worker."""

from __future__ import annotations

import random
from typing import Any

import pytest

from service.cluster.changes import Change, Recorded, UpdateTraceSettings
from service.errors import InvalidInput
from service.observability.trace_settings import Sampler, TraceSettings, Values, sampler_defaults

START = Values(on=True, rate=1, count=-1, log_frequency=0)


def triton(level: str, rate: str, count: str = "-1", frequency: str = "0") -> dict[str, Any]:
    return {
        "trace_level": [level],
        "trace_rate": rate,
        "trace_count": count,
        "log_frequency": frequency,
        "trace_mode": "opentelemetry",
    }


@pytest.mark.parametrize(
    ("environ", "on", "rate", "follow"),
    [
        ({}, True, 1, True),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, True, 1, False),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, False, 0, False),
        ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, True, 0, True),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
         True, 100, False),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.3"},
         True, 3, True),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, True, 0, False),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"}, True, 1, False),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, True, 1, True),
    ],
)  # fmt: skip
def test_start_values_follow_the_otel_sampler(
    environ: dict[str, str], on: bool, rate: int, follow: bool
) -> None:
    values, follows = sampler_defaults(environ)
    assert (values.on, values.rate, values.count, follows) == (on, rate, -1, follow)


def test_model_settings_fall_back_to_the_global_ones_as_in_triton() -> None:
    ts = TraceSettings(START)
    assert ts.get() == ts.get("simple") == triton("TIMESTAMPS", "1")
    # A model's own settings; the rest follows the global ones, now and after they change.
    assert ts.update("simple", ts.check({"trace_rate": "12", "log_frequency": "34"})) == triton(
        "TIMESTAMPS", "12", "-1", "34"
    )
    ts.update(None, ts.check({"trace_rate": "56", "trace_count": "78", "trace_level": ["OFF"]}))
    assert ts.get() == triton("OFF", "56", "78")
    assert ts.get("simple") == triton("OFF", "12", "78", "34")
    assert ts.get("other") == triton("OFF", "56", "78")
    # null clears: the global setting returns to its start value, a model's to the global.
    assert ts.update(None, ts.check({"trace_rate": None, "trace_count": None})) == triton(
        "OFF", "1"
    )
    assert ts.get("simple") == triton("OFF", "12", "-1", "34")
    assert ts.update("simple", ts.check({"trace_rate": None, "trace_level": None})) == triton(
        "OFF", "1", "-1", "34"
    )
    # A model whose settings are all cleared follows the global ones entirely.
    ts.update("simple", ts.check({"log_frequency": None}))
    ts.update(None, ts.check({"trace_level": ["TIMESTAMPS"]}))
    assert ts.get("simple") == ts.get() == triton("TIMESTAMPS", "1")
    assert ts.sampler("simple") is ts.sampler("anything")


def test_each_change_starts_fresh_counters() -> None:
    ts = TraceSettings(START)
    ts.update(None, ts.check({"trace_count": "2"}))
    s = ts.sampler("m")
    assert [s.take() for _ in range(3)] == [True, True, False]
    assert ts.get()["trace_count"] == "2"  # the setting, not what is left of it
    ts.update("m", ts.check({"trace_rate": 1}))  # plain integers are taken too
    assert ts.sampler("m").take()
    assert not ts.sampler("other").take()  # the global counter is spent


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"trace_file": "x.log"}, "trace file location can not be updated through network"),
        ({"trace_mode": "triton"}, "unknown settings ['trace_mode']"),
        ({"trace_level": "TIMESTAMPS"}, "trace_level must be a list of strings"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "Expect only one trace level 'OFF'"),
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["LOUD"]}, "unknown trace_level 'LOUD'"),
        ({"trace_rate": "ten"}, "Unable to parse 'trace_rate', got: ten"),
        ({"trace_rate": "-1"}, "out of range [ 0, 4294967295 ], got: -1"),
        ({"trace_rate": 1.5}, "Unable to parse 'trace_rate'"),
        ({"trace_rate": True}, "Unable to parse 'trace_rate'"),
        ({"trace_count": "-2"}, "out of range [ -1, 2147483647 ], got: -2"),
        ({"log_frequency": "4294967296"}, "out of range [ 0, 4294967295 ]"),
        ({"log_frequency": "1" * 30}, "Unable to parse 'log_frequency'"),
    ],
)
def test_bad_settings_are_refused_naming_them(changes: dict[str, Any], message: str) -> None:
    ts = TraceSettings(START)
    with pytest.raises(InvalidInput) as err:
        ts.check(changes)
    assert message in err.value.message
    assert ts.get() == triton("TIMESTAMPS", "1")


def test_a_server_that_cannot_trace_refuses_to_turn_it_on() -> None:
    ts = TraceSettings.off("no SDK here")
    assert ts.get()["trace_level"] == ["OFF"]
    with pytest.raises(InvalidInput, match="tracing can not be turned on: no SDK here"):
        ts.check({"trace_level": ["TIMESTAMPS"]})
    assert ts.update(None, ts.check({"trace_rate": "5"}))["trace_rate"] == "5"


def test_sampling_counters_match_the_plain_rule_on_random_settings() -> None:
    rng = random.Random(22)
    for _ in range(300):
        rate, count, frequency = rng.randint(0, 7), rng.randint(-1, 6), rng.randint(0, 4)
        n = rng.randint(0, 60)
        s = Sampler(Values(on=True, rate=rate, count=count, log_frequency=frequency))
        taken = [i for i in range(n) if s.take()]
        # Every rate-th request (Triton's counter), while the count lasts (-1: no end).
        every = [i for i in range(n) if rate and (i + 1) % rate == 0]
        assert taken == (every if count < 0 else every[:count]), (rate, count, n)
        flushes = [s.collected_one() for _ in taken]
        for k, flushed in enumerate(flushes, 1):
            last = count >= 0 and k == len(taken) and len(taken) == count
            assert flushed == bool((frequency and k % frequency == 0) or last)


def test_the_change_carries_the_settings_and_its_record_merges_them() -> None:
    entries: dict[str, Recorded] = {}
    first = UpdateTraceSettings("m", {"trace_rate": 3, "trace_level": ["OFF"]})
    assert Change.from_json(first.to_json()) == first
    first.record(entries, 1)
    UpdateTraceSettings("m", {"trace_rate": None, "trace_count": 5}).record(entries, 2)
    UpdateTraceSettings(None, {"log_frequency": 2}).record(entries, 3)
    assert entries["@trace/m"] == Recorded(
        2, UpdateTraceSettings("m", {"trace_level": ["OFF"], "trace_count": 5})
    )
    assert entries["@trace"].change == UpdateTraceSettings(None, {"log_frequency": 2})
    # A worker that replays the record reaches the same settings as one that saw each change.
    live, replayed = TraceSettings(START), TraceSettings(START)
    for change in (
        first,
        UpdateTraceSettings("m", {"trace_rate": None, "trace_count": 5}),
        UpdateTraceSettings(None, {"log_frequency": 2}),
    ):
        live.update(change.model, change.settings)
    for recorded in entries.values():
        change = recorded.change
        assert isinstance(change, UpdateTraceSettings)
        replayed.update(change.model, change.settings)
    assert live.get("m") == replayed.get("m") == triton("OFF", "1", "5", "2")
    assert live.get() == replayed.get()
