"""Triton's system shared-memory extension: clients on this host pass tensors through POSIX
shared memory instead of request and response bodies.

A client creates a POSIX shared memory object (``shm_open("/name")``), registers a region of
it by name (``POST /v2/systemsharedmemory/region/{name}/register`` with ``{key, offset,
byte_size}``), and then names the region in an input's or output's parameters
(``shared_memory_region``, ``shared_memory_byte_size``, ``shared_memory_offset``). The server
maps the region once; an input is an ``np.frombuffer`` view over the mapping (no copy before
the staging copy every input has), an output is written into it (and its response entry
carries no data, as Triton's).

What is checked, each violation a 400 that names the region:

- a key is a POSIX shared memory name only: ``/name`` (or ``name``) of letters, digits, ``_``,
  ``.`` and ``-``; never a path. It is opened in ``/dev/shm`` without following symlinks, and
  must be a regular file;
- the region (``offset``, ``byte_size``) lies within the object, and a tensor (its offset and
  byte size) within its region: nothing outside a registered region is read or written;
- at most ``max_regions`` regions at once;
- an object that shrank after registration is refused when used (a read past its end would
  kill the process with SIGBUS). A client that truncates its object *while* the server reads
  it can still cause that; it must share the host (and the object) to do so.

A region unregistered while requests use it is unmapped when the last of them is done (their
views keep the mapping alive; Triton defers the same way). Triton's CUDA shared-memory routes
answer too: status and unregister (nothing is ever registered) and a register that says CUDA
shared memory is not supported.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import InvalidInput, NotFound
from service.protocol.request import MAX_NAME_CHARS, check_text

SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared memory objects (``shm_open`` opens ``/dev/shm/<name>``)."""
_KEY = re.compile(r"/?([A-Za-z0-9_.-]{1,255})")
_MAX_BYTES = 1 << 62  # bounds the arithmetic; an object's own size is the real limit


@dataclass(eq=False)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    mapping: mmap.mmap
    start: int
    """Where the region starts in ``mapping`` (mappings start on a page boundary)."""


