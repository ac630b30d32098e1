"""The ``bitserve`` command line: flags map onto settings; check-repo and demo-repo."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import build_parser, main, settings_from_args
from service.settings import Settings


def test_every_setting_is_a_flag() -> None:
    serve = build_parser().parse_args(["serve"])
    for name in Settings.model_fields:
        assert hasattr(serve, name), name


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BITSERVE_PORT", "9001")
    monkeypatch.setenv("BITSERVE_HOST", "0.0.0.0")
    args = build_parser().parse_args(
        ["serve", "--port", "9100", "--model-repository", str(tmp_path), "--no-warmup",
         "--log-level", "debug", "--max-body-bytes", "1024"]
    )  # fmt: skip
    s = settings_from_args(args)
    assert s.port == 9100
    assert s.host == "0.0.0.0"  # from the environment, no flag given
    assert s.model_repository == tmp_path
    assert s.warmup is False
    assert (s.log_level, s.max_body_bytes) == ("debug", 1024)


def test_bad_setting_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "nope"]) == 2
    err = capsys.readouterr().err
    assert "port" in err
    assert "integer" in err
    assert main(["serve", "--model-repository", "/no/such/dir"]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_unknown_choice_is_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "loud"])


def test_demo_repo_then_check_repo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo-repo", str(tmp_path / "repo")]) == 0
    assert list((tmp_path / "repo" / "demo").rglob("config.toml"))
    assert main(["check-repo", str(tmp_path / "repo")]) == 0
    assert "OK" in capsys.readouterr().out
    # Never overwrites: a second demo-repo into the same folder fails with a message.
    assert main(["demo-repo", str(tmp_path / "repo")]) == 1
    assert "exists already" in capsys.readouterr().err


def test_check_repo_reports_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "bad"
    model.mkdir()
    (model / "config.toml").write_text("max_batch_size = 'many'\n")
    assert main(["check-repo", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "config.toml" in err
    assert "max_batch_size" in err
    assert main(["check-repo", str(tmp_path / "missing")]) == 1
    assert "not a folder" in capsys.readouterr().err
