"""Bearer-token authentication for FastAPI's routes (the check itself: ``service.auth``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import SecretStr
from starlette.requests import Request

from service.auth import check_bearer


def make_auth_check(token: SecretStr | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that raises :class:`Unauthorized` unless the request has ``token``.

    With ``token`` None it accepts everything (see :func:`check_bearer`). The check is a
    coroutine function because FastAPI runs a plain function dependency in a worker thread:
    two thread hops per request for a microsecond of work.
    """
    expected = token.get_secret_value().encode() if token is not None else None

    async def check(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), expected)

    return check
