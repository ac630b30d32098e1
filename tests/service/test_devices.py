"""The one parser of device strings, read by configs, settings and the pipeline."""

from __future__ import annotations

import pytest

from service.models import devices
from service.models.builder import resolve_device as resolve_for_config
from service.models.config import ConfigError
from service.models.devices import parse_device, resolve_device


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("auto", ("auto", None)),
        ("cpu", ("cpu", None)),
        ("cuda", ("cuda", None)),
        ("cuda:0", ("cuda", 0)),
        ("cuda:15", ("cuda", 15)),
    ],
)
def test_parse_device(text: str, parsed: tuple[str, int | None]) -> None:
    assert parse_device(text) == parsed


@pytest.mark.parametrize("text", ["gpu", "CUDA", "cpu:0", "auto:1", "cuda:", "cuda:-1", " cpu", ""])
def test_malformed_devices_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match='is not "auto", "cpu", "cuda" or "cuda:N"'):
        parse_device(text)


def test_resolve_device_with_a_fake_gpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("auto", "cuda:1") == "cuda:1"
    assert resolve_device("auto", "cpu") == "cpu"
    assert resolve_device("cuda") == "cuda:0"
    assert resolve_device("cpu", "cuda:1") == "cpu"
    with pytest.raises(ValueError, match="this host has 2 CUDA device"):
        resolve_device("cuda:2")
    with pytest.raises(
        ConfigError, match=r"m/config.toml: device: device 'cuda:5' requested but this"
    ):
        resolve_for_config("cuda:5", source="m/config.toml")
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    assert resolve_device("auto") == "cpu"
