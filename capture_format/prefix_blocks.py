"""Shared prefixes stored once: content-addressed prefix blocks, and the references records make to them.

Many requests a server sees start alike (a system prompt, the earlier turns of a chat). The states
of a token depend only on the tokens up to it, so the states of a shared prefix are the same in
every record that starts with it, and can be stored once.

Content key. `prefix_key(ids, namespace)` is 128 bits of BLAKE2b over a domain tag, the namespace of
the states (`states_namespace`: model fingerprint, capture layers, hidden size, dtype) and the token ids
as little-endian int32: it names exactly the states of that token sequence from that model, whatever
record they came from (two models capturing into one collector never share a block id).

Prefix blocks. The capture plugin cuts each captured sequence at multiples of a block size B
(`EAGLE_TAP_PREFIX_BLOCK_TOKENS`). The block ending at token b is an ordinary record with id
`prefix-<prefix_key(ids[:b])>` (`block_record_id`), no loss spans, metadata `{"kind": "prefix_block"}`,
token ids `ids[:b]`, and the states of tokens [a, b) only: its own first a tokens refer to the block
before it (`states_prefix`, a = b - B), or none for the first block. Two requests with the same first
b tokens make the same block, with the same id, so the collector stores it once (it deduplicates on
record ids) and the plugin, which remembers which blocks it already sent, sends it once.

References. A record (or block) whose first P tokens' states lie in the block ending at P says so with
`states_prefix = StatesPrefix(prefix_key(ids[:P]), P)` and holds the states of tokens P.. only.

Long records. A capture too long to decode whole (64K tokens at hidden size 7168 are gigabytes) is
stored the same way: a chain of blocks ("parts", metadata `{"kind": "prefix_block", "capture_part":
{"record_id": ..., "index": i}}`) and a closing record holding the last rows. Readers do not tell parts
from shared-prefix blocks.

The chain (`walk_chain`), which every reader follows before handing out a record or a window of one
(`resolve_prefix` joins every block's rows, `record_windows.py` only those a window needs). It works on
`ChainLink`s, what a frame header alone says of a frame, so it reads no states. What must hold:
- a reference is followed only if it is the content key of the referring record's own first P
  tokens (in its own namespace), and a block is used only if its record id is that key's, it holds P
  token ids, they are the record's first P ids (compared by their xxh3_64, which a frame header
  carries and every decode checks), it holds the states of exactly its own tokens, and it has the same
  model fingerprint, capture layers, hidden size and dtype: a resolved record is never wrong by
  accident, whatever the shards hold (on frame headers the checks hash the record's ids once: O(T)
  however long its chain);
- a block that is missing (never stored, in a shard not read, a damaged shard) or fails a check makes
  the referring record unreadable: `DanglingPrefixError`, which readers count and skip like any other
  unreadable record;
- blocks are never training samples: `is_prefix_block` tells them apart by their record id, which
  capture tags may not use (`capture_format.tag`).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from capture_format.errors import CaptureFormatError
from capture_format.frame_header import FrameInfo
from capture_format.records import TOKEN_ID_DTYPE, CaptureRecord, StatesPrefix

__all__ = [
    "BLOCK_KIND",
    "BLOCK_RECORD_PREFIX",
    "BlockCache",
    "ChainLink",
    "DanglingPrefixError",
    "block_record_id",
    "is_prefix_block",
    "prefix_key",
    "prefix_keys",
    "record_namespace",
    "resolve_prefix",
    "states_namespace",
    "walk_chain",
]

BLOCK_RECORD_PREFIX = "prefix-"
BLOCK_KIND = "prefix_block"
_KEY_DOMAIN = b"eagle-tap prefix states v1\0"


class DanglingPrefixError(CaptureFormatError):
    """A record refers to a shared prefix that cannot be read or does not match it: the record is skipped."""


def states_namespace(model_fingerprint: str, capture_layers: Sequence[int], hidden_size: int, dtype: str) -> str:
    """What, besides the token ids, decides the states a block holds."""
    return f"{model_fingerprint}\0{','.join(map(str, capture_layers))}\0{hidden_size}\0{dtype}"


def record_namespace(record: CaptureRecord) -> str:
    return states_namespace(record.model_fingerprint, record.capture_layers, record.hidden_size, record.dtype)


def prefix_keys(token_ids: Sequence[int] | np.ndarray, lengths: Sequence[int], namespace: str = "") -> list[str]:
    """`prefix_key(token_ids[:n], namespace)` for each n of lengths (increasing), hashing the ids once."""
    ids = np.ascontiguousarray(token_ids, dtype=TOKEN_ID_DTYPE)
    digest = hashlib.blake2b(_KEY_DOMAIN + namespace.encode("utf-8", "surrogatepass") + b"\0", digest_size=16)
    keys, done = [], 0
    for length in lengths:
        if not done <= length <= len(ids):
            raise ValueError(f"prefix lengths must increase within the {len(ids)} tokens; got {length} after {done}")
        digest.update(ids[done:length].tobytes())
        done = length
        keys.append(digest.copy().hexdigest())
    return keys


def prefix_key(token_ids: Sequence[int] | np.ndarray, namespace: str = "") -> str:
    """The content key of exactly these token ids in a namespace (32 hex digits)."""
    return prefix_keys(token_ids, [len(token_ids)], namespace)[0]


def block_record_id(key: str) -> str:
    return f"{BLOCK_RECORD_PREFIX}{key}"


def is_prefix_block(record_id: str) -> bool:
    """Whether a record id names a prefix block (stored states of a shared prefix, not a training sample)."""
    return record_id.startswith(BLOCK_RECORD_PREFIX)


class BlockCache:
    """Decoded prefix blocks, least recently used dropped past max_bytes: one system prompt's blocks are
    read once for the thousands of records that share them. It counts blocks, so a long record's parts
    come and go one by one; a block larger than max_bytes is not kept (it would evict all the rest).
    Thread-safe."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._blocks: collections.OrderedDict[str, CaptureRecord] = collections.OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def get(self, record_id: str) -> CaptureRecord | None:
        with self._lock:
            block = self._blocks.get(record_id)
            if block is not None:
                self._blocks.move_to_end(record_id)
            return block

    def put(self, block: CaptureRecord) -> None:
        with self._lock:
            if block.record_id in self._blocks or block.raw_nbytes > self.max_bytes:
                return
            self._blocks[block.record_id] = block
            self._nbytes += block.raw_nbytes
            while self._nbytes > self.max_bytes:
                _, dropped = self._blocks.popitem(last=False)
                self._nbytes -= dropped.raw_nbytes


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainLink:
    """What walking a chain needs of one record or block: all of it is in its frame header."""

    record_id: str
    num_tokens: int
    num_states: int
    """Rows the frame holds itself (past its shared prefix)."""
    states_prefix: StatesPrefix | None
    ids_xxh3_64: str
    """xxh3_64 of all its token ids as little-endian int32 (a frame header's token_ids raw_xxh3_64)."""
    model_fingerprint: str
    capture_layers: tuple[int, ...]
    hidden_size: int
    dtype: str

    @property
    def first_state_token(self) -> int:
        return self.states_prefix.num_tokens if self.states_prefix else 0

    @classmethod
    def of_record(cls, record: CaptureRecord) -> ChainLink:
        return cls(record_id=record.record_id, num_tokens=record.num_tokens, num_states=record.num_states,
                   states_prefix=record.states_prefix,
                   ids_xxh3_64=xxhash.xxh3_64_hexdigest(np.ascontiguousarray(record.token_ids)),
                   model_fingerprint=record.model_fingerprint, capture_layers=record.capture_layers,
                   hidden_size=record.hidden_size, dtype=record.dtype)

    @classmethod
    def of_frame(cls, info: FrameInfo) -> ChainLink:
        return cls(record_id=info.record_id, num_tokens=info.num_tokens, num_states=info.tensors[1].shape[0],
                   states_prefix=info.states_prefix, ids_xxh3_64=info.ids_xxh3_64,
                   model_fingerprint=info.model_fingerprint, capture_layers=info.capture_layers,
                   hidden_size=info.hidden_size, dtype=info.dtype)


