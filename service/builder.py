"""Building a model version: the one path ``serve`` and ``check-repo`` share.

:func:`build_version` reads and checks the version's files (:func:`service.model_files.
load_version`: everything before a device is touched), then builds the pipeline of its kind
on its device (an ``[index]``: :class:`service.index_pipeline.IndexPipeline`), whose dry run
(:func:`service.model_check.dry_run`) runs a batch of 1 and one of ``max_batch_size``
through it and checks the outputs. ``bitserve serve`` builds every version
through it; ``bitserve check-repo`` (:func:`check_repository`) calls the same function (on the
CPU unless told otherwise) and drops the result, so the two cannot disagree about a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from service.config import DEFAULT_MAX_BATCH_BYTES, ConfigError, ModelConfig
from service.dry_run_child import dry_run_in_child
from service.layout import VersionSource, model_names, model_versions
from service.model_files import load_version
from service.pipeline import Pipeline, resolve_device


def build_version(
    name: str,
    src: VersionSource,
    *,
    default_device: str,
    max_operator_bytes: int,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    patch: Mapping[str, Any] | None = None,
    warmup: bool = True,
    isolate: bool = True,
) -> tuple[ModelConfig, Pipeline]:
    """:func:`load_version`, then the pipeline on its device with its dry run.

    A model whose failing call can abort the process (``ModelFile.dry_run_in_child``: an
    AOTInductor package) is first built and dry-run in a child process
    (:mod:`service.dry_run_child`): a crash there is a refusal, not this process's end.

    Args:
        name: the model's name.
        src: where the version lives.
        default_device: the device of a config that says ``device = "auto"``.
        max_operator_bytes: see :func:`load_version`.
        max_batch_bytes: see :func:`load_version`.
        patch: see :func:`load_version`.
        warmup: also run the full batch a second time (``--warmup``).
        isolate: make the dry run of such a model in a child process first (the child
            itself builds with False).

    Raises:
        ConfigError: every problem, each naming the file and the key.
    """
    cfg, artifacts = load_version(
        src, max_operator_bytes=max_operator_bytes, max_batch_bytes=max_batch_bytes, patch=patch
    )
    device = resolve_device(cfg.device, default_device, source=src.source)
    model = artifacts.model
    if isolate and model is not None and model.dry_run_in_child:
        dry_run_in_child(
            name,
            src,
            model.path.name,
            default_device=default_device,
            threads=torch.get_num_threads(),
            max_operator_bytes=max_operator_bytes,
            max_batch_bytes=max_batch_bytes,
            patch=patch,
        )
    kind = Pipeline
    if cfg.index is not None:
        from service.index_pipeline import IndexPipeline

        kind = IndexPipeline
    pipe = kind(name, cfg, artifacts, device, warmup=warmup, source=src.source)
    return cfg, pipe


def check_model(
    root: Path,
    name: str,
    *,
    max_operator_bytes: int,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    device: str = "cpu",
) -> list[str]:
    """Every problem of one model of a repository, through :func:`build_version` (the dry
    run included) on ``device``: ``serve`` refuses exactly these.

    Args:
        device: where the versions are built, whatever their configs say (a config's own
            ``"cuda:N"`` needs a host that has it; the dry run's outcome does not).

    Returns:
        One line per problem, as the server would say it; empty when ``serve`` would load
        the model.
    """
    try:
        versions = model_versions(root, name)
    except ConfigError as exc:
        return exc.problems
    problems: list[str] = []
    for src in versions.values():
        try:
            build_version(name, src, default_device=device, patch={"device": device},
                          warmup=False, max_operator_bytes=max_operator_bytes,
                          max_batch_bytes=max_batch_bytes)  # fmt: skip
        except ConfigError as exc:
            problems += exc.problems
        except Exception as exc:  # a bug of ours: still one line, never a traceback
            problems += src.error(src.source, "unexpected error", exc).problems
    return [p.replace(f"{src.source} + config override", src.source) for p in problems]


def check_repository(
    root: Path,
    *,
    max_operator_bytes: int,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    device: str = "cpu",
) -> list[str]:
    """Validate a repository as ``serve`` loads it, dry runs on ``device`` included
    (``bitserve check-repo``).

    Returns:
        Human-readable problems, each naming the file and the key; empty when valid.
    """
    try:
        names = model_names(root) if root.is_dir() else None
    except OSError as exc:
        return [f"{root}: cannot read the folder ({exc.strerror or type(exc).__name__})"]
    if names is None:
        return [f"{root}: not a directory"]
    if not names:
        return [f"{root}: no model folders"]
    limits = {"max_operator_bytes": max_operator_bytes, "max_batch_bytes": max_batch_bytes}
    return [p for n in names for p in check_model(root, n, device=device, **limits)]
