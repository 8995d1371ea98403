"""Reading sealed shards from an object-store prefix (s3://bucket/prefix), as ShardDirectory reads a folder.

A prefix holds what collectors uploaded: `shard-<collector id>-NNNNNN.etap` objects and their
`.index.json` objects (older names without an id are read too). A collector puts a shard, checks it,
and only then puts its index, so:
- a shard with an index is readable; its object must be exactly the index's shard_nbytes, else it is
  damaged (a partial or foreign object) and never read;
- a shard without an index is still being uploaded (or its collector died mid-upload and will put it
  again): listed in `open_shard_paths`, not read;
- an index without its shard is damaged.

What must hold: a record comes back only after the same checks as a local read (check_record_bytes):
its bytes are exactly the indexed frame, checksums and header fields agree with the index. Each record
is fetched alone with a ranged GET, so a training rank fetches only the records it reads, and is kept in
a RecordCache; a cached copy that fails its checks is dropped (no reference to it kept) and fetched again
once, so reading a record holds one copy of it, never two. A window of a long record (`read_window`)
fetches the frames of its chain it overlaps, each alone into the cache, and only the start of the others
(header, and for the record's own frame its ids: FRAME_START_NBYTES in one ranged GET, more in a second).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import PurePosixPath
from types import TracebackType
from typing import Any, TypeVar

from capture_format.errors import CaptureFormatError, ShardError
from capture_format.object_store import ObjectLocation, RecordCache, object_error, parse_location, s3_filesystem
from capture_format.records import CaptureRecord
from capture_format.shard_index import (
    INDEX_SUFFIX,
    SEALED_SUFFIX,
    IndexEntry,
    ShardIndex,
    parse_index,
    parse_shard_file_name,
    shard_stem,
)
from capture_format.shard_reader import DamagedShard, IndexedShards, VerifyReport, check_record_bytes
from capture_format.token_ids import Pread, RecordTokens, read_token_ids_from_frame

__all__ = ["RemoteShardDirectory", "list_objects"]

T = TypeVar("T")

FETCH_CHUNK_NBYTES = 4 << 20
"""A frame larger than this is fetched in ranged GETs of this size (see RemoteShardDirectory._fetch)."""
FRAME_START_NBYTES = 64 << 10
"""Bytes of a frame one GET fetches to read its header (and ids) alone: a block's header is ~1 KB, a
record's ids 4 bytes a token."""
MAX_INDEX_NBYTES = 64 << 20
"""An index object larger than this is damaged and never fetched (an index takes some 300 bytes a record)."""
INDEX_BATCH_MAX_OBJECTS = 32
INDEX_BATCH_MAX_NBYTES = 256 << 20
"""Index objects are fetched concurrently in batches of at most so many objects and listed bytes (an object
over MAX_INDEX_NBYTES counts as nothing: it is not fetched)."""


def _index_batches(indexed: list[tuple[str, str]], objects: dict[str, int],
                   max_index_nbytes: int) -> Iterator[list[tuple[str, str]]]:
    """(shard, index object) pairs in order, in batches bounded by INDEX_BATCH_MAX_OBJECTS and _NBYTES."""
    batch: list[tuple[str, str]] = []
    batch_nbytes = 0
    for pair in indexed:
        nbytes = objects[pair[1]] if objects[pair[1]] <= max_index_nbytes else 0
        if batch and (len(batch) == INDEX_BATCH_MAX_OBJECTS or batch_nbytes + nbytes > INDEX_BATCH_MAX_NBYTES):
            yield batch
            batch, batch_nbytes = [], 0
        batch.append(pair)
        batch_nbytes += nbytes
    if batch:
        yield batch


