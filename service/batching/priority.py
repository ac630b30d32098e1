"""Priority levels, as in Triton's ``dynamic_batching``: their config and a request's level.

A model's ``config.toml`` may set ``priority_levels`` (1 the highest), its
``default_priority_level`` and, per level, a ``[priority_queue_policy.N]`` table with that
level's own ``max_queue_size``. A request's ``parameters.priority`` picks its level; 0, none or
a priority past ``priority_levels`` is the default level (Triton's rule). The queue itself is
:class:`service.batching.queue.LevelQueue`.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

MAX_PRIORITY_LEVELS = 100


class LevelPolicy(BaseModel):
    """One priority level's queue (a ``[priority_queue_policy.N]`` table, Triton's
    ``dynamic_batching.priority_queue_policy``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_queue_size: int = Field(default=0, ge=0)
    """Requests of this level allowed to wait (within ``max_queue_size`` for all levels);
    beyond it the answer is 503 with Retry-After. 0 = no bound of its own."""


def check_levels(levels: int, default: int, policy: Mapping[int, LevelPolicy]) -> None:
    """Check a config's ``priority_levels``, ``default_priority_level`` and
    ``priority_queue_policy`` together.

    Raises:
        ValueError: naming what is inconsistent.
    """
    if not levels:
        if default or policy:
            raise ValueError(
                "default_priority_level and priority_queue_policy need priority_levels > 0"
            )
        return
    if not 1 <= default <= levels:
        raise ValueError(
            f"default_priority_level must be in [1, {levels}] (priority_levels), got {default}"
        )
    outside = sorted(k for k in policy if not 1 <= k <= levels)
    if outside:
        raise ValueError(
            f"priority_queue_policy levels must be in [1, {levels}] (priority_levels), got "
            f"{outside}"
        )


def level_limits(levels: int, policy: Mapping[int, LevelPolicy]) -> list[int]:
    """Each level's own queue bound, level 1 first (0: none); one entry for a model without
    levels."""
    return [policy[k].max_queue_size if k in policy else 0 for k in range(1, max(levels, 1) + 1)]


def level_of(priority: int | None, levels: int, default: int) -> int:
    """The level (1 the highest) of a request that asked for ``priority``: 0, none or a
    priority past ``levels`` is the ``default`` level; 1 for a model without levels."""
    if priority and priority <= levels:
        return priority
    return default or 1
