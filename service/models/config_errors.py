"""A model configuration's error type and the config file's name: what every module that
reads a model's files needs, and nothing else (``service.models.layout``, ``service.models.config``
and the readers of a version's files all raise it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from service.text import clean_reason

__all__ = ["CONFIG_FILE", "ConfigError", "library_error"]

CONFIG_FILE = "config.toml"
"""The name of a model version's configuration file."""


class ConfigError(Exception):
    """A model configuration is invalid; ``problems`` holds one line per problem, each
    naming the file and key, as clients and ``bitserve check-repo`` see it."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems

    @classmethod
    def join(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error with every problem of ``errors`` (the first cause kept for the log)."""
        out = cls([p for e in errors for p in e.problems])
        out.__cause__ = next((e.__cause__ for e in errors if e.__cause__ is not None), None)
        return out


def library_error(
    where: str, what: str, exc: BaseException, folder: Path | None = None, shown: str = ""
) -> ConfigError:
    """A load problem a library raised, with the library's own message, cleaned for a client.

    The message (``where: what: ExceptionClass: text``) is the same for ``/load``, the
    repository index and ``bitserve check-repo``: the exception's first paragraph, without
    its traceback, each line's whitespace folded, cut to 300 characters; the model folder's
    absolute path is shown as ``shown`` (the folder as the repository names it) and any
    other absolute path as ``<server path>``. Raise it ``from exc`` so the server log keeps
    the traceback.
    """
    return ConfigError([f"{where}: {what}: {clean_reason(exc, folder, shown)}"])
