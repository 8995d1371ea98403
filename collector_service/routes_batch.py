"""/v1/batches: ingest several frames in one POST, each acknowledged on its own.

The body is frames back to back (Content-Type application/x-eagle-tap-frames). The answer is 200
`{"results": [...]}` with one entry per frame read, in body order:

    {"record_id": "...", "status": "stored"}      durable now (or "duplicate": already stored)
    {"status": "rejected", "error": "<reason>", "detail": "..."}   a bad frame: do not send it again
    {"status": "retry", "error": "<reason>", "detail": "..."}      not stored now (overloaded, disk
                                                                      full, stopping): send it again

Frames after the last entry were not read (the stream could not be split further, or the batch
limit was reached): the sender sends them again. A batch is never all-or-nothing: every entry
stands for itself, and since ids are idempotent, re-sending a stored frame only answers "duplicate".
Frames are checked a group at a time (`next_frames`) and handed to the writer in body order while the rest
of the body streams in, so one group commit covers many of them.

The route is a plain ASGI endpoint (a starlette `Route`), not a FastAPI route: FastAPI's dependency solving, its
request wrapper and the serialisation of the returned dict ran on the event loop for every POST (a one-frame POST
to a bare uvicorn app: 0.44-0.50 ms of server CPU as a FastAPI route, 0.22-0.24 as a plain one; to the collector
0.98-1.10 -> 0.88-0.91 ms), and a draft-serving replica at a low sampling rate posts one or two short records at
a time. The app's handler
still answers an ApiError (the token check, a wrong Content-Type) as for every other route. Not listed in /docs.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from collector_service.dependencies import check_token
from collector_service.errors import ApiError
from collector_service.receive_batch import (
    BATCH_CONTENT_TYPE,
    MAX_FRAMES_PER_BATCH,
    BodyReader,
    next_frames,
)
from collector_service.store import RecordStore, SubmitOutcome

__all__ = ["batch_route"]

_RETRY_STATUS = {408, 503, 507}


def _error_entry(err: ApiError) -> dict[str, Any]:
    status = "retry" if err.status_code in _RETRY_STATUS else "rejected"
    return {"status": status, "error": err.reason, "detail": err.detail}


async def _outcome_entry(store: RecordStore, submitted: asyncio.Task[SubmitOutcome]) -> dict[str, Any]:
    try:
        outcome = await submitted
    except ApiError as err:
        store.count_reject(err.reason)
        return _error_entry(err)
    return {"record_id": outcome.record_id, "status": outcome.status}


class _PostBatch:
    """The endpoint. An object, not a function: starlette wraps a function endpoint (a Request in, a Response out,
    as FastAPI does) and calls an object as the ASGI app it is."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stores each frame of the body; answers once every stored one is durable."""
        request = Request(scope, receive)
        check_token(request)
        store: RecordStore = request.app.state.store
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != BATCH_CONTENT_TYPE:
            raise ApiError(415, "unsupported_media_type", f"Content-Type is {media_type or 'missing'!r}; send frames "
                           f"back to back as {BATCH_CONTENT_TYPE}", close_connection=True)
        reader = BodyReader(request.stream().__aiter__())
        entries: list[asyncio.Task[SubmitOutcome] | dict[str, Any]] = []
        try:
            async with asyncio.timeout(store.settings.receive_timeout_s):
                while len(entries) < MAX_FRAMES_PER_BATCH and not await reader.at_end():
                    group = await next_frames(reader, store.settings, store.buffer_pool, store.decode_slots,
                                              MAX_FRAMES_PER_BATCH - len(entries))
                    for frame in group.frames:
                        if isinstance(frame, ApiError):  # a bad frame, read to its end: the batch goes on
                            store.count_reject(frame.reason)
                            entries.append(_error_entry(frame))
                        else:
                            entries.append(asyncio.create_task(store.submit(frame)))
                    if group.error is not None:  # the rest of the body cannot be split into frames
                        store.count_reject(group.error.reason)
                        entries.append(_error_entry(group.error))
                        break
        except TimeoutError:
            store.count_reject("receive_timeout")
            entries.append(_error_entry(ApiError(
                408, "receive_timeout", f"received {reader.received} bytes in receive_timeout_s="
                f"{store.settings.receive_timeout_s:g}; send the rest again")))
        except ClientDisconnect:
            pass  # no one to answer; what was submitted is still stored (a re-send answers "duplicate")
        results = [entry if isinstance(entry, dict) else await _outcome_entry(store, entry) for entry in entries]
        await JSONResponse({"results": results})(scope, receive, send)


batch_route = Route("/v1/batches", _PostBatch(), methods=["POST"])
