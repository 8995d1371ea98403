"""Shard file names and shard index files.

A shard directory holds:

    shard-000001.etap          sealed shard: frames back to back, nothing else
    shard-000001.index.json    its index
    shard-000002.etap.open     the shard a writer is appending to

In an object-store prefix that several collectors write, each object name carries the uploading
collector's id: `shard-c0ffee-000001.etap` and `shard-c0ffee-000001.index.json`. Readers accept both
forms anywhere; a shard and its index belong together when their names share the part before the
suffix (the stem), so two collectors' shards of the same number never meet.

A shard has no file header: it is exactly the frames as received, concatenated, and every frame
carries its own magic, version and checksums, so a file header would tell a reader nothing new.

What must hold for a sealed shard and its index:
- the index entries tile the shard: the first starts at 0, each starts where the previous ends, the
  last ends at shard_nbytes;
- each entry's record_id, length, token count, header and ids checksums are those of its frame;
- the index is written atomically (temp file, fsync, rename, fsync of the directory) before the
  rename that seals the shard, so a sealed shard always has a complete index.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture_format import records
from capture_format.errors import CaptureFormatError, ShardError, check_json_type, describe, describe_path
from capture_format.files import write_file_atomically
from capture_format.frame_header import FrameInfo

__all__ = ["INDEX_FORMAT_VERSION", "IndexEntry", "ShardFiles", "ShardIndex", "build_index", "check_collector_id",
           "format_index", "list_shard_files", "load_index", "parse_index", "shard_stem", "write_index"]

INDEX_FORMAT_VERSION = 1
SEALED_SUFFIX = ".etap"
OPEN_SUFFIX = ".etap.open"
INDEX_SUFFIX = ".index.json"
QUARANTINE_DIR_NAME = "quarantine"
"""Sub-folder where the collector moves damaged shards at start-up; their numbers are never reused."""
UPLOADED_DIR_NAME = "uploaded"
"""Sub-folder holding the index of each shard the collector verified in its bucket (its numbers stay taken)."""
_COLLECTOR_ID = re.compile(r"[a-z0-9][a-z0-9_]{0,31}", re.ASCII)
_FILE_NAME = re.compile(r"shard-(?:([a-z0-9][a-z0-9_]{0,31})-)?(\d{6,})(\.etap|\.etap\.open|\.index\.json)", re.ASCII)
_CHECKSUM = re.compile(r"[0-9a-f]{16}", re.ASCII)
_RECORD_FIELDS = ("record_id", "sample_id", "offset", "length", "num_tokens", "header_xxh3_64", "ids_xxh3_64")
_SHARED_FIELDS = ("model_fingerprint", "capture_layers", "hidden_size", "dtype")
"""Written once at shard level when all records agree, else in every record entry."""
_TOTAL_FIELDS = ("shard_nbytes", "num_records", "num_tokens", "raw_nbytes", "stored_nbytes")
_INDEX_FIELDS = (
    "format_version",
    "shard",
    *_TOTAL_FIELDS,
    *_SHARED_FIELDS,
    "aux_semantics",
    "final_semantics",
    "records",
)


def check_collector_id(collector_id: str) -> str:
    """A collector id as shard names carry it: 1-32 of lowercase letters, digits and '_', not starting with '_'."""
    if not isinstance(collector_id, str) or _COLLECTOR_ID.fullmatch(collector_id) is None:
        raise ValueError(f"collector id {describe(collector_id)} must be 1-32 characters of a-z, 0-9 and '_', "
                         "starting with a letter or digit (it becomes part of shard names)")
    return collector_id


def shard_file_name(number: int, suffix: str, collector_id: str | None = None) -> str:
    owner = "" if collector_id is None else f"{check_collector_id(collector_id)}-"
    return f"shard-{owner}{number:06d}{suffix}"


def parse_shard_file_name(name: str) -> tuple[int, str] | None:
    """Returns (number, suffix) for a shard, open shard or index file name (with or without a collector id), else None."""
    match = _FILE_NAME.fullmatch(name)
    return None if match is None else (int(match.group(2)), match.group(3))


def shard_stem(name: str) -> str | None:
    """The name without its suffix (`shard-000001`, `shard-c0ffee-000001`): a shard's and its index's, else None."""
    match = _FILE_NAME.fullmatch(name)
    return None if match is None else name[: match.start(3)]


@dataclass(frozen=True, slots=True)
class ShardFiles:
    """The shard files of a directory by kind, each a list of (number, path) in number order."""

    sealed: list[tuple[int, Path]]
    open: list[tuple[int, Path]]
    indexes: list[tuple[int, Path]]


def list_shard_files(directory: Path | str) -> ShardFiles:
    """The one listing of a shard directory; ShardError names a folder that is missing or not a folder."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is not a folder" if directory.exists() else "does not exist"
        raise ShardError(f"shards folder {describe_path(directory)} {what}")
    files: dict[str, list[tuple[int, Path]]] = {SEALED_SUFFIX: [], OPEN_SUFFIX: [], INDEX_SUFFIX: []}
    for name in sorted(os.listdir(directory)):
        parsed = parse_shard_file_name(name)
        if parsed is not None:
            files[parsed[1]].append((parsed[0], directory / name))
    return ShardFiles(sealed=files[SEALED_SUFFIX], open=files[OPEN_SUFFIX], indexes=files[INDEX_SUFFIX])


