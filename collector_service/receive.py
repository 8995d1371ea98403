"""Receiving one frame from a POST body: bounded, streamed, checked before anything is written.

What must hold:
- nothing larger than max_body_bytes is read: Content-Length and then the frame prefix (its first
  32 bytes give the frame's total length) are checked before the rest of the body is read;
- the body is copied once, chunk by chunk, into one pooled buffer of exactly the frame's length;
  a body that ends early or runs past the frame is refused;
- the frame is checked with inspect_frame (prefix, header, sizes, stored checksums), then decoded
  once as every reader decodes it (decoded checksums, token ids, the codec's true output size) before
  it is handed to the writer: what no reader accepts is refused here, not acknowledged and lost later;
- decoding is bounded: a record may decode to at most max_expansion_ratio times its frame's bytes
  (checked from the header, before decoding), at most max_concurrent_decodes threads check frames at once,
  always off the event loop (the frames of a batch that arrived together in one hop: check_frames); a refused
  frame's buffer goes back to the pool.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import ClientDisconnect, Request

from capture_format import (
    FRAME_PREFIX_NBYTES,
    CaptureFormatError,
    FrameInfo,
    inspect_frame,
    read_frame_prefix,
    verify_inspected_frame,
)
from collector_service.buffers import BufferPool, BuffersExhausted
from collector_service.errors import ApiError, api_error_from_format_error
from collector_service.settings import CollectorSettings

__all__ = ["FRAME_CONTENT_TYPE", "ReceivedFrame", "check_frame", "check_frames", "check_free_space", "receive_frame"]

FRAME_CONTENT_TYPE = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class ReceivedFrame:
    """A checked frame: `view` (exactly the frame) lies in `buffer`, which belongs to the pool."""

    buffer: bytearray
    view: memoryview
    info: FrameInfo


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise ApiError(400, "length_mismatch", f"Content-Length {value[:40]!r} is not a byte count")
    return int(value)


def check_free_space(data_dir: Path, frame_nbytes: int, min_free_bytes: int) -> None:
    """Raises 507 if writing frame_nbytes would leave less than min_free_bytes on data_dir's disk."""
    free_bytes = shutil.disk_usage(data_dir).free
    if free_bytes - frame_nbytes < min_free_bytes:
        raise ApiError(
            507,
            "insufficient_storage",
            f"the data disk has {free_bytes} bytes free; a {frame_nbytes}-byte frame would leave less than "
            f"min_free_bytes={min_free_bytes}: free space or lower the limit",
            close_connection=True,
        )


