"""A load's config override: Triton's field names mapped onto ``config.toml`` keys, refusals
naming the field, and real loads through the data plane (the same validation as the files,
this load only, Triton's ``failed to load`` wording)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from service.controlplane import ControlPlane
from service.errors import InvalidInput
from service.models.config import ConfigError
from service.models.override import MAX_OVERRIDE_CHARS, load_parameters, parse_override
from service.models.repository import ModelRepository
from service.observability.metrics import Metrics
from tests.service.test_repository import cfg_text, write


def test_tritons_fields_become_config_keys() -> None:
    o = parse_override(
        json.dumps(
            {
                "name": "m",
                "platform": "bitserve",
                "backend": "bitserve",
                "max_batch_size": "16",  # protobuf's JSON: integers may be strings
                "dynamic_batching": {
                    "max_queue_delay_microseconds": 250,
                    "preferred_batch_size": [16],
                    "priority_levels": "2",
                    "default_priority_level": 2,
                    "priority_queue_policy": {"1": {"max_queue_size": "3"}},
                    "default_queue_policy": {
                        "max_queue_size": "7",
                        "default_timeout_microseconds": 400000,
                        "timeout_action": "REJECT",
                        "allow_timeout_override": True,
                    },
                },
                "instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [1]}],
            }
        ),
        "m",
    )
    assert o.patch == {
        "max_batch_size": 16,
        "max_queue_delay_us": 250,
        "priority_levels": 2,
        "default_priority_level": 2,
        "priority_queue_policy": {"1": {"max_queue_size": 3}},
        "max_queue_size": 7,
        "queue_timeout_us": 400000,
        "device": "cuda:1",
    }
    assert o.inputs is None
    assert o.outputs is None
    assert parse_override("{}", "m").patch == {}
    for kind, device in (("KIND_CPU", "cpu"), ("KIND_GPU", "cuda"), ("KIND_AUTO", "auto")):
        text = json.dumps({"instance_group": [{"kind": kind}]})
        assert parse_override(text, "m").patch == {"device": device}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('"parameters": {"config": {{"max_batch_size": "16"}}}', "not JSON"),
        ("[1, 2]", "the config must be an object"),
        ('{"max_batch_size": 1.5}', "max_batch_size: must be an integer, got 1.5"),
        ('{"max_batch_size": "sixteen"}', "max_batch_size: must be an integer"),
        ('{"max_batch_size": true}', "max_batch_size: must be an integer"),
        ('{"max_batch_size": "1_6"}', "max_batch_size: must be an integer"),
        ('{"sequence_batching": {}}', "unknown field(s) ['sequence_batching'] in the config"),
        ('{"dynamic_batching": {"preserve_ordering": true}}', "in dynamic_batching"),
        (
            '{"dynamic_batching": {"priority_queue_policy": {"1": {"timeout_action": "DELAY"}}}}',
            "unknown field(s) ['timeout_action'] in dynamic_batching.priority_queue_policy.1",
        ),
        ('{"dynamic_batching": {"priority_queue_policy": {"x": {}}}}', "must be an integer"),
        ('{"dynamic_batching": []}', "dynamic_batching must be an object"),
        ('{"dynamic_batching": {"default_queue_policy": {"timeout_action": 1}}}', "policy"),
        (
            '{"dynamic_batching": {"default_queue_policy": {"timeout_action": "DELAY"}}}',
            "timeout_action: bitserve has only \"REJECT\", got 'DELAY'",
        ),
        (
            '{"dynamic_batching": {"default_queue_policy": {"allow_timeout_override": false}}}',
            "allow_timeout_override: bitserve has only true",
        ),
        (
            '{"dynamic_batching": {"default_queue_policy": {"priority": 1}}}',
            "unknown field(s) ['priority'] in dynamic_batching.default_queue_policy",
        ),
        ('{"name": "other"}', "name 'other' is not 'm'"),
        ('{"platform": "pytorch_libtorch"}', "this server's is 'bitserve'"),
        ('{"instance_group": [{"kind": "KIND_CPU", "count": 2}]}', "one instance per model"),
        ('{"instance_group": [{}, {}]}', "exactly one group"),
        ('{"instance_group": [{"kind": "KIND_TPU"}]}', "kind 'KIND_TPU'"),
        ('{"instance_group": [{"kind": "KIND_CPU", "gpus": [0]}]}', "one GPU, with KIND_GPU"),
        ('{"input": {"name": "x"}}', "input must be a list of objects"),
    ],
)
def test_refusals_name_the_field(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_override(text, "m")
    (message,) = info.value.problems
    assert message.startswith("config override: ")
    assert problem in message


def test_a_huge_override_is_refused_unread() -> None:
    with pytest.raises(ConfigError, match="longer than"):
        parse_override(" " * (MAX_OVERRIDE_CHARS + 1), "m")


# --- real loads through the control plane -------------------------------------------------


async def load(control: ControlPlane, name: str, config: str | None = None) -> None:
    """A V2 load request through the control plane, ``config`` its override."""
    await control.load(name, {} if config is None else {"parameters": {"config": config}})


def run_with(root: Path, fn: Any) -> None:
    async def main() -> None:
        metrics = Metrics(nvml=None)
        repo = ModelRepository(root, warmup=False, metrics=metrics)
        await repo.start()
        try:
            await fn(ControlPlane(repo), repo)
        finally:
            await repo.stop()

    asyncio.run(main())


def test_override_for_this_load_only_through_the_files_validation(tmp_path: Path) -> None:
    write(tmp_path / "m", cfg_text(max_batch_size=8, delay_us=5))

    async def check(dp: ControlPlane, repo: ModelRepository) -> None:
        await load(dp, "m", '{"max_batch_size": "16", "dynamic_batching": '
                           '{"max_queue_delay_microseconds": "300"}}')  # fmt: skip
        config = repo.get("m").config()
        assert config["max_batch_size"] == 16
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 300
        assert repo.get("m").batcher.max_batch_size == 16
        # What GET .../config gives can be sent back as it is.
        await load(dp, "m", json.dumps(config | {"max_batch_size": 4}))
        assert repo.get("m").config()["max_batch_size"] == 4
        # A later load without an override reads the files again.
        await load(dp, "m")
        assert repo.get("m").config()["max_batch_size"] == 8
        # The patched config goes through config.toml's own validation...
        with pytest.raises(InvalidInput) as info:
            await load(dp, "m", '{"max_batch_size": 100000000}')
        message = info.value.message
        assert message.startswith("failed to load 'm': ")
        assert "m/config.toml + config override: max_batch_size: " in message
        # ... and a failed load keeps the version that serves.
        assert repo.get("m").config()["max_batch_size"] == 8
        # Inputs and outputs are the repository's: an override may only repeat them.
        changed = config | {"input": [{"name": "other", "data_type": "TYPE_UINT8", "dims": [1]}]}
        with pytest.raises(InvalidInput, match=r"input .* differs from the model's"):
            await load(dp, "m", json.dumps(changed))
        for bad, text in (
            ("{nope", "failed to load 'm': config override: not JSON"),
            ('{"max_batch_size": "x"}', "failed to load 'm': config override: max_batch_size"),
        ):
            with pytest.raises(InvalidInput, match=text):
                await load(dp, "m", bad)
        with pytest.raises(InvalidInput, match="failed to load 'wrong_model_name': "):
            await load(dp, "wrong_model_name")
        with pytest.raises(InvalidInput, match="failed to load 'wrong_model_name': "):
            await load(dp, "wrong_model_name", "{}")

    run_with(tmp_path, check)


def test_override_of_the_builtin_demo() -> None:
    async def main() -> None:
        repo = ModelRepository(None, warmup=False)
        await repo.start()
        dp = ControlPlane(repo)
        try:
            await load(dp, "demo", '{"max_batch_size": 2}')
            assert repo.get("demo").config()["max_batch_size"] == 2
            with pytest.raises(InvalidInput, match=r"built-in demo.*\+ config override"):
                await load(dp, "demo", '{"max_batch_size": -1}')
            # A valid but huge batch would allocate (and touch) 262 GB of input buffer at
            # load: refused before anything is allocated, and the demo keeps serving.
            with pytest.raises(InvalidInput) as info:
                await load(dp, "demo", '{"max_batch_size": 65536}')
            assert (
                "inputs[0] (spikes): max_batch_size 65536 x shape [20, 50000] needs a device "
                "buffer of 262,144,000,000 bytes, more than max_batch_bytes (4,294,967,296)"
            ) in info.value.message
            assert repo.get("demo").config()["max_batch_size"] == 2
        finally:
            await repo.stop()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"parameters": []}, "'parameters' must be an object"),
        ({"parameters": {"config": {"max_batch_size": 2}}}, "must be a string of JSON"),
        ({"parameters": {"file:1/model.pt": "AAAA"}}, "unsupported parameters ['file:1/model.pt']"),
    ],
)
def test_load_parameters_refused(body: dict[str, Any], text: str) -> None:
    with pytest.raises(InvalidInput) as info:
        load_parameters("m", body)
    assert info.value.message.startswith("failed to load 'm': ")
    assert text in info.value.message
    assert load_parameters("m", {}) is None
    assert load_parameters("m", {"parameters": {"config": "{}"}}) == "{}"
