"""Hostile model repositories: ``bitserve check-repo`` and a server load agree on every model.

Each case writes one repository holding a good model and a hostile one (path escapes,
symlinked configs and files, corrupt safetensors, non-UTF-8, deep nesting, huge operators,
non-float tensors, non-finite parameters, ...). ``check-repo`` runs as the CLI does, and the
server side is a :class:`ModelRepository` started in-process as ``serve`` starts it. Per
model, both must give the same verdict, with the same problem lines (the server's with the
library text hidden), and check-repo prints no traceback. An end-to-end case with a real
``bitserve serve`` process is in ``tests/e2e/test_hostile_repos_e2e.py``.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from service.cli import main
from service.models.repository import READY, ModelRepository
from tests.service.test_model_files import GAUSS, text


def config(n: int = 3, b: int = 40, extra: str = "") -> str:
    return text(GAUSS + "\n" + extra, n=n, b=b)


def tensors(n: int = 3, b: int = 40, a: int = 5, dtype: str = "float32") -> dict[str, np.ndarray]:
    c = np.sort(np.random.default_rng(0).uniform(0, b - 1, (n, a)), axis=1)
    return {"x": np.arange(b).astype(dtype), "c": c.astype(dtype)}


def model(
    folder: Path, text: str | bytes | None = None, t: dict[str, np.ndarray] | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    raw = config() if text is None else text
    (folder / "config.toml").write_bytes(raw.encode() if isinstance(raw, str) else raw)
    save_file(tensors() if t is None else t, str(folder / "op.safetensors"))
    return folder


# builder(folder, outside): writes a hostile model into folder (its files may be outside)
Case = Callable[[Path, Path], None]


def _escape_dotdot(bad: Path, outside: Path) -> None:
    model(outside / "op")
    model(bad, config().replace('"op.safetensors"', '"../../outside/op/op.safetensors"'))


def _absolute_file(bad: Path, outside: Path) -> None:
    model(bad, config().replace('"op.safetensors"', f'"{outside}/op.safetensors"'))


def _symlinked_operator(bad: Path, outside: Path) -> None:
    model(outside / "op")
    model(bad)
    (bad / "op.safetensors").unlink()
    (bad / "op.safetensors").symlink_to(outside / "op" / "op.safetensors")


def _symlinked_config(bad: Path, outside: Path) -> None:
    model(outside / "cfg")
    model(bad)
    (bad / "config.toml").unlink()
    (bad / "config.toml").symlink_to(outside / "cfg" / "config.toml")


def _symlinked_version(bad: Path, outside: Path) -> None:
    model(outside / "v")
    bad.mkdir()
    (bad / "1").symlink_to(outside / "v")


def _symlinked_model(bad: Path, outside: Path) -> None:
    model(outside / "m")
    bad.symlink_to(outside / "m")


def _symlink_loop(bad: Path, outside: Path) -> None:
    model(bad)
    (bad / "op.safetensors").unlink()
    (bad / "op.safetensors").symlink_to(bad / "loop")
    (bad / "loop").symlink_to(bad / "op.safetensors")


def _dangling_config(bad: Path, outside: Path) -> None:
    bad.mkdir()
    (bad / "config.toml").symlink_to(outside / "nothing.toml")


def _corrupt_safetensors(bad: Path, outside: Path) -> None:
    model(bad)
    (bad / "op.safetensors").write_bytes(os.urandom(64))


def _lying_safetensors(bad: Path, outside: Path) -> None:
    # A valid header whose offsets run far past the end of the file.
    header = b'{"x":{"dtype":"F32","shape":[40],"data_offsets":[0,160]},"c":{"dtype":"F32",'
    header += b'"shape":[3,5],"data_offsets":[160,99999999999]}}'
    model(bad)
    (bad / "op.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)


def _truncated_safetensors(bad: Path, outside: Path) -> None:
    model(bad)
    data = (bad / "op.safetensors").read_bytes()
    (bad / "op.safetensors").write_bytes(data[:-20])


def _not_utf8(bad: Path, outside: Path) -> None:
    model(bad, b"max_batch_size = 16 # caf\xe9\n" + config().encode())


def _deep_nesting(bad: Path, outside: Path) -> None:
    model(bad, config() + "x = " + "[" * 2000 + "]" * 2000 + "\n")


def _huge_config(bad: Path, outside: Path) -> None:
    model(bad, config() + ("# padding " * 100 + "\n") * 2000)


def _support_1e12(bad: Path, outside: Path) -> None:
    # The case: 20 x 500 coarse points over 50000 fine ones, every window the whole
    # grid: a 2 GB dense operator. Refused from x and c alone, nothing built.
    text = config(20, 50_000, "support = 1e12")
    model(bad, text, tensors(20, 50_000, 500))


def _constant_x(bad: Path, outside: Path) -> None:
    t = tensors()
    t["x"][:] = 3.0
    model(bad, None, t)


def _sigma(value: str) -> Case:
    def build(bad: Path, outside: Path) -> None:
        model(bad, config().replace("sigma = 2.0", f"sigma = {value}"))

    return build


def _support(value: str) -> Case:
    def build(bad: Path, outside: Path) -> None:
        model(bad, config(extra=f"support = {value}"))

    return build


def _dtype(dtype: str, key: str = "x") -> Case:
    def build(bad: Path, outside: Path) -> None:
        t = tensors()
        t[key] = t[key].astype(dtype)
        model(bad, None, t)

    return build


def _non_finite_c(bad: Path, outside: Path) -> None:
    t = tensors()
    t["c"][1, 1] = np.nan
    model(bad, None, t)


def _missing_tensor(bad: Path, outside: Path) -> None:
    t = tensors()
    del t["c"]
    model(bad, None, t)


def _corrupt_model(bad: Path, outside: Path) -> None:
    text = config() + '[model]\nfile = "head.pt2"\n'
    model(bad, text)
    (bad / "head.pt2").write_bytes(b"PK\x03\x04 not really a zip")


def _pickle_model(bad: Path, outside: Path) -> None:
    model(bad, config() + '[model]\nfile = "head.pkl"\n')


def _one_bad_version(bad: Path, outside: Path) -> None:
    model(bad / "1")
    t = tensors()
    t["x"] = t["x"][::-1].copy()
    model(bad / "2", None, t)


def _invalid_name(bad: Path, outside: Path) -> None:
    model(bad.with_name(f"{bad.name} name\x1b[2J"))


def _config_is_a_folder(bad: Path, outside: Path) -> None:
    (bad / "config.toml").mkdir(parents=True)


CASES: dict[str, Case] = {
    "escape-dotdot": _escape_dotdot,
    "absolute-file": _absolute_file,
    "symlinked-operator": _symlinked_operator,
    "symlinked-config": _symlinked_config,
    "symlinked-version": _symlinked_version,
    "symlinked-model": _symlinked_model,
    "symlink-loop": _symlink_loop,
    "dangling-config": _dangling_config,
    "corrupt-safetensors": _corrupt_safetensors,
    "lying-safetensors": _lying_safetensors,
    "truncated-safetensors": _truncated_safetensors,
    "not-utf8": _not_utf8,
    "deep-nesting": _deep_nesting,
    "huge-config": _huge_config,
    "support-1e12": _support_1e12,
    "constant-x": _constant_x,
    "sigma-inf": _sigma("inf"),
    "sigma-nan": _sigma("nan"),
    "sigma-tiny": _sigma("1e-300"),
    "support-inf": _support("inf"),
    "i64-x": _dtype("int64"),
    "i64-c": _dtype("int64", "c"),
    "bool-x": _dtype("bool"),
    "f16-x": _dtype("float16"),  # allowed: the good control of the dtype cases
    "non-finite-c": _non_finite_c,
    "missing-tensor": _missing_tensor,
    "corrupt-model": _corrupt_model,
    "pickle-model": _pickle_model,
    "one-bad-version": _one_bad_version,
    "invalid-name": _invalid_name,
    "config-is-a-folder": _config_is_a_folder,
}
ACCEPTED = {"f16-x", "sigma-tiny"}  # hostile-looking but valid: both must load them


def check_repo(repo: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["check-repo", str(repo)])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err, out.err
    assert "\x1b" not in out.err  # names are escaped, never sent to the terminal
    lines = out.err.splitlines()
    if code == 0:
        assert lines == []
        return code, []
    assert lines[-1] == f"{len(lines) - 1} problem(s) in {repo}"
    return code, lines[:-1]


def served(repo: Path) -> dict[str, tuple[bool, str]]:
    """Per model on disk: (every version READY, the reasons) after ``serve``'s start."""

    async def start() -> list[dict[str, str]]:
        r = ModelRepository(repo, default_device="cpu", warmup=False)
        await r.start()
        try:
            return r.index()
        finally:
            await r.stop()

    out: dict[str, tuple[bool, str]] = {}
    for e in asyncio.run(start()):
        ok, why = out.get(e["name"], (True, ""))
        out[e["name"]] = (ok and e["state"] == READY, "; ".join(filter(None, [why, e["reason"]])))
    return out


