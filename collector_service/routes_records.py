"""/v1/records: ingest one frame (POST) and ask whether a record is stored (GET).

POST answers 201 `{"status": "stored", ...}` once the record is durable, 200 `{"status":
"duplicate", ...}` when its id is already stored (nothing is written), or an error listed in
errors.py. Both 2xx bodies say where the record lies.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from capture_format import InvalidRecordError
from capture_format.records import check_record_id
from collector_service.catalog import RecordLocation
from collector_service.dependencies import StoreDep, require_token
from collector_service.errors import ApiError
from collector_service.receive import FRAME_CONTENT_TYPE, receive_frame
from collector_service.store import RecordStore

__all__ = ["router"]

router = APIRouter(prefix="/v1/records", tags=["records"], dependencies=[Depends(require_token)])


def _describe(store: RecordStore, record_id: str, location: RecordLocation) -> dict[str, Any]:
    return {
        "record_id": record_id,
        "shard": store.shard_name_of(location),
        "sealed": store.is_sealed(location),
        "offset": location.offset,
        "frame_nbytes": location.frame_nbytes,
        "num_tokens": location.num_tokens,
        "header_xxh3_64": location.header_xxh3_64,
    }


_FRAME_BODY = {"content": {FRAME_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}}


@router.post(
    "",
    status_code=201,
    openapi_extra={"requestBody": _FRAME_BODY},
    responses={200: {"description": "duplicate: the id is already stored; nothing was written"}},
)
async def post_record(request: Request, store: StoreDep) -> JSONResponse:
    """Stores one frame (the body) and answers after it is durable."""
    frame = await receive_frame(request, store.settings, store.buffer_pool, store.decode_slots)
    outcome = await store.submit(frame)
    if outcome.location is None:  # a part, kept until the record that closes its capture comes
        body = {"status": outcome.status, "record_id": outcome.record_id, "part": True}
    else:
        body = {"status": outcome.status, **_describe(store, outcome.record_id, outcome.location)}
    if outcome.status == "duplicate":
        body["same_frame"] = outcome.same_frame
        return JSONResponse(body, status_code=200)
    body["durable"] = store.settings.durability == "fsync"
    return JSONResponse(body, status_code=201)


@router.get("/{record_id}")
async def get_record(record_id: str, store: StoreDep) -> dict[str, Any]:
    """Where a stored record lies; 404 if it is not stored (in flight counts as not stored yet)."""
    try:
        check_record_id(record_id)
    except InvalidRecordError as err:
        raise ApiError(400, "invalid_record_id", str(err)) from None
    location = store.lookup(record_id)
    if location is None:
        raise ApiError(404, "not_found", f"record {record_id!r} is not stored")
    return {"stored": True, **_describe(store, record_id, location)}
