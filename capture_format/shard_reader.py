"""Reading sealed shards through their indexes.

What must hold: a record comes back only if every check passed: the frame's bytes are exactly the
indexed length, its header checksum and record id are the index entry's, and its header, stored
and decoded tensor checksums match. Otherwise ChecksumError or FrameError is raised with the shard
path, the offset and what failed, so a trainer can report and skip that one record.
Reads use os.pread on a file descriptor per shard: no shared file position, safe across threads
and in forked loader workers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from capture_format.errors import CaptureFormatError, ChecksumError, FrameError, ShardError
from capture_format.frames import decode_frame, inspect_frame_header, parse_frame_prefix
from capture_format.prefix_blocks import BlockCache, ChainLink, is_prefix_block, resolve_prefix
from capture_format.record_windows import RecordLayout, RecordWindow, check_window, cut_window, walk_record
from capture_format.records import CaptureRecord
from capture_format.shard_index import (
    SEALED_SUFFIX,
    IndexEntry,
    ShardIndex,
    list_shard_files,
    load_index,
    shard_stem,
)
from capture_format.token_ids import (FrameStart, Pread, RecordTokens, check_entry_fields, read_frame_start,
                                      read_token_ids)

__all__ = ["DamagedShard", "ShardDirectory", "VerifyReport", "check_record_bytes", "verify_shard"]

def _read_record(fd: int, entry: IndexEntry) -> CaptureRecord:
    return check_record_bytes(os.pread(fd, entry.length, entry.offset), entry, str(entry.shard_path))


def check_record_bytes(data: bytes | memoryview, entry: IndexEntry, shard_name: str) -> CaptureRecord:
    """Decodes the frame bytes read for entry, with every check of the module docstring; errors name
    shard_name (a path or URL) and the offset."""
    where = f"{shard_name} at offset {entry.offset}"
    try:
        if len(data) != entry.length:
            raise FrameError(f"the shard ends {len(data)} bytes into this {entry.length}-byte record")
        prefix = parse_frame_prefix(data)
        if prefix.header_xxh3_64 != entry.header_xxh3_64:
            raise ChecksumError(
                f"frame header checksum {prefix.header_xxh3_64} differs from the index's {entry.header_xxh3_64}"
            )
        info = inspect_frame_header(data)
        check_entry_fields(info, entry)
        record = decode_frame(data)
    except ChecksumError as err:
        raise ChecksumError(f"{where}: {err}") from None
    except CaptureFormatError as err:
        raise FrameError(f"{where}: {err}") from None
    return record


def _load_checked_index(shard_path: Path) -> ShardIndex:
    index = load_index(shard_path)
    actual_nbytes = shard_path.stat().st_size
    if actual_nbytes != index.shard_nbytes:
        raise ShardError(f"{shard_path} is {actual_nbytes} bytes; its index says {index.shard_nbytes}")
    return index


@dataclass(frozen=True, slots=True)
class DamagedShard:
    """A sealed shard that cannot be read through its index (or an index whose shard is gone), and why."""

    path: Path
    reason: str


class IndexedShards:
    """What every reader of a set of sealed shards offers from their indexes alone (`shards` is set by it)."""

    shards: tuple[ShardIndex, ...]

    @property
    def num_records(self) -> int:
        return sum(shard.num_records for shard in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)

    def iter_index(self) -> Iterator[IndexEntry]:
        """The index entry of every training record, shard by shard in name order, records in file order;
        prefix blocks (`prefix_blocks.py`), which only hold states other records refer to, are left out."""
        for shard in self.shards:
            for entry in shard.entries:
                if not is_prefix_block(entry.record_id):
                    yield entry

    def read_stored_record(self, entry: IndexEntry) -> CaptureRecord:
        """The record at entry as stored, fully verified; a shared-prefix reference is left unresolved."""
        raise NotImplementedError

    def read_record(self, entry: IndexEntry) -> CaptureRecord:
        """Reads and fully verifies the record at entry, with the states of every token: a shared prefix it
        refers to is read from the blocks of these shards (prefix_blocks.resolve_prefix; DanglingPrefixError
        if one is missing or does not match)."""
        return resolve_prefix(self.read_stored_record(entry), self._read_block)

    def read_layout(self, entry: IndexEntry) -> RecordLayout:
        """S of the record at entry and where each frame of its chain ends (record_windows.RecordLayout), read
        from frame headers and its ids alone, with the checks read_record makes on them (DanglingPrefixError)."""
        return walk_record(self._frame_start(entry), self._block_link).layout

    def read_window(self, entry: IndexEntry, start: int, end: int) -> RecordWindow:
        """Rows [start, end) of the states of the record at entry, with all its tokens: read_record(entry)'s
        rows, decoding only the frames of its chain those rows lie in (record_windows.py). ValueError for a
        range outside 0 <= start < end <= S; DanglingPrefixError, ChecksumError, FrameError as read_record."""
        own = self._frame_start(entry)
        start, end = check_window(own.info, start, end)
        walked = walk_record(own, self._block_link)
        last = len(walked.links) - 1

        def read_frame(index: int) -> CaptureRecord:
            if index == last:
                return self.read_stored_record(entry)
            block = self._read_block(walked.links[index].record_id)
            assert block is not None  # its entry was there for the walk
            return block

        return cut_window(walked, start, end, read_frame)

    def _frame_start(self, entry: IndexEntry, *, with_token_ids: bool = True) -> FrameStart:
        return read_frame_start(self._pread(entry), entry, self._shard_name(entry), with_token_ids=with_token_ids)

    def _pread(self, entry: IndexEntry) -> Pread:
        """pread(nbytes, offset) of entry's shard, for reads within entry's frame."""
        raise NotImplementedError

    def _shard_name(self, entry: IndexEntry) -> str:
        """entry's shard as errors name it."""
        return str(entry.shard_path)

    @functools.cached_property
    def _blocks(self) -> _Blocks:
        """Built whole on first use before it is stored, so a thread never sees half of it."""
        return _Blocks(BlockCache(), {entry.record_id: entry for shard in self.shards for entry in shard.entries
                                      if is_prefix_block(entry.record_id)})

    def _read_block(self, record_id: str) -> CaptureRecord | None:
        blocks = self._blocks
        block = blocks.cache.get(record_id)
        if block is None:
            entry = blocks.entries.get(record_id)
            if entry is None:
                return None
            block = self.read_stored_record(entry)
            blocks.cache.put(block)
        return block

    def _block_link(self, record_id: str) -> ChainLink | None:
        """The chain link of the block of that id from its checked frame header, or None if no entry has it."""
        blocks = self._blocks
        link = blocks.links.get(record_id)
        if link is None:
            entry = blocks.entries.get(record_id)
            if entry is None:
                return None
            info = self._frame_start(entry, with_token_ids=False).info
            link = blocks.links[record_id] = ChainLink.of_frame(info)
        return link


