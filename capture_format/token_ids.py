"""Reading only the token ids and loss spans of an indexed record, without touching its states.

Counting token frequencies over a capture (the vocab mapping) needs ids and spans, which are a few
bytes per token against tens of kilobytes of hidden states. `read_token_ids` preads the frame's
prefix, its header and its token_ids tensor, and nothing else.

What must hold: the ids and spans come back only if the frame's header checksum is the index
entry's, the header parses under the frame rules, the token_ids bytes match their stored and
decoded checksums and the entry's ids digest; otherwise ChecksumError or FrameError naming shard
and offset, as `ShardDirectory.read_record` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from capture_format.errors import CaptureFormatError, ChecksumError, FrameError
from capture_format.frames import FRAME_PREFIX_NBYTES, check_header, decode_tensor, parse_frame_prefix
from capture_format.shard_index import IndexEntry

__all__ = ["RecordTokens", "read_token_ids", "read_token_ids_from_frame"]

@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RecordTokens:
    """The token ids and loss spans of one record."""

    record_id: str
    token_ids: np.ndarray
    """int32 [T]."""
    loss_spans: tuple[tuple[int, int], ...]

    def loss_mask(self) -> np.ndarray:
        """uint8 [T]: 1 on tokens inside a loss span."""
        mask = np.zeros(self.token_ids.shape[0], dtype=np.uint8)
        for start, end in self.loss_spans:
            mask[start:end] = 1
        return mask


Pread = Callable[[int, int], bytes]
"""pread(nbytes, offset) -> the bytes of the shard at offset (fewer at its end)."""


def _exactly(pread: Pread, nbytes: int, offset: int) -> bytes:
    data = pread(nbytes, offset)
    if len(data) != nbytes:
        raise FrameError(f"the shard ends {len(data)} bytes into a {nbytes}-byte read at offset {offset}")
    return data


def _read(pread: Pread, entry: IndexEntry) -> RecordTokens:
    prefix_bytes = _exactly(pread, FRAME_PREFIX_NBYTES, entry.offset)
    prefix = parse_frame_prefix(prefix_bytes)
    if prefix.header_xxh3_64 != entry.header_xxh3_64:
        raise ChecksumError(
            f"frame header checksum {prefix.header_xxh3_64} differs from the index's {entry.header_xxh3_64}"
        )
    if prefix.frame_nbytes != entry.length:
        raise FrameError(f"frame is {prefix.frame_nbytes} bytes; the index says {entry.length}")
    info = check_header(prefix, prefix_bytes, _exactly(pread, prefix.header_nbytes, entry.offset + FRAME_PREFIX_NBYTES))
    if info.record_id != entry.record_id:
        raise FrameError(f"frame holds record {info.record_id!r}; the index says {entry.record_id!r}")
    if info.ids_xxh3_64 != entry.ids_xxh3_64:
        raise ChecksumError(f"frame's token ids hash to {info.ids_xxh3_64}; the index says {entry.ids_xxh3_64}")
    tensor = info.tensors[0]  # token_ids, always first in the payload
    stored_offset = entry.offset + FRAME_PREFIX_NBYTES + info.header_nbytes + tensor.offset
    token_ids = decode_tensor(_exactly(pread, tensor.stored_nbytes, stored_offset), tensor)
    return RecordTokens(record_id=info.record_id, token_ids=token_ids, loss_spans=info.loss_spans)


def _read_naming(pread: Pread, entry: IndexEntry, shard_name: str) -> RecordTokens:
    try:
        return _read(pread, entry)
    except ChecksumError as err:
        raise ChecksumError(f"{shard_name} at offset {entry.offset}: {err}") from None
    except CaptureFormatError as err:
        raise FrameError(f"{shard_name} at offset {entry.offset}: {err}") from None


def read_token_ids(entry: IndexEntry, fd: int | None = None) -> RecordTokens:
    """Token ids and loss spans of the record at entry; fd: an open read descriptor of entry's shard."""
    own_fd = fd is None
    if own_fd:
        fd = os.open(entry.shard_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_naming(lambda nbytes, offset: os.pread(fd, nbytes, offset), entry, str(entry.shard_path))
    finally:
        if own_fd:
            os.close(fd)


def read_token_ids_from_frame(frame: bytes, entry: IndexEntry, shard_name: str) -> RecordTokens:
    """As read_token_ids, from the bytes of entry's whole frame (fetched from an object store)."""
    view = memoryview(frame)

    def pread(nbytes: int, offset: int) -> bytes:
        start = offset - entry.offset
        return bytes(view[start : start + nbytes])

    return _read_naming(pread, entry, shard_name)
