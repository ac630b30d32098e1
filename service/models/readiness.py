"""The readiness rule every transport answers by, and Triton's words for a model that is not
in the repository (the repository's messages that are not its state)."""

from __future__ import annotations

from service.residency.resident_versions import LOADING, UNAVAILABLE, UNLOADING

__all__ = ["readiness_reason", "shown_name", "unknown_model"]


def readiness_reason(
    states: list[tuple[str, str, str, str]], *, started: bool, closing: bool, strict: bool
) -> str | None:
    """The readiness rule, for any transport: why a server is not ready, or None.

    Args:
        states: ``(model, version, state, reason)`` of every version of every model not
            explicitly unloaded.
        started: whether the initial loads are done.
        closing: whether the server is stopping.
        strict: whether a version that failed to load (UNAVAILABLE) keeps it not ready.
    """
    if closing:
        return "server is not ready: shutting down"
    busy = sorted({m for m, _, state, _ in states if state in (LOADING, UNLOADING)})
    if not started or busy:
        names = ", ".join(f"'{m}'" for m in busy)
        return f"server is not ready: loading models{f' ({names})' if names else ''}"
    failed = [(m, v, why) for m, v, state, why in states if state == UNAVAILABLE]
    if not strict or not failed:
        return None
    m, v, why = failed[0]
    more = f" (and {len(failed) - 1} more failed versions)" if len(failed) > 1 else ""
    return (
        f"server is not ready: model '{m}' version {v} failed to load{more}; serve with "
        f"--no-strict-readiness to be ready without it: {why or 'no reason given'}"
    )


def shown_name(name: str) -> str:
    """A name safe to echo in a message (bounded, control characters escaped)."""
    return ascii(name[:128])[1:-1]


def unknown_model(name: str, version: str | None = None) -> str:
    """Triton's wording for a model (version) that is not in the repository: its clients and
    examples match on the start, ``Request for unknown model``."""
    if version is None:
        return f"Request for unknown model: '{shown_name(name)}' is not found"
    shown = f"'{shown_name(name)}' version {shown_name(version)}"
    return f"Request for unknown model: {shown} is not found"
