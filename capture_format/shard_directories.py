"""One way to open sealed shards wherever they are: a local folder or an s3://bucket/prefix.

The factory lives apart from both readers so that neither imports the other's module for it:
`shard_reader` (local) is the base, `remote_shards` builds on it, and this module on both.
"""

from __future__ import annotations

import os

from capture_format.object_store import RecordCache, is_remote
from capture_format.remote_shards import RemoteShardDirectory
from capture_format.shard_reader import ShardDirectory

__all__ = ["open_shard_directory"]


def open_shard_directory(location: str | os.PathLike[str], *, skip_damaged: bool = False,
                         cache: RecordCache | None = None) -> ShardDirectory | RemoteShardDirectory:
    """The sealed shards of a local folder or of an s3://bucket/prefix (capture_format.remote_shards),
    read alike: `shards`, `damaged`, `iter_index`, `read_record`, `read_window`, `read_layout`,
    `read_token_ids`, `prefetch`."""
    if is_remote(location):
        return RemoteShardDirectory(str(location), skip_damaged=skip_damaged, cache=cache)
    return ShardDirectory(location, skip_damaged=skip_damaged)