def _ids_digests(token_ids: np.ndarray, lengths: Sequence[int]) -> list[str]:
    """xxh3_64 of token_ids[:n] for each n of lengths (increasing), hashing the ids once."""
    ids = np.ascontiguousarray(token_ids, dtype=TOKEN_ID_DTYPE)
    digest, digests, done = xxhash.xxh3_64(), [], 0
    for length in lengths:
        digest.update(ids[done:length].tobytes())
        done = length
        digests.append(digest.copy().hexdigest())
    return digests


def _where(record: ChainLink, reference: StatesPrefix) -> str:
    block_id = block_record_id(reference.key)
    return f"record {record.record_id}: its shared prefix of {reference.num_tokens} tokens ({block_id})"


def _check_link(block: ChainLink | None, reference: StatesPrefix, record: ChainLink) -> ChainLink:
    """The checks a block passes on its header alone; its ids and key are checked once the chain is known."""
    if block is None:
        raise DanglingPrefixError(f"{_where(record, reference)} is not in the shards read")
    if block.num_tokens != reference.num_tokens:
        raise DanglingPrefixError(f"{_where(record, reference)} holds other token ids ({block.num_tokens} tokens)")
    if block.num_states != block.num_tokens - block.first_state_token:
        raise DanglingPrefixError(f"{_where(record, reference)} lacks the state of its last token")
    for name in ("model_fingerprint", "capture_layers", "hidden_size", "dtype"):
        if getattr(block, name) != getattr(record, name):
            raise DanglingPrefixError(f"{_where(record, reference)} has {name} {getattr(block, name)!r}; the record "
                                      f"has {getattr(record, name)!r}")
    return block


