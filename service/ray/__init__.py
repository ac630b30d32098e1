"""Past one machine: bulk scoring on Ray Data and V2 serving on Ray Serve (the ``ray`` extra).

- :class:`BatchScorer`: a Ray Data batch callable; a model of a repository, resident once per
  actor, computing each batch with the server's own pipeline.
- :func:`score`: a Dataset scored by it (one actor per GPU, or CPU actors).
- :func:`score_files`: Parquet files scored into an output folder, resumable
  (``bitserve score``).
- :func:`deployment`, :func:`app`: a Ray Serve deployment answering the V2 REST protocol from
  the server's own application, one repository per replica.

Names are imported on first use, so ``import service.ray`` stays light until one is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.ray.data import score
    from service.ray.job import score_files
    from service.ray.scorer import BatchScorer, ScoringError
    from service.ray.serving import app, deployment

__all__ = ["BatchScorer", "ScoringError", "app", "deployment", "score", "score_files"]

_WHERE = {
    "BatchScorer": "service.ray.scorer",
    "ScoringError": "service.ray.scorer",
    "app": "service.ray.serving",
    "deployment": "service.ray.serving",
    "score": "service.ray.data",
    "score_files": "service.ray.job",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'service.ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
