"""Building a model's versions for the repository, and what each will hold.

:class:`VersionBuilder` is the repository's side of :func:`service.models.builder.build_version`
(every version of a model from its folder, or the built-in demo), plus what the device
memory budget needs around a build (``service.residency.budget``): an estimate of each version's
bytes before it is built (:meth:`VersionBuilder.plan`) and its measured bytes after
(:meth:`VersionBuilder.measured`). Everything here runs in a worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from service.models.builder import build_pipeline, build_version, resolve_device
from service.models.config import ConfigError, ModelConfig, load_config
from service.models.files import Artifacts, check_buffers, check_operator
from service.models.layout import VersionSource
from service.models.override import ConfigOverride
from service.models.pipeline import Pipeline
from service.models.signature import Bound, Signature
from service.residency.budget import held_bytes, trim_host_memory_soon

log = logging.getLogger("service.models.repository")  # its reports read as the repository's

Built = dict[str, tuple[ModelConfig, Pipeline]]
Plan = tuple[str, int, dict[Hashable, int]]
"""A version's device, its estimated bytes of its own, and its shared parts (key: bytes)."""
Measured = dict[str, tuple[ModelConfig, Pipeline, int]]


@dataclass
class VersionBuilder:
    """How the repository builds versions (its settings), and its builds in progress.

    Args:
        default_device: the device of configs that say ``auto``.
        max_operator_bytes, max_batch_bytes: see ``service.models.files.load_version``.
        warmup: run the full batch of the dry run twice.
    """

    default_device: str
    max_operator_bytes: int
    max_batch_bytes: int
    warmup: bool
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _running: int = 0
    _started: int = 0

    def build_all(
        self, name: str, sources: dict[str, VersionSource] | None, override: ConfigOverride | None
    ) -> Built:
        """Load every version's files and build its pipeline.

        Raises:
            ConfigError: every version's problems (nothing is returned if one fails).
        """
        patch = override.patch if override is not None else None
        if sources is None:
            from service.models.demo import demo_config, demo_tensors

            source = "<built-in demo>/config.toml"
            cfg = demo_config(patch)
            tensors = {k: torch.from_numpy(v) for k, v in demo_tensors().items()}
            check_buffers(cfg, source, self.max_batch_bytes)
            check_operator(cfg, tensors, source, max_operator_bytes=self.max_operator_bytes)
            device = resolve_device(cfg.device, self.default_device, source="<built-in demo>")
            pipe = build_pipeline(name, cfg, Artifacts(tensors), device, warmup=self.warmup,
                                  source=source)  # fmt: skip
            check_override_io(override, source, name, cfg, pipe)
            return {"1": (cfg, pipe)}
        out: Built = {}
        problems: list[str] = []
        for v, src in sources.items():
            try:
                cfg, pipe = build_version(
                    name,
                    src,
                    default_device=self.default_device,
                    max_operator_bytes=self.max_operator_bytes,
                    max_batch_bytes=self.max_batch_bytes,
                    patch=patch,
                    warmup=self.warmup,
                )
                check_override_io(override, src.source, name, cfg, pipe)
                out[v] = (cfg, pipe)
            except ConfigError as exc:
                problems += exc.problems
                if exc.__cause__ is not None:  # a library's error: its traceback, logged
                    log.error("%s", "; ".join(exc.problems), exc_info=exc.__cause__)
            except Exception as exc:  # a broken operator or model: report, don't crash
                log.exception("model %s version %s failed to build", name, v)
                problems += src.error(src.source, "failed to build", exc).problems
        if problems:
            raise ConfigError(problems)
        return out

    def plan(
        self,
        sources: dict[str, VersionSource] | None,
        override: ConfigOverride | None,
        known: Callable[[str], Plan | None],
    ) -> list[Plan]:
        """``(device, estimated bytes of its own, shared parts)`` of each version to build:
        ``known(version)`` (as measured at its last load), else the size of its folder's
        files (no shared parts). Unreadable configs and unknown devices are left to the
        build to report."""
        out: list[Plan] = []
        patch = override.patch if override is not None else None
        todo: dict[str, VersionSource | None] = {"1": None} if sources is None else {**sources}
        for v, src in todo.items():
            last = known(v)
            if last is not None:
                out.append(last)
                continue
            try:
                if src is None:
                    from service.models.demo import demo_config

                    cfg, estimate = demo_config(patch), 0
                else:
                    cfg = load_config(src.config_path, src.source, patch=patch)
                    estimate = sum(f.stat().st_size for f in src.folder.iterdir() if f.is_file())
                out.append((resolve_device(cfg.device, self.default_device), estimate, {}))
            except (ConfigError, OSError):
                continue
        return out

    def unbuilt(
        self, sources: dict[str, VersionSource], override: ConfigOverride | None
    ) -> dict[str, tuple[ModelConfig, str, int]] | None:
        """``{version: (config, device, size of its files)}`` read without building anything
        (a load at start past the budget lists its versions with these); None when a config
        cannot be read (the build then reports why)."""
        patch = override.patch if override is not None else None
        out: dict[str, tuple[ModelConfig, str, int]] = {}
        try:
            for v, src in sources.items():
                cfg = load_config(src.config_path, src.source, patch=patch)
                files = sum(f.stat().st_size for f in src.folder.iterdir() if f.is_file())
                out[v] = (cfg, resolve_device(cfg.device, self.default_device), files)
        except (ConfigError, OSError):
            return None
        return out

    def measured(self, build: Callable[[], Built]) -> Measured:
        """``build()`` with each pipeline's bytes: the tensors it holds (each storage once),
        or on CUDA the allocator's growth over the build when no other build ran meanwhile,
        whichever is larger. The pipeline's ``device_memory_bytes`` is set to it."""
        cuda = torch.cuda.is_available()
        before = [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())]
        with self._lock:
            self._running += 1
            alone_from = self._started if self._running == 1 else -1
            self._started += 1
        try:
            built = build()
        finally:
            with self._lock:
                self._running -= 1
                ran_alone = alone_from == self._started - 1
        alone = ran_alone and len(built) == 1
        out: Measured = {}
        for v, (cfg, pipe) in built.items():
            nbytes = max(held_bytes(pipe), pipe.device_memory_bytes)
            if cuda and alone and pipe.device.type == "cuda":
                index = pipe.device.index or 0
                nbytes = max(nbytes, torch.cuda.memory_allocated(index) - before[index])
            pipe.device_memory_bytes = nbytes
            out[v] = (cfg, pipe, nbytes)
        if any(pipe.device.type == "cpu" for _, pipe, _ in out.values()):
            trim_host_memory_soon()  # the build's temporaries, back to the system
        return out


