"""Parts of captures sent in parts (`capture_format.parts`), kept durably until the record that closes them.

A part is acknowledged once it is durable in `<data_dir>/parts/<record id of its capture>/`: the frame as
received (`<index>.frame`), or, for a part whose block the shards already hold (the same tokens captured
before), a note of what was received (`<index>.stored`: its record id and header checksum). Nothing in that
folder is in a shard, so no reader sees it. When the closing record comes, `check_closing` finds every part
it names, computes the digest over what was received and checks the chain; the store then appends the parts
to the shards (those not stored yet), then the record, and removes the folder (`remove`).

What must hold:
- a part is written whole or not at all (temporary file, fsync, rename, fsync of the folder) before it is
  acknowledged; re-sending the same frame writes nothing; a different frame for the same index (another
  attempt at the request) replaces it, and the closing record's digest decides which attempt closes;
- a record closes only over exactly its `count` parts, each with the checksum its digest names, each
  referring to the one before it and the record to the last: else 409 naming what is missing or differs,
  nothing appended; a record whose parts were removed by the timeout gets `parts_expired` (counted and
  logged: its plugin was still sending when they expired), not `parts_missing`;
- the parts of a capture that is never closed (request aborted, server killed) are removed once no part of
  it came for `timeout_s`, counted, never appended; after a restart the same timeout runs from the later
  of the files' modification times and the collector's start, so the time it was down (when no plugin
  could reach it) never counts against a capture.
- all of one capture's part and closing work runs under that capture's lock, in arrival order, so a part
  and its closing record in one batch are handled part first. File I/O runs in threads, off the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture_format.frame_header import FrameInfo
from capture_format.frames import read_frame_header
from capture_format.parts import ClosingParts, PartsDigest
from capture_format.prefix_blocks import block_record_id
from capture_format.shard_index import fsync_directory
from collector_service.errors import ApiError

__all__ = ["CaptureParts", "StagedPart"]

PARTS_DIRECTORY = "parts"
_FRAME_SUFFIX = ".frame"
_STORED_SUFFIX = ".stored"
_MAX_EXPIRED_REMEMBERED = 1 << 16
"""Captures whose parts expired, remembered (oldest forgotten first) to name why their record is refused."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StagedPart:
    index: int
    record_id: str
    header_xxh3_64: str
    path: Path | None
    """The frame as received, or None when the shards held its block already on arrival."""
    nbytes: int


