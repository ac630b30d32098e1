"""Optional bearer-token authentication (constant-time comparison)."""

from __future__ import annotations

import hmac

from service.errors import Unauthorized


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_bearer(authorization: str | None, expected: bytes | None) -> None:
    """Raise :class:`Unauthorized` unless ``authorization`` carries the token ``expected``.

    Every transport checks its credentials here (an HTTP ``Authorization`` header, gRPC's
    ``authorization`` metadata). ``expected`` None accepts everything. The comparison is
    ``hmac.compare_digest`` on bytes, so its time does not depend on how much of a guess
    matches.
    """
    if expected is None:
        return
    got = bearer_token(authorization)
    if got is None:
        raise Unauthorized("missing bearer token (send 'Authorization: Bearer <token>')")
    if not hmac.compare_digest(got.encode(), expected):
        raise Unauthorized("invalid bearer token")
