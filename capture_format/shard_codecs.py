"""Which codecs the records of a shard directory use, the error the lossy ones measured; re-encoding shards.

Reads each record's frame prefix and header and, for a lossy tensor, the error sums at the start of
its stored bytes (`codecs_lossy.py`): no tensor is decoded, so this is cheap next to verifying.
Values come from frames as stored; `verify` is what checks them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from capture_format.codec_base import ErrorSums
from capture_format.codecs import get_codec
from capture_format.errors import CaptureFormatError
from capture_format.frame_header import FrameInfo
from capture_format.frames import FRAME_PREFIX_NBYTES, codec_for_states, read_frame_header
from capture_format.shard_index import IndexEntry, ShardIndex
from capture_format.shard_reader import ShardDirectory
from capture_format.shards import write_shards

__all__ = ["CodecTally", "codec_summary", "format_codec_summary", "recode_shards"]

_MAX_ERROR_PREFIX_NBYTES = 64


@dataclass(slots=True)
class CodecTally:
    """The state tensors (aux and final) stored with one codec."""

    codec: str
    lossy: bool
    num_tensors: int = 0
    raw_nbytes: int = 0
    stored_nbytes: int = 0
    error: ErrorSums | None = None
    """Sum of what the encoders measured (lossy codecs only)."""
    record_ids: set[str] = field(default_factory=set)

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.stored_nbytes if self.stored_nbytes else 0.0


def _read_entry(fd: int, entry: IndexEntry, tallies: dict[str, CodecTally]) -> FrameInfo:
    prefix, info = read_frame_header(fd, entry.offset)
    payload_start = entry.offset + FRAME_PREFIX_NBYTES + prefix.header_nbytes
    for tensor in info.tensors[1:]:  # token ids are always raw
        codec = get_codec(tensor.codec)
        tally = tallies.setdefault(codec.spec, CodecTally(codec=codec.spec, lossy=codec.lossy))
        tally.num_tensors += 1
        tally.raw_nbytes += tensor.raw_nbytes
        tally.stored_nbytes += tensor.stored_nbytes
        tally.record_ids.add(info.record_id)
        if codec.lossy:
            stored = memoryview(os.pread(fd, min(tensor.stored_nbytes, _MAX_ERROR_PREFIX_NBYTES),
                                         payload_start + tensor.offset))
            error = codec.stored_error(stored, tensor.layout)
            tally.error = error if tally.error is None else tally.error + error
    return info


def codec_summary(directory: ShardDirectory, on_header: Callable[[IndexEntry, FrameInfo], None] | None = None,
                  ) -> tuple[dict[str, CodecTally], list[str]]:
    """(codec spec -> tally over the sealed shards' records, problems met while reading headers).
    on_header, if given, gets each header read, so other readers of headers (stats' served drafts) share the pass."""
    tallies: dict[str, CodecTally] = {}
    problems = []
    for shard in directory.shards:
        fd = os.open(shard.shard_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for entry in shard.entries:
                try:
                    info = _read_entry(fd, entry, tallies)
                except (CaptureFormatError, ValueError) as err:
                    problems.append(f"{shard.shard_path.name} at offset {entry.offset}: {err}")
                    continue
                if on_header is not None:
                    on_header(entry, info)
        finally:
            os.close(fd)
    return tallies, problems


def format_codec_summary(tallies: dict[str, CodecTally]) -> list[str]:
    """One line per codec: records, ratio, and for a lossy codec the error its encoders measured."""
    lines = []
    for spec, tally in sorted(tallies.items()):
        line = f"{spec}: {len(tally.record_ids):,} records, ratio {tally.ratio:.3f}"
        if tally.lossy and tally.error is not None:
            line += (f", LOSSY: relative RMS error {100 * tally.error.relative_rms_error:.3f}%, max abs error "
                     f"{tally.error.max_abs_error:.4g} (measured by the encoders against the states they got)")
        else:
            line += ", lossless"
        lines.append(line)
    return lines


def recode_shards(source: ShardDirectory, out_dir: Path, codec: str) -> list[ShardIndex]:
    """Writes every record of source's sealed shards into new sealed shards in out_dir, aux and final stored with
    codec, one shard per source shard. Records are verified as a trainer reads them; prefix blocks and the
    references to them are kept as they are."""
    indexes: list[ShardIndex] = []
    for shard in source.shards:
        records = [source.read_stored_record(entry) for entry in shard.entries]  # references kept as they are
        if records:
            codec_for_states(records[0].dtype, codec)  # a codec that cannot store the states fails before writing
            indexes += write_shards(records, out_dir, records_per_shard=len(records), codec=codec)
    return indexes
