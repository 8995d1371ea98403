"""Reading sealed shards through their indexes.

What must hold: a record comes back only if every check passed: the frame's bytes are exactly the
indexed length, its header checksum and record id are the index entry's, and its header, stored
and decoded tensor checksums match. Otherwise ChecksumError or FrameError is raised with the shard
path, the offset and what failed, so a trainer can report and skip that one record.
Reads use os.pread on a file descriptor per shard: no shared file position, safe across threads
and in forked loader workers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from capture_format.errors import CaptureFormatError, ChecksumError, FrameError, ShardError
from capture_format.frames import decode_frame, parse_frame_prefix
from capture_format.records import CaptureRecord
from capture_format.shard_index import IndexEntry, ShardIndex, list_shard_files, load_index

__all__ = ["ShardDirectory", "VerifyReport", "verify_shard"]


def _read_record(fd: int, entry: IndexEntry) -> CaptureRecord:
    where = f"{entry.shard_path} at offset {entry.offset}"
    data = os.pread(fd, entry.length, entry.offset)
    try:
        if len(data) != entry.length:
            raise FrameError(f"the shard ends {len(data)} bytes into this {entry.length}-byte record")
        prefix = parse_frame_prefix(data)
        if prefix.header_xxh3_64 != entry.header_xxh3_64:
            raise ChecksumError(
                f"frame header checksum {prefix.header_xxh3_64} differs from the index's {entry.header_xxh3_64}"
            )
        record = decode_frame(data)
        if record.record_id != entry.record_id:
            raise FrameError(f"frame holds record {record.record_id!r}; the index says {entry.record_id!r}")
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


class ShardDirectory:
    """The sealed shards of a directory and their indexes, loaded when it is opened."""

    def __init__(self, path: Path | str) -> None:
        """Loads every sealed shard's index; ShardError if one is missing, malformed or wrong-sized."""
        self.path = Path(path)
        files = list_shard_files(self.path)
        self.shards: tuple[ShardIndex, ...] = tuple(_load_checked_index(shard) for _, shard in files.sealed)
        self.open_shard_paths: tuple[Path, ...] = tuple(shard for _, shard in files.open)
        """Shards still being written (or awaiting recovery): not readable through an index."""
        self._fds: dict[Path, int] = {}

    @property
    def num_records(self) -> int:
        return sum(shard.num_records for shard in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)

    def iter_index(self) -> Iterator[IndexEntry]:
        """Every index entry, shard by shard in name order, records in file order."""
        for shard in self.shards:
            yield from shard.entries

    def read_record(self, entry: IndexEntry) -> CaptureRecord:
        """Reads and fully verifies the record at entry (see the module docstring)."""
        fd = self._fds.get(entry.shard_path)
        if fd is None:
            opened_fd = os.open(entry.shard_path, os.O_RDONLY | os.O_CLOEXEC)
            # setdefault is atomic: of two threads opening the same shard, one keeps its descriptor.
            fd = self._fds.setdefault(entry.shard_path, opened_fd)
            if fd != opened_fd:
                os.close(opened_fd)
        return _read_record(fd, entry)

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
