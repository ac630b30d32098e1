"""gpu_ops._cbuild: on-first-use C builds, their cache, and the ways they can be refused."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_ops import _cbuild

SOURCE = "int bs_answer(int x) { return x + %d; }\n"


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.bs_answer.argtypes = [ctypes.c_int]
    lib.bs_answer.restype = ctypes.c_int
    return lib


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BITSERVE_CPU_KERNELS", raising=False)
    if _cbuild.build(_write(tmp_path, 0), "probe", _bind, "probe") is None:
        pytest.skip("no C compiler here")
    return tmp_path / "cache"


def _write(folder: Path, k: int) -> Path:
    path = folder / "answer.c"
    path.write_text(SOURCE % k)
    return path


def test_builds_once_per_source_in_a_private_folder(tmp_path: Path, cache: Path) -> None:
    lib = _cbuild.Library(_write(tmp_path, 40), "answer", _bind, "test kernels").get()
    assert lib is not None
    assert lib.bs_answer(2) == 42
    assert len(list(cache.glob("answer_*.so"))) == 1
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    # Cached: a second Library finds the file; an edited source gets its own file.
    again = _cbuild.Library(_write(tmp_path, 40), "answer", _bind, "test kernels").get()
    assert again is not None
    assert again.bs_answer(2) == 42
    assert len(list(cache.glob("answer_*.so"))) == 1
    edited = _cbuild.Library(_write(tmp_path, 1), "answer", _bind, "test kernels").get()
    assert edited is not None
    assert edited.bs_answer(2) == 3
    assert len(list(cache.glob("answer_*.so"))) == 2
    assert not [p for p in cache.iterdir() if p.name.startswith(".build-")]


def test_disabled_by_environment(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = _cbuild.Library(_write(tmp_path, 40), "answer", _bind, "test kernels")
    monkeypatch.setenv("BITSERVE_CPU_KERNELS", "0")
    assert library.get() is None
    monkeypatch.setenv("BITSERVE_CPU_KERNELS", "1")
    assert library.get() is not None


def test_broken_source_or_compiler_warns_and_returns_none(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with caplog.at_level(logging.INFO, logger=_cbuild.__name__):
        assert _cbuild.Library(bad, "bad", _bind, "broken kernels").get() is None
    assert "could not build the broken kernels" in caplog.text
    assert "falling back to torch" in caplog.text
    assert "error" in caplog.text  # the compiler's message, at INFO
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert _cbuild.build(_write(tmp_path, 7), "answer", _bind, "test kernels") is None
    assert not list(cache.glob("bad_*.so"))


@pytest.mark.slow  # fresh processes and C builds: `make test` runs it, `make test-unit` not
def test_racing_processes_share_one_build(tmp_path: Path, cache: Path) -> None:
    """Several first uses at once: one file per cache key, complete when loaded."""
    source = _write(tmp_path, 5)
    code = (
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "from gpu_ops import _cbuild\n"
        "def bind(lib):\n"
        "    lib.bs_answer.restype = ctypes.c_int\n"
        "    return lib\n"
        f"lib = _cbuild.Library(Path({str(source)!r}), 'race', bind, 'race').get()\n"
        "sys.exit(0 if lib is not None and lib.bs_answer(1) == 6 else 1)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "BITSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    assert len(list(cache.glob("race_*.so"))) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".build-")]


def _evil(tmp_path: Path, target: Path) -> None:
    """Put a library answering x + 1000 where the cache expects ``target``."""
    subprocess.run(
        ["cc", "-shared", "-fPIC", str(_write(tmp_path / "evil", 1000)), "-o", str(target)],
        check=True,
    )


@pytest.mark.parametrize("how", ["foreign owner", "group writable", "symlink"])
def test_untrusted_cached_library_is_not_loaded(
    tmp_path: Path, cache: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    source = _write(tmp_path, 40)
    assert _cbuild.build(source, "answer", _bind, "test kernels") is not None
    (cached,) = cache.glob("answer_*.so")
    (tmp_path / "evil").mkdir()
    if how == "symlink":
        _evil(tmp_path, tmp_path / "evil" / "lib.so")
        cached.unlink()
        cached.symlink_to(tmp_path / "evil" / "lib.so")
    else:
        _evil(tmp_path, cached)
        if how == "group writable":
            cached.chmod(0o770)
        elif os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        else:
            os.chown(cached, 12345, 12345)
    with caplog.at_level(logging.WARNING, logger=_cbuild.__name__):
        lib = _cbuild.build(source, "answer", _bind, "test kernels")
    assert lib is not None
    assert lib.bs_answer(2) == 42  # a private build, not the planted x + 1000
    assert "not loading the cached test kernels" in caplog.text
    assert {"foreign owner": "owned by uid 12345", "group writable": "writable by group"}.get(
        how, "symbolic link"
    ) in caplog.text


@pytest.mark.parametrize("how", ["foreign world-writable", "symlink"])
def test_untrusted_cache_folder_builds_privately(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    shared = tmp_path / "shared"
    shared.mkdir()
    if how == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        shared.rmdir()
        shared.symlink_to(tmp_path / "real")
    elif os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    else:
        os.chown(shared, 12345, 12345)
        shared.chmod(0o777)
    monkeypatch.setenv("BITSERVE_CACHE_DIR", str(shared))
    with caplog.at_level(logging.WARNING, logger=_cbuild.__name__):
        lib = _cbuild.build(_write(tmp_path, 40), "answer", _bind, "test kernels")
    assert lib is not None
    assert lib.bs_answer(2) == 42
    assert "not using the cache folder" in caplog.text
    assert not list(shared.iterdir())  # nothing written where others could swap it
    if how != "symlink":
        assert stat.S_IMODE(shared.stat().st_mode) == 0o777  # not ours to change


def test_cache_folder_of_ours_made_wider_is_tightened(tmp_path: Path, cache: Path) -> None:
    cache.chmod(0o777)
    assert _cbuild.build(_write(tmp_path, 40), "answer", _bind, "test kernels") is not None
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    for lib in cache.glob("*.so"):
        assert stat.S_IMODE(lib.stat().st_mode) & 0o022 == 0


def test_cache_key_names_the_cpu(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-march=native code built on one CPU must not be reused on another sharing the cache."""
    ident = _cbuild._cpu_id()
    assert ident.startswith(platform.machine())
    if Path("/proc/cpuinfo").exists():
        assert len(ident.splitlines()[1]) > 0  # the feature flags were found
    source = _write(tmp_path, 40)
    assert _cbuild.build(source, "answer", _bind, "test kernels") is not None
    monkeypatch.setattr(_cbuild, "_cpu_id", lambda: "x86_64\nfpu sse2")
    lib = _cbuild.build(source, "answer", _bind, "test kernels")
    assert lib is not None
    assert lib.bs_answer(2) == 42
    assert len(list(cache.glob("answer_*.so"))) == 2