def index_path_for(shard_path: Path) -> Path:
    """The index beside a sealed or open shard."""
    parsed = parse_shard_file_name(shard_path.name)
    if parsed is None or parsed[1] == INDEX_SUFFIX:
        raise ShardError(f"{describe_path(shard_path)} is not a shard file name like shard-000001{SEALED_SUFFIX}")
    return shard_path.with_name(shard_stem(shard_path.name) + INDEX_SUFFIX)


def fsync_directory(directory: Path) -> None:
    """Makes renames and new names in directory durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexEntry:
    """Where one record lies in a sealed shard, and what to check it against when reading it."""

    shard_path: Path
    record_id: str
    sample_id: str
    offset: int
    length: int
    """Frame length in bytes."""
    num_tokens: int
    header_xxh3_64: str
    ids_xxh3_64: str
    model_fingerprint: str
    capture_layers: tuple[int, ...]
    hidden_size: int
    dtype: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardIndex:
    """The index of one sealed shard."""

    shard_path: Path
    shard_nbytes: int
    raw_nbytes: int
    """Sum over records of token_ids + aux + final bytes, uncompressed."""
    stored_nbytes: int
    """Sum over records of stored tensor bytes (frame payloads)."""
    entries: tuple[IndexEntry, ...]

    @property
    def num_records(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.entries)

    def to_json(self) -> dict[str, Any]:
        shared = {}
        for name in _SHARED_FIELDS:
            values = {getattr(entry, name) for entry in self.entries}
            shared[name] = _json_value(values.pop()) if len(values) == 1 else None
        entries = []
        for entry in self.entries:
            row = {name: getattr(entry, name) for name in _RECORD_FIELDS}
            row.update({name: _json_value(getattr(entry, name)) for name in _SHARED_FIELDS if shared[name] is None})
            entries.append(row)
        return {
            "format_version": INDEX_FORMAT_VERSION,
            "shard": self.shard_path.name,
            "shard_nbytes": self.shard_nbytes,
            "num_records": self.num_records,
            "num_tokens": self.num_tokens,
            "raw_nbytes": self.raw_nbytes,
            "stored_nbytes": self.stored_nbytes,
            **shared,
            "aux_semantics": records.AUX_SEMANTICS,
            "final_semantics": records.FINAL_SEMANTICS,
            "records": entries,
        }


def _json_value(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def build_index(shard_path: Path, shard_nbytes: int, frames: Iterable[tuple[int, FrameInfo]]) -> ShardIndex:
    """Index of a shard from (offset, info) of each frame, in file order."""
    frames = list(frames)
    entries = tuple(
        IndexEntry(
            shard_path=shard_path,
            record_id=info.record_id,
            sample_id=info.sample_id,
            offset=offset,
            length=info.frame_nbytes,
            num_tokens=info.num_tokens,
            header_xxh3_64=info.header_xxh3_64,
            ids_xxh3_64=info.ids_xxh3_64,
            model_fingerprint=info.model_fingerprint,
            capture_layers=info.capture_layers,
            hidden_size=info.hidden_size,
            dtype=info.dtype,
        )
        for offset, info in frames
    )
    return ShardIndex(
        shard_path=shard_path,
        shard_nbytes=shard_nbytes,
        raw_nbytes=sum(info.raw_nbytes for _, info in frames),
        stored_nbytes=sum(info.stored_nbytes for _, info in frames),
        entries=entries,
    )


def _format_index(data: dict[str, Any]) -> str:
    """JSON with one line per shard field and per record: short to read, and diffs name the record."""
    fields = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items() if key != "records"]
    rows = ",\n".join(f"    {json.dumps(row)}" for row in data["records"])
    fields.append(f'  "records": [\n{rows}\n  ]' if rows else '  "records": []')
    return "{\n" + ",\n".join(fields) + "\n}\n"


def format_index(index: ShardIndex) -> str:
    """The index file's text (what write_index writes)."""
    return _format_index(index.to_json())


def write_index(index: ShardIndex, index_path: Path) -> None:
    """Writes the index atomically: a reader sees the previous file or the whole new one."""
    write_file_atomically(index_path, format_index(index))


