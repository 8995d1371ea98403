"""Writing shards: append frames as received, seal them with an index, recover after a crash.

What must hold:
- an open shard only ever ends at a frame boundary: a failed write is cut back, and if even that
  fails the writer refuses further appends and leaves the shard to recovery;
- after `flush()` returns, every frame appended before it survives a crash (the file's name was
  made durable when it was created, its data by fdatasync). Appends do not sync on their own, so
  many appends can share one flush (group commit is the caller's policy);
- sealing is: sync the shard, write its index atomically, rename .etap.open to .etap, sync the
  directory. A crash at any point leaves an open shard (recovered on start-up) or a sealed shard
  with its complete index;
- one process at a time writes an open shard: the writer and recovery hold an exclusive flock on it.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from capture_format.errors import CaptureFormatError, ShardError, describe_path
from capture_format.frame_header import FrameInfo
from capture_format.frames import (
    FRAME_PREFIX_NBYTES,
    encode_frame,
    inspect_frame,
    inspect_frame_header,
    read_frame_prefix,
)
from capture_format.records import CaptureRecord
from capture_format.shard_index import (
    OPEN_SUFFIX,
    QUARANTINE_DIR_NAME,
    SEALED_SUFFIX,
    UPLOADED_DIR_NAME,
    ShardIndex,
    build_index,
    fsync_directory,
    index_path_for,
    list_shard_files,
    parse_shard_file_name,
    shard_file_name,
    shard_stem,
    write_index,
)

__all__ = ["RecoveryReport", "ShardWriter", "recover_open_shard", "repair_shard", "write_shards"]


def _next_shard_number(directory: Path) -> int:
    numbers = []
    # A quarantined number stays taken, and so does an uploaded one: its name is already in the bucket.
    for folder in (Path(directory), Path(directory) / QUARANTINE_DIR_NAME, Path(directory) / UPLOADED_DIR_NAME):
        if folder.is_dir():
            files = list_shard_files(folder)
            numbers += [number for number, _ in files.sealed + files.open + files.indexes]
    return max(numbers, default=0) + 1


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ShardError(f"{path} is locked by another writer or recovery") from None


def _seal(open_path: Path, fd: int, frames: list[tuple[int, FrameInfo]], shard_nbytes: int) -> ShardIndex:
    """Syncs the open shard, writes its index, renames it to its sealed name and syncs the directory."""
    sealed_path = open_path.with_name(shard_stem(open_path.name) + SEALED_SUFFIX)
    os.fsync(fd)
    index = build_index(sealed_path, shard_nbytes, frames)
    write_index(index, index_path_for(sealed_path))
    os.rename(open_path, sealed_path)
    fsync_directory(open_path.parent)
    return index


class ShardWriter:
    """Appends inspected frames to a new open shard `shard-NNNNNN.etap.open` in directory.

    One thread appends and seals. flush may run in another thread while appends go on: it makes
    durable at least every frame whose append returned before flush was called.
    """

    def __init__(self, directory: Path | str, *, number: int | None = None) -> None:
        """Creates the open shard; number defaults to one past the highest shard number in directory."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.number = number if number is not None else _next_shard_number(self.directory)
        self.path = self.directory / shard_file_name(self.number, OPEN_SUFFIX)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _lock(self._fd, self.path)
            fsync_directory(self.directory)
        except BaseException:
            os.close(self._fd)
            raise
        self.opened_at = time.monotonic()
        """time.monotonic() when the shard was created: for age-based sealing."""
        self.bytes_written = 0
        self._frames: list[tuple[int, FrameInfo]] = []
        self._unusable_reason: str | None = None

    @property
    def num_records(self) -> int:
        return len(self._frames)

    def _check_usable(self) -> None:
        if self._unusable_reason is not None:
            raise ShardError(f"shard writer for {self.path} cannot write: {self._unusable_reason}")

    def append(self, frame: bytes | bytearray | memoryview, info: FrameInfo) -> int:
        """Writes frame, already checked by inspect_frame into info, and returns its offset."""
        self._check_usable()
        view = memoryview(frame).cast("B")
        if view.nbytes != info.frame_nbytes:
            raise ShardError(f"frame is {view.nbytes} bytes but its FrameInfo says {info.frame_nbytes}")
        offset = self.bytes_written
        try:
            position = offset
            while position < offset + view.nbytes:
                position += os.pwrite(self._fd, view[position - offset :], position)
        except OSError:
            # Cut the partial frame so later appends do not land after garbage, which recovery
            # would have to drop together with everything after it.
            try:
                os.ftruncate(self._fd, offset)
            except OSError:
                self._unusable_reason = f"a failed write at offset {offset} could not be cut back"
            raise
        self._frames.append((offset, info))
        self.bytes_written += view.nbytes
        return offset

    def flush(self, durable: bool = True) -> None:
        """Makes appended frames durable when durable is True (fdatasync).

        Appends go straight to the OS, so readers of the file see them without a flush either way.
        """
        self._check_usable()
        if durable:
            os.fdatasync(self._fd)

    def seal(self) -> ShardIndex:
        """Syncs, writes the index, renames the shard to its sealed name; the writer is done after."""
        self._check_usable()
        index = _seal(self.path, self._fd, self._frames, self.bytes_written)
        self.close()
        self.path = index.shard_path
        self._unusable_reason = "the shard is sealed"
        return index

    def close(self) -> None:
        """Closes the file without sealing: the open shard stays for recovery."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._unusable_reason = self._unusable_reason or "the writer is closed"


def write_shards(
    records: Iterable[CaptureRecord], directory: Path | str, *, records_per_shard: int, codec: str | None = None
) -> list[ShardIndex]:
    """Writes records into new sealed shards of up to records_per_shard records each, as the collector
    stores them (encode_frame, inspect_frame, append, seal): shards made offline, for tests and benchmarks."""
    if records_per_shard < 1:
        raise ValueError(f"records_per_shard must be at least 1; got {records_per_shard}")
    indexes: list[ShardIndex] = []
    writer: ShardWriter | None = None
    try:
        for record in records:
            if writer is None:
                writer = ShardWriter(directory)
            frame = encode_frame(record, codec)
            writer.append(frame, inspect_frame(frame))
            if writer.num_records == records_per_shard:
                indexes.append(writer.seal())
                writer = None
        if writer is not None:
            indexes.append(writer.seal())
            writer = None
    finally:
        if writer is not None:
            writer.close()
    return indexes


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryReport:
    """What recover_open_shard kept and cut."""

    open_path: Path
    sealed_path: Path | None
    """The sealed shard; None when no complete frame was found and the open shard was removed."""
    num_records: int
    bytes_kept: int
    bytes_cut: int
    stop_reason: str | None
    """Why the scan stopped before the end of the file; None when every byte was a valid frame."""
    dropped: tuple[str, ...] = ()
    """Frames left out of the index: damaged payload behind an intact header (their bytes stay, unindexed)."""


def _scan_frames(fd: int, file_nbytes: int) -> tuple[list[tuple[int, FrameInfo]], int, str | None, list[str]]:
    """Returns the valid frames, where the last one ends, why the scan stopped, and the frames stepped over.

    A frame whose header checks out but whose payload does not is stepped over (its length is known),
    so one bad frame does not cost the acknowledged frames behind it; a bad header ends the scan."""
    frames: list[tuple[int, FrameInfo]] = []
    dropped: list[str] = []
    offset = kept_end = 0
    while offset < file_nbytes:
        left = file_nbytes - offset
        try:
            frame_nbytes = read_frame_prefix(os.pread(fd, min(FRAME_PREFIX_NBYTES, left), offset))
            if frame_nbytes > left:
                return frames, kept_end, f"frame at offset {offset} needs {frame_nbytes} bytes; {left} are left", dropped
            data = os.pread(fd, frame_nbytes, offset)
            try:
                frames.append((offset, inspect_frame(data)))
            except CaptureFormatError as err:
                info = inspect_frame_header(data)  # raises (ending the scan) unless the header is intact
                dropped.append(f"record {info.record_id!r} at offset {offset}: {err}")
        except CaptureFormatError as err:
            return frames, kept_end, f"frame at offset {offset}: {err}", dropped
        offset += frame_nbytes
        kept_end = offset
    return frames, kept_end, None, dropped


def _compact(shard_path: Path, fd: int, frames: list[tuple[int, FrameInfo]]) -> tuple[int, list[tuple[int, FrameInfo]]]:
    """Rewrites the open shard with only `frames`, back to back (an index must tile its shard): a copy is
    written and synced beside it, then renamed over it, so a crash leaves the old file or the new one.
    Returns a locked descriptor of the new file and the frames at their new offsets."""
    temp_path = shard_path.with_name(f".{shard_path.name}.compacting")
    new_fd = os.open(temp_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    moved: list[tuple[int, FrameInfo]] = []
    try:
        _lock(new_fd, temp_path)
        offset = 0
        for old_offset, info in frames:
            os.pwrite(new_fd, os.pread(fd, info.frame_nbytes, old_offset), offset)
            moved.append((offset, info))
            offset += info.frame_nbytes
        os.fsync(new_fd)
        os.replace(temp_path, shard_path)
        fsync_directory(shard_path.parent)
    except BaseException:
        os.close(new_fd)
        temp_path.unlink(missing_ok=True)
        raise
    return new_fd, moved


@dataclass(slots=True)
class _Kept:
    fd: int
    """A locked descriptor of the shard as it is now (a new file after compaction)."""
    frames: list[tuple[int, FrameInfo]]
    kept_nbytes: int
    file_nbytes: int
    stop_reason: str | None
    dropped: list[str]

    def report(self, shard_path: Path, sealed_path: Path | None) -> RecoveryReport:
        return RecoveryReport(open_path=shard_path, sealed_path=sealed_path, num_records=len(self.frames),
                              bytes_kept=self.kept_nbytes, bytes_cut=self.file_nbytes - self.kept_nbytes,
                              stop_reason=self.stop_reason, dropped=tuple(self.dropped))


def _keep_valid_frames(shard_path: Path, suffix: str) -> _Kept:
    """Locks the shard, scans it and leaves only its valid frames in it (compacted or cut); see recovery."""
    parsed = parse_shard_file_name(shard_path.name)
    if parsed is None or parsed[1] != suffix:
        kind = "an open" if suffix == OPEN_SUFFIX else "a sealed"
        raise ShardError(f"{describe_path(shard_path)} is not {kind} shard name like shard-000001{suffix}")
    fd = os.open(shard_path, os.O_RDWR | os.O_CLOEXEC)
    try:
        _lock(fd, shard_path)
        file_nbytes = os.fstat(fd).st_size
        frames, kept_nbytes, stop_reason, dropped = _scan_frames(fd, file_nbytes)
        if dropped and frames:  # keep the good frames behind the dropped ones, back to back
            new_fd, frames = _compact(shard_path, fd, frames)
            os.close(fd)
            fd = new_fd
            kept_nbytes = sum(info.frame_nbytes for _, info in frames)
        elif kept_nbytes < file_nbytes:
            os.ftruncate(fd, kept_nbytes)
    except BaseException:
        os.close(fd)
        raise
    return _Kept(fd, frames, kept_nbytes, file_nbytes, stop_reason, dropped)


def recover_open_shard(path: Path | str) -> RecoveryReport:
    """Keeps the complete, valid frames of an open shard, cuts the rest and seals it.

    Frames are checked as on ingest (inspect_frame); one with an intact header and a damaged payload
    is left out of the index and the scan goes on behind it. An open shard with no valid frame is removed.
    """
    open_path = Path(path)
    kept = _keep_valid_frames(open_path, OPEN_SUFFIX)
    try:
        if kept.frames:
            sealed_path = _seal(open_path, kept.fd, kept.frames, kept.kept_nbytes).shard_path
        else:
            sealed_path = None
            os.unlink(open_path)
            fsync_directory(open_path.parent)
    finally:
        os.close(kept.fd)
    return kept.report(open_path, sealed_path)


def repair_shard(path: Path | str) -> RecoveryReport:
    """Rebuilds a sealed shard's index from the shard itself, keeping every frame that passes the ingest
    checks (a frame with a damaged payload behind an intact header is dropped, as in recovery; the file
    is cut at the first frame whose header is damaged). The shard keeps its name; no frame is rewritten
    unless one is dropped. For a shard whose index is lost, damaged, or disagrees with the file."""
    shard_path = Path(path)
    kept = _keep_valid_frames(shard_path, SEALED_SUFFIX)
    try:
        os.fsync(kept.fd)
        write_index(build_index(shard_path, kept.kept_nbytes, kept.frames), index_path_for(shard_path))
        fsync_directory(shard_path.parent)
    finally:
        os.close(kept.fd)
    return kept.report(shard_path, shard_path)
