"""The ``bitserve`` command line: flags map onto settings; check-repo and demo-repo."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import build_parser, main, settings_from_args
from service.settings import Settings


def test_every_setting_is_a_flag() -> None:
    serve = build_parser().parse_args(["serve"])
    for name in Settings.model_fields:
        assert hasattr(serve, name), name


@pytest.mark.parametrize(
    "argv",
    [
        ["genotypes", "score", "--help"],
        ["score", "--help"],
        ["index", "build", "--help"],
        ["demo-repo", "--help"],
    ],
)
def test_commands_without_settings_start_without_pydantic(argv: list[str]) -> None:
    """Only serve and check-repo read the settings: the other commands' start skips their
    import (pydantic, about 0.2 s of every `bitserve genotypes score`)."""
    code = (
        "import sys\nfrom service.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('pydantic', 'service.settings') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          check=True, env=os.environ)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]


def test_every_command_is_listed_and_serve_help_has_the_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, wanted in ((["--help"], "genotypes"), (["serve", "--help"], "--max-body-bytes"),
                         (["check-repo", "--help"], "--max-operator-bytes")):  # fmt: skip
        with pytest.raises(SystemExit):
            main(argv)
        assert wanted in capsys.readouterr().out


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


def test_demo_repo_files_take_the_umask_permissions(tmp_path: Path) -> None:
    # The container's user (uid 10001) reads the repository through a mount: every file
    # gets the permissions the umask gives (0644 under 022), none is private to its writer.
    old = os.umask(0o022)
    try:
        assert main(["demo-repo", str(tmp_path / "repo")]) == 0
    finally:
        os.umask(old)
    files = [f for f in (tmp_path / "repo").rglob("*") if f.is_file()]
    assert {f.name for f in files} == {"config.toml", "operator.safetensors"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


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


def test_check_repo_never_prints_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, raw in [
        ("latin1", b"max_batch_size = 16 # caf\xe9\n"),
        ("deep", b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n"),
        ("deeptable", b"x = " + b"{a = " * 2000 + b"1" + b"}" * 2000 + b"\n"),
        ("escape", b'"\\u001b[31mred" = 1\n'),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.toml").write_bytes(raw)
    assert main(["check-repo", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "\x1b" not in err  # a key's escape sequence is shown, not sent to the terminal
    root = tmp_path.name
    assert f"{root}/latin1/config.toml: not UTF-8: byte 0xe9 on line 1" in err
    assert f"{root}/deep/config.toml: invalid TOML: nested too deeply" in err
    assert f"{root}/deeptable/config.toml: invalid TOML: nested too deeply" in err
    assert f"{root}/escape/config.toml: \\x1b[31mred: Extra inputs are not permitted" in err
    assert "6 problem(s)" in err  # escape also lacks inputs and outputs


def test_check_repo_operator_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["demo-repo", str(tmp_path)]) == 0
    capsys.readouterr()
    demo_bytes = 20 * 500 * (1001 * 4 + 4)  # N x A x (W float32 weights + an int32 start)
    assert main(["check-repo", str(tmp_path)]) == 0
    assert main(["check-repo", str(tmp_path), "--max-operator-bytes", str(demo_bytes)]) == 0
    assert main(["check-repo", str(tmp_path), "--max-operator-bytes", str(demo_bytes - 1)]) == 1
    assert f"demo/1/config.toml: operator: would take {demo_bytes} bytes (38.2 MiB): a band of" in (
        capsys.readouterr().err
    )
    # Without the flag, the environment's limit applies, as it would to `serve`.
    monkeypatch.setenv("BITSERVE_MAX_OPERATOR_BYTES", "1000000")
    assert main(["check-repo", str(tmp_path)]) == 1
    assert "max_operator_bytes = 1000000 bytes" in capsys.readouterr().err
    assert main(["check-repo", str(tmp_path), "--max-operator-bytes", "1073741824"]) == 0
    for bad in ("0", "-5", "lots", "1.5"):
        assert main(["check-repo", str(tmp_path), "--max-operator-bytes", bad]) == 2
        assert "bitserve check-repo: max_operator_bytes: " in capsys.readouterr().err
    assert Settings().max_operator_bytes == 1000000


def test_check_repo_batch_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["demo-repo", str(tmp_path)]) == 0
    capsys.readouterr()
    buffer = 16 * 20 * 50000 * 4  # max_batch_size x shape x float32
    assert main(["check-repo", str(tmp_path), "--max-batch-bytes", str(buffer)]) == 0
    assert main(["check-repo", str(tmp_path), "--max-batch-bytes", str(buffer - 1)]) == 1
    assert (
        f"demo/1/config.toml: inputs[0] (spikes): max_batch_size 16 x shape [20, 50000] needs a "
        f"device buffer of {buffer:,} bytes, more than max_batch_bytes ({buffer - 1:,})"
    ) in capsys.readouterr().err
    monkeypatch.setenv("BITSERVE_MAX_BATCH_BYTES", str(buffer - 1))
    assert main(["check-repo", str(tmp_path)]) == 1
    assert main(["check-repo", str(tmp_path), "--max-batch-bytes", "lots"]) == 2
    assert "bitserve check-repo: max_batch_bytes: " in capsys.readouterr().err
    assert Settings().max_batch_bytes == buffer - 1
