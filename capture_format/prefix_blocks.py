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

Resolution (`resolve_prefix`), what every reader of shards does before handing a record out: follow
the chain of blocks back to token 0 and join their rows in front of the record's own. What must hold:
- a reference is followed only if it is the content key of the referring record's own first P
  tokens (in its own namespace), and a block is used only if its record id is that key's, it holds P
  token ids, those of its own rows equal the record's, and it has the same model fingerprint, capture
  layers, hidden size and dtype: a resolved record is never wrong by accident, whatever the shards hold
  (the checks cost O(T) per record, however long its chain);
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

import numpy as np

from capture_format.errors import CaptureFormatError
from capture_format.records import TOKEN_ID_DTYPE, CaptureRecord, StatesPrefix

__all__ = [
    "BLOCK_KIND",
    "BLOCK_RECORD_PREFIX",
    "BlockCache",
    "DanglingPrefixError",
    "block_record_id",
    "is_prefix_block",
    "prefix_key",
    "prefix_keys",
    "record_namespace",
    "resolve_prefix",
    "states_namespace",
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
    read once for the thousands of records that share them. Thread-safe."""

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


def _check_block(block: CaptureRecord | None, reference: StatesPrefix, ids: np.ndarray,
                 record: CaptureRecord) -> CaptureRecord:
    where = f"record {record.record_id}: its shared prefix of {reference.num_tokens} tokens ({block_record_id(reference.key)})"
    if block is None:
        raise DanglingPrefixError(f"{where} is not in the shards read")
    own = slice(block.first_state_token, reference.num_tokens)  # the tokens of the block's own rows
    if block.num_tokens != reference.num_tokens or not np.array_equal(block.token_ids[own], ids[own]):
        raise DanglingPrefixError(f"{where} holds other token ids")
    if block.num_states != block.num_tokens - block.first_state_token:
        raise DanglingPrefixError(f"{where} lacks the state of its last token")
    for name in ("model_fingerprint", "capture_layers", "hidden_size", "dtype"):
        if getattr(block, name) != getattr(record, name):
            raise DanglingPrefixError(f"{where} has {name} {getattr(block, name)!r}; the record has "
                                      f"{getattr(record, name)!r}")
    return block


def resolve_prefix(record: CaptureRecord, read_block: Callable[[str], CaptureRecord | None]) -> CaptureRecord:
    """The record with the states of every token, its shared prefix's rows joined in front of its own.

    read_block(record_id) returns the stored block of that id (as stored: it may refer further back)
    or None. A record without a reference is returned as it is. Raises DanglingPrefixError."""
    if record.states_prefix is None:
        return record
    ids = record.token_ids
    references, blocks = [], []
    reference = record.states_prefix
    while reference is not None:  # num_tokens decreases strictly (records.py): the walk ends
        references.append(reference)
        blocks.append(_check_block(read_block(block_record_id(reference.key)), reference, ids, record))
        reference = blocks[-1].states_prefix
    # Every reference must be the key of the record's own first tokens; the ids are hashed once.
    lengths = [reference.num_tokens for reference in reversed(references)]
    for reference, key in zip(reversed(references), prefix_keys(ids, lengths, record_namespace(record))):
        if reference.key != key:
            raise DanglingPrefixError(f"record {record.record_id}: the shared prefix key {reference.key} is not "
                                      f"the key of its first {reference.num_tokens} tokens")
    blocks.reverse()
    return CaptureRecord(
        record_id=record.record_id, sample_id=record.sample_id, model_fingerprint=record.model_fingerprint,
        capture_layers=record.capture_layers, hidden_size=record.hidden_size, dtype=record.dtype,
        token_ids=ids, loss_spans=record.loss_spans,
        aux=np.concatenate([block.aux for block in blocks] + [record.aux]),
        final=np.concatenate([block.final for block in blocks] + [record.final]),
        metadata=record.metadata, schema_version=record.schema_version)
