"""Triton's system shared-memory extension: clients on this host pass tensors through POSIX
shared memory instead of request and response bodies.

A client creates a POSIX shared memory object (``shm_open("/name")``), registers a region of
it by name (``POST /v2/systemsharedmemory/region/{name}/register`` with ``{key, offset,
byte_size}``), and then names the region in an input's or output's parameters
(``shared_memory_region``, ``shared_memory_byte_size``, ``shared_memory_offset``). The server
opens the object once; an input is read from it with ``pread`` (one copy, into the request's
own buffer), an output is written into it with ``pwrite`` (and its response entry carries no
data, as Triton's).

Nothing is mapped: the client owns the object and may truncate it at any moment, and a read
or write through a mapping past the new end is SIGBUS, which kills the process (every worker
that had the region registered). ``pread`` past the end just reads less: a region that
shrank is a 400 for the request that uses it, and nothing else notices.

What is checked, each violation a 400 that names the region:

- a key is a POSIX shared memory name only: ``/name`` (or ``name``) of letters, digits, ``_``,
  ``.`` and ``-``; never a path. It is opened in ``/dev/shm`` without following symlinks, and
  must be a regular file;
- the region (``offset``, ``byte_size``) lies within the object, and a tensor (its offset and
  byte size) within its region: nothing outside a registered region is read or written;
- at most ``max_regions`` regions at once;
- an object that shrank after registration, before or while a tensor is read from it or
  written into it, fails that request (a write never grows it back past a shrunken end
  unchecked: its size is checked first).

A request's outputs keep their own descriptor of the object, so a region unregistered while
requests use it still takes their outputs (Triton defers the unmapping the same way). Triton's
CUDA shared-memory routes
answer too: status and unregister (nothing is ever registered) and a register that says CUDA
shared memory is not supported.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.errors import InvalidInput, NotFound
from service.protocol.request import MAX_NAME_CHARS, check_text
from service.protocol.types import SharedOutput

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
    """The object, open for reading and writing; -1 once unregistered."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while ``fd`` is used, so it is never closed (and its number reused) meanwhile."""


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
            self._regions[name] = self._open(name, key_text, base, offset, byte_size)

    def _open(self, name: str, key: str, base: str, offset: int, byte_size: int) -> _Region:
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
        except BaseException:
            os.close(fd)
            raise
        return _Region(name, key, offset, byte_size, fd)

    def unregister(self, name: str | None = None) -> None:
        """Unregister region ``name`` (None: every region); an unknown name is no error (as
        in Triton). Outputs of requests in flight keep their own descriptor."""
        with self._lock:
            if name is None:
                regions = list(self._regions.values())
                self._regions.clear()
            else:
                region = self._regions.pop(name, None)
                regions = [] if region is None else [region]
        for r in regions:
            with r.lock:
                os.close(r.fd)
                r.fd = -1

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

    def _locate(
        self, region: object, offset: object, byte_size: object, what: str
    ) -> tuple[_Region, int, int, str]:
        """The region a tensor names, where its bytes start in the object, how many, and how
        messages name it; bounds checked."""
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
        return r, r.offset + offset, byte_size, where

    def read(self, region: object, offset: object, byte_size: object, what: str) -> memoryview:
        """A copy of ``byte_size`` bytes at ``offset`` of a registered region (``pread``).

        Args:
            region, offset, byte_size: a tensor's ``shared_memory_region``,
                ``shared_memory_offset`` (None: 0) and ``shared_memory_byte_size``.
            what: names the tensor in messages (``input 'x'``).

        Raises:
            InvalidInput: an unknown region, a bad offset or size, bounds past the region, or
                an object that shrank below them.
        """
        r, position, nbytes, where = self._locate(region, offset, byte_size, what)
        buf = bytearray(nbytes)
        with r.lock:
            if r.fd < 0:
                raise InvalidInput(f"{where} is not registered")
            got = _pread_into(r.fd, memoryview(buf), position)
        if got < nbytes:
            raise InvalidInput(_shrank(where, r.key, position + nbytes))
        return memoryview(buf)

    def output(self, region: object, offset: object, byte_size: object, what: str) -> SharedOutput:
        """Where an output goes: ``byte_size`` bytes at ``offset`` of a registered region,
        written with ``pwrite`` through a descriptor of its own (closed once written, or when
        the request is dropped).

        Raises:
            InvalidInput: as :meth:`read`, but for the object's size (checked at the write).
        """
        r, position, nbytes, where = self._locate(region, offset, byte_size, what)
        with r.lock:
            if r.fd < 0:
                raise InvalidInput(f"{where} is not registered")
            fd = os.dup(r.fd)
        return SharedOutput(r.name, nbytes, _Writer(fd, position, nbytes, where, r.key))

    def __len__(self) -> int:
        return len(self._regions)

    def __contains__(self, name: object) -> bool:
        return name in self._regions


def _pread_into(fd: int, buf: memoryview, position: int) -> int:
    """Read into ``buf`` from ``position`` of ``fd`` until it is full or the file ends;
    returns the bytes read."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], position + done)
        if n == 0:
            break
        done += n
    return done


def _shrank(where: str, key: str, needed: int) -> str:
    return (
        f"{where}: its object '{key}' shrank since registration (it ends before byte "
        f"{needed}); register the region again"
    )


class _Writer:
    """Writes one output into a region through its own descriptor (``pwrite``)."""

    def __init__(self, fd: int, position: int, nbytes: int, where: str, key: str) -> None:
        self._fd = fd
        self._position = position
        self._nbytes = nbytes
        self._where = where
        self._key = key
        # Closed once written, or when the request is dropped unwritten (an error).
        self._close = weakref.finalize(self, os.close, fd)

    def __call__(self, data: memoryview) -> None:
        """Write ``data`` (at most the output's byte size) at the output's place.

        Raises:
            InvalidInput: the object shrank below it (nothing is written then).
        """
        assert data.nbytes <= self._nbytes, "sizes are checked against the signature first"
        data = data.cast("B")
        try:
            end = self._position + data.nbytes
            if os.fstat(self._fd).st_size < end:  # pwrite would grow it back: refuse
                raise InvalidInput(_shrank(self._where, self._key, end))
            done = 0
            while done < data.nbytes:
                done += os.pwrite(self._fd, data[done:], self._position + done)
        finally:
            self._close()


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