def _hide(line: str) -> str:
    """A check-repo line as the server shows it: a library's own text left out."""
    return re.sub(r" \((\w+): .*\)$", r" (\1; details in the server log)", line)


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_repo_and_serve_agree(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    outside.mkdir()
    model(repo / "good")
    CASES[case](repo / "bad", outside)
    code, lines = check_repo(repo, capsys)
    server = served(repo)
    assert server["good"] == (True, "")
    assert not any("/good" in p for p in lines)
    bad_lines = [p for p in lines if p.startswith("repo/bad")]
    assert bad_lines == lines  # every problem names the file it is in
    if case in ACCEPTED:
        assert code == 0, lines
        assert server["bad"] == (True, "")
        return
    assert code == 1
    assert bad_lines, "check-repo found nothing"
    if case == "invalid-name":  # not a model name: serve skips the folder, with a warning
        assert set(server) == {"good"}
        assert lines == ["repo/bad name\\x1b[2J: invalid model name (allowed: [A-Za-z0-9_.-], "
                         "no leading dot)"]  # fmt: skip
        return
    ready, reason = server["bad"]
    assert not ready
    # The same problems, in the same words; the server hides only the libraries' text.
    assert reason == "; ".join(_hide(p) for p in bad_lines)
    assert str(tmp_path) not in reason


def test_the_builtin_demo_goes_through_the_same_checks() -> None:
    async def index(limit: int) -> list[dict[str, str]]:
        r = ModelRepository(None, default_device="cpu", warmup=False, max_operator_bytes=limit)
        await r.start()
        try:
            return r.index()
        finally:
            await r.stop()

    demo_bytes = 20 * 500 * (1001 * 4 + 4)
    assert asyncio.run(index(demo_bytes))[0]["state"] == READY
    (entry,) = asyncio.run(index(demo_bytes - 1))
    assert entry["state"] != READY
    assert entry["reason"].startswith(
        f"<built-in demo>/config.toml: operator: would take {demo_bytes} bytes (38.2 MiB): "
        "a band of 20 x 500 x 1001 float32 weights (W = 1001 of B = 50000 fine points); "
        f"more than max_operator_bytes = {demo_bytes - 1} bytes"
    )
