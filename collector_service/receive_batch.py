"""Receiving a body of several frames back to back, frame by frame, as it streams in.

Frames are self-delimiting (the first 32 bytes give a frame's length), so a batch needs no framing of
its own: the body is exactly frame, frame, ..., frame. Each frame is copied once into its own pooled
buffer and checked like a single POST's frame; the frames of up to GROUP_MAX_BYTES are checked together.

What must hold:
- each frame is judged on its own: a frame that fails its checks is rejected and the next one is read,
  as long as the stream still splits into frames (a bad prefix, an oversized frame or a body that ends
  mid-frame ends the batch there: what follows cannot be located and is left for the sender to re-send);
- nothing larger than max_body_bytes is read for one frame, and at most MAX_FRAMES_PER_BATCH frames;
- a frame's buffer goes back to the pool unless the frame is handed on (a group cut short by a timeout or a
  client gone releases every frame of it: none has an entry, so the sender sends them again).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from capture_format import FRAME_PREFIX_NBYTES, CaptureFormatError, read_frame_prefix
from collector_service.buffers import BufferPool, BuffersExhausted
from collector_service.errors import ApiError, api_error_from_format_error
from collector_service.receive import ReceivedFrame, check_free_space, check_frames
from collector_service.settings import CollectorSettings

__all__ = ["BATCH_CONTENT_TYPE", "GROUP_MAX_BYTES", "MAX_FRAMES_PER_BATCH", "BodyReader", "FrameGroup", "next_frames"]

BATCH_CONTENT_TYPE = "application/x-eagle-tap-frames"
MAX_FRAMES_PER_BATCH = 1024
"""Bounds the per-frame answer (a few dozen bytes each) and the work one request can queue."""
GROUP_MAX_BYTES = 4 << 20
"""Frames of a batch checked in one thread hop: about this many bytes of them (a frame larger goes alone), so the
first of them waits a few milliseconds at most for the rest to arrive."""


@dataclass(frozen=True, slots=True)
class FrameGroup:
    """Frames read one after the other from a batch's body and checked together."""

    frames: list[ReceivedFrame | ApiError]
    """In body order: a checked frame (its buffer belongs to the caller now), or why that frame, read to its end,
    is refused (the batch goes on after it)."""
    error: ApiError | None = None
    """Set when the body cannot be split into frames after these: the batch ends here."""


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


async def next_frames(reader: BodyReader, settings: CollectorSettings, pool: BufferPool,
                      decode_slots: asyncio.Semaphore, max_frames: int) -> FrameGroup:
    """The next frames of the body, at most max_frames and about GROUP_MAX_BYTES of them (at least one), read in
    full and then checked in one thread hop: a hop a frame cost the collector as much CPU as checking a short
    record's frame. Nothing is lost when the body ends early or the time runs out: frames without an entry are
    sent again."""
    read: list[tuple[bytearray, memoryview]] = []
    error = None
    group_nbytes = 0
    try:
        while len(read) < max_frames and group_nbytes < GROUP_MAX_BYTES and not await reader.at_end():
            try:
                buffer, view = await _read_frame(reader, settings, pool)
            except ApiError as err:
                error = err
                break
            read.append((buffer, view))
            group_nbytes += view.nbytes
        results = await check_frames([view for _, view in read], settings, decode_slots) if read else []
    except BaseException:
        for buffer, _ in read:
            pool.release(buffer)
        raise
    frames: list[ReceivedFrame | ApiError] = []
    for (buffer, view), result in zip(read, results, strict=True):
        if isinstance(result, ApiError):
            pool.release(buffer)
            frames.append(result)
        else:
            frames.append(ReceivedFrame(buffer=buffer, view=view, info=result))
    return FrameGroup(frames, error)


async def _read_frame(reader: BodyReader, settings: CollectorSettings, pool: BufferPool) -> tuple[bytearray, memoryview]:
    """The next frame's bytes in a pool buffer, unchecked past its prefix; ApiError: the body cannot be split."""
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
    except BaseException:
        pool.release(buffer)
        raise
    return buffer, view
