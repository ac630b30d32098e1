"""The HTTP server's connections and what it asks of the operating system about them: bytes
a socket holds unread, how many connections fit the process's file-descriptor limit, and
which connection the connection cap evicts first."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import sys
import termios
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from service.observability import Tally

log = logging.getLogger(__name__)
C = TypeVar("C", bound=Hashable)


class Waiting(Generic[C]):
    """One server's connections waiting for a request head, oldest first, in two classes:
    those that were never answered (slowloris holds only these) and those that were (a
    keep-alive client between requests). The first are evicted first; evictions are counted
    and logged (to ``logger``) at most every 10 s."""

    def __init__(self, logger: logging.Logger) -> None:
        self.fresh: OrderedDict[C, None] = OrderedDict()
        self.served: OrderedDict[C, None] = OrderedDict()
        self.evicted = Tally(
            logger,
            logging.WARNING,
            "connection cap %d reached: closed connection(s) waiting for a head",
        )

    def add(self, conn: C, *, served: bool) -> None:
        """Add ``conn`` as the newest of its class."""
        self.remove(conn)
        (self.served if served else self.fresh)[conn] = None

    def remove(self, conn: C) -> None:
        self.fresh.pop(conn, None)
        self.served.pop(conn, None)

    def oldest(self) -> C | None:
        """The connection to evict first, if any."""
        for group in (self.fresh, self.served):
            if group:
                return next(iter(group))
        return None


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
