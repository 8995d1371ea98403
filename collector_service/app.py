"""`create_app(settings)`: the collector as a FastAPI app; uvicorn serves it (see cli.py).

What must hold: the app holds no module-level state. Its lifespan owns the store (recovery at
start-up, the writer thread, sealing at shutdown); settings, store and metrics live on app.state,
so many apps can run in one process (tests do).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from collector_service.errors import ApiError
from collector_service.metrics import CollectorMetrics
from collector_service.metrics import router as metrics_router
from collector_service.routes_batch import batch_route
from collector_service.routes_health import health_router, stats_router
from collector_service.routes_records import router as records_router
from collector_service.settings import CollectorSettings
from collector_service.store import RecordStore

__all__ = ["create_app"]

log = logging.getLogger(__name__)


async def _handle_api_error(request: Request, err: ApiError) -> JSONResponse:
    store: RecordStore | None = getattr(request.app.state, "store", None)
    if store is not None and request.method == "POST":
        store.count_reject(err.reason)
    log.info("%s %s -> %d %s: %s", request.method, request.url.path, err.status_code, err.reason, err.detail)
    headers = {}
    if err.close_connection:
        headers["Connection"] = "close"
    if err.status_code == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="eagle-tap collector"'
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


def create_app(settings: CollectorSettings) -> FastAPI:
    """The collector app for settings; the store starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await RecordStore.open(settings, observe_commit=app.state.metrics.observe_commit)
        app.state.store = store
        log.info("collector on %s: %d records in %d sealed shards, durability %s",
                 settings.data_dir, store.totals.num_records, store.totals.num_sealed_shards, settings.durability)
        try:
            yield
        finally:
            await store.close()

    app = FastAPI(title="eagle-tap collector", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = CollectorMetrics(lambda: app.state.store.stats() if hasattr(app.state, "store") else None)
    app.include_router(records_router)
    app.router.routes.append(batch_route)  # a plain ASGI route: see routes_batch
    app.include_router(stats_router)
    app.include_router(health_router)
    app.include_router(metrics_router)
    app.add_exception_handler(ApiError, _handle_api_error)
    return app
