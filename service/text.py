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
    kind = type(exc).__name__
    # TorchScript repeats the class in its last line
    text = clean_text(" ".join(lines), folder, shown, limit=None).removeprefix(f"{kind}: ")
    return f"{kind}: {safe_text(text, 300)}" if text else kind


def clean_text(
    text: str, folder: Path | None = None, shown: str = "", *, limit: int | None = 300
) -> str:
    """One line of a library's message for a client: whitespace folded, the model folder
    ``folder`` shown as ``shown``, any other absolute path as ``<server path>``, cut to
    ``limit`` characters (None: not cut, nor escaped)."""
    text = " ".join(text.split())
    if folder is not None:
        for root in {str(folder), str(folder.resolve())}:
            text = text.replace(root, shown or folder.name)
    text = _ABS_PATH.sub("<server path>", text)
    return text if limit is None else safe_text(text, limit)
