"""Error types of the capture format.

Every problem with a record, a codec spec, a frame or a shard raises a subclass of
`CaptureFormatError` (itself a `ValueError`), so a service can map them all to one "bad input"
answer. Messages name the bad value and, where there is a fixed set, the accepted ones.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CaptureFormatError",
    "ChecksumError",
    "CodecError",
    "FrameError",
    "InvalidRecordError",
    "ShardError",
    "UnknownCodecError",
    "check_json_type",
    "describe",
]


class CaptureFormatError(ValueError):
    """Base class of every error this package raises for bad input."""


class InvalidRecordError(CaptureFormatError):
    """A record field breaks the record rules (id pattern, shapes, dtype, spans, metadata)."""


class CodecError(CaptureFormatError):
    """A codec cannot encode this data, or stored bytes are not what the codec wrote."""


class UnknownCodecError(CodecError):
    """A codec spec string names no registered codec."""


class FrameError(CaptureFormatError):
    """Bytes are not a well-formed frame: magic, version, sizes, header fields or layout."""


class ChecksumError(FrameError):
    """Bytes do not match the checksum stored for them."""


class ShardError(CaptureFormatError):
    """A shard file, shard name or shard index is missing, malformed or inconsistent."""


def describe(value: object, *, max_chars: int = 80) -> str:
    """Returns repr(value), cut to max_chars so hostile input cannot flood a message or a log."""
    text = repr(value)
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text)} chars)"


def describe_path(path: object, *, max_chars: int = 120) -> str:
    """repr(str(path)), cut at its start when longer than max_chars: a path's end names the file or folder,
    where `describe` would cut that part away."""
    text = repr(str(path))
    if len(text) <= max_chars:
        return text
    return f"...{text[-max_chars:]} ({len(text)} chars)"


def check_json_type(value: Any, expected: type, what: str, error: type[CaptureFormatError]) -> Any:
    """Returns value if it is a JSON value of type expected, else raises error naming what it is.

    JSON true/false load as bool, an int subclass: they never pass as int.
    """
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise error(f"{what} must be {expected.__name__}; got {describe(value)}")
    return value
