"""Errors the API answers with: one reason code per kind of problem, a status, a message.

Every refused request is answered `{"error": "<reason>", "detail": "<what is wrong>"}` and counted
under its reason in /v1/stats and /metrics. Status codes:

    401 unauthorized            missing or wrong `Authorization: Bearer <token>`
    415 unsupported_media_type  Content-Type is not application/octet-stream
    413 body_too_large          Content-Length or the frame prefix exceeds max_body_bytes
    408 receive_timeout         the body took longer than receive_timeout_s
    400 empty_body              no bytes at all
    400 client_disconnected     the client went away before the whole body arrived
    400 length_mismatch         Content-Length disagrees with the frame, or the body ends early or runs on
    400 malformed_frame         magic, version, flags, header JSON, shapes, sizes or layout (FrameError)
    400 checksum_mismatch       header or stored tensor bytes do not match their checksum
    422 invalid_record          a record rule is broken: unsafe id, schema version, spans, dimensions
    422 unknown_codec           a tensor names a codec this collector does not know
    400 invalid_record_id       GET with an id that no record could have
    404 not_found               GET of an id that is not stored
    507 insufficient_storage    the data disk would fall below min_free_bytes (or is full)
    503 storage_failed          the writer cannot write or sync; nothing was acknowledged
    503 overloaded              max_inflight_bytes are already being received or written; retry
    503 shutting_down           the service is stopping
"""

from __future__ import annotations

from capture_format import (
    CaptureFormatError,
    ChecksumError,
    FrameError,
    InvalidRecordError,
    UnknownCodecError,
)

__all__ = ["ApiError", "api_error_from_format_error"]


class ApiError(Exception):
    """A request the collector refuses: HTTP status, reason code, and a message naming the problem."""

    def __init__(self, status_code: int, reason: str, detail: str, *, close_connection: bool = False) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.reason = reason
        self.detail = detail
        self.close_connection = close_connection
        """Answer with `Connection: close`: the rest of the body is not worth reading."""

    def body(self) -> dict[str, str]:
        return {"error": self.reason, "detail": self.detail}


def api_error_from_format_error(err: CaptureFormatError) -> ApiError:
    """Maps a capture_format error raised by inspect_frame to its reason code and status."""
    # Most specific first: ChecksumError is a FrameError, UnknownCodecError a CodecError.
    if isinstance(err, ChecksumError):
        return ApiError(400, "checksum_mismatch", str(err))
    if isinstance(err, UnknownCodecError):
        return ApiError(422, "unknown_codec", str(err))
    if isinstance(err, InvalidRecordError):
        return ApiError(422, "invalid_record", str(err))
    if isinstance(err, FrameError):
        return ApiError(400, "malformed_frame", str(err))
    return ApiError(400, "malformed_frame", f"{type(err).__name__}: {err}")
