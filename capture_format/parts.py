"""A long capture sent in parts: what the parts and the record that closes them say about each other.

A capture longer than one part (`EAGLE_TAP_PART_MAX_TOKENS` / `_BYTES` on the plugin) leaves the server
as it is computed, so the plugin never holds more than one part of it. Each part is an ordinary prefix
block (`prefix_blocks.py`): record id `prefix-<prefix_key(ids[:b])>`, token ids `ids[:b]`, the states of
tokens [a, b) only, a reference to the part (or shared-prefix block) ending at a, and metadata
`{"kind": "prefix_block", "capture_part": {"record_id": R, "index": i}}` naming the capture it belongs to
(R, the closing record's id) and its place in it (0, 1, ...). The closing record is the capture's record:
all its token ids, loss spans and metadata, the rows after the last part, a reference to the last part,
and `"capture_parts": {"count": n, "digest": D}` in its metadata.

D is `PartsDigest` over the parts in order: each part's record id and the header checksum of the frame
the plugin sent (`FrameInfo.header_xxh3_64`). The collector computes it over what it received and
stores the record only when both agree, so a record is never closed over a part it did not receive,
a part from another attempt at the same request, or a part missing in between.

What must hold:
- parts are never training samples (they are prefix blocks) and a reader resolves a closed record like
  any record with a shared prefix; a record with parts is readable only once every part is stored;
- `capture_part_of` / `closing_parts_of` accept only well-formed metadata and raise InvalidRecordError
  naming what is wrong, so the collector refuses a malformed part or close before writing anything.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capture_format.errors import InvalidRecordError, describe
from capture_format.prefix_blocks import BLOCK_KIND, is_prefix_block
from capture_format.records import check_record_id

__all__ = [
    "CLOSING_KEY",
    "MAX_PARTS",
    "PART_KEY",
    "SENDER_MAX_BACKOFF_S",
    "ClosingParts",
    "PartOf",
    "PartsDigest",
    "capture_part_of",
    "closing_metadata",
    "closing_parts_of",
    "part_metadata",
]

PART_KEY = "capture_part"
"""Metadata key of a part: {"record_id": the capture's record id, "index": its place, from 0}."""
CLOSING_KEY = "capture_parts"
"""Metadata key of the record that closes a capture sent in parts: {"count": parts, "digest": PartsDigest}."""
MAX_PARTS = 1 << 20
SENDER_MAX_BACKOFF_S = 10.0
"""The longest a plugin waits between two tries to reach its collector (its spool backoff doubles from 0.5 s
up to this). A collector's part timeout must be well above it, or the parts of a capture can expire while
the plugin is still re-sending them; the collector warns below `2 * SENDER_MAX_BACKOFF_S`."""
_DIGEST_PATTERN = re.compile(r"[0-9a-f]{32}", re.ASCII)
_DIGEST_DOMAIN = b"eagle-tap capture parts v1\0"


@dataclass(frozen=True, slots=True)
class PartOf:
    """Where a part belongs: the capture's (closing record's) id and the part's index in it."""

    record_id: str
    index: int


@dataclass(frozen=True, slots=True)
class ClosingParts:
    """What a closing record says of its parts."""

    count: int
    digest: str


def part_metadata(record_id: str, index: int) -> dict[str, Any]:
    return {"kind": BLOCK_KIND, PART_KEY: {"record_id": record_id, "index": index}}


def closing_metadata(metadata: Mapping[str, Any], count: int, digest: str) -> dict[str, Any]:
    """The closing record's metadata: the capture's own, plus what it says of its parts."""
    return {**metadata, CLOSING_KEY: {"count": count, "digest": digest}}


def _check_index(value: object, name: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < MAX_PARTS:
        raise InvalidRecordError(f"{name} must be an int in {low}..{MAX_PARTS - 1}; got {describe(value)}")
    return value


def capture_part_of(record_id: str, metadata: Mapping[str, Any]) -> PartOf | None:
    """The capture a part belongs to, or None for a record that is not a part."""
    entry = metadata.get(PART_KEY)
    if entry is None:
        return None
    if not is_prefix_block(record_id) or metadata.get("kind") != BLOCK_KIND:
        raise InvalidRecordError(f"record {record_id}: metadata {PART_KEY!r} is only for prefix blocks "
                                 f"(kind {BLOCK_KIND!r}, id prefix-<key>)")
    if not isinstance(entry, Mapping) or set(entry) != {"record_id", "index"}:
        raise InvalidRecordError(f"record {record_id}: metadata {PART_KEY!r} must be "
                                 f'{{"record_id": ..., "index": ...}}; got {describe(entry)}')
    return PartOf(check_record_id(entry["record_id"]), _check_index(entry["index"], f"{PART_KEY}.index", 0))


def closing_parts_of(record_id: str, metadata: Mapping[str, Any]) -> ClosingParts | None:
    """What a closing record says of its parts, or None for a record sent whole."""
    entry = metadata.get(CLOSING_KEY)
    if entry is None:
        return None
    if is_prefix_block(record_id):
        raise InvalidRecordError(f"record {record_id}: a prefix block cannot close parts ({CLOSING_KEY!r})")
    if not isinstance(entry, Mapping) or set(entry) != {"count", "digest"}:
        raise InvalidRecordError(f"record {record_id}: metadata {CLOSING_KEY!r} must be "
                                 f'{{"count": ..., "digest": ...}}; got {describe(entry)}')
    digest = entry["digest"]
    if not isinstance(digest, str) or _DIGEST_PATTERN.fullmatch(digest) is None:
        raise InvalidRecordError(f"record {record_id}: {CLOSING_KEY}.digest must be 32 hex digits; got {describe(digest)}")
    return ClosingParts(_check_index(entry["count"], f"{CLOSING_KEY}.count", 1), digest)


class PartsDigest:
    """BLAKE2b-128 over (record id, frame header checksum) of each part, in order."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(_DIGEST_DOMAIN, digest_size=16)
        self.count = 0

    def update(self, record_id: str, header_xxh3_64: str) -> None:
        self._hash.update(f"{record_id}\0{header_xxh3_64}\n".encode("ascii"))
        self.count += 1

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
