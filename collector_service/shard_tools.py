"""`eagle-tap shards verify|stats DIR`: check and summarize a shard directory (capture_format only).

verify: every sealed shard against its index and every record's checksums (decoding it), indexes
without a shard, and record ids stored twice. Open shards are listed, not read: the collector
recovers them when it starts. Returns False if anything is wrong.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import TextIO

from capture_format import ShardDirectory, ShardError, load_index, verify_shard
from capture_format.shard_index import INDEX_SUFFIX, OPEN_SUFFIX, SEALED_SUFFIX, parse_shard_file_name, shard_file_name

__all__ = ["print_stats", "verify_directory"]


def _shard_files(data_dir: Path) -> dict[str, list[tuple[int, str]]]:
    files: dict[str, list[tuple[int, str]]] = {SEALED_SUFFIX: [], OPEN_SUFFIX: [], INDEX_SUFFIX: []}
    for name in sorted(os.listdir(data_dir)):
        parsed = parse_shard_file_name(name)
        if parsed is not None:
            files[parsed[1]].append((parsed[0], name))
    return files


def verify_directory(data_dir: Path, *, out: TextIO) -> bool:
    """Prints one line per shard and a summary; True when no problem was found."""
    files = _shard_files(data_dir)
    problems: list[str] = []
    record_ids: Counter[str] = Counter()
    num_records = num_verified = 0
    for _, name in files[SEALED_SUFFIX]:
        try:
            report = verify_shard(data_dir / name)
            entries = load_index(data_dir / name).entries
        except ShardError as err:
            problems.append(str(err))
            print(f"{name}: FAILED: {err}", file=out)
            continue
        record_ids.update(entry.record_id for entry in entries)
        num_records += report.num_records
        num_verified += report.num_verified
        problems.extend(report.problems)
        status = "ok" if report.ok else f"{len(report.problems)} problems"
        print(f"{name}: {report.num_verified}/{report.num_records} records verified, {status}", file=out)
        for problem in report.problems:
            print(f"  {problem}", file=out)
    for _, name in files[OPEN_SUFFIX]:
        print(f"{name}: open, not verified (the collector writes it, or recovers it when it starts)", file=out)
    shard_numbers = {number for number, _ in files[SEALED_SUFFIX] + files[OPEN_SUFFIX]}
    for number, name in files[INDEX_SUFFIX]:
        if number not in shard_numbers:
            problem = f"{name}: index without a shard ({shard_file_name(number, SEALED_SUFFIX)} is missing)"
            problems.append(problem)
            print(problem, file=out)
    for record_id, count in sorted(record_ids.items()):
        if count > 1:
            problem = f"record {record_id!r} is stored {count} times"
            problems.append(problem)
            print(problem, file=out)
    verdict = "OK" if not problems else f"FAILED ({len(problems)} problems)"
    print(
        f"{len(files[SEALED_SUFFIX])} sealed shards, {len(files[OPEN_SUFFIX])} open; "
        f"{num_verified}/{num_records} records verified: {verdict}",
        file=out,
    )
    return not problems


def print_stats(data_dir: Path, *, out: TextIO) -> None:
    """Prints totals over the sealed shards: records, tokens, bytes and the compression ratio."""
    with ShardDirectory(data_dir) as shards:
        raw_nbytes = sum(shard.raw_nbytes for shard in shards.shards)
        stored_nbytes = sum(shard.stored_nbytes for shard in shards.shards)
        shard_nbytes = sum(shard.shard_nbytes for shard in shards.shards)
        rows = [
            ("sealed shards", f"{len(shards.shards):,}"),
            ("open shards", f"{len(shards.open_shard_paths):,} (not counted below)"),
            ("records", f"{shards.num_records:,}"),
            ("tokens", f"{shards.num_tokens:,}"),
            ("raw tensor bytes", f"{raw_nbytes:,} ({raw_nbytes / 2**30:.3f} GiB)"),
            ("stored tensor bytes", f"{stored_nbytes:,} ({stored_nbytes / 2**30:.3f} GiB)"),
            ("shard bytes", f"{shard_nbytes:,} ({shard_nbytes / 2**30:.3f} GiB)"),
            ("compression ratio", f"{raw_nbytes / stored_nbytes:.3f}" if stored_nbytes else "-"),
        ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}", file=out)