@dataclass(frozen=True, slots=True)
class _Blocks:
    """What a reader keeps of the prefix blocks of its shards."""

    cache: BlockCache
    """Decoded blocks, least recently used dropped first (a part of a long record is a block)."""
    entries: dict[str, IndexEntry]
    """Every prefix block's index entry by record id."""
    links: dict[str, ChainLink] = field(default_factory=dict)
    """Chain links read from block headers: a few hundred bytes each, at most one per entry."""


class ShardDirectory(IndexedShards):
    """The sealed shards of a directory and their indexes, loaded when it is opened."""

    def __init__(self, path: Path | str, *, skip_damaged: bool = False) -> None:
        """Loads every sealed shard's index. A shard whose index is missing, malformed or of the wrong size,
        or an index whose shard is gone, raises ShardError; with skip_damaged it is listed in `damaged`
        instead and the other shards are served (`eagle-tap shards repair` rebuilds such an index)."""
        self.path = Path(path)
        files = list_shard_files(self.path)
        shards, damaged = [], []
        for _, shard_path in files.sealed:
            try:
                shards.append(_load_checked_index(shard_path))
            except ShardError as err:
                if not skip_damaged:
                    raise
                damaged.append(DamagedShard(shard_path, f"{shard_path.name}: {err}"))
        present = {shard_stem(path.name) for _, path in files.sealed + files.open}
        for _, index_path in files.indexes:
            if shard_stem(index_path.name) not in present:
                reason = f"{index_path} is an index without a shard ({shard_stem(index_path.name)}{SEALED_SUFFIX} is gone)"
                if not skip_damaged:
                    raise ShardError(reason)
                damaged.append(DamagedShard(index_path, reason))
        self.shards: tuple[ShardIndex, ...] = tuple(shards)
        self.damaged: tuple[DamagedShard, ...] = tuple(damaged)
        """Shards left out (only with skip_damaged): each is named and counted by whoever reads the directory."""
        self.open_shard_paths: tuple[Path, ...] = tuple(shard for _, shard in files.open)
        """Shards still being written (or awaiting recovery): not readable through an index."""
        self._fds: dict[Path, int] = {}

    def read_stored_record(self, entry: IndexEntry) -> CaptureRecord:
        """Reads and fully verifies the record at entry as stored (see the module docstring)."""
        return _read_record(self._fd(entry), entry)

    def _pread(self, entry: IndexEntry) -> Pread:
        return functools.partial(os.pread, self._fd(entry))

    def _fd(self, entry: IndexEntry) -> int:
        fd = self._fds.get(entry.shard_path)
        if fd is None:
            opened_fd = os.open(entry.shard_path, os.O_RDONLY | os.O_CLOEXEC)
            # setdefault is atomic: of two threads opening the same shard, one keeps its descriptor.
            fd = self._fds.setdefault(entry.shard_path, opened_fd)
            if fd != opened_fd:
                os.close(opened_fd)
        return fd

    def read_token_ids(self, entry: IndexEntry) -> RecordTokens:
        """Token ids and loss spans of the record at entry (capture_format.token_ids), nothing of its states."""
        return read_token_ids(entry, self._fd(entry))

    def prefetch(self, entries: Iterable[IndexEntry]) -> None:
        """Nothing to do for a local folder (RemoteShardDirectory fetches ahead here)."""

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardDirectory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    """Outcome of verify_shard: one line per problem found."""

    shard_path: Path
    num_records: int
    num_verified: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_shard(path: Path | str) -> VerifyReport:
    """Checks a sealed shard against its index: size, and every record read as read_record reads it.

    Raises ShardError only when the index itself cannot be loaded; every other problem is reported.
    """
    shard_path = Path(path)
    index = load_index(shard_path)
    problems = []
    actual_nbytes = shard_path.stat().st_size
    if actual_nbytes != index.shard_nbytes:
        problems.append(f"{shard_path} is {actual_nbytes} bytes; its index says {index.shard_nbytes}")
    num_verified = 0
    fd = os.open(shard_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for entry in index.entries:
            try:
                _read_record(fd, entry)
            except CaptureFormatError as err:
                problems.append(str(err))
            else:
                num_verified += 1
    finally:
        os.close(fd)
    return VerifyReport(
        shard_path=shard_path, num_records=index.num_records, num_verified=num_verified, problems=tuple(problems)
    )
