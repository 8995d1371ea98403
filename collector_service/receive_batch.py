"""Receiving a body of several frames back to back, frame by frame, as it streams in.

Frames are self-delimiting (the first 32 bytes give a frame's length), so a batch needs no framing of
its own: the body is exactly frame, frame, ..., frame. Each frame is copied once into its own pooled
buffer and checked like a single POST's frame.

What must hold:
- each frame is judged on its own: a frame that fails its checks is rejected and the next one is read,
  as long as the stream still splits into frames (a bad prefix, an oversized frame or a body that ends
  mid-frame ends the batch there: what follows cannot be located and is left for the sender to re-send);
- nothing larger than max_body_bytes is read for one frame, and at most MAX_FRAMES_PER_BATCH frames;
- a frame's buffer goes back to the pool unless the frame is handed on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from capture_format import FRAME_PREFIX_NBYTES, CaptureFormatError, read_frame_prefix
from collector_service.buffers import BufferPool, BuffersExhausted
from collector_service.errors import ApiError, api_error_from_format_error
from collector_service.receive import ReceivedFrame, check_frame, check_free_space
from collector_service.settings import CollectorSettings

__all__ = ["BATCH_CONTENT_TYPE", "MAX_FRAMES_PER_BATCH", "BodyReader", "FrameRejected", "next_frame"]

BATCH_CONTENT_TYPE = "application/x-eagle-tap-frames"
MAX_FRAMES_PER_BATCH = 1024
"""Bounds the per-frame answer (a few dozen bytes each) and the work one request can queue."""


class FrameRejected(Exception):
    """This frame is bad but was read to its end: the batch goes on with the next frame."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.detail)
        self.error = error


@dataclass(slots=True)
class BodyReader:
    """Exact-length reads over a body's chunks, whatever their sizes."""

    chunks: AsyncIterator[bytes]
    pending: memoryview = memoryview(b"")
    received: int = 0

    async def _refill(self) -> bool:
        while not self.pending:
            chunk = await anext(self.chunks, None)
            if chunk is None:
                return False
            self.pending = memoryview(chunk)  # starlette ends a body with b"": skipped by the loop
            self.received += len(chunk)
        return True

    async def at_end(self) -> bool:
        return not await self._refill()

    async def read_into(self, view: memoryview) -> int:
        """Fills view from the body; returns how many bytes it got (fewer only when the body ended)."""
        filled = 0
        while filled < view.nbytes and await self._refill():
            take = min(view.nbytes - filled, self.pending.nbytes)
            view[filled : filled + take] = self.pending[:take]
            self.pending = self.pending[take:]
            filled += take
        return filled


async def next_frame(reader: BodyReader, settings: CollectorSettings, pool: BufferPool,
                     decode_slots: asyncio.Semaphore) -> ReceivedFrame:
    """The next checked frame. FrameRejected: this one is bad, go on; ApiError: the batch ends here."""
    prefix = bytearray(FRAME_PREFIX_NBYTES)
    if await reader.read_into(memoryview(prefix)) < FRAME_PREFIX_NBYTES:
        raise ApiError(400, "length_mismatch", "the body ends inside a frame prefix")
    try:
        frame_nbytes = read_frame_prefix(prefix)
    except CaptureFormatError as err:
        raise api_error_from_format_error(err) from None
    if frame_nbytes > settings.max_body_bytes:
        raise ApiError(413, "body_too_large",
                       f"a frame prefix declares {frame_nbytes} bytes; max_body_bytes={settings.max_body_bytes}")
    check_free_space(settings.data_dir, frame_nbytes, settings.min_free_bytes)
    try:
        buffer = pool.acquire(frame_nbytes)
    except BuffersExhausted as err:
        raise ApiError(503, "overloaded", f"{err}; send the rest again later") from None
    try:
        view = memoryview(buffer)[:frame_nbytes]
        view[:FRAME_PREFIX_NBYTES] = prefix
        received = FRAME_PREFIX_NBYTES + await reader.read_into(view[FRAME_PREFIX_NBYTES:])
        if received < frame_nbytes:
            raise ApiError(400, "length_mismatch",
                           f"the body ended {received} bytes into a frame whose prefix declares {frame_nbytes}")
        try:
            info = await check_frame(view, settings, decode_slots)  # what every reader checks, as /v1/records
        except ApiError as err:
            raise FrameRejected(err) from None
    except BaseException:
        pool.release(buffer)
        raise
    return ReceivedFrame(buffer=buffer, view=view, info=info)
