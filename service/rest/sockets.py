"""What the HTTP server asks of the operating system: bytes a socket holds unread, and how
many connections fit the process's file-descriptor limit."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import sys
import termios

log = logging.getLogger(__name__)


def unread_bytes(transport: asyncio.Transport) -> int:
    """Bytes in the socket's receive queue that the loop has not read yet (0 if unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        out = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int.from_bytes(out, sys.byteorder, signed=True)


def max_connections(wanted: int) -> int:
    """``wanted``, lowered to leave file descriptors for files, pipes and the models' threads
    under the process's ``RLIMIT_NOFILE`` (a cap above it would fail in ``accept`` instead)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    fit = max(16, soft - 64)
    if fit < wanted:
        log.warning(
            "max_connections %d lowered to %d to fit the file-descriptor limit %d",
            wanted,
            fit,
            soft,
        )
    return min(wanted, fit)
