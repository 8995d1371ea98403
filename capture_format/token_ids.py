"""Reading only the token ids and loss spans of an indexed record, without touching its states.

Counting token frequencies over a capture (the vocab mapping) needs ids and spans, which are a few
bytes per token against tens of kilobytes of hidden states. `read_token_ids` preads the frame's
prefix, its header and its token_ids tensor, and nothing else. `read_frame_start` is the same read
for any reader that needs a frame's header (and maybe its ids) without its states: walking a chain of
prefix blocks (`record_windows.py`) reads each block's header this way.

What must hold: the header (and ids) come back only if the frame's header checksum and length are the
index entry's, the header parses under the frame rules, its record and sample id, token count, ids
digest, model fingerprint, capture layers, hidden size and dtype are the entry's (`check_entry_fields`,
which full reads use too), and the token_ids bytes match their stored and decoded checksums; otherwise
ChecksumError or FrameError naming shard and offset, as `ShardDirectory.read_record` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from capture_format.errors import CaptureFormatError, ChecksumError, FrameError
from capture_format.frame_header import FrameInfo
from capture_format.frames import FRAME_PREFIX_NBYTES, check_header, decode_tensor, parse_frame_prefix
from capture_format.shard_index import IndexEntry

__all__ = ["FrameStart", "RecordTokens", "check_entry_fields", "read_frame_start", "read_token_ids",
           "read_token_ids_from_frame"]

ENTRY_FIELDS = ("record_id", "sample_id", "num_tokens", "ids_xxh3_64", "model_fingerprint", "capture_layers",
                "hidden_size", "dtype")
"""Index fields a reader compares with the frame's own header: an index that lies about any is caught."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RecordTokens:
    """The token ids and loss spans of one record."""

    record_id: str
    token_ids: np.ndarray
    """int32 [T]."""
    loss_spans: tuple[tuple[int, int], ...]
    input_embed_spans: tuple[tuple[int, int], ...] = ()
    """The image positions (records.CaptureRecord.input_embed_spans); () for a record without images."""

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


def check_entry_fields(info: FrameInfo, entry: IndexEntry) -> None:
    """FrameError unless the frame's header has every ENTRY_FIELDS value of its index entry."""
    for name in ENTRY_FIELDS:
        if getattr(info, name) != getattr(entry, name):
            raise FrameError(f"frame has {name} {getattr(info, name)!r}; the index says {getattr(entry, name)!r}")


@dataclass(frozen=True, slots=True, eq=False)
class FrameStart:
    """The checked header of an indexed frame, and its token ids when they were read."""

    info: FrameInfo
    token_ids: np.ndarray | None
    """int32 [T], or None."""


def _read_start(pread: Pread, entry: IndexEntry, with_token_ids: bool) -> FrameStart:
    prefix_bytes = _exactly(pread, FRAME_PREFIX_NBYTES, entry.offset)
    prefix = parse_frame_prefix(prefix_bytes)
    if prefix.header_xxh3_64 != entry.header_xxh3_64:
        raise ChecksumError(
            f"frame header checksum {prefix.header_xxh3_64} differs from the index's {entry.header_xxh3_64}"
        )
    if prefix.frame_nbytes != entry.length:
        raise FrameError(f"frame is {prefix.frame_nbytes} bytes; the index says {entry.length}")
    info = check_header(prefix, prefix_bytes, _exactly(pread, prefix.header_nbytes, entry.offset + FRAME_PREFIX_NBYTES))
    check_entry_fields(info, entry)
    if not with_token_ids:
        return FrameStart(info, None)
    tensor = info.tensors[0]  # token_ids, always first in the payload
    stored_offset = entry.offset + FRAME_PREFIX_NBYTES + info.header_nbytes + tensor.offset
    return FrameStart(info, decode_tensor(_exactly(pread, tensor.stored_nbytes, stored_offset), tensor))


def read_frame_start(pread: Pread, entry: IndexEntry, shard_name: str, *, with_token_ids: bool) -> FrameStart:
    """The checked header of the frame at entry, and with_token_ids its token ids, read with pread (which
    is never asked for a byte past the token ids); errors name shard_name and the offset."""
    try:
        return _read_start(pread, entry, with_token_ids)
    except ChecksumError as err:
        raise ChecksumError(f"{shard_name} at offset {entry.offset}: {err}") from None
    except CaptureFormatError as err:
        raise FrameError(f"{shard_name} at offset {entry.offset}: {err}") from None


def _read_naming(pread: Pread, entry: IndexEntry, shard_name: str) -> RecordTokens:
    start = read_frame_start(pread, entry, shard_name, with_token_ids=True)
    assert start.token_ids is not None
    return RecordTokens(record_id=start.info.record_id, token_ids=start.token_ids, loss_spans=start.info.loss_spans,
                        input_embed_spans=start.info.input_embed_spans)


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
