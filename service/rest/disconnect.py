"""How an HTTP connection tells a request's handler that its client has gone.

An ASGI server tells an application of a closed connection only through ``receive()``
(``http.disconnect``), which a handler that has read its body and now waits for its batch
never calls. bitserve's connection (:mod:`service.rest.http_protocol`) does more: when it is
lost before a request's response is complete, it calls :func:`client_gone` with the request's
scope, which marks the scope and calls what the handler registered with
:func:`on_disconnect` (the infer route cancels its task: a queued request leaves its model's
queue and is never computed; a running batch finishes).

The two sides share nothing else: a protocol that never calls :func:`client_gone` only leaves
requests to finish as before.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]

_CALLBACK = "bitserve.on_disconnect"
_GONE = "bitserve.client_gone"


def on_disconnect(scope: MutableMapping[str, Any], callback: Callable[[], object] | None) -> None:
    """Call ``callback`` when the request's client goes away before its response is complete
    (None: no longer)."""
    if callback is None:
        scope.pop(_CALLBACK, None)
    else:
        scope[_CALLBACK] = callback


def client_gone(scope: MutableMapping[str, Any]) -> None:
    """The connection of ``scope``'s request was lost before its response was complete (the
    connection's side): mark it, and call the handler's callback once."""
    scope[_GONE] = True
    callback = scope.pop(_CALLBACK, None)
    if callback is not None:
        callback()


def is_gone(scope: MutableMapping[str, Any]) -> bool:
    """Whether the request's client went away before its response was complete."""
    return bool(scope.get(_GONE, False))