class CaptureParts:
    """The parts folder of one collector; see the module docstring."""

    def __init__(self, data_dir: Path, timeout_s: float) -> None:
        self.directory = data_dir / PARTS_DIRECTORY
        self.timeout_s = timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._holders: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self._open: set[str] = set()
        """Captures with parts kept here (filled from the folder by the first sweep, then kept up to date)."""
        self._expired: OrderedDict[str, None] = OrderedDict()
        """Captures this process removed parts of by the timeout, newest last, and not closed since."""
        self._started_s = time.time()
        """Parts left by an earlier run expire no sooner than timeout_s after this."""

    @asynccontextmanager
    async def lock(self, record_id: str) -> AsyncIterator[None]:
        """Serialises the work on one capture's parts (FIFO: asyncio.Lock wakes waiters in order)."""
        lock = self._locks.setdefault(record_id, asyncio.Lock())
        self._holders[record_id] += 1
        try:
            async with lock:
                yield
        finally:
            self._holders[record_id] -= 1
            if not self._holders[record_id]:
                del self._holders[record_id], self._locks[record_id]

    def stage(self, capture_id: str, index: int, info: FrameInfo, frame: memoryview | None) -> str:
        """Keeps a part durably: its frame, or (frame None: its block is stored) a note of what came.
        "stored" when something was written, "duplicate" when the same part was here already. In a thread."""
        folder = self.directory / capture_id
        name = f"{index:07d}"
        frame_path, note_path = folder / f"{name}{_FRAME_SUFFIX}", folder / f"{name}{_STORED_SUFFIX}"
        if frame_path.exists() and _frame_checksum(frame_path) == info.header_xxh3_64:
            return "duplicate"
        if note_path.exists() and _read_note(note_path)[1] == info.header_xxh3_64:
            return "duplicate"
        folder.mkdir(parents=True, exist_ok=True)
        self._open.add(capture_id)
        if frame is None:
            data = json.dumps({"record_id": info.record_id, "header_xxh3_64": info.header_xxh3_64}).encode()
            _write_durably(note_path, data)
            frame_path.unlink(missing_ok=True)
        else:
            _write_durably(frame_path, frame)
            note_path.unlink(missing_ok=True)
        fsync_directory(folder)
        self.counts["parts_staged"] += 1
        return "stored"

    def check_closing(self, info: FrameInfo, closing: ClosingParts) -> list[StagedPart]:
        """The parts the record closes, in order, after checking them against it (ApiError 409). In a thread."""
        record_id = info.record_id
        folder = self.directory / record_id
        staged = _list_staged(folder) if folder.is_dir() else {}
        missing = [index for index in range(closing.count) if index not in staged]
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
            if record_id in self._expired:
                self.counts["records_refused_parts_expired"] += 1
                log.warning("refused record %s: its parts %s expired (no part came for %.0f s) while its plugin "
                            "was still sending; raise --part-timeout-s", record_id, shown, self.timeout_s)
                raise ApiError(409, "parts_expired", f"record {record_id} closes {closing.count} parts; parts {shown} "
                               f"were removed after the part timeout ({self.timeout_s:g} s without a part of this "
                               "capture) before the record came: raise the collector's --part-timeout-s")
            raise ApiError(409, "parts_missing", f"record {record_id} closes {closing.count} parts; parts {shown} "
                           "were never received: send the capture again")
        parts = [staged[index] for index in range(closing.count)]
        digest = PartsDigest()
        for part in parts:
            digest.update(part.record_id, part.header_xxh3_64)
        if digest.hexdigest() != closing.digest:
            raise ApiError(409, "parts_differ", f"record {record_id}: the {closing.count} parts received hash to "
                           f"{digest.hexdigest()}, the record says {closing.digest}: parts of another attempt at "
                           "this request; send the capture again")
        last = info.states_prefix
        if last is None or block_record_id(last.key) != parts[-1].record_id:
            raise ApiError(409, "parts_differ", f"record {record_id} does not refer to its last part "
                           f"{parts[-1].record_id}")
        for before, part in zip(parts, parts[1:]):
            if part.path is not None:
                reference = _read_header(part.path).states_prefix
                if reference is None or block_record_id(reference.key) != before.record_id:
                    raise ApiError(409, "parts_differ", f"record {record_id}: part {part.index} does not refer "
                                   f"to part {before.index}")
        return parts

    def remove(self, record_id: str) -> None:
        """Drops a closed capture's folder. In a thread."""
        shutil.rmtree(self.directory / record_id, ignore_errors=True)
        self._open.discard(record_id)
        self._expired.pop(record_id, None)
        self.counts["captures_closed"] += 1

    def sweep(self, now_s: float | None = None) -> None:
        """Removes the parts of captures no part of which came within timeout_s. In a thread."""
        now_s = time.time() if now_s is None else now_s
        if not self.directory.is_dir():
            return
        for folder in self.directory.iterdir():
            self._open.add(folder.name)
            if folder.name in self._locks:
                continue  # being staged or closed now
            files = [entry.stat() for entry in os.scandir(folder)] if folder.is_dir() else []
            newest = max((stat.st_mtime for stat in files), default=folder.stat().st_mtime)
            if now_s - max(newest, self._started_s) < self.timeout_s:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            self._open.discard(folder.name)
            self._expired[folder.name] = None
            self._expired.move_to_end(folder.name)
            if len(self._expired) > _MAX_EXPIRED_REMEMBERED:
                self._expired.popitem(last=False)
            self.counts["captures_expired"] += 1
            self.counts["parts_expired"] += len(files)
            self.counts["bytes_expired"] += sum(stat.st_size for stat in files)

    def stats(self) -> dict[str, Any]:
        """Counts kept in memory: no disk I/O (the event loop calls it)."""
        counts = {key: self.counts[key] for key in
                  ("parts_staged", "captures_closed", "captures_expired", "parts_expired", "bytes_expired",
                   "records_refused_parts_expired")}
        return {"open_captures": len(self._open), "timeout_s": self.timeout_s, **counts}


def _write_durably(path: Path, data: bytes | memoryview) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _read_header(path: Path) -> FrameInfo:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_frame_header(fd, 0)[1]
    finally:
        os.close(fd)


def _frame_checksum(path: Path) -> str | None:
    try:
        return _read_header(path).header_xxh3_64
    except (OSError, ValueError):
        return None  # unreadable: replaced by the part received now


def _read_note(path: Path) -> tuple[str, str]:
    note = json.loads(path.read_bytes())
    return note["record_id"], note["header_xxh3_64"]


def _list_staged(folder: Path) -> dict[int, StagedPart]:
    staged = {}
    for entry in os.scandir(folder):
        stem, _, suffix = entry.name.partition(".")
        if not stem.isdigit() or f".{suffix}" not in (_FRAME_SUFFIX, _STORED_SUFFIX):
            continue  # a temporary file of a write that did not finish
        path = Path(entry.path)
        try:
            if f".{suffix}" == _FRAME_SUFFIX:
                info = _read_header(path)
                part = StagedPart(int(stem), info.record_id, info.header_xxh3_64, path, info.frame_nbytes)
            else:
                record_id, checksum = _read_note(path)
                part = StagedPart(int(stem), record_id, checksum, None, 0)
        except (OSError, ValueError, KeyError):
            continue  # damaged on disk: as if never received
        staged[part.index] = part
    return staged
