"""Progress for long runs: a tqdm bar when tqdm is installed, else a periodic line on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

# Seconds between two plain progress lines (tests set it to 0).
LINE_INTERVAL_S = 5.0


class Bar(Protocol):
    """What the bulk loops call: ``update(n)`` as items finish, ``close()`` at the end."""

    def update(self, n: int) -> Any: ...
    def close(self) -> None: ...


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _LineBar:
    """``demo: 1200/5000 rows (24.0%), 850 rows/s`` on stderr every few seconds, and at the end."""

    def __init__(self, total: int | None, desc: str, unit: str, initial: int) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self._start_n = initial
        self._start = self._last = time.monotonic()

    def _line(self, now: float) -> str:
        done = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        share = f" ({100 * self.n / self.total:.1f}%)" if self.total else ""
        rate = (self.n - self._start_n) / max(now - self._start, 1e-9)
        return f"{self.desc}: {done} {self.unit}s{share}, {rate:.1f} {self.unit}s/s"

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= LINE_INTERVAL_S:
            self._last = now
            print(self._line(now), file=sys.stderr, flush=True)

    def close(self) -> None:
        print(self._line(time.monotonic()), file=sys.stderr, flush=True)


def progress(
    enabled: bool, total: int | None, desc: str, unit: str = "row", initial: int = 0
) -> Bar:
    """A progress display: tqdm when installed (``bitserve-client[progress]``), else lines.

    Args:
        enabled: False for no output at all.
        total: the number of items, or None when unknown.
        desc: what is counted (shown first).
        unit: the item's name ("row", "req").
        initial: items already done (a resumed run).
    """
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineBar(total, desc, unit, initial)
    bar: Bar = tqdm(total=total, unit=unit, desc=desc, dynamic_ncols=True, initial=initial)
    return bar
