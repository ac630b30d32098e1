"""Building a model version: its load stages, in order, in one function.

:func:`build_version` is the one path ``bitserve serve`` and ``bitserve check-repo`` share
(the repository builds every version through it; ``check-repo``, :func:`check_repository`,
calls it on the CPU unless told otherwise and drops the result, so the two cannot disagree
about a model). Its stages, each a function of its own:

1. **files** (:func:`read_files`): the config, the operator's tensors, the corpus, the code
   tables, the ``warmup_file`` sample and the model file, read and checked one by one on the
   host (never with pickle; ``service.models.files``);
2. **host checks** (:func:`check_on_host`): the files against each other: the model's
   signature against the config (``service.models.checks``), each input buffer's size in the
   dtype it is handed in (the dtype rule: ``service.models.signature``); a model whose failing call
   can abort the process is then built and dry-run once in a child process first
   (:func:`dry_run_isolated`, ``service.models.dry_run_child``: a crash there is a refusal);
3. **device** (:func:`to_device`): the pipeline of its kind built on its device
   (``service.models.pipeline``; an ``[index]``: ``service.index.pipeline``);
4. **dry run** (:func:`dry_run`): a batch of 1 and one of ``max_batch_size`` through it, the
   outputs checked (``service.models.checks``); an index then brings its whole corpus to the
   device.

Every stage raises :class:`service.models.config.ConfigError` naming the file and the key. The
dry-run child's entry point (:func:`child_main`, ``python -m service.models.builder``) is here,
beside :func:`build_version`, which it calls.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from service.index.pipeline import IndexPipeline
from service.models import checks, devices
from service.models.config import DEFAULT_MAX_BATCH_BYTES, ConfigError, ModelConfig
from service.models.dry_run_child import dry_run_in_child
from service.models.files import Artifacts, check_buffers, load_version
from service.models.layout import VersionSource, model_names, model_versions
from service.models.pipeline import Pipeline
from service.models.signature import handed_dtypes

log = logging.getLogger(__name__)


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
    """Build one version through its stages (module docstring): files -> host checks ->
    device -> dry run.

    Args:
        name: the model's name.
        src: where the version lives.
        default_device: the device of a config that says ``device = "auto"``.
        max_operator_bytes: the most bytes its response operator may take once built.
        max_batch_bytes: the most bytes each of its input buffers may take.
        patch: ``config.toml`` keys a load's config override replaces.
        warmup: also run the full batch a second time (``--warmup``).
        isolate: make the dry run of a model that can abort the process in a child process
            first (the child itself builds with False).

    Returns:
        The version's config and its pipeline, dry-run.

    Raises:
        ConfigError: every problem, each naming the file and the key.
    """
    cfg, artifacts = read_files(src, max_operator_bytes, max_batch_bytes, patch)
    check_on_host(cfg, artifacts, src.source, max_batch_bytes)
    device = resolve_device(cfg.device, default_device, source=src.source)
    if isolate:
        dry_run_isolated(name, src, artifacts, default_device, max_operator_bytes,
                         max_batch_bytes, patch)  # fmt: skip
    pipe = to_device(name, cfg, artifacts, device, src.source)
    dry_run(pipe, artifacts, again=warmup)
    return cfg, pipe


def build_pipeline(
    name: str,
    cfg: ModelConfig,
    artifacts: Artifacts,
    device: str,
    *,
    warmup: bool = True,
    source: str = "config.toml",
) -> Pipeline:
    """The device and dry-run stages for files already in memory (the built-in demo, tests).

    Raises:
        ConfigError: as :func:`to_device` and :func:`dry_run`.
    """
    pipe = to_device(name, cfg, artifacts, device, source)
    dry_run(pipe, artifacts, again=warmup)
    return pipe


# --- the stages, in order ---------------------------------------------------------------------


def resolve_device(device: str, default: str = "auto", *, source: str = "config.toml") -> str:
    """:func:`service.models.devices.resolve_device` for a config, its problems as ConfigError."""
    try:
        return devices.resolve_device(device, default)
    except ValueError as e:
        raise ConfigError([f"{source}: device: {e}"]) from None


def read_files(
    src: VersionSource,
    max_operator_bytes: int,
    max_batch_bytes: int,
    patch: Mapping[str, Any] | None,
) -> tuple[ModelConfig, Artifacts]:
    """Stage 1, files: :func:`service.models.files.load_version` (nothing touches a device)."""
    return load_version(
        src, max_operator_bytes=max_operator_bytes, max_batch_bytes=max_batch_bytes, patch=patch
    )


def check_on_host(cfg: ModelConfig, artifacts: Artifacts, source: str, limit: int) -> None:
    """Stage 2, host checks: the model file's signature against the config, then each input
    buffer's size (``limit``: ``max_batch_bytes``) in the dtype the model is handed it in.

    Raises:
        ConfigError: one problem per input that does not fit.
    """
    model = artifacts.model
    if model is None:
        return
    operator_shape = None
    if cfg.operator is not None:  # the operator's output: (N, A)
        n = cfg.inputs[cfg.operator_input or 0].shape[0]
        operator_shape = [n, artifacts.tensors["c"].shape[1]]
    checks.check_signature(cfg, model, f"{source}: model.file", operator_shape)
    check_buffers(cfg, source, limit, handed_dtypes(cfg, model))


def dry_run_isolated(
    name: str,
    src: VersionSource,
    artifacts: Artifacts,
    default_device: str,
    max_operator_bytes: int,
    max_batch_bytes: int,
    patch: Mapping[str, Any] | None,
) -> None:
    """Stage 2, last: a model whose failing call can abort the process
    (``ModelFile.dry_run_in_child``: an AOTInductor package) is built and dry-run in a child
    process first (:func:`service.models.dry_run_child.dry_run_in_child`); others: nothing.

    Raises:
        ConfigError: the child refused the version, or crashed.
    """
    model = artifacts.model
    if model is None or not model.dry_run_in_child:
        return
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


def to_device(
    name: str, cfg: ModelConfig, artifacts: Artifacts, device: str, source: str
) -> Pipeline:
    """Stage 3, device: the pipeline of the version's kind, built on ``device``.

    Raises:
        ConfigError: the model or the corpus cannot be prepared on the device.
    """
    kind = IndexPipeline if cfg.index is not None else Pipeline
    return kind(name, cfg, artifacts, device, source=source)


def dry_run(pipe: Pipeline, artifacts: Artifacts, *, again: bool) -> None:
    """Stage 4, dry run: :func:`service.models.checks.dry_run` (``again``: the full batch a
    second time, ``--warmup``), its outputs' item shapes kept on the pipeline; then the
    pipeline's own last step (an index's whole corpus to the device).

    Raises:
        ConfigError: the model raised (its message), or an output does not match.
    """
    file = artifacts.model.path.name if artifacts.model is not None else "the operator"
    pipe.output_shapes = checks.dry_run(pipe, artifacts.warmup, file, artifacts.folder, again=again)
    pipe.after_dry_run()


# --- check-repo -------------------------------------------------------------------------------


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


# --- the dry-run child (``python -m service.models.builder``, see service.models.dry_run_child)
# -------------


def _exit_when_orphaned(stdin: IO[bytes]) -> None:
    """The lifeline: the parent holds the child's stdin open until it has the answer."""
    stdin.read()
    os._exit(3)


