"""What is already in a data directory, made consistent at start-up.

What must hold after `open_catalog(data_dir)`:
- no open shard is left: each was recovered (truncated to its last valid frame and sealed, or
  removed when it held no valid frame), so every acknowledged record is in a sealed, indexed shard;
- `locations` holds every record id stored in the directory (the dedupe set survives restarts);
  an id found twice on disk (only possible after a failed sync) is counted and the first copy wins;
- shards uploaded to an object store and removed here still count: their indexes in `uploaded/`
  give their record ids (so a re-sent record stays a duplicate) and keep their numbers taken;
- every sealed shard's index loaded and matched its file size; a shard that does not (a flipped
  index byte, a truncated file) is moved with its index into `quarantine/`, named in the log and
  counted in /v1/stats, and the rest is served: one damaged file does not stop ingest.
  `eagle-tap shards repair` rebuilds its index from the shard, keeping every verifiable record.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from capture_format import DamagedShard, RecoveryReport, ShardDirectory, ShardError, ShardIndex, recover_open_shard
from capture_format.shard_index import (
    INDEX_SUFFIX,
    OPEN_SUFFIX,
    QUARANTINE_DIR_NAME,
    SEALED_SUFFIX,
    UPLOADED_DIR_NAME,
    fsync_directory,
    list_shard_files,
    parse_index,
    parse_shard_file_name,
    shard_file_name,
    shard_stem,
)

__all__ = ["Catalog", "RecordLocation", "Totals", "open_catalog", "shard_name"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecordLocation:
    """Where an acknowledged record lies."""

    shard_number: int
    offset: int
    frame_nbytes: int
    num_tokens: int
    header_xxh3_64: str


@dataclass(slots=True)
class Totals:
    """Sums over every stored record (all shards, sealed or open)."""

    num_records: int = 0
    num_tokens: int = 0
    raw_nbytes: int = 0
    """Tensor bytes before compression."""
    stored_nbytes: int = 0
    """Tensor bytes as stored (frame payloads)."""
    frame_nbytes: int = 0
    """Bytes on disk: payloads plus frame prefixes and headers."""
    num_sealed_shards: int = 0

    def add(self, *, num_tokens: int, raw_nbytes: int, stored_nbytes: int, frame_nbytes: int) -> None:
        self.num_records += 1
        self.num_tokens += num_tokens
        self.raw_nbytes += raw_nbytes
        self.stored_nbytes += stored_nbytes
        self.frame_nbytes += frame_nbytes


@dataclass(slots=True)
class Catalog:
    locations: dict[str, RecordLocation] = field(default_factory=dict)
    totals: Totals = field(default_factory=Totals)
    recoveries: list[RecoveryReport] = field(default_factory=list)
    num_duplicates_on_disk: int = 0
    quarantined: list[str] = field(default_factory=list)
    """Damaged shards (or orphaned indexes) moved to quarantine/ at start-up, each with its reason."""


def shard_name(shard_number: int, sealed: bool) -> str:
    return shard_file_name(shard_number, SEALED_SUFFIX if sealed else OPEN_SUFFIX)


def _quarantine(data_dir: Path, damaged: DamagedShard) -> str:
    """Moves a damaged shard and its index (whichever exist) into data_dir/quarantine; returns the log line."""
    quarantine = data_dir / QUARANTINE_DIR_NAME
    quarantine.mkdir(exist_ok=True)
    stem = shard_stem(damaged.path.name)
    for suffix in (SEALED_SUFFIX, INDEX_SUFFIX):
        path = data_dir / (stem + suffix)
        if path.exists():
            os.replace(path, quarantine / path.name)
    fsync_directory(quarantine)
    fsync_directory(data_dir)
    line = f"{damaged.reason}; moved to {QUARANTINE_DIR_NAME}/ (eagle-tap shards repair rebuilds its index)"
    log.error("quarantined a damaged shard: %s", line)
    return line


def open_catalog(data_dir: Path) -> Catalog:
    """Recovers open shards in data_dir, then indexes every sealed shard (see the module docstring)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    catalog = Catalog()
    for _, path in list_shard_files(data_dir).open:
        report = recover_open_shard(path)
        log.warning(
            "recovered %s: kept %d records (%d bytes), cut %d bytes%s%s",
            path.name, report.num_records, report.bytes_kept, report.bytes_cut,
            f" ({report.stop_reason})" if report.stop_reason else "",
            "".join(f"; dropped {reason}" for reason in report.dropped),
        )
        catalog.recoveries.append(report)
    with ShardDirectory(data_dir, skip_damaged=True) as shards:
        for damaged in shards.damaged:
            catalog.quarantined.append(_quarantine(data_dir, damaged))
        for shard in shards.shards:
            _add_shard(catalog, shard)
        local_names = {shard.shard_path.name for shard in shards.shards}
    for shard in _uploaded_shards(data_dir, local_names):
        _add_shard(catalog, shard)
    return catalog


def _uploaded_shards(data_dir: Path, local_names: set[str]) -> list[ShardIndex]:
    """Indexes in uploaded/ of shards no longer here (a kept local copy was counted already)."""
    uploaded = data_dir / UPLOADED_DIR_NAME
    if not uploaded.is_dir():
        return []
    shards = []
    for _, index_path in list_shard_files(uploaded).indexes:
        shard_name = shard_stem(index_path.name) + SEALED_SUFFIX
        if shard_name in local_names:
            continue
        try:
            shards.append(parse_index(index_path.read_bytes(), data_dir / shard_name, str(index_path)))
        except (OSError, ShardError) as err:
            log.error("cannot read the index of uploaded shard %s: %s; its records are not known as stored here "
                      "(a re-sent one would be stored again)", shard_name, err)
    return shards


def _add_shard(catalog: Catalog, shard: ShardIndex) -> None:
    """Adds a sealed shard's records (and totals); an id already known is counted as stored twice."""
    number, _ = parse_shard_file_name(shard.shard_path.name)
    catalog.totals.num_sealed_shards += 1
    catalog.totals.raw_nbytes += shard.raw_nbytes
    catalog.totals.stored_nbytes += shard.stored_nbytes
    for entry in shard.entries:
        if entry.record_id in catalog.locations:
            catalog.num_duplicates_on_disk += 1
            log.warning("record %r is stored twice; %s at offset %d is ignored",
                        entry.record_id, shard.shard_path.name, entry.offset)
            continue
        catalog.locations[entry.record_id] = RecordLocation(
            shard_number=number,
            offset=entry.offset,
            frame_nbytes=entry.length,
            num_tokens=entry.num_tokens,
            header_xxh3_64=entry.header_xxh3_64,
        )
        catalog.totals.num_records += 1
        catalog.totals.num_tokens += entry.num_tokens
        catalog.totals.frame_nbytes += entry.length
