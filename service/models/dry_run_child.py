"""The dry run of a model that can abort its process, made first in a child process.

An AOTInductor package runs C++ compiled for that one model. A check that fails inside one
of its OpenMP parallel regions (an index out of range, say) throws a C++ exception that
cannot leave the region: the runtime calls ``std::terminate`` and the whole process aborts,
the server with every model it serves, or ``bitserve check-repo`` before it prints a line.
A format whose calls can do that says so (:attr:`service.backends.ModelFile.
dry_run_in_child`), and :func:`service.models.builder.build_version` then builds the version and
dry-runs it once in a fresh child process (``python -m service.models.builder``: the child's entry
point, :func:`service.models.builder.child_main`, sits beside ``build_version``) before it builds it
in its own. This module is the parent's side: it starts the child and reads its answer. A
crash there is a refusal like any other::

    repo/m/config.toml: model.file: model.pt2: the compiled model crashed during the dry run
    (SIGABRT; it threw c10::Error: index out of bounds: 0 <= tmp14 < 10L)

The child builds exactly as the caller would (:func:`service.models.builder.build_version` with the
same device, config override, limits and torch thread count), so the refusals it finds are
the caller's, word for word, and the caller does not build a version the child refused. Its
stderr (the traceback, AOTInductor's and ONNX Runtime's own lines) goes to the caller's log
when the child refuses or crashes. The cost, at load only: a Python interpreter with torch
imported, and the model loaded and dry-run once more (``benchmarks/results/formats.md``).

Protocol: the request is one JSON line on the child's stdin, which stays open as a lifeline
(the child exits when its parent dies); the answer is one JSON object on the child's stdout
(``{"problems": [...]}``, or ``null`` problems for an error of ours, which the caller then
meets in its own build). Everything else the child or a library prints goes to its stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.models.config import ConfigError
from service.models.layout import VersionSource
from service.text import clean_text, safe_text

log = logging.getLogger(__name__)

_PROJECT = str(Path(__file__).resolve().parents[1])
_THROWN = re.compile(r"terminate called after throwing an instance of '([^']+)'\s*what\(\):\s*(.*)")
_STDERR_TAIL = 16_000


def dry_run_in_child(
    name: str,
    src: VersionSource,
    file: str,
    *,
    default_device: str,
    threads: int,
    max_operator_bytes: int,
    max_batch_bytes: int,
    patch: Mapping[str, Any] | None,
) -> None:
    """Build and dry-run a version in a child process, as :func:`service.models.builder.
    build_version` would here.

    Args:
        name: the model's name.
        src: where the version lives.
        file: the model file's name, for messages.
        default_device, max_operator_bytes, max_batch_bytes, patch: as the caller builds.
        threads: the caller's torch thread count (a kernel runs in parallel, and can abort,
            only with more than one).

    Raises:
        ConfigError: the child refused the version (its problems), or crashed (naming the
            signal and, where the C++ runtime printed it, what was thrown).
    """
    request = {
        "name": name,
        "version": src.version,
        "folder": str(src.folder),
        "model_folder": str(src.model_folder),
        "source": src.source,
        "default_device": default_device,
        "threads": threads,
        "max_operator_bytes": max_operator_bytes,
        "max_batch_bytes": max_batch_bytes,
        "patch": dict(patch) if patch is not None else None,
    }
    code, answer, stderr = _run_child(request)
    if code == 0 and answer is not None:
        problems = answer.get("problems")
        if problems:
            log.error("%s: the dry run in a child process refused it:\n%s", src.source, stderr)
            raise ConfigError([str(p) for p in problems])
        return
    log.error("%s: the dry run in a child process ended with %s:\n%s", src.source, code, stderr)
    why = _how_it_ended(code) if code != 0 else "it gave no answer"
    thrown = _THROWN.search(stderr)
    if thrown is not None:
        what = clean_text(thrown.group(2), src.folder, src.shown_folder)
        why += f"; it threw {safe_text(thrown.group(1), 80)}: {what}"
    raise ConfigError(
        [f"{src.source}: model.file: {safe_text(file)}: the compiled model crashed during the "
         f"dry run ({why})"]
    )  # fmt: skip


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _run_child(request: dict[str, Any]) -> tuple[int, dict[str, Any] | None, str]:
    """The child's exit status (negative: the signal), its answer and the tail of its stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.models.builder"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            try:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it ended before reading: its status says how
            raw = proc.stdout.read()
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted here: never leave it running
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - _STDERR_TAIL))
        stderr = err.read().decode("utf-8", "replace")
    try:
        answer = json.loads(raw) if raw else None
    except ValueError:
        answer = None
    return code, answer if isinstance(answer, dict) else None, stderr
