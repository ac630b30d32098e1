"""Small C libraries built on first use with the system compiler and loaded through ctypes.

Used by the CPU kernels of ``gpu_ops`` (``_resample_cpu.c``, ``_bits_cpu.c``). A library is
compiled once per machine (``cc -O3 -march=native -fopenmp``, falling back to plainer flag
sets, the last one without OpenMP) into a cache folder (``$BITSERVE_CACHE_DIR``, else
``~/.cache/bitserve``, mode 0o700). The file name hashes the source, the compiler's version
banner and the flags, so an edited source or an upgraded compiler gets a fresh build, and
processes racing on first use each build a private file that ``os.replace`` moves into place
atomically. ``BITSERVE_CPU_KERNELS=0`` disables every such library; callers then run their
torch code, as they do (after a warning) when no compiler is found or no build succeeds.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger(__name__)

FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-strict-aliasing"],
    ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-strict-aliasing"],
    ["-O3", "-fPIC", "-shared", "-fno-strict-aliasing"],  # no OpenMP runtime: one thread
)


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


def _compile(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    """Build into a private temporary file, then ``os.replace`` it onto ``target``.

    Processes that race on first use each build their own file; the rename is atomic, so a
    reader only ever maps a complete library.
    """
    # 0o700: a library another user could swap in would run as us.
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if target.parent.stat().st_uid == os.getuid():
        target.parent.chmod(0o700)  # tighten a folder an older version made wider
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(out)],
            check=True,
            capture_output=True,
            timeout=120,
        )
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
    ident = _compiler_id(compiler)
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([code, ident.encode(), *map(str.encode, flags)]))
        target = cache_dir() / f"{name}_{key.hexdigest()[:20]}.so"
        try:
            if not target.exists():
                _compile(compiler, flags, source, target)
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
