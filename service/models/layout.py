"""The model repository on disk: which folders are models, their versions, and where each
version's files are.

A repository is a folder with one sub-folder per model. A model folder holds either a
``config.toml`` (one version, ``"1"``) or numbered version folders ``1/``, ``2/``, ... each with
its own ``config.toml``. Files named in a config are relative to the folder of that config and
may not leave the model's folder.

Every problem is reported as ``<file>: <key>: <message>`` (a :class:`service.models.config.
ConfigError`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from service.models.config_errors import CONFIG_FILE, ConfigError, library_error
from service.text import safe_text

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def valid_model_name(name: str) -> bool:
    """Whether ``name`` may name a model: ``[A-Za-z0-9_.-]``, no leading dot, <= 128 chars."""
    return _NAME_RE.fullmatch(name) is not None


def valid_version(version: str) -> bool:
    """Whether ``version`` is a version folder name: a positive integer without leading zeros."""
    return re.fullmatch(r"[1-9][0-9]{0,17}", version) is not None


@dataclass(frozen=True)
class VersionSource:
    """Where one model version lives."""

    name: str
    version: str
    folder: Path
    """The folder of its ``config.toml``; the config's file names are relative to it."""
    model_folder: Path
    source: str
    """The config's path as shown in messages (relative to the repository's parent)."""

    @property
    def shown_folder(self) -> str:
        """The version's folder as messages name it (``repo/model`` or ``repo/model/2``)."""
        return self.source.removesuffix(f"/{CONFIG_FILE}")

    def error(self, where: str, what: str, exc: BaseException) -> ConfigError:
        """:func:`library_error` for a file of this version (its folder shown as named)."""
        return library_error(where, what, exc, self.folder, self.shown_folder)

    @property
    def config_path(self) -> Path:
        """The version's ``config.toml``."""
        return self.folder / CONFIG_FILE

    def resolve(self, file: str, key: str) -> Path:
        """A file named by the config, refused when it resolves outside the model's folder.

        Raises:
            ConfigError: naming ``key`` when it escapes (through symlinks), loops, or is not
                a regular file.
        """
        where = f"{self.source}: {key}: "
        return self._inside(
            self.folder / file,
            loop=f"{where}{file!r} is a symlink loop",
            outside=f"{where}{file!r} resolves outside the model",
            missing=f"{where}file {file!r} not found",
        )

    def checked_config_path(self) -> Path:
        """The version's ``config.toml``, refused when it resolves outside the model's folder.

        A ``config.toml`` (or version folder) symlinked from elsewhere would make the server
        read, and report on, a file the repository does not hold.

        Raises:
            ConfigError: it leaves the model's folder, loops, or is not a regular file.
        """
        return self._inside(
            self.config_path,
            loop=f"{self.source}: is a symlink loop",
            outside=f"{self.source}: resolves outside the model's folder",
            missing=f"{self.source}: missing",
        )

    def _inside(self, path: Path, *, loop: str, outside: str, missing: str) -> Path:
        """``path`` resolved, when it is a regular file inside the model's folder; else a
        ConfigError with the message for what is wrong."""
        try:
            resolved = path.resolve()
            inside = resolved.is_relative_to(self.model_folder.resolve())
        except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
            raise ConfigError([loop]) from None
        if not inside:
            raise ConfigError([outside])
        if not resolved.is_file():
            raise ConfigError([missing])
        return resolved


def model_versions(root: Path, name: str) -> dict[str, VersionSource]:
    """The versions of model ``name`` in repository ``root``, by version string.

    Raises:
        ConfigError: the name is not allowed, the folder is missing or outside ``root``, or
            its layout is ambiguous (a top-level ``config.toml`` and version folders both).
    """
    shown = f"{root.name}/{safe_text(name)}"
    if not valid_model_name(name):
        raise ConfigError(
            [f"{shown}: invalid model name (allowed: [A-Za-z0-9_.-], no leading dot)"]
        )
    folder = root / name
    try:
        if not folder.is_dir():
            raise ConfigError([f"{shown}: no such model folder"])
        if not folder.resolve().is_relative_to(root.resolve()):
            raise ConfigError([f"{shown}: resolves outside the repository"])
        numbered = sorted(
            (p for p in folder.iterdir() if p.is_dir() and valid_version(p.name)),
            key=lambda p: int(p.name),
        )
    except (OSError, RuntimeError) as exc:  # unreadable folder, symlink loop
        raise ConfigError([f"{shown}: cannot read the folder ({type(exc).__name__})"]) from None
    top = folder / CONFIG_FILE
    if top.is_file():
        if numbered:
            versions = [p.name for p in numbered]
            raise ConfigError([f"{shown}: has both {CONFIG_FILE} and version folders {versions}"])
        return {"1": VersionSource(name, "1", folder, folder, f"{shown}/{CONFIG_FILE}")}
    if not numbered:
        raise ConfigError([f"{shown}: no {CONFIG_FILE} and no numbered version folder"])
    out: dict[str, VersionSource] = {}
    problems = []
    for p in numbered:
        src = f"{shown}/{p.name}/{CONFIG_FILE}"
        if not (p / CONFIG_FILE).is_file():
            problems.append(f"{src}: missing")
        else:
            out[p.name] = VersionSource(name, p.name, p, folder, src)
    if problems:
        raise ConfigError(problems)
    return out


def model_names(root: Path) -> list[str]:
    """Sub-folder names of ``root`` that look like models (hidden entries are skipped), sorted."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def repository_models(root: Path | None) -> list[str]:
    """The models a server serves from ``root``: the built-in ``demo`` without a repository,
    else every sub-folder with a valid model name (others are logged and skipped). The one
    answer for a single server and for the ``--workers`` supervisor."""
    if root is None:
        return ["demo"]
    names = []
    for name in model_names(root):
        if valid_model_name(name):
            names.append(name)
        else:
            log.warning("skipping %r: not a valid model name", name)
    return names