def child_main() -> None:
    """The dry-run child: read the request (one JSON line on stdin, written by
    :func:`service.models.dry_run_child.dry_run_in_child`), build through :func:`build_version`
    exactly as the parent would, write the answer (one JSON object on stdout), exit at once."""
    request = json.loads(sys.stdin.buffer.readline())
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the answer
    threading.Thread(target=_exit_when_orphaned, args=(sys.stdin.buffer,), daemon=True).start()
    torch.set_num_threads(int(request["threads"]))
    src = VersionSource(
        request["name"],
        request["version"],
        Path(request["folder"]),
        Path(request["model_folder"]),
        request["source"],
    )
    problems: list[str] | None = []
    try:
        build_version(
            request["name"],
            src,
            default_device=request["default_device"],
            max_operator_bytes=request["max_operator_bytes"],
            max_batch_bytes=request["max_batch_bytes"],
            patch=request["patch"],
            warmup=False,
            isolate=False,
        )
    except ConfigError as exc:
        problems = exc.problems
        if exc.__cause__ is not None:
            logging.basicConfig()
            log.error("%s", "; ".join(problems), exc_info=exc.__cause__)
    except Exception:  # an error of ours: the caller meets it in its own build and logs it
        problems = None
    answer.write(json.dumps({"problems": problems}))
    answer.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: the answer is out, nothing else is needed


if __name__ == "__main__":
    child_main()
