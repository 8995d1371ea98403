"""Request dependencies: the app's store and the bearer-token guard.

Both are `async def` so FastAPI runs them inline: a sync dependency costs a thread-pool hop per
request. What must hold: the token is compared in constant time (hmac.compare_digest on bytes), and a
refused request is told what was wrong with its Authorization header, never the token.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from collector_service.errors import ApiError
from collector_service.store import RecordStore

__all__ = ["StoreDep", "check_token", "get_store", "require_token"]


async def get_store(request: Request) -> RecordStore:
    return request.app.state.store


StoreDep = Annotated[RecordStore, Depends(get_store)]


async def require_token(request: Request) -> None:
    """Passes when no token is configured or the request carries `Authorization: Bearer <token>`."""
    check_token(request)


def check_token(request: Request) -> None:
    """`require_token` for a route that is not a FastAPI route (`routes_batch`): ApiError 401 when refused."""
    token = request.app.state.settings.token
    if token is None:
        return
    header = request.headers.get("authorization")
    if header is None:
        raise ApiError(401, "unauthorized", "missing Authorization header; send 'Authorization: Bearer <token>'",
                       close_connection=True)
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise ApiError(401, "unauthorized", "the Authorization header must be 'Bearer <token>'",
                       close_connection=True)
    if not hmac.compare_digest(presented.strip().encode(), token.get_secret_value().encode()):
        raise ApiError(401, "unauthorized", "wrong bearer token", close_connection=True)