def walk_chain(record: ChainLink, token_ids: np.ndarray,
               read_link: Callable[[str], ChainLink | None]) -> tuple[ChainLink, ...]:
    """The blocks holding the states of record's first tokens, from token 0 on, each checked (see the module
    docstring); () for a record without a shared prefix. token_ids: the record's [T], checked against its
    own checksum by whoever read them. read_link(record_id) returns the link of the stored block of that
    id, or None. Raises DanglingPrefixError."""
    references, blocks = [], []
    reference = record.states_prefix
    while reference is not None:  # num_tokens decreases strictly (records.py): the walk ends
        references.append(reference)
        blocks.append(_check_link(read_link(block_record_id(reference.key)), reference, record))
        reference = blocks[-1].states_prefix
    references.reverse()
    blocks.reverse()
    lengths = [reference.num_tokens for reference in references]
    keys = prefix_keys(token_ids, lengths, states_namespace(record.model_fingerprint, record.capture_layers,
                                                             record.hidden_size, record.dtype))
    for reference, block, key, digest in zip(references, blocks, keys, _ids_digests(token_ids, lengths)):
        if block.ids_xxh3_64 != digest:
            raise DanglingPrefixError(f"{_where(record, reference)} holds other token ids")
        # Every reference must be the key of the record's own first tokens.
        if reference.key != key:
            raise DanglingPrefixError(f"record {record.record_id}: the shared prefix key {reference.key} is not "
                                      f"the key of its first {reference.num_tokens} tokens")
    return tuple(blocks)


def resolve_prefix(record: CaptureRecord, read_block: Callable[[str], CaptureRecord | None]) -> CaptureRecord:
    """The record with the states of every token, its shared prefix's rows joined in front of its own.

    read_block(record_id) returns the stored block of that id (as stored: it may refer further back)
    or None. A record without a reference is returned as it is. Raises DanglingPrefixError."""
    if record.states_prefix is None:
        return record
    read: dict[str, CaptureRecord] = {}

    def read_link(record_id: str) -> ChainLink | None:
        block = read_block(record_id)
        if block is None:
            return None
        read[record_id] = block
        return ChainLink.of_record(block)

    chain = walk_chain(ChainLink.of_record(record), record.token_ids, read_link)
    blocks = [read[link.record_id] for link in chain]
    return CaptureRecord(
        record_id=record.record_id, sample_id=record.sample_id, model_fingerprint=record.model_fingerprint,
        capture_layers=record.capture_layers, hidden_size=record.hidden_size, dtype=record.dtype,
        token_ids=record.token_ids, loss_spans=record.loss_spans,
        aux=np.concatenate([block.aux for block in blocks] + [record.aux]),  # [S, K, H]
        final=np.concatenate([block.final for block in blocks] + [record.final]),  # [S, H]
        metadata=record.metadata, schema_version=record.schema_version)
