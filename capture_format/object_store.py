"""Shards in an S3-compatible object store: locations, the client, and a bounded local cache of records.

fsspec and s3fs load only when an `s3://` location is used (`pip install 'eagle-tap[s3]'`), so the base
install keeps its three dependencies.

Where the store is, who we are and the readers' cache come from the environment (ENVIRONMENT below,
also in docs/settings.md); credentials are read as every AWS client reads them.

What must hold for the cache:
- a file in it is a whole frame as the store returned it (written to a temp name, then renamed), and a
  frame read from it is checked like any other (a damaged file is dropped and fetched again);
- it holds at most max_bytes, plus at most an eighth of max_bytes per process that shares it (ranks and
  loader workers of one machine share one folder): each process evicts least recently used files first
  (use time is the file's mtime, set on every hit), rescanning the folder after every eighth it wrote;
- it counts frames, not records: a long record stored as a chain of parts (`prefix_blocks.py`) is one
  file per part, each kept or evicted alone; a frame larger than max_bytes is not kept at all (keeping
  it would evict everything else), its reader reads it uncached.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture_format.errors import ShardError, describe

__all__ = ["ObjectLocation", "RecordCache", "is_remote", "parse_location", "s3_filesystem"]

ENDPOINT_ENV = "EAGLE_TAP_S3_ENDPOINT_URL"
CACHE_DIR_ENV = "EAGLE_TAP_CACHE_DIR"
CACHE_MAX_BYTES_ENV = "EAGLE_TAP_CACHE_MAX_BYTES"
DEFAULT_CACHE_MAX_BYTES = 8 << 30
ENVIRONMENT: tuple[tuple[str, str, str], ...] = (
    (ENDPOINT_ENV, "unset", "Endpoint of an S3-compatible store (MinIO, Ceph, moto, ...); unset: botocore's own "
     "AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS."),
    ("AWS_ACCESS_KEY_ID", "unset", "Credentials, region and profile as every AWS client reads them (also "
     "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, AWS_DEFAULT_REGION, an instance role)."),
    (CACHE_DIR_ENV, "~/.cache/eagle-tap/records", "Readers of s3:// shards keep fetched records here "
     "($XDG_CACHE_HOME/eagle-tap/records when set); a training config's data.cache_dir wins."),
    (CACHE_MAX_BYTES_ENV, "8 GiB", "Bytes the record cache may hold; least recently used records go first; a "
     "training config's data.cache_max_bytes wins."),
)
"""(variable, default, meaning) of the environment the collector's uploads and every s3:// reader read."""
ENVIRONMENT_VARIABLES = (ENDPOINT_ENV, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                         "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", CACHE_DIR_ENV,
                         CACHE_MAX_BYTES_ENV)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", re.ASCII)


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for an object-store URL (s3://...), False for a local folder."""
    return isinstance(location, str) and location.startswith("s3://")


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """A bucket and a prefix in it (no leading or trailing '/'; empty for the bucket's root)."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def path(self, name: str = "") -> str:
        """The s3fs path of name under the prefix (the prefix itself for "")."""
        return "/".join(part for part in (self.bucket, self.prefix, name) if part)

    def url_of(self, name: str) -> str:
        return f"s3://{self.path(name)}"


def parse_location(url: str) -> ObjectLocation:
    """s3://bucket[/prefix] -> ObjectLocation; ValueError says what is wrong with it."""
    if not is_remote(url):
        raise ValueError(f"{describe(url)} is not an object-store location; expected s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if _BUCKET.fullmatch(bucket) is None:
        raise ValueError(f"{describe(url)}: {describe(bucket)} is not a bucket name (3-63 of a-z, 0-9, '.', '-')")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"{describe(url)}: the prefix must not hold empty, '.' or '..' parts")
    return ObjectLocation(bucket, prefix)


def s3_filesystem() -> Any:
    """A new s3fs filesystem for the environment's endpoint and credentials (ENVIRONMENT).

    Not shared with other callers (fsspec would hand every caller one cached instance, which a forked
    loader worker must not reuse) and without a listing cache (listings must show new uploads)."""
    try:
        import s3fs
    except ImportError:
        raise ValueError("reading or writing s3:// locations needs s3fs: pip install 'eagle-tap[s3]'") from None
    endpoint_url = os.environ.get(ENDPOINT_ENV) or None
    fs = s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": endpoint_url} if endpoint_url else {},
        # A store that does not answer fails an attempt in seconds; callers retry with their own backoff.
        config_kwargs={"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2, "mode": "standard"}},
        use_listings_cache=False,
        skip_instance_cache=True,
    )
    fs.retries = 2  # s3fs's own retries of a failed call, on top of botocore's
    return fs


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle-tap" / "records"


class RecordCache:
    """Frames fetched from the object store, as files in one folder, least recently used evicted first."""

    def __init__(self, directory: Path | str | None = None, max_bytes: int | None = None) -> None:
        """directory and max_bytes default to EAGLE_TAP_CACHE_DIR and EAGLE_TAP_CACHE_MAX_BYTES (ENVIRONMENT)."""
        if max_bytes is None:
            text = os.environ.get(CACHE_MAX_BYTES_ENV)
            try:
                max_bytes = DEFAULT_CACHE_MAX_BYTES if text is None else int(text)
            except ValueError:
                raise ValueError(f"{CACHE_MAX_BYTES_ENV}={text!r} is not a number of bytes") from None
        if max_bytes < 1:
            raise ValueError(f"the record cache needs at least 1 byte; got max_bytes {max_bytes}")
        self.directory = Path(directory or os.environ.get(CACHE_DIR_ENV) or _default_cache_dir())
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        """File name -> bytes, least recently used first (this process's view of the folder)."""
        self._num_bytes = 0
        self._written_since_scan = 0
        self.num_hits = self.num_misses = self.num_evicted = 0
        self._scan()

    @staticmethod
    def key(url: str, offset: int, length: int, header_xxh3_64: str) -> str:
        """The cache file name of one frame: which object, where in it, and the frame's header checksum."""
        digest = hashlib.blake2b(url.encode(), digest_size=10).hexdigest()
        return f"{digest}-{offset}-{length}-{header_xxh3_64}.frame"

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def _scan(self) -> None:
        files = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".frame"):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another process evicted it just now
                    continue
                files.append((stat.st_mtime_ns, entry.name, stat.st_size))
        files.sort()
        self._sizes = OrderedDict((name, size) for _, name, size in files)
        self._num_bytes = sum(self._sizes.values())
        self._written_since_scan = 0

    def get(self, key: str) -> bytes | None:
        path = self.directory / key
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            with self._lock:
                self.num_misses += 1
                if key in self._sizes:
                    self._num_bytes -= self._sizes.pop(key)
            return None
        with self._lock:
            self.num_hits += 1
            if key in self._sizes:
                self._sizes.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> None:
        """Keeps data under key, evicting least recently used files past max_bytes; data larger than max_bytes
        is not kept (a copy already under key is dropped)."""
        if len(data) > self.max_bytes:
            self.discard(key)
            return
        path = self.directory / key
        temp_path = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            temp_path.write_bytes(data)
            os.replace(temp_path, path)
        except OSError:
            temp_path.unlink(missing_ok=True)
            raise
        with self._lock:
            self._num_bytes += len(data) - self._sizes.pop(key, 0)
            self._sizes[key] = len(data)
            self._written_since_scan += len(data)
            if self._written_since_scan > self.max_bytes // 8:
                self._scan()
            while self._num_bytes > self.max_bytes and self._sizes:
                name, size = self._sizes.popitem(last=False)
                (self.directory / name).unlink(missing_ok=True)
                self._num_bytes -= size
                self.num_evicted += 1

    def discard(self, key: str) -> None:
        (self.directory / key).unlink(missing_ok=True)
        with self._lock:
            if key in self._sizes:
                self._num_bytes -= self._sizes.pop(key)


def object_error(url: str, err: BaseException) -> ShardError:
    """A ShardError for a failed object-store call that says which object and what the store answered."""
    return ShardError(f"{url}: {type(err).__name__}: {err}")
