"""State changes and readiness for gRPC, through the application's own HTTP routes.

With ``--workers`` a change of server state must reach every worker, and readiness means
every worker is ready: :mod:`service.cluster` does both in front of the REST routes
(``POST /v2/repository/models/{m}/load|unload``, ``/v2/systemsharedmemory/...register|
unregister``, ``POST /v2/logging``, ``GET /v2/health/ready``). gRPC's RepositoryModelLoad/
Unload, SystemSharedMemoryRegister/Unregister, LogSettings, ServerReady and the health check
go through those same routes, in process (no socket), so a change made over gRPC is applied,
recorded and forwarded exactly as one made over REST, with the same answers, in one process
or many. What only reads state asks the data plane directly.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from service.errors import ServiceError

# How long a load may take (it builds and warms up models, on every worker).
_TIMEOUT_S = 900.0


class RouteError(ServiceError):
    """A route's error answer, with its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status


class AppRoutes:
    """The application's control routes, called in process.

    Args:
        app: the ASGI application (its gateway and middleware included).
        auth_token: the server's bearer token (the gRPC call has already shown it).
    """

    def __init__(self, app: Any, auth_token: str | None = None) -> None:
        self._transport = httpx.ASGITransport(app=app)
        self._headers = {"authorization": f"Bearer {auth_token}"} if auth_token else {}

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None, request_id: str | None
    ) -> httpx.Response:
        headers = dict(self._headers)
        if request_id is not None:
            headers["x-request-id"] = request_id  # one id in every worker's log
        async with httpx.AsyncClient(transport=self._transport, base_url="http://grpc") as c:
            content = None if body is None else json.dumps(body).encode()
            return await c.request(
                method, path, content=content, headers=headers, timeout=_TIMEOUT_S
            )

    async def post(self, path: str, body: dict[str, Any], request_id: str | None = None) -> Any:
        """``POST path`` with a JSON ``body``; the answer's JSON.

        Args:
            path: the route, its parameters percent-encoded.

        Raises:
            RouteError: the route's error, with its status and message.
        """
        r = await self._call("POST", path, body, request_id)
        if r.status_code != 200:
            raise RouteError(r.status_code, _error(r))
        return r.json() if r.content else None

    async def ready(self) -> bool:
        """``GET /v2/health/ready`` answers 200 (every worker's models ready)."""
        return (await self._call("GET", "/v2/health/ready", None, None)).status_code == 200


def _error(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {response.status_code}"
    return str(message)
