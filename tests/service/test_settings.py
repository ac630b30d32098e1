"""Settings: environment variables, defaults, cross-field checks with clear messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from service.settings import Settings


def test_defaults() -> None:
    s = Settings()
    assert (s.host, s.port, s.model_repository, s.device) == ("127.0.0.1", 8000, None, "auto")
    assert s.max_body_bytes == 64 << 20
    assert s.auth_token is None


def test_environment_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BITSERVE_PORT", "9001")
    monkeypatch.setenv("BITSERVE_MODEL_REPOSITORY", str(tmp_path))
    monkeypatch.setenv("BITSERVE_AUTH_TOKEN", "s3cr3t")
    monkeypatch.setenv("BITSERVE_WARMUP", "false")
    s = Settings()
    assert s.port == 9001
    assert s.model_repository == tmp_path
    assert s.auth_token is not None
    assert s.auth_token.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(s)  # the token never shows up in logs of the settings
    assert s.warmup is False
    assert Settings(port=9002).port == 9002  # explicit values (CLI flags) win over the env


def test_empty_env_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITSERVE_AUTH_TOKEN", "")
    monkeypatch.setenv("BITSERVE_MODEL_REPOSITORY", "")
    s = Settings()
    assert s.auth_token is None
    assert s.model_repository is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "gpu"}, '\'gpu\' is not "auto", "cpu", "cuda" or "cuda:N"'),
        ({"port": 70000}, "less than or equal to 65535"),
        ({"max_body_bytes": 0}, "greater than 0"),
        ({"model_repository": "/definitely/not/here"}, "is not a folder"),
        ({"log_level": "loud"}, "'critical', 'error', 'warning', 'info' or 'debug'"),
        ({"unknown_setting": 1}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only host")
def test_cuda_without_a_gpu_fails_at_start() -> None:
    with pytest.raises(ValidationError, match="requested but this host has 0 CUDA device"):
        Settings(device="cuda")
    with pytest.raises(ValidationError, match="'cuda:1' requested"):
        Settings(device="cuda:1")


def test_every_setting_is_documented() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description, name
