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
from dataclasses import dataclass

import numpy as np

from capture_format.errors import CaptureFormatError, ChecksumError, FrameError
from capture_format.frames import FRAME_PREFIX_NBYTES, check_header, decode_tensor, parse_frame_prefix
from capture_format.shard_index import IndexEntry

__all__ = ["RecordTokens", "read_token_ids"]

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


def _pread_exactly(fd: int, nbytes: int, offset: int) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise FrameError(f"the shard ends {len(data)} bytes into a {nbytes}-byte read at offset {offset}")
    return data


def _read(fd: int, entry: IndexEntry) -> RecordTokens:
    prefix_bytes = _pread_exactly(fd, FRAME_PREFIX_NBYTES, entry.offset)
    prefix = parse_frame_prefix(prefix_bytes)
    if prefix.header_xxh3_64 != entry.header_xxh3_64:
        raise ChecksumError(
            f"frame header checksum {prefix.header_xxh3_64} differs from the index's {entry.header_xxh3_64}"
        )
    if prefix.frame_nbytes != entry.length:
        raise FrameError(f"frame is {prefix.frame_nbytes} bytes; the index says {entry.length}")
    info = check_header(prefix, prefix_bytes, _pread_exactly(fd, prefix.header_nbytes, entry.offset + FRAME_PREFIX_NBYTES))
    if info.record_id != entry.record_id:
        raise FrameError(f"frame holds record {info.record_id!r}; the index says {entry.record_id!r}")
    if info.ids_xxh3_64 != entry.ids_xxh3_64:
        raise ChecksumError(f"frame's token ids hash to {info.ids_xxh3_64}; the index says {entry.ids_xxh3_64}")
    tensor = info.tensors[0]  # token_ids, always first in the payload
    stored_offset = entry.offset + FRAME_PREFIX_NBYTES + info.header_nbytes + tensor.offset
    token_ids = decode_tensor(_pread_exactly(fd, tensor.stored_nbytes, stored_offset), tensor)
    return RecordTokens(record_id=info.record_id, token_ids=token_ids, loss_spans=info.loss_spans)


def read_token_ids(entry: IndexEntry, fd: int | None = None) -> RecordTokens:
    """Token ids and loss spans of the record at entry; fd: an open read descriptor of entry's shard."""
    own_fd = fd is None
    if own_fd:
        fd = os.open(entry.shard_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read(fd, entry)
    except ChecksumError as err:
        raise ChecksumError(f"{entry.shard_path} at offset {entry.offset}: {err}") from None
    except CaptureFormatError as err:
        raise FrameError(f"{entry.shard_path} at offset {entry.offset}: {err}") from None
    finally:
        if own_fd:
            os.close(fd)