def list_objects(fs: Any, location: ObjectLocation) -> dict[str, int]:
    """Object name -> size of the shard and index objects directly under location (sub-prefixes are not read)."""
    try:
        listing = fs.ls(location.path(), detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    except Exception as err:  # the store's own errors (no such bucket, access denied, unreachable)
        raise object_error(location.url, err) from None
    objects = {}
    for item in listing:
        name = item["name"].rsplit("/", 1)[-1]
        if item.get("type") == "file" and parse_shard_file_name(name) is not None:
            objects[name] = int(item["size"])
    return objects


class RemoteShardDirectory(IndexedShards):
    """The sealed shards under an s3:// prefix and their indexes, loaded when it is opened."""

    def __init__(self, url: str, *, skip_damaged: bool = False, cache: RecordCache | None = None,
                 max_index_nbytes: int | None = None) -> None:
        """Lists the prefix and loads every index (damaged shards raise ShardError, or with skip_damaged are
        listed in `damaged`); records are fetched when read, through cache (default: RecordCache()). An index
        object over max_index_nbytes (default MAX_INDEX_NBYTES) is damaged and not fetched."""
        self.location = parse_location(url)
        self.path = self.location.url
        self._cache = cache
        self._fs_pid = -1
        self._fs: Any = None
        max_index_nbytes = MAX_INDEX_NBYTES if max_index_nbytes is None else max_index_nbytes
        objects = list_objects(self.fs, self.location)
        if not objects:
            raise ShardError(f"{self.location.url} holds no shard objects (shard-*.etap and their .index.json): "
                             "is it the prefix the collector uploads to?")
        sealed = {shard_stem(name): name for name in sorted(objects) if parse_shard_file_name(name)[1] == SEALED_SUFFIX}
        indexes = {shard_stem(name): name for name in sorted(objects) if parse_shard_file_name(name)[1] == INDEX_SUFFIX}
        shards, damaged = [], []
        indexed = [(name, indexes[stem]) for stem, name in sealed.items() if stem in indexes]
        for batch in _index_batches(indexed, objects, max_index_nbytes):
            texts = self._fetch_indexes([(index_name, objects[index_name]) for _, index_name in batch],
                                        max_index_nbytes)
            for (name, index_name), text in zip(batch, texts):
                try:
                    shards.append(self._load_index(name, objects[name], text))
                except ShardError as err:
                    if not skip_damaged:
                        raise
                    damaged.append(DamagedShard(PurePosixPath(self.location.path(name)), f"{name}: {err}"))
            del texts  # one batch of index texts at a time
        for stem, index_name in indexes.items():
            if stem not in sealed:
                reason = f"{self.location.url_of(index_name)} is an index without a shard ({stem}{SEALED_SUFFIX} is gone)"
                if not skip_damaged:
                    raise ShardError(reason)
                damaged.append(DamagedShard(PurePosixPath(self.location.path(index_name)), reason))
        self.shards: tuple[ShardIndex, ...] = tuple(shards)
        self.damaged: tuple[DamagedShard, ...] = tuple(damaged)
        self.open_shard_paths: tuple[PurePosixPath, ...] = tuple(
            PurePosixPath(self.location.path(name)) for stem, name in sealed.items() if stem not in indexes)
        """Shards whose index is not in the store yet (an upload under way or to be redone): not read."""
        self.num_fetched_records = 0
        self.num_fetched_bytes = 0

    @property
    def fs(self) -> Any:
        """This process's filesystem: a forked loader worker makes its own (the parent's event loop is not its)."""
        if self._fs_pid != os.getpid():
            self._fs, self._fs_pid = s3_filesystem(), os.getpid()
        return self._fs

    @property
    def cache(self) -> RecordCache:
        if self._cache is None:
            self._cache = RecordCache()
        return self._cache

    def _fetch_indexes(self, objects: list[tuple[str, int]], max_index_nbytes: int) -> list[bytes | BaseException]:
        """The bytes of each (index object, listed size), fetched together with ranged GETs of exactly the
        listed size; an object over max_index_nbytes is not fetched (a ShardError in its place)."""
        texts: list[bytes | BaseException] = [
            ShardError(f"{self.location.url_of(name)} is {nbytes:,} bytes, over the {max_index_nbytes:,} an index "
                       "may be (remote_shards.MAX_INDEX_NBYTES): not read, the shard is damaged; "
                       "`eagle-tap shards repair` on the collector's copy rebuilds its index")
            if nbytes > max_index_nbytes else b"" for name, nbytes in objects]
        wanted = [position for position, (_, nbytes) in enumerate(objects) if 0 < nbytes <= max_index_nbytes]
        if not wanted:
            return texts
        try:
            fetched = self.fs.cat_ranges([self.location.path(objects[position][0]) for position in wanted],
                                         [0] * len(wanted), [objects[position][1] for position in wanted],
                                         on_error="return")
        except Exception as err:
            raise object_error(self.location.url, err) from None
        for position, data in zip(wanted, fetched):
            texts[position] = data
        return texts

    def _load_index(self, name: str, object_nbytes: int, text: bytes | BaseException | None) -> ShardIndex:
        index_url = self.location.url_of(shard_stem(name) + INDEX_SUFFIX)
        if isinstance(text, ShardError):
            raise text
        if not isinstance(text, bytes):
            raise ShardError(f"reading {index_url} failed: {text!r}")
        index = parse_index(text, PurePosixPath(self.location.path(name)), index_url)  # type: ignore[arg-type]
        if object_nbytes != index.shard_nbytes:
            raise ShardError(f"{self.location.url_of(name)} is {object_nbytes} bytes; its index says "
                             f"{index.shard_nbytes} (a partial or foreign object: the collector puts it again)")
        return index

    def url_of(self, entry: IndexEntry) -> str:
        return f"s3://{entry.shard_path}"

    def _shard_name(self, entry: IndexEntry) -> str:
        return self.url_of(entry)

    def _pread(self, entry: IndexEntry) -> Pread:
        """pread within entry's frame by ranged GETs: its first FRAME_START_NBYTES (prefix, header and most
        often its ids) in one GET on the first read, any read past them in one more."""
        start: list[bytes] = []

        def pread(nbytes: int, offset: int) -> bytes:
            if not start:
                start.append(self._fetch_range(entry, entry.offset, min(entry.length, FRAME_START_NBYTES)))
            begin = offset - entry.offset
            if begin + nbytes <= len(start[0]):
                return start[0][begin : begin + nbytes]
            return self._fetch_range(entry, offset, nbytes)

        return pread

    def _fetch_range(self, entry: IndexEntry, offset: int, nbytes: int) -> bytes:
        try:
            data = self.fs.cat_file(str(entry.shard_path), start=offset, end=offset + nbytes)
        except Exception as err:
            raise object_error(self.url_of(entry), err) from None
        self.num_fetched_bytes += len(data)
        return data

    def _key(self, entry: IndexEntry) -> str:
        return RecordCache.key(self.url_of(entry), entry.offset, entry.length, entry.header_xxh3_64)

    def prefetch(self, entries: Iterable[IndexEntry]) -> None:
        """Fetches the entries not in the cache, all at once (concurrent ranged GETs), into the cache.
        A failed fetch is left for read_record, which fetches again and reports the error."""
        missing = {self._key(entry): entry for entry in entries}
        missing = {key: entry for key, entry in missing.items() if not (self.cache.directory / key).exists()}
        if not missing:
            return
        entries = list(missing.values())
        try:
            fetched = self.fs.cat_ranges([str(entry.shard_path) for entry in entries],
                                         [entry.offset for entry in entries],
                                         [entry.offset + entry.length for entry in entries], on_error="return")
        except Exception:  # left for read_record
            return
        for key, data in zip(missing, fetched):
            if isinstance(data, bytes):
                self.cache.put(key, data)
                self.num_fetched_records += 1
                self.num_fetched_bytes += len(data)

    def _fetch(self, entry: IndexEntry) -> bytes:
        """entry's frame with ranged GETs of at most FETCH_CHUNK_NBYTES into one buffer: a whole-frame GET
        would briefly hold the frame twice (the client joins the body's chunks)."""
        path = str(entry.shard_path)
        try:
            if entry.length <= FETCH_CHUNK_NBYTES:
                data = self.fs.cat_file(path, start=entry.offset, end=entry.offset + entry.length)
            else:
                data = bytearray(entry.length)
                num_read = 0
                while num_read < entry.length:
                    start = entry.offset + num_read
                    chunk = self.fs.cat_file(path, start=start, end=min(start + FETCH_CHUNK_NBYTES,
                                                                        entry.offset + entry.length))
                    if not chunk:  # the object ends early: check_record_bytes names the short frame
                        del data[num_read:]
                        break
                    data[num_read : num_read + len(chunk)] = chunk
                    num_read += len(chunk)
                    del chunk
        except Exception as err:
            raise object_error(self.url_of(entry), err) from None
        self.num_fetched_records += 1
        self.num_fetched_bytes += len(data)
        return data

    def read_frame(self, entry: IndexEntry, check: Callable[[bytes], T]) -> T:
        """check(frame bytes) on the cached copy of entry's frame, or on a fresh one if there is none or the
        cached one fails; a fresh frame that passes is cached (unless larger than the whole cache)."""
        key = self._key(entry)
        result = self._check_cached(key, check)
        if result is not None:
            return result[0]
        data = self._fetch(entry)
        result = check(data)
        self.cache.put(key, data)
        return result

    def _check_cached(self, key: str, check: Callable[[bytes], T]) -> tuple[T] | None:
        """(check(cached copy),), or None when there is none or it fails (then it is discarded). Its own
        frame, so that no reference to a damaged copy (a local, a traceback's frame) outlives it while
        the store's copy is fetched: a frame may be as large as a record gets."""
        cached = self.cache.get(key)
        if cached is None:
            return None
        try:
            return (check(cached),)
        except CaptureFormatError:
            self.cache.discard(key)  # damaged in the cache: the store's copy decides
            return None

    def read_stored_record(self, entry: IndexEntry) -> CaptureRecord:
        """Reads and fully verifies the record at entry as stored (see the module docstring)."""
        return self.read_frame(entry, lambda data: check_record_bytes(data, entry, self.url_of(entry)))

    def read_token_ids(self, entry: IndexEntry) -> RecordTokens:
        return self.read_frame(entry, lambda data: read_token_ids_from_frame(data, entry, self.url_of(entry)))

    def verify_shard(self, index: ShardIndex) -> VerifyReport:
        """Reads the whole shard object once (not through the cache) and checks every record against index."""
        url = f"s3://{index.shard_path}"
        problems = []
        num_verified = 0
        try:
            with self.fs.open(str(index.shard_path), "rb", block_size=8 << 20, cache_type="readahead") as file:
                for entry in index.entries:
                    try:
                        check_record_bytes(file.read(entry.length), entry, url)
                    except CaptureFormatError as err:
                        problems.append(str(err))
                    else:
                        num_verified += 1
                trailing = file.read(1)
                if trailing:
                    problems.append(f"{url} holds bytes past the {index.shard_nbytes} its index lists")
        except Exception as err:
            problems.append(str(object_error(url, err)))
        return VerifyReport(shard_path=index.shard_path, num_records=index.num_records,  # type: ignore[arg-type]
                            num_verified=num_verified, problems=tuple(problems))

    def close(self) -> None:
        pass

    def __enter__(self) -> RemoteShardDirectory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
