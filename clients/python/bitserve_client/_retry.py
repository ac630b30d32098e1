"""The retry policy: exponential backoff with jitter, honouring ``Retry-After``."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Retry"]


@dataclass(frozen=True)
class Retry:
    """When and how long to wait before retrying a request.

    Requests are retried when the connection could not be made (or the server closed a
    kept-alive connection before answering) and on 503 (queue full, model not ready) —
    never on other 4xx/5xx answers and never after a read timeout, where the server may still
    be working on the request.

    The n-th retry (n = 0, 1, ...) waits ``min(max_backoff, backoff * 2**n)`` scaled by a
    random factor in [0.5, 1] ("equal jitter": spreads clients apart but still backs off).
    When the server sends ``Retry-After``, the wait is at least that long (plus up to one
    backoff step of jitter); a ``Retry-After`` above ``max_retry_after`` is not waited for:
    the 503 is raised instead.

    Attributes:
        retries: how many times to retry after the first attempt (0 disables retries).
        backoff: the first backoff step in seconds.
        max_backoff: the cap on a backoff step in seconds.
        max_retry_after: the longest ``Retry-After`` (seconds) the client will wait for.
        rng: the random source for the jitter (seed it for reproducible waits).
    """

    retries: int = 3
    backoff: float = 0.1
    max_backoff: float = 10.0
    max_retry_after: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("Retry: retries, backoff and max_backoff must be >= 0")

    def delay(self, attempt: int, retry_after: float | None = None) -> float | None:
        """Seconds to wait before retry number ``attempt`` (0-based), or None to give up.

        Args:
            attempt: how many retries were made already.
            retry_after: the server's ``Retry-After`` in seconds, if it sent one.
        """
        if attempt >= self.retries:
            return None
        step = min(self.max_backoff, self.backoff * 2.0**attempt)
        if retry_after is not None:
            if retry_after > self.max_retry_after:
                return None
            return max(0.0, retry_after) + self.rng.uniform(0.0, step)
        return step * self.rng.uniform(0.5, 1.0)
