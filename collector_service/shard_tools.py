"""`eagle-tap shards verify|stats DIR`: check and summarize a shard directory (capture_format only).

verify: every sealed shard against its index and every record's checksums (decoding it), indexes
without a shard, and record ids stored twice. Open shards are listed, not read: the collector
recovers them when it starts. Returns False if anything is wrong.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TextIO

from capture_format import ShardDirectory, ShardError, load_index, verify_shard
from capture_format.shard_index import SEALED_SUFFIX, list_shard_files, shard_file_name

__all__ = ["print_stats", "verify_directory"]


def verify_directory(data_dir: Path, *, out: TextIO) -> bool:
    """Prints one line per shard and a summary; True when no problem was found (an empty folder is one)."""
    files = list_shard_files(data_dir)
    problems: list[str] = []
    record_ids: Counter[str] = Counter()
    num_records = num_verified = 0
    for _, path in files.sealed:
        try:
            report = verify_shard(path)
            entries = load_index(path).entries
        except ShardError as err:
            problems.append(str(err))
            print(f"{path.name}: FAILED: {err}", file=out)
            continue
        record_ids.update(entry.record_id for entry in entries)
        num_records += report.num_records
        num_verified += report.num_verified
        problems.extend(report.problems)
        status = "ok" if report.ok else f"{len(report.problems)} problems"
        print(f"{path.name}: {report.num_verified}/{report.num_records} records verified, {status}", file=out)
        for problem in report.problems:
            print(f"  {problem}", file=out)
    for _, path in files.open:
        print(f"{path.name}: open, not verified (the collector writes it, or recovers it when it starts)", file=out)
    shard_numbers = {number for number, _ in files.sealed + files.open}
    for number, path in files.indexes:
        if number not in shard_numbers:
            problem = f"{path.name}: index without a shard ({shard_file_name(number, SEALED_SUFFIX)} is missing)"
            problems.append(problem)
            print(problem, file=out)
    for record_id, count in sorted(record_ids.items()):
        if count > 1:
            problem = f"record {record_id!r} is stored {count} times"
            problems.append(problem)
            print(problem, file=out)
    if not (files.sealed or files.open or files.indexes):
        problems.append(f"{data_dir} holds no shard files (shard-NNNNNN{SEALED_SUFFIX}): is it the shards folder?")
        print(f"warning: {problems[-1]}", file=out)
    verdict = "OK" if not problems else f"FAILED ({len(problems)} problems)"
    print(
        f"{len(files.sealed)} sealed shards, {len(files.open)} open; "
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