def _parse_entry(row: object, shared: dict[str, Any], shard_path: Path) -> IndexEntry:
    row = check_json_type(row, dict, "record entry", ShardError)
    expected_keys = set(_RECORD_FIELDS) | {name for name in _SHARED_FIELDS if shared[name] is None}
    if row.keys() != expected_keys:
        raise ShardError(f"record entry has fields {sorted(row)}; expected {sorted(expected_keys)}")
    values = {**shared, **row}
    for name in ("header_xxh3_64", "ids_xxh3_64"):
        if _CHECKSUM.fullmatch(check_json_type(values[name], str, name, ShardError)) is None:
            raise ShardError(f"{name} {describe(values[name])} must be 16 lowercase hex digits")
    return IndexEntry(
        shard_path=shard_path,
        record_id=records.check_record_id(values["record_id"]),
        sample_id=records.check_sample_id(values["sample_id"]),
        offset=check_json_type(values["offset"], int, "offset", ShardError),
        length=check_json_type(values["length"], int, "length", ShardError),
        num_tokens=records.check_num_tokens(values["num_tokens"]),
        header_xxh3_64=values["header_xxh3_64"],
        ids_xxh3_64=values["ids_xxh3_64"],
        model_fingerprint=records.check_model_fingerprint(values["model_fingerprint"]),
        capture_layers=records.check_capture_layers(
            check_json_type(values["capture_layers"], list, "capture_layers", ShardError)
        ),
        hidden_size=records.check_hidden_size(values["hidden_size"]),
        dtype=records.check_dtype(values["dtype"]),
    )


def _index_from_json(data: object, shard_path: Path) -> ShardIndex:
    data = check_json_type(data, dict, "index", ShardError)
    if sorted(data) != sorted(_INDEX_FIELDS):
        raise ShardError(f"index has fields {describe(sorted(data), max_chars=400)}; expected {sorted(_INDEX_FIELDS)}")
    if type(data["format_version"]) is not int or data["format_version"] != INDEX_FORMAT_VERSION:
        raise ShardError(
            f"index format_version {describe(data['format_version'])} is not supported; "
            f"accepted: {INDEX_FORMAT_VERSION}"
        )
    if data["shard"] != shard_path.name:
        raise ShardError(f"index describes shard {describe(data['shard'])}; expected {shard_path.name!r}")
    for name, known in (("aux_semantics", records.AUX_SEMANTICS), ("final_semantics", records.FINAL_SEMANTICS)):
        if data[name] != known:
            raise ShardError(f"index {name} {describe(data[name])} is not supported; accepted: {known!r}")
    totals = {name: check_json_type(data[name], int, name, ShardError) for name in _TOTAL_FIELDS}
    shared = {name: data[name] for name in _SHARED_FIELDS}
    rows = check_json_type(data["records"], list, "records", ShardError)
    entries = tuple(_parse_entry(row, shared, shard_path) for row in rows)
    expected_offset = 0
    for entry in entries:
        if entry.offset != expected_offset or entry.length <= 0:
            raise ShardError(
                f"record {entry.record_id!r} spans [{entry.offset}, {entry.offset + entry.length}); "
                f"entries must tile the shard and this one should start at {expected_offset}"
            )
        expected_offset += entry.length
    index = ShardIndex(
        shard_path=shard_path,
        shard_nbytes=totals["shard_nbytes"],
        raw_nbytes=totals["raw_nbytes"],
        stored_nbytes=totals["stored_nbytes"],
        entries=entries,
    )
    recomputed = {"shard_nbytes": expected_offset, "num_records": index.num_records, "num_tokens": index.num_tokens}
    for name, actual in recomputed.items():
        if totals[name] != actual:
            raise ShardError(f"index says {name} {totals[name]}; its records add up to {actual}")
    return index


def parse_index(text: bytes, shard_path: Path, where: str) -> ShardIndex:
    """Checks and parses an index file's bytes for the shard at shard_path; ShardError starts with `where`
    (the index file's path or URL) on any problem."""
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ShardError(f"{where}: not valid JSON: {err}") from None
    try:
        return _index_from_json(data, shard_path)
    except CaptureFormatError as err:
        raise ShardError(f"{where}: {err}") from None


def load_index(shard_path: Path | str) -> ShardIndex:
    """Reads and checks the index of a sealed shard; ShardError names the index file on any problem."""
    shard_path = Path(shard_path)
    index_path = index_path_for(shard_path)
    try:
        text = index_path.read_bytes()
    except FileNotFoundError:
        raise ShardError(f"sealed shard {shard_path} has no index {index_path.name}") from None
    return parse_index(text, shard_path, str(index_path))
