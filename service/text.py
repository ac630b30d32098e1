"""Text from clients, files, folders and libraries, made safe to show: in a message, a log
line, a terminal, a client's error. Imports nothing of the server's."""

from __future__ import annotations

import re
from pathlib import Path


def safe_text(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, with control and unprintable characters escaped.

    For names and keys taken from files or folders and printed to a terminal or log: an
    escape sequence in a TOML key or a folder name is shown, never interpreted.
    """
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return cut if cut.isprintable() else ascii(cut)[1:-1]


_SCRIPT_HEADER = "The following operation failed in the TorchScript interpreter"
_TRACE_MARKS = ("Traceback", "The above exception", "Exception raised from", "While executing")
_ABS_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s'\"`:,;()\[\]<>]+/?)+")


def clean_reason(exc: BaseException, folder: Path | None = None, shown: str = "") -> str:
    """``ExceptionClass: message`` of ``exc`` for a client (see :func:`library_error`)."""
    raw = [line for line in str(exc).splitlines() if line.strip()]
    if raw and raw[0].startswith(_SCRIPT_HEADER):
        raw = raw[-1:]  # TorchScript's interpreter: its source trace, then the error itself
    lines = []
    for line in raw:
        if line.lstrip().startswith(_TRACE_MARKS):
            break
        lines.append(" ".join(line.split()))
    text = " ".join(lines)
    if folder is not None:
        for root in {str(folder), str(folder.resolve())}:
            text = text.replace(root, shown or folder.name)
    text = _ABS_PATH.sub("<server path>", text)
    kind = type(exc).__name__
    text = text.removeprefix(f"{kind}: ")  # TorchScript repeats the class in its last line
    return f"{kind}: {safe_text(text, 300)}" if text else kind
