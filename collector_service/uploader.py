"""Uploading sealed shards to an object store (`--upload-to s3://bucket/prefix`), off the ingest path.

One thread owns the uploads of one data directory. A shard `shard-000007.etap` of collector `c0ffee`
becomes the objects `shard-c0ffee-000007.etap` and `shard-c0ffee-000007.index.json` (the index's
`shard` field names the object), so collectors sharing a prefix never write the same name.

What must hold:
- a shard is removed here only after its upload was checked: the object read back is exactly the
  local file (size and xxh3-128) and every frame in it passes the ingest check (inspect_frame) with
  the header checksum and record id its index lists; then its index is put and read back equal.
  The index goes last, so readers of the prefix never see an index whose shard is not complete;
- then the index is written to `uploaded/` here (atomically; it keeps the record ids for dedupe and
  the shard number taken), and only after that the shard and its index leave the data directory
  (kept with keep_local);
- a failed upload leaves the shard here and is retried with exponential backoff (with jitter), for
  as long as it takes; a shard that fails its own checks here (its index does not load, or its bytes do
  not match it frame by frame, checked before anything is put) is not uploaded nor retried, and is named
  with the reason in stats (`refused`, in /v1/stats), which points at `eagle-tap shards repair`;
- a restart finds every sealed shard without an `uploaded/` index and uploads it again; an object
  already in the store that checks out is not put again, one that does not (a partial or foreign
  object) is replaced. Object names depend only on the collector id and shard number, so a re-upload
  overwrites, never duplicates;
- ingest never waits for an upload: the store hands sealed shards over and returns. On shutdown the
  shards not tried yet get up to upload_drain_s; a failing store does not hold the shutdown up.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import xxhash

from capture_format import CaptureFormatError, ShardError, inspect_frame, load_index
from capture_format.files import write_file_atomically
from capture_format.object_store import ObjectLocation, s3_filesystem
from capture_format.shard_index import (
    INDEX_SUFFIX,
    SEALED_SUFFIX,
    UPLOADED_DIR_NAME,
    ShardIndex,
    check_collector_id,
    format_index,
    fsync_directory,
    index_path_for,
    list_shard_files,
    parse_shard_file_name,
    shard_file_name,
)

__all__ = ["COLLECTOR_ID_FILE", "UploadError", "Uploader", "finish_uploaded", "pending_uploads",
           "resolve_collector_id"]

log = logging.getLogger(__name__)

COLLECTOR_ID_FILE = "collector-id"
"""File in the data directory that keeps the collector id its shards were uploaded under."""
_READ_BLOCK_NBYTES = 8 << 20


class UploadError(Exception):
    """An upload that did not check out; the shard stays local and is tried again."""


def resolve_collector_id(data_dir: Path, configured: str | None) -> str:
    """The id this data directory's shards are uploaded under: kept in data_dir/collector-id, written on first
    use (configured, or a random 12-hex-digit id). A configured id that differs from the kept one is refused:
    shards half-uploaded under the old name would be uploaded again under the new one."""
    path = data_dir / COLLECTOR_ID_FILE
    try:
        kept = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        kept = None
    if kept is not None:
        check_collector_id(kept)
        if configured is not None and configured != kept:
            raise ValueError(f"{data_dir} was uploaded as collector {kept!r} ({path}); got collector_id "
                             f"{configured!r}. Use {kept!r}, or a new data folder for a new id")
        return kept
    collector_id = check_collector_id(configured) if configured is not None else secrets.token_hex(6)
    data_dir.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, collector_id + "\n")
    return collector_id


def finish_uploaded(data_dir: Path, keep_local: bool) -> None:
    """Removes the local copies of shards already verified in the store (a crash can leave them between the
    `uploaded/` index and the removal); run before the catalog is built."""
    uploaded = data_dir / UPLOADED_DIR_NAME
    if keep_local or not uploaded.is_dir():
        return
    removed = False
    for _, index_path in list_shard_files(uploaded).indexes:
        shard_path = data_dir / (index_path.name[: -len(INDEX_SUFFIX)] + SEALED_SUFFIX)
        for path in (shard_path, index_path_for(shard_path)):
            if path.exists():
                path.unlink()
                removed = True
    if removed:
        fsync_directory(data_dir)


def pending_uploads(data_dir: Path) -> list[Path]:
    """Sealed shards of data_dir not yet verified in the store, in number order."""
    uploaded = data_dir / UPLOADED_DIR_NAME
    done = {path.name for _, path in list_shard_files(uploaded).indexes} if uploaded.is_dir() else set()
    return [path for _, path in list_shard_files(data_dir).sealed if index_path_for(path).name not in done]


def _check_frames(file: Any, index: ShardIndex) -> tuple[list[str], str, int]:
    """(problems, xxh3-128, bytes read) of the shard bytes read from file, checked against index: every frame
    passes inspect_frame with the header checksum and record id its index lists."""
    problems: list[str] = []
    digest = xxhash.xxh3_128()
    num_read = 0
    for entry in index.entries:
        data = file.read(entry.length)
        digest.update(data)
        num_read += len(data)
        try:
            if len(data) != entry.length:
                raise ShardError(f"the shard ends {len(data)} bytes into this {entry.length}-byte frame")
            info = inspect_frame(data)
            if info.header_xxh3_64 != entry.header_xxh3_64 or info.record_id != entry.record_id:
                raise ShardError(f"frame holds {info.record_id!r} with header checksum {info.header_xxh3_64}; the "
                                 f"index lists {entry.record_id!r} with {entry.header_xxh3_64}")
        except CaptureFormatError as err:
            problems.append(f"record {entry.record_id!r} at offset {entry.offset}: {err}")
            if len(data) != entry.length:
                break
    while block := file.read(_READ_BLOCK_NBYTES):
        digest.update(block)
        num_read += len(block)
    return problems, digest.hexdigest(), num_read


def check_local_shard(shard_path: Path, index: ShardIndex) -> str:
    """The xxh3-128 of the shard at shard_path; ShardError when it is not what its index describes (damaged
    here: uploading it would spread the damage, and its copy would never check out)."""
    with open(shard_path, "rb") as file:
        problems, local_xxh3_128, num_read = _check_frames(file, index)
    if num_read != index.shard_nbytes:
        problems.append(f"it is {num_read} bytes; its index says {index.shard_nbytes}")
    if problems:
        raise ShardError(f"{shard_path} does not match its index: {'; '.join(problems)}")
    return local_xxh3_128


def check_object(fs: Any, path: str, index: ShardIndex, local_xxh3_128: str) -> list[str]:
    """What is wrong with the object at path as a copy of the shard index describes (empty: it checks out)."""
    with fs.open(path, "rb", block_size=_READ_BLOCK_NBYTES, cache_type="readahead") as file:
        problems, object_xxh3_128, num_read = _check_frames(file, index)
    if num_read != index.shard_nbytes:
        problems.append(f"the object is {num_read} bytes; the shard is {index.shard_nbytes}")
    elif object_xxh3_128 != local_xxh3_128:
        problems.append(f"the object hashes to {object_xxh3_128}; the local shard to {local_xxh3_128}")
    return problems


@dataclass(slots=True)
class _Pending:
    shard_path: Path
    num_attempts: int = 0
    not_before: float = 0.0


class Uploader:
    """Uploads the sealed shards handed to `submit` (and those found pending at start) in a thread of its own."""

    def __init__(self, data_dir: Path, target: ObjectLocation, collector_id: str, *, keep_local: bool,
                 retry_initial_s: float, retry_max_s: float) -> None:
        self.data_dir = data_dir
        self.target = target
        self.collector_id = check_collector_id(collector_id)
        self.keep_local = keep_local
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self._condition = threading.Condition()
        self._pending: deque[_Pending] = deque(_Pending(path) for path in pending_uploads(data_dir))
        self._stop_at: float | None = None
        """Set by stop: the monotonic time after which no upload starts."""
        self._refused: dict[str, str] = {}
        self._uploading: Path | None = None
        """The shard being uploaded now (counted as pending until it is done)."""
        self._fs: Any = None
        self.num_uploaded = 0
        self.num_uploaded_nbytes = 0
        self.num_failed_attempts = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="collector-uploader", daemon=True)

    def start(self) -> None:
        if self._pending:
            log.info("%d sealed shards of %s wait for their upload to %s", len(self._pending), self.data_dir,
                     self.target.url)
        self._thread.start()

    def submit(self, shard_path: Path) -> None:
        """Queues a sealed shard; returns at once."""
        with self._condition:
            self._pending.append(_Pending(shard_path))
            self._condition.notify()

    def stop(self, drain_s: float) -> None:
        """Uploads go on for at most drain_s (what is left is uploaded at the next start); join() waits."""
        with self._condition:
            self._stop_at = time.monotonic() + drain_s
            self._condition.notify()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def object_name(self, shard_path: Path) -> str:
        number, _ = parse_shard_file_name(shard_path.name)
        return shard_file_name(number, SEALED_SUFFIX, self.collector_id)

    def stats(self) -> dict[str, Any]:
        with self._condition:
            pending = [item.shard_path.name for item in self._pending]
            if self._uploading is not None:
                pending.insert(0, self._uploading.name)
        return {
            "upload_to": self.target.url,
            "collector_id": self.collector_id,
            "num_uploaded": self.num_uploaded,
            "num_uploaded_nbytes": self.num_uploaded_nbytes,
            "num_pending": len(pending),
            "pending": pending[:20],
            "num_failed_attempts": self.num_failed_attempts,
            "last_error": self.last_error,
            "refused": dict(self._refused),
        }

    def _next(self) -> _Pending | None:
        """The next shard whose backoff has passed, waiting for one. Once stopping, only shards not tried yet are
        (a store that fails does not hold up the shutdown); None when there is none or the drain time is over."""
        with self._condition:
            while True:
                now = time.monotonic()
                if self._stop_at is not None:
                    untried = next((item for item in self._pending if item.num_attempts == 0), None)
                    if untried is None or now >= self._stop_at:
                        return None
                    self._pending.remove(untried)
                    self._uploading = untried.shard_path
                    return untried
                due = next((item for item in self._pending if item.not_before <= now), None)
                if due is not None:
                    self._pending.remove(due)
                    self._uploading = due.shard_path
                    return due
                wake_at = min((item.not_before for item in self._pending), default=None)
                self._condition.wait(None if wake_at is None else max(0.0, wake_at - now))

    def _run(self) -> None:
        while (item := self._next()) is not None:
            try:
                self._upload(item.shard_path)
            except ShardError as err:  # the local shard itself is damaged: uploading it would spread the damage
                self._refused[item.shard_path.name] = (f"{err}; not uploaded, not retried: stop the collector and run "
                                                        f"`eagle-tap shards repair {self.data_dir}`")
                log.error("not uploading %s: %s (`eagle-tap shards repair` rebuilds its index)", item.shard_path, err)
            except Exception as err:  # the store failed or the copy did not check out: try again later
                item.num_attempts += 1
                self.num_failed_attempts += 1
                self.last_error = f"{item.shard_path.name}: {type(err).__name__}: {err}"
                delay_s = min(self.retry_max_s, self.retry_initial_s * 2 ** (item.num_attempts - 1))
                delay_s *= random.uniform(0.5, 1.0)  # collectors that failed together do not retry together
                item.not_before = time.monotonic() + delay_s
                log.warning("uploading %s failed (attempt %d): %s; retrying in %.1f s", item.shard_path.name,
                            item.num_attempts, self.last_error, delay_s)
                self._fs = None  # a fresh client: the old one may hold broken connections
                with self._condition:
                    self._pending.appendleft(item)
            finally:
                with self._condition:
                    self._uploading = None

    def _upload(self, shard_path: Path) -> None:
        if self._fs is None:
            self._fs = s3_filesystem()
        fs = self._fs
        index = load_index(shard_path)
        if shard_path.stat().st_size != index.shard_nbytes:
            raise ShardError(f"{shard_path} is {shard_path.stat().st_size} bytes; its index says {index.shard_nbytes}")
        local_xxh3_128 = check_local_shard(shard_path, index)
        name = self.object_name(shard_path)
        object_path = self.target.path(name)
        existing = _object_size(fs, object_path)
        if existing != index.shard_nbytes or check_object(fs, object_path, index, local_xxh3_128):
            fs.put_file(str(shard_path), object_path)
            problems = check_object(fs, object_path, index, local_xxh3_128)
            if problems:
                raise UploadError(f"{self.target.url_of(name)} does not match {shard_path.name}: {'; '.join(problems)}")
        index_text = format_index(replace(index, shard_path=PurePosixPath(name))).encode()
        index_path = self.target.path(name[: -len(SEALED_SUFFIX)] + INDEX_SUFFIX)
        fs.pipe_file(index_path, index_text)
        if fs.cat_file(index_path) != index_text:
            raise UploadError(f"{self.target.url_of(name)}: the index read back differs from the one put")
        uploaded = self.data_dir / UPLOADED_DIR_NAME
        uploaded.mkdir(exist_ok=True)
        write_file_atomically(uploaded / index_path_for(shard_path).name, format_index(index))
        fsync_directory(self.data_dir)
        if not self.keep_local:
            shard_path.unlink()
            index_path_for(shard_path).unlink()
            fsync_directory(self.data_dir)
        self.num_uploaded += 1
        self.num_uploaded_nbytes += index.shard_nbytes
        self.last_error = None
        log.info("uploaded %s to %s (%d records, %d bytes)%s", shard_path.name, self.target.url_of(name),
                 index.num_records, index.shard_nbytes, "" if self.keep_local else "; removed here")


def _object_size(fs: Any, path: str) -> int | None:
    try:
        return int(fs.info(path)["size"])
    except FileNotFoundError:
        return None
