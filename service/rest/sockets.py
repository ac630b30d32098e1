"""The HTTP server's connections and what it asks of the operating system about them: bytes
a socket holds unread, how many connections fit the process's file-descriptor limit, and
which connection the connection cap may close to admit another."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import sys
import termios
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from service.observability.request_ids import Tally

log = logging.getLogger(__name__)


class Connection(Protocol):
    """What the connection cap reads of a connection."""

    opened_at: float
    """The event loop's time when it was accepted."""
    transport: asyncio.Transport

    def __hash__(self) -> int: ...


C = TypeVar("C", bound=Connection)


class IdleConnections(Generic[C]):
    """One server's idle connections, oldest first: those that have received nothing since
    they were accepted or last answered, in two classes: those never answered (a client
    that connects and sends nothing holds only these) and those answered before (a
    keep-alive client between requests). A connection leaves as the first byte of a head is
    parsed. Evictions and refusals are counted and logged (to ``logger``) at most every 10 s.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.fresh: OrderedDict[C, None] = OrderedDict()
        self.served: OrderedDict[C, None] = OrderedDict()
        self.evicted = Tally(
            logger,
            logging.WARNING,
            "connection cap %d reached: closed idle connection(s) with a 503 (nothing received)",
        )
        self.refused = Tally(
            logger,
            logging.WARNING,
            "connection cap %d reached: answered new connection(s) 503 (no connection idle)",
        )

    def add(self, conn: C, *, served: bool) -> None:
        """Add ``conn`` as the newest of its class."""
        self.remove(conn)
        (self.served if served else self.fresh)[conn] = None

    def remove(self, conn: C) -> None:
        self.fresh.pop(conn, None)
        self.served.pop(conn, None)

    def evictable(self, opened_before: float) -> C | None:
        """The connection to close for a newcomer, if any: the one idle longest among those
        never answered and accepted before ``opened_before`` (a younger one may have its
        request on the way), else among those answered before; never one whose socket holds
        bytes not read yet (a request that has arrived)."""
        for conn in self.fresh:
            if conn.opened_at > opened_before:
                break  # the rest are younger still
            if not unread_bytes(conn.transport):
                return conn
        for conn in self.served:
            if not unread_bytes(conn.transport):
                return conn
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
