"""The cyclic garbage collector kept off the request path.

A serving process holds a few hundred thousand long-lived Python objects before it answers
its first request (torch, FastAPI, pydantic, the models). CPython's full collection visits
every one of them: measured on the demo model, 120-155 ms with the event loop stopped, once
or twice in 20 s of serving at concurrency 32 (``benchmarks/results/overhead.md``), which is
the whole p99 of requests that take 40 ms. Objects that live as long as the process never
become garbage, so the collector is told to leave them alone (``gc.freeze``: they move to a
generation it never visits) once the models are loaded, and again after every change of the
loaded models. Before freezing anew, the earlier frozen objects are returned to the collector
and one full collection runs, so that the objects of a model unloaded since (reference cycles
included) are freed, not kept frozen. That collection costs the same pause, once per change,
where a model load already takes seconds; requests then see young-generation collections
only (well under a millisecond).

The server process does this (``service.server.BitServer.run``: after its start-up, and after
each load or unload through ``ControlPlane.models_changed``); an application built in a test
or a tool leaves its host process's collector as it is.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def settle() -> None:
    """Collect everything, then freeze what is left (see the module docstring)."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.debug(
        "%d objects frozen out of the collector's reach (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - t0) * 1e3,
    )