async def receive_frame(request: Request, settings: CollectorSettings, pool: BufferPool,
                        decode_slots: asyncio.Semaphore) -> ReceivedFrame:
    """Reads and checks the frame in request's body; ApiError (4xx/503/507) names what is wrong."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != FRAME_CONTENT_TYPE:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type is {media_type or 'missing'!r}; send one frame as {FRAME_CONTENT_TYPE}",
            close_connection=True,
        )
    content_length = _content_length(request)
    if content_length is not None and content_length > settings.max_body_bytes:
        raise ApiError(
            413,
            "body_too_large",
            f"Content-Length {content_length} exceeds max_body_bytes={settings.max_body_bytes}",
            close_connection=True,
        )
    if content_length == 0:
        raise ApiError(400, "empty_body", "the body is empty; send one frame")
    progress = _Progress()
    try:
        async with asyncio.timeout(settings.receive_timeout_s):
            received = await _receive(request.stream().__aiter__(), content_length, settings, pool, progress)
    except TimeoutError:
        raise ApiError(
            408,
            "receive_timeout",
            f"received {progress.received} bytes in receive_timeout_s={settings.receive_timeout_s:g}; send faster",
            close_connection=True,
        ) from None
    except ClientDisconnect:
        raise ApiError(400, "client_disconnected", f"the client went away after {progress.received} bytes") from None
    try:
        info = await check_frame(received.view, settings, decode_slots)
    except BaseException:
        pool.release(received.buffer)
        raise
    return ReceivedFrame(buffer=received.buffer, view=received.view, info=info)


@dataclass(frozen=True, slots=True)
class _Received:
    buffer: bytearray
    view: memoryview


@dataclass(slots=True)
class _Progress:
    received: int = 0


async def _receive(
    chunks: AsyncIterator[bytes], content_length: int | None, settings: CollectorSettings, pool: BufferPool,
    progress: _Progress,
) -> _Received:
    head = b""
    while len(head) < FRAME_PREFIX_NBYTES:
        chunk = await anext(chunks, None)
        if chunk is None:
            break
        head = chunk if not head else head + chunk  # only until the 32-byte prefix is in
        progress.received = len(head)
    if not head:
        raise ApiError(400, "empty_body", "the body is empty; send one frame")
    try:
        frame_nbytes = read_frame_prefix(head[:FRAME_PREFIX_NBYTES])
    except CaptureFormatError as err:
        raise api_error_from_format_error(err) from None
    if frame_nbytes > settings.max_body_bytes:
        raise ApiError(
            413,
            "body_too_large",
            f"the frame prefix declares {frame_nbytes} bytes; max_body_bytes={settings.max_body_bytes}",
            close_connection=True,
        )
    if content_length is not None and content_length != frame_nbytes:
        raise ApiError(
            400,
            "length_mismatch",
            f"Content-Length is {content_length} but the frame prefix declares a {frame_nbytes}-byte frame",
            close_connection=True,
        )
    if len(head) > frame_nbytes:
        raise _runs_past(frame_nbytes)
    check_free_space(settings.data_dir, frame_nbytes, settings.min_free_bytes)
    try:
        buffer = pool.acquire(frame_nbytes)
    except BuffersExhausted as err:
        raise ApiError(503, "overloaded", f"{err}; send again later", close_connection=True) from None
    try:
        view = memoryview(buffer)[:frame_nbytes]
        received = len(head)
        view[:received] = head
        del head
        async for chunk in chunks:
            end = received + len(chunk)
            if end > frame_nbytes:
                raise _runs_past(frame_nbytes)
            view[received:end] = chunk
            received = progress.received = end
        if received < frame_nbytes:
            raise ApiError(
                400, "length_mismatch",
                f"the body ended after {received} bytes; the frame prefix declares {frame_nbytes}",
            )
    except BaseException:
        pool.release(buffer)
        raise
    return _Received(buffer=buffer, view=view)


def _runs_past(frame_nbytes: int) -> ApiError:
    return ApiError(
        400, "length_mismatch", f"the body runs past the {frame_nbytes}-byte frame; send exactly one frame",
        close_connection=True,
    )


async def check_frame(view: memoryview, settings: CollectorSettings, decode_slots: asyncio.Semaphore) -> FrameInfo:
    """What every reader checks (see check_frames), for one frame; ApiError names what is wrong."""
    (result,) = await check_frames([view], settings, decode_slots)
    if isinstance(result, ApiError):
        raise result
    return result


async def check_frames(views: list[memoryview], settings: CollectorSettings,
                       decode_slots: asyncio.Semaphore) -> list[FrameInfo | ApiError]:
    """What every reader checks, for each of views in turn, all in one thread hop and one decode slot: its
    FrameInfo, or the ApiError that refuses it. A hop costs 30-100 us of CPU here (the waking of a thread on
    another core), as much as checking a short record's frame; a frame costs inspect_frame, a bound on the
    decoded size, then one full decode."""
    async with decode_slots:
        return await asyncio.to_thread(_check_frames, views, settings.max_expansion_ratio)


def _check_frames(views: list[memoryview], max_expansion_ratio: float) -> list[FrameInfo | ApiError]:
    results: list[FrameInfo | ApiError] = []
    for view in views:
        try:
            results.append(_check_frame(view, max_expansion_ratio))
        except CaptureFormatError as err:
            results.append(api_error_from_format_error(err))
        except ApiError as err:
            results.append(err)
    return results


def _check_frame(view: memoryview, max_expansion_ratio: float) -> FrameInfo:
    info = inspect_frame(view)
    decoded_nbytes = sum(tensor.raw_nbytes for tensor in info.tensors)
    max_decoded_nbytes = int(max_expansion_ratio * view.nbytes)
    if decoded_nbytes > max_decoded_nbytes:
        raise ApiError(
            413,
            "expands_too_much",
            f"the {view.nbytes}-byte frame decodes to {decoded_nbytes} bytes, over max_expansion_ratio="
            f"{max_expansion_ratio:g} times its size; send it with a weaker codec",
        )
    verify_inspected_frame(view, info)  # decoded checksums, token ids, true output sizes
    return info
