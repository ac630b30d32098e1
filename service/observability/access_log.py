"""The access log's lines, written without a log record where the logging is the server's own.

One line per request is the largest single piece of the serving loop's profile that the
baselines do not have (``benchmarks/results/overhead.md``): through ``logging`` each line
is a ``LogRecord`` (a dozen attributes, two clock reads), three loggers' handler lists,
the handler's lock and filters, and a ``Formatter`` that formats the time with
``strftime`` on every line. When the access logger's lines end, as the server configures
them (:func:`service.observability.request_ids.logging_config`), in one
:class:`~service.observability.request_ids.BatchedStreamHandler` with the server's format and no
other handler or filter on the way (but the log settings' level switches,
``service.observability.log_settings``), :meth:`AccessLog.write` makes the same line itself (the
time part once per second, in either of the settings' ``log_format``) and hands it to that
handler. Any other logging configuration (a
handler or filter added, another format, another level, a log record factory such as the
one Ray installs when it is imported) takes the plain way:
``logger.info`` with the request id in its context, exactly as before. The lines are the
same bytes either way (``tests/service/test_access_log.py`` compares the two on random
requests).
"""

from __future__ import annotations

import logging
import time

from service.observability.log_settings import LevelSwitches
from service.observability.request_ids import (
    LOG_FORMAT,
    BatchedStreamHandler,
    RequestIdFilter,
    request_id_var,
)

MESSAGE = "%s %s %d %.1fms"
"""An access line's message: method, path, status, milliseconds."""
_FRONT, _NAME, _BACK = LOG_FORMAT.partition("%(name)s")


def _tag(fmt: str) -> str | None:
    """What the server's format ``fmt`` puts after the logger's name (``" w3"`` for a worker
    process's), or None if ``fmt`` is not one of the server's."""
    if not (fmt.startswith(_FRONT + _NAME) and fmt.endswith(_BACK)):
        return None
    tag = fmt[len(_FRONT + _NAME) : len(fmt) - len(_BACK)]
    if tag and not (tag.startswith(" w") and tag[2:].isdigit()):
        return None
    return tag


class AccessLog:
    """Writes access lines to ``logger`` (see the module docstring).

    Args:
        logger: the access logger (``service.rest.gateway.access``).
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._second = -1
        self._asctime = ""
        self._formatter: logging.Formatter | None = None

    def write(self, method: str, path: str, status: int, ms: float, request_id: str) -> None:
        """The line of one request: ``method path status 1.2ms``, with its request id."""
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):
            return
        found = self._direct()
        if found is None:
            token = request_id_var.set(request_id)
            try:
                logger.info(MESSAGE, method, path, status, ms)
            finally:
                request_id_var.reset(token)
            return
        handler, formatter, tag = found
        now = time.time()
        second = int(now)
        datefmt = formatter.datefmt
        if second != self._second or formatter is not self._formatter:
            # As ``Formatter.formatTime`` makes it, once a second.
            shape = datefmt or formatter.default_time_format
            self._asctime = time.strftime(shape, formatter.converter(now))
            self._second, self._formatter = second, formatter
        asctime = self._asctime
        if not datefmt and formatter.default_msec_format:
            msecs = int((now - second) * 1000) + 0.0  # as ``LogRecord`` computes it
            asctime = formatter.default_msec_format % (asctime, msecs)
        message = MESSAGE % (method, path, status, ms)
        line = f"{asctime} INFO {logger.name}{tag} [{request_id}] {message}{handler.terminator}"
        handler.hold(line)

    def _direct(self) -> tuple[BatchedStreamHandler, logging.Formatter, str] | None:
        """The server's own handler of this logger's INFO lines, its formatter and the
        format's worker tag, when nothing else sees the lines; else None."""
        logger: logging.Logger | None = self.logger
        assert logger is not None
        if logger.disabled or logger.filters or type(logger) is not logging.Logger:
            return None
        if logging.getLogRecordFactory() is not logging.LogRecord:
            return None  # a factory may change any part of a record (Ray's sets ``created``)
        found: BatchedStreamHandler | None = None
        while logger is not None:  # the handlers ``Logger.callHandlers`` would call
            for h in logger.handlers:
                if found is not None or type(h) is not BatchedStreamHandler:
                    return None
                found = h
            if not logger.propagate:
                break
            logger = logger.parent
        if found is None or found.level > logging.INFO:
            return None
        ids = 0
        for f in found.filters:  # the request id's, and the log settings' level switches
            if type(f) is RequestIdFilter:
                ids += 1
            elif type(f) is not LevelSwitches or not f.info:
                return None
        if ids != 1:
            return None
        formatter = found.formatter
        if type(formatter) is not logging.Formatter:
            return None
        style = formatter._style
        if type(style) is not logging.PercentStyle or not formatter.usesTime():
            return None
        tag = _tag(style._fmt)
        if tag is None:
            return None
        return found, formatter, tag
