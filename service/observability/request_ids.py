"""Request ids and logging: the id of the request being handled on every log record.

Every request gets an id (see ``service.rest.gateway``): the client's ``X-Request-ID`` when it is
a sane token, else a fresh one from :class:`RequestIds`. It is echoed in the response's
``X-Request-ID``, put on every log record emitted while the request is handled
(``%(request_id)s``, via :class:`RequestIdFilter`), and quoted in the body of a 500 so an
operator can find the traceback, which is logged and never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import math
import os
import re
import time
from typing import Any

from service.text import safe_text

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")


class RequestIds:
    """Request ids: the client's ``X-Request-ID`` when it is a sane token, else a fresh one.

    Fresh ids are a random per-process prefix and a counter (``3f9c1a0b-1f``): unique across
    worker processes and restarts, and a counter increment instead of a ``uuid4`` per request.
    """

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex() + "-"
        self._count = itertools.count(1)

    def __call__(self, sent: bytes | None) -> str:
        """The id of a request that sent ``X-Request-ID: sent`` (None: none sent)."""
        if sent is not None and _VALID_ID.fullmatch(sent):
            return sent.decode("ascii")
        return f"{self._prefix}{next(self._count):x}"


class Tally:
    """Counts an event that clients can cause by the thousand (a shed request, an evicted
    connection) and logs it at most every ``every_s`` seconds, with the count since the last
    line: one line per occurrence would flood the log (and cost the CPU that shedding is
    meant to save). Occurrences counted after a line are written ``every_s`` after it (a
    timer on the running event loop), even if no other occurrence comes: the last burst's
    count is never left unsaid.

    Args:
        logger: where the lines go.
        level: their level.
        message: a %-format for the latest occurrence's arguments; the count is appended.
        every_s: the least time between two lines.
    """

    def __init__(
        self, logger: logging.Logger, level: int, message: str, every_s: float = 10.0
    ) -> None:
        self.logger = logger
        self.level = level
        self.message = message + " (%d time(s) since the last such line)"
        self.every_s = every_s
        self._count = 0
        self._logged_at = -math.inf
        self._args: tuple[object, ...] = ()
        self._flush_due = False

    def __call__(self, *args: object) -> None:
        """Count one occurrence (``args`` fill ``message`` if a line is written now)."""
        self._count += 1
        self._args = args
        now = time.monotonic()
        if now - self._logged_at >= self.every_s:
            self._write(now)
        elif not self._flush_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # outside a loop: the next occurrence's line carries the count
            self._flush_due = True
            loop.call_later(self._logged_at + self.every_s - now, self.flush)

    def flush(self) -> None:
        """Write the occurrences counted since the last line, if any."""
        self._flush_due = False
        if self._count:
            self._write(time.monotonic())

    def _write(self, now: float) -> None:
        self.logger.log(self.level, self.message, *self._args, self._count)
        self._count = 0
        self._logged_at = now


def printable_path(path: str) -> str:
    """A request path for a log line or an error message: control characters escaped (a
    percent-encoded newline must not forge a log line), at most 256 characters."""
    return safe_text(path, 256)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request) so formats can use it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class BatchedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes the INFO and DEBUG lines of one turn of the event loop
    in one write (one system call for a batch's access lines, not one per request).

    Lines at WARNING and above, and lines from outside an event loop (worker threads, tools),
    are written at once, after the lines held before them: the order is kept. Held lines are
    written at the end of the loop's turn, and by ``flush`` (which ``logging.shutdown``
    calls at exit).
    """

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self._held: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._take(line, record.levelno < logging.WARNING)

    def hold(self, line: str) -> None:
        """Write a formatted INFO line (with its terminator) as :meth:`emit` writes a
        record's: ``service.observability.access_log`` makes its lines itself."""
        with self.lock or contextlib.nullcontext():
            self._take(line, True)

    def _take(self, line: str, low: bool) -> None:
        if low:
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None and (not self._held or loop is self._loop):
                if not self._held:
                    self._loop = loop
                    loop.call_soon(self.flush)
                self._held.append(line)
                return
        self._held.append(line)
        self._write()

    def flush(self) -> None:
        with self.lock or contextlib.nullcontext():
            self._write()

    def _write(self) -> None:
        held, self._held = self._held, []
        if held and self.stream is not None:
            try:
                self.stream.write("".join(held))
                self.stream.flush()
            except Exception:
                logging.Handler.handleError(self, logging.makeLogRecord({"msg": "log write"}))


def logging_config(level: str, worker: int | None = None) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for the server and uvicorn, with request ids (and the
    worker's index after the logger name in a worker process of ``--workers``)."""
    handler = {
        "class": "service.observability.request_ids.BatchedStreamHandler",
        "formatter": "default",
        "filters": ["request_id"],
        "stream": "ext://sys.stderr",
    }
    tagged = LOG_FORMAT.replace("%(name)s", f"%(name)s w{worker}")
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"default": {"format": LOG_FORMAT if worker is None else tagged}},
        "handlers": {"default": handler},
        "loggers": {
            # Every logger is named by its module (``logging.getLogger(__name__)``), so these
            # two roots cover the server and the ops it runs.
            "service": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "gpu_ops": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            # Our own access log carries the request id; uvicorn's would duplicate it.
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }


def configure_logging(level: str, worker: int | None = None) -> dict[str, Any]:
    """Apply :func:`logging_config` to this process; returns it (for uvicorn's ``Config``).

    Records skip what nobody formats here (caller's file and line, thread, process), each of
    which costs a lookup per record: the access log writes one record per request.
    """
    import logging.config

    config = logging_config(level, worker)
    logging.config.dictConfig(config)
    # The logging module's documented switches for this ("Optimization" in its HOWTO).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    return config
