"""Triton's logging extension (``GET``/``POST /v2/logging``) mapped onto the server's logging.

Triton's settings and what they do here:

- ``log_info``, ``log_warning``, ``log_error`` (booleans): whether records of that level are
  written (``log_error`` covers ERROR; CRITICAL records are always written). They are
  independent switches, as in Triton, applied by a filter on the server's log handlers; the
  loggers' level follows the lowest level switched on, so a record nobody writes costs
  nothing. ``log_info`` also switches the access log (one INFO line per request).
- ``log_verbose_level`` (integer >= 0): 0 writes no DEBUG records, 1 or more writes them
  (the server has a single verbose level).
- ``log_format``: ``"default"`` (``2024-05-01 12:00:00,123 INFO ...``) or ``"ISO8601"``
  (``2024-05-01T12:00:00Z INFO ...``, UTC).
- ``log_file``: always ``""`` (the server writes to stderr); setting it to anything else is
  refused, as Triton refuses it over the network.

The initial values follow ``--log-level``. Unknown settings and values of the wrong type are
refused (400) and nothing is changed.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from service.errors import InvalidInput
from service.observability.request_ids import LOG_FORMAT, RequestIdFilter

LOGGERS = ("service", "gpu_ops", "uvicorn")
"""The server's loggers (``service.observability.request_ids.logging_config`` gives them the
handler)."""
_FORMATS = ("default", "ISO8601")
_MAX_VERBOSE = 2**32 - 1


class LevelSwitches(logging.Filter):
    """Drops the records whose level is switched off (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.info = True
        self.warning = True
        self.error = True
        self.verbose = 0

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.CRITICAL:
            return True
        if level >= logging.ERROR:
            return self.error
        if level >= logging.WARNING:
            return self.warning
        if level >= logging.INFO:
            return self.info
        return self.verbose > 0

    def lowest(self) -> int:
        """The lowest level written (the loggers' level)."""
        for on, level in (
            (self.verbose > 0, logging.DEBUG),
            (self.info, logging.INFO),
            (self.warning, logging.WARNING),
            (self.error, logging.ERROR),
        ):
            if on:
                return level
        return logging.CRITICAL


def _formatter(layout: str, iso: bool) -> logging.Formatter:
    if not iso:
        return logging.Formatter(layout)
    fmt = logging.Formatter(layout, datefmt="%Y-%m-%dT%H:%M:%SZ")
    fmt.converter = time.gmtime
    return fmt


class LogSettings:
    """The server's log settings in Triton's terms.

    Args:
        level: the starting level (``--log-level``: ``debug`` ... ``critical``).
        loggers: the loggers whose handlers and levels it controls.
    """

    def __init__(self, level: str = "info", loggers: Sequence[str] = LOGGERS) -> None:
        self.loggers = tuple(loggers)
        self.switches = LevelSwitches()
        n = logging.getLevelNamesMapping()[level.upper()]
        self.switches.verbose = 1 if n <= logging.DEBUG else 0
        self.switches.info = n <= logging.INFO
        self.switches.warning = n <= logging.WARNING
        self.switches.error = n <= logging.ERROR
        self.format = "default"
        # Each handler's record layout as configured (a worker's carries its index): only
        # the time stamp's form changes with log_format.
        self._layouts: weakref.WeakKeyDictionary[logging.Handler, str] = weakref.WeakKeyDictionary()

    def attach(self) -> None:
        """Put the switches and the format on the loggers' handlers now (those that
        ``service.observability.request_ids.logging_config`` made: they carry its request-id
        filter).

        Called at start (after uvicorn has applied the logging configuration, which makes
        new handlers; the loggers' levels are already ``--log-level`` then) and after every
        change; idempotent.
        """
        for name in self.loggers:
            for handler in logging.getLogger(name).handlers:
                if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
                    continue  # not one of the server's (a test's capture, say)
                for old in [f for f in handler.filters if isinstance(f, LevelSwitches)]:
                    if old is not self.switches:  # an earlier app's, in the same process
                        handler.removeFilter(old)
                if self.switches not in handler.filters:
                    handler.addFilter(self.switches)
                layout = self._layouts.get(handler)
                if layout is None:
                    layout = getattr(handler.formatter, "_fmt", None) or LOG_FORMAT
                    self._layouts[handler] = layout
                handler.setFormatter(_formatter(layout, self.format == "ISO8601"))

    def get(self) -> dict[str, Any]:
        """The settings, with Triton's names."""
        s = self.switches
        return {
            "log_file": "",
            "log_info": s.info,
            "log_warning": s.warning,
            "log_error": s.error,
            "log_verbose_level": s.verbose,
            "log_format": self.format,
        }

    def check(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """The settings ``changes`` gives (a ``null`` value leaves one as it is), checked.

        Raises:
            InvalidInput: an unknown setting, a value of the wrong type, or a log file.
        """
        known = set(self.get())
        unknown = sorted(k for k in changes if k not in known)
        if unknown:
            shown = [ascii(k[:64])[1:-1] for k in unknown[:5]]
            raise InvalidInput(f"logging: unknown settings {shown} (known: {sorted(known)})")
        given = {k: v for k, v in changes.items() if v is not None}
        for key in ("log_info", "log_warning", "log_error"):
            if key in given and not isinstance(given[key], bool):
                raise InvalidInput(f"logging: {key} must be a boolean")
        verbose = given.get("log_verbose_level")
        if verbose is not None and (
            isinstance(verbose, bool)
            or not isinstance(verbose, int)
            or not 0 <= verbose <= _MAX_VERBOSE
        ):
            raise InvalidInput(
                f"logging: log_verbose_level must be an integer from 0 to {_MAX_VERBOSE}"
            )
        fmt = given.get("log_format")
        if fmt is not None and fmt not in _FORMATS:
            raise InvalidInput(f"logging: log_format must be one of {list(_FORMATS)}")
        if given.get("log_file", "") != "":
            raise InvalidInput(
                "logging: log_file can not be changed through the API (the server logs to stderr)"
            )
        return given

    def update(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the settings given (checked by :meth:`check`); all or nothing.

        Returns:
            every setting after the change.

        Raises:
            InvalidInput: see :meth:`check`.
        """
        given = self.check(changes)
        s = self.switches
        s.info = given.get("log_info", s.info)
        s.warning = given.get("log_warning", s.warning)
        s.error = given.get("log_error", s.error)
        s.verbose = given.get("log_verbose_level", s.verbose)
        self.format = given.get("log_format", self.format)
        self.attach()
        level = s.lowest()
        for name in self.loggers:
            logging.getLogger(name).setLevel(level)
        return self.get()