def _count(value: object, what: str, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= _MAX_BYTES:
        shown = repr(value)[:40]
        raise InvalidInput(f"{what} must be an integer from {least} to {_MAX_BYTES}, got {shown}")
    return value


class SystemSharedMemory:
    """The registered system shared-memory regions of this process.

    Args:
        max_regions: the most regions registered at once.
        directory: where POSIX shared memory objects live (``/dev/shm``; tests may pass
            another tmpfs folder).
    """

    def __init__(self, max_regions: int = 64, directory: Path = SHM_DIR) -> None:
        self.max_regions = max_regions
        self.directory = directory
        self._regions: dict[str, _Region] = {}
        # Registration, unregistration and lookups may come from the event loop and from
        # decoding threads at once.
        self._lock = threading.Lock()

    # --- registration ---------------------------------------------------------------------

    def check(
        self, name: object, key: object, offset: object, byte_size: object
    ) -> tuple[str, str, int, int]:
        """A registration's name, key, offset and byte size, checked (nothing is opened).

        Raises:
            InvalidInput: a bad name, key, offset or size; the message names the region.
        """
        name = check_text(name, "shared memory region name", MAX_NAME_CHARS)
        what = f"failed to register shared memory region '{name}'"
        key_text = key if isinstance(key, str) else None
        match = _KEY.fullmatch(key_text) if key_text is not None else None
        if key_text is None or match is None or match.group(1) in (".", ".."):
            shown = repr(key)[:80]
            raise InvalidInput(
                f"{what}: key {shown} is not a POSIX shared memory name ('/name' of letters, "
                "digits, '_', '.' and '-'; never a path)"
            )
        offset = _count(offset, f"{what}: offset", least=0)
        byte_size = _count(byte_size, f"{what}: byte_size", least=1)
        return name, key_text, offset, byte_size

    def register(self, name: object, key: object, offset: object, byte_size: object) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the POSIX object ``key`` as region ``name``.

        Raises:
            InvalidInput: a bad name, key, offset or size (:meth:`check`), an object that
                cannot be opened or is too small, a name already registered, or too many
                regions; the message names the region.
        """
        name, key_text, offset, byte_size = self.check(name, key, offset, byte_size)
        what = f"failed to register shared memory region '{name}'"
        base = key_text.lstrip("/")
        with self._lock:
            if name in self._regions:
                raise InvalidInput(f"shared memory region '{name}' already in manager")
            if len(self._regions) >= self.max_regions:
                raise InvalidInput(
                    f"{what}: {len(self._regions)} regions are registered, the most this "
                    f"server takes (max_shm_regions {self.max_regions}); unregister some"
                )
            self._regions[name] = self._map(name, key_text, base, offset, byte_size)

    def _map(self, name: str, key: str, base: str, offset: int, byte_size: int) -> _Region:
        what = f"failed to register shared memory region '{name}'"
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.directory / base, flags)
        except OSError as exc:
            why = "a symlink" if exc.errno == errno.ELOOP else (exc.strerror or "cannot open")
            raise InvalidInput(
                f"{what}: unable to open shared memory object '{key}' ({why})"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInput(f"{what}: '{key}' is not a shared memory object")
            if offset + byte_size > st.st_size:
                raise InvalidInput(
                    f"{what}: offset {offset} + byte_size {byte_size} runs past the end of "
                    f"'{key}' ({st.st_size} bytes)"
                )
            start = offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, start + byte_size, offset=offset - start)
        except BaseException:
            os.close(fd)
            raise
        return _Region(name, key, offset, byte_size, fd, mapping, start)

    def unregister(self, name: str | None = None) -> None:
        """Unregister region ``name`` (None: every region); an unknown name is no error (as
        in Triton). A region still in use is unmapped when its last user is done."""
        with self._lock:
            if name is None:
                regions = list(self._regions.values())
                self._regions.clear()
            else:
                region = self._regions.pop(name, None)
                regions = [] if region is None else [region]
        for r in regions:
            os.close(r.fd)
            # Views of in-flight requests keep it mapped until they are released.
            with contextlib.suppress(BufferError):
                r.mapping.close()

    def close(self) -> None:
        """Unregister everything (at shutdown)."""
        self.unregister(None)

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """Triton's status: ``[{name, key, offset, byte_size}]`` of one region or all.

        Raises:
            NotFound: no region ``name``.
        """
        with self._lock:
            if name is None:
                regions = sorted(self._regions.values(), key=lambda r: r.name)
            elif name in self._regions:
                regions = [self._regions[name]]
            else:
                shown = check_text(name, "shared memory region name", MAX_NAME_CHARS)
                raise NotFound(f"Unable to find system shared memory region: '{shown}'")
        return [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for r in regions
        ]

    # --- use ------------------------------------------------------------------------------

    def view(self, region: object, offset: object, byte_size: object, what: str) -> memoryview:
        """``byte_size`` bytes at ``offset`` of a registered region, writable, without a copy.

        Args:
            region, offset, byte_size: a tensor's ``shared_memory_region``,
                ``shared_memory_offset`` (None: 0) and ``shared_memory_byte_size``.
            what: names the tensor in messages (``input 'x'``).

        Raises:
            InvalidInput: an unknown region, a bad offset or size, bounds past the region, or
                an object that shrank since it was registered.
        """
        name = check_text(region, f"{what}: shared_memory_region", MAX_NAME_CHARS)
        where = f"{what}: shared memory region '{name}'"
        if byte_size is None:
            raise InvalidInput(f"{where}: shared_memory_byte_size is required")
        offset = _count(0 if offset is None else offset, f"{where}: shared_memory_offset", least=0)
        byte_size = _count(byte_size, f"{where}: shared_memory_byte_size", least=0)
        with self._lock:
            r = self._regions.get(name)
            if r is None:
                raise InvalidInput(f"{where} is not registered")
            if offset + byte_size > r.byte_size or (byte_size and offset >= r.byte_size):
                raise InvalidInput(
                    f"{where}: offset {offset} + byte size {byte_size} runs past the region's "
                    f"{r.byte_size} bytes"
                )
            # A page past the end of a shrunken object would be SIGBUS, not an exception.
            if os.fstat(r.fd).st_size < r.offset + r.byte_size:
                raise InvalidInput(f"{where}: its object '{r.key}' shrank since registration")
            begin = r.start + offset
            return memoryview(r.mapping)[begin : begin + byte_size]

    def __len__(self) -> int:
        return len(self._regions)

    def __contains__(self, name: object) -> bool:
        return name in self._regions


# --- CUDA shared memory -------------------------------------------------------------------


class CudaSharedMemory:
    """Triton's CUDA shared-memory routes on a server that does not take CUDA IPC handles:
    status is empty, unregister does nothing, register is refused."""

    def __init__(self, system: SystemSharedMemory | None) -> None:
        self._system = system  # the two share one namespace of region names

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """``[]``; a named region is not found (or is a system region)."""
        if name is None:
            return []
        shown = check_text(name, "shared memory region name", MAX_NAME_CHARS)
        if self._system is not None and shown in self._system:
            raise NotFound(
                f"The region named '{shown}' is registered as system shared memory, not CUDA "
                "shared memory"
            )
        raise NotFound(f"Unable to find cuda shared memory region: '{shown}'")

    def unregister(self, name: str | None = None) -> None:
        """Nothing is registered: nothing to do (an unknown name is no error, as in Triton)."""

    def register(self, name: str) -> None:
        """Always refused.

        Raises:
            InvalidInput: CUDA shared memory is not supported.
        """
        shown = check_text(name, "shared memory region name", MAX_NAME_CHARS)
        raise InvalidInput(
            f"failed to register CUDA shared memory region '{shown}': CUDA shared memory is not "
            "supported (use system shared memory)"
        )