class Unbuilt(Pipeline):
    """The stand-in of a version listed but never built (at start, past the device memory
    budget): its config and device, no tensors. Its handle serves the config and the
    metadata (each output's shape from its config, else ``[-1]`` until the first load);
    its first request builds the real pipeline, as for an evicted version.

    Args:
        name, cfg, device, source: see :class:`~service.models.pipeline.Pipeline`.
    """

    def __init__(self, name: str, cfg: ModelConfig, device: str, source: str) -> None:
        # Nothing is built: the attributes a handle and the repository read, set here.
        self.name = name
        self.cfg = cfg
        self.device = torch.device(device)
        self.stats = None
        self.last_phases_ns = None
        self._events = []
        self.source = source
        self.inputs = list(cfg.inputs)
        self.capacity = max(cfg.max_batch_size, 1)
        self.batched = cfg.max_batch_size > 0
        self.compute_dtype = torch.float32
        self._buffers = []
        self.output_shapes = [list(o.shape) if o.shape is not None else [-1] for o in cfg.outputs]
        self.device_memory_bytes = 0

    def run(
        self, requests: Sequence[Bound], *, check: bool = False
    ) -> list[list[np.ndarray[Any, Any]]]:
        """Never called: an unbuilt version's handle is not resident, so its requests wait
        for the real one."""
        raise RuntimeError(f"model {self.name!r} is not built")


def check_override_io(
    override: ConfigOverride | None, source: str, name: str, cfg: ModelConfig, pipe: Pipeline
) -> None:
    """The override's ``input``/``output``, if any, against the built model's."""
    if override is not None and (override.inputs is not None or override.outputs is not None):
        sig = Signature(name, cfg, pipe.output_shapes)
        override.check_io(source, sig.input_config(), sig.output_config())
