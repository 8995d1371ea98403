"""/healthz (open) and /v1/stats (token-guarded)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from collector_service.dependencies import StoreDep, require_token

__all__ = ["health_router", "stats_router"]

health_router = APIRouter(tags=["health"])
stats_router = APIRouter(prefix="/v1/stats", tags=["stats"], dependencies=[Depends(require_token)])


@health_router.get("/healthz")
async def healthz(store: StoreDep) -> JSONResponse:
    """200 while records can be stored; 503 with the reason after a storage failure (for good, or the latest write)."""
    reason = store.failed_reason
    if reason is not None:
        return JSONResponse({"status": "failed", "detail": reason}, status_code=503)
    if store.storage_error is not None:
        return JSONResponse({"status": "failing", "detail": store.storage_error}, status_code=503)
    return JSONResponse({"status": "ok", "durability": store.settings.durability})


@stats_router.get("")
async def stats(store: StoreDep) -> dict[str, Any]:
    """Records, tokens, bytes (raw, stored, on disk), shards, duplicates and rejects by reason."""
    return store.stats()
