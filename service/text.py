"""Text from clients, files and folders, made safe to show: in a message, a log line, a
terminal. Imports nothing of the server's."""

from __future__ import annotations


def safe_text(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, with control and unprintable characters escaped.

    For names and keys taken from files or folders and printed to a terminal or log: an
    escape sequence in a TOML key or a folder name is shown, never interpreted.
    """
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return cut if cut.isprintable() else ascii(cut)[1:-1]
