"""Small C libraries built on first use with the system compiler and loaded through ctypes.

Used by the CPU kernels of ``gpu_ops`` (``_resample_c.c``, ``_bits_c.c``). A library is
compiled once per machine (``cc -O3 -march=native -fopenmp ...``, falling back to plainer flag
sets, the last one without OpenMP) into a cache folder (``$BITSERVE_CACHE_DIR``, else
``~/.cache/bitserve``, mode 0o700). The file name hashes the source, the compiler's version
banner, the flags and the CPU (architecture and feature flags: ``-march=native`` code can
crash on another CPU sharing the home folder or image), so an edited source, an upgraded
compiler or another CPU gets a fresh build, and processes racing on first use each build a
private file that ``os.replace`` moves into place atomically.

Before a library is loaded, the folder and the file must be ours (owned by this user, not
writable by group or others, not symbolic links): a library someone else could have written
would run as us. When the cache fails that check (``BITSERVE_CACHE_DIR`` on a shared path), a
warning is logged and the library is built into a private temporary folder for this process
instead. ``BITSERVE_CPU_KERNELS=0`` disables every such library; callers then run their torch
code, as they do (after a warning) when no compiler is found or no build succeeds.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger(__name__)

# -fno-trapping-math: no kernel reads floating-point exception flags, and without it gcc will
# not turn the conditional selects of the response loops into vector blends.
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-strict-aliasing",
     "-fno-trapping-math"],
    ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-strict-aliasing", "-fno-trapping-math"],
    ["-O3", "-fPIC", "-shared", "-fno-strict-aliasing", "-fno-trapping-math"],  # no OpenMP
)  # fmt: skip


def cache_dir() -> Path:
    """The folder compiled libraries are cached in."""
    root = os.environ.get("BITSERVE_CACHE_DIR") or Path.home() / ".cache" / "bitserve"
    return Path(root)


def enabled() -> bool:
    """False when ``BITSERVE_CPU_KERNELS=0`` asks for the torch code paths only."""
    return os.environ.get("BITSERVE_CPU_KERNELS", "1") != "0"


def _compiler_id(compiler: str) -> str:
    """The compiler's ``--version`` banner, so an upgraded compiler gets a fresh build."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return compiler
    return compiler + "\n" + done.stdout.decode(errors="replace")


def _cpu_id() -> str:
    """The architecture and the CPU's feature flags, which ``-march=native`` code depends on."""
    features = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                # x86: "flags"; ARM: "Features". Every core lists the same ones.
                if line.split(":", 1)[0].strip() in ("flags", "Features"):
                    features = line.split(":", 1)[1].strip()
                    break
    except OSError:  # not Linux: the processor's name is the best cheap proxy
        features = platform.processor()
    return f"{platform.machine()}\n{features}"


def _why_unsafe(path: Path) -> str | None:
    """Why loading from ``path`` could run code another user wrote; ``None`` when it cannot.

    ``lstat``: a symbolic link is refused itself, whoever owns what it points to.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _cache_problem(root: Path) -> str | None:
    """Create (0o700) or tighten the cache folder; why it cannot be trusted, or ``None``."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(root)
        if st.st_uid == os.getuid() and not stat.S_ISLNK(st.st_mode):
            root.chmod(0o700)  # tighten a folder an older version made wider
        return _why_unsafe(root)
    except OSError as exc:
        return f"cannot be used ({exc})"


def _load_private(
    compiler: str,
    flags: list[str],
    source: Path,
    name: str,
    bind: Callable[[ctypes.CDLL], ctypes.CDLL],
) -> ctypes.CDLL:
    """Build into a fresh private folder (0o700, ours), load, and delete the files.

    The loaded mapping outlives the unlinked file, so nothing is left behind.
    """
    with tempfile.TemporaryDirectory(prefix="bitserve-cc-") as tmp:
        target = Path(tmp) / name
        _compile(compiler, flags, source, target)
        return bind(ctypes.CDLL(str(target)))


def _compile(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    """Build into a private temporary file, then ``os.replace`` it onto ``target``.

    Processes that race on first use each build their own file; the rename is atomic, so a
    reader only ever maps a complete library.
    """
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(out)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        out.chmod(0o700)  # whatever the umask: a group-writable file would be refused
        os.replace(out, target)


def build(
    source: Path, name: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL], what: str
) -> ctypes.CDLL | None:
    """Compile (or reuse from the cache) ``source`` and bind it; ``None`` when impossible.

    Args:
        source: the C file.
        name: the cache file prefix (``<name>_<hash>.so``).
        bind: sets ``argtypes``/``restype`` of the library's functions (an AttributeError
            for a missing symbol counts as a failed build).
        what: how log messages name the kernels, e.g. "CPU resample kernels".
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _log.warning("no C compiler found (set CC): the %s fall back to torch code", what)
        return None
    code = source.read_bytes()
    ident = _compiler_id(compiler) + "\n" + _cpu_id()
    root = cache_dir()
    problem = _cache_problem(root)
    if problem is not None:
        _log.warning(
            "not using the cache folder %s for the %s: it %s; building into a private "
            "temporary folder instead (set BITSERVE_CACHE_DIR to a folder only you can write)",
            root, what, problem,
        )  # fmt: skip
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([code, ident.encode(), *map(str.encode, flags)]))
        file_name = f"{name}_{key.hexdigest()[:20]}.so"
        target = root / file_name
        try:
            if problem is not None:
                return _load_private(compiler, flags, source, file_name, bind)
            if not os.path.lexists(target):
                _compile(compiler, flags, source, target)
            unsafe = _why_unsafe(target)
            if unsafe is not None:
                _log.warning(
                    "not loading the cached %s %s: it %s; building a private copy instead",
                    what, target, unsafe,
                )  # fmt: skip
                return _load_private(compiler, flags, source, file_name, bind)
            return bind(ctypes.CDLL(str(target)))
        except (OSError, AttributeError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            _log.info(
                "%s with %s %s: %s %s",
                what, compiler, " ".join(flags), exc, detail.decode(errors="replace")[-500:],
            )  # fmt: skip
    _log.warning(
        "could not build the %s with %s (cache %s): falling back to torch code; run with "
        "DEBUG/INFO logging of %s for the compiler output",
        what, compiler, cache_dir(), __name__,
    )  # fmt: skip
    return None


class Library:
    """A C library built on the first :meth:`get` in this process (thread-safe)."""

    def __init__(
        self, source: Path, name: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL], what: str
    ) -> None:
        self._args = (source, name, bind, what)
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        """The library, or ``None`` when disabled (``BITSERVE_CPU_KERNELS=0``) or unbuildable."""
        if not enabled():
            return None
        if self._tried:  # the common case: no lock
            return self._lib
        with self._lock:
            if not self._tried:
                self._lib = build(*self._args)
                self._tried = True
        return self._lib
