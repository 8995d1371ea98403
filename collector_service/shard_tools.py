"""`eagle-tap shards verify|stats|repair|recode --shards DIR`: check, summarize, repair and re-encode shard
directories (capture_format only).

verify and stats also read an object-store prefix (s3://bucket/prefix) the collector uploads to.
stats on a folder also pools the acceptance of the drafts that served the records (`served_draft`
metadata, capture_format/served_draft.py), read from frame headers: the index holds no metadata.

verify: every sealed shard against its index and every record's checksums (decoding it), indexes
without a shard, and record ids stored twice. Open shards are listed, not read: the collector
recovers them when it starts. Returns False if anything is wrong. verify and stats also list the
codecs the records use; a lossy codec with the error its encoders measured.
recode: every record of DIR's sealed shards, decoded and encoded again with another codec into new
shards in an empty folder, one shard per source shard (to store captures smaller, or to measure what
a lossy codec costs the trainer).
repair: every shard of DIR and DIR/quarantine whose index does not load (or a shard that fails
verify) gets its index rebuilt from the shard, keeping every verifiable record; a repaired shard
from quarantine/ moves back into DIR. Stop the collector first: repair takes the shard's lock.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from capture_format import (
    InvalidRecordError,
    ShardDirectory,
    ShardError,
    is_remote,
    load_index,
    open_shard_directory,
    repair_shard,
    verify_shard,
)
from capture_format.frame_header import FrameInfo
from capture_format.prefix_blocks import is_prefix_block
from capture_format.records import num_span_positions
from capture_format.shard_codecs import codec_summary, format_codec_summary, recode_shards
from capture_format.shard_index import (
    QUARANTINE_DIR_NAME,
    SEALED_SUFFIX,
    UPLOADED_DIR_NAME,
    IndexEntry,
    index_path_for,
    list_shard_files,
    shard_stem,
)
from capture_format.served_draft import ServedDraft, pool_served_drafts, tally_header, tally_rows
from capture_format.tables import text_table

__all__ = ["print_stats", "recode_directory", "repair_directory", "verify_directory"]


def _print_codecs(data_dir: Path, out: TextIO,
                  on_header: Callable[[IndexEntry, FrameInfo], None] | None = None) -> list[str]:
    """Prints the codecs of the readable sealed shards' records; returns the problems met reading them.
    on_header gets each header read (`codec_summary`)."""
    with ShardDirectory(data_dir, skip_damaged=True) as shards:
        tallies, problems = codec_summary(shards, on_header)
    for line in format_codec_summary(tallies):
        print(f"codec {line}", file=out)
    return problems


def verify_directory(data_dir: Path | str, *, out: TextIO) -> bool:
    """Prints one line per shard and a summary; True when no problem was found (an empty folder is one).
    data_dir may be an s3://bucket/prefix: every shard object is read in full and checked the same way."""
    if is_remote(data_dir):
        return _verify_remote(str(data_dir), out=out)
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
    shard_stems = {shard_stem(path.name) for _, path in files.sealed + files.open}
    for _, path in files.indexes:
        if shard_stem(path.name) not in shard_stems:
            problem = f"{path.name}: index without a shard ({shard_stem(path.name)}{SEALED_SUFFIX} is missing)"
            problems.append(problem)
            print(problem, file=out)
    problems += _report_repeats(record_ids, out)
    uploaded = data_dir / UPLOADED_DIR_NAME
    if uploaded.is_dir():
        print(f"{len(list_shard_files(uploaded).indexes)} shards uploaded to an object store are listed in "
              f"{UPLOADED_DIR_NAME}/ (verify them there: eagle-tap shards verify s3://...)", file=out)
    if not (files.sealed or files.open or files.indexes):
        problems.append(f"{data_dir} holds no shard files (shard-NNNNNN{SEALED_SUFFIX}): is it the shards folder?")
        print(f"warning: {problems[-1]}", file=out)
    else:
        problems.extend(_print_codecs(data_dir, out))
    verdict = "OK" if not problems else f"FAILED ({len(problems)} problems)"
    print(
        f"{len(files.sealed)} sealed shards, {len(files.open)} open; "
        f"{num_verified}/{num_records} records verified: {verdict}",
        file=out,
    )
    return not problems


def _report_repeats(record_ids: Counter[str], out: TextIO) -> list[str]:
    problems = []
    for record_id, count in sorted(record_ids.items()):
        if count > 1:
            problems.append(f"record {record_id!r} is stored {count} times")
            print(problems[-1], file=out)
    return problems


def _verify_remote(url: str, *, out: TextIO) -> bool:
    """verify_directory for an object-store prefix (capture_format.remote_shards says what a prefix holds)."""
    from capture_format.remote_shards import RemoteShardDirectory

    problems: list[str] = []
    record_ids: Counter[str] = Counter()
    num_records = num_verified = 0
    with RemoteShardDirectory(url, skip_damaged=True) as shards:
        for shard in shards.shards:
            report = shards.verify_shard(shard)
            record_ids.update(entry.record_id for entry in shard.entries)
            num_records += report.num_records
            num_verified += report.num_verified
            problems.extend(report.problems)
            status = "ok" if report.ok else f"{len(report.problems)} problems"
            print(f"{shard.shard_path.name}: {report.num_verified}/{report.num_records} records verified, {status}",
                  file=out)
            for problem in report.problems:
                print(f"  {problem}", file=out)
        for damaged in shards.damaged:
            problems.append(damaged.reason)
            print(f"FAILED: {damaged.reason}", file=out)
        for path in shards.open_shard_paths:
            print(f"{path.name}: no index yet, not verified (its collector puts the index after checking the upload)",
                  file=out)
        problems += _report_repeats(record_ids, out)
        num_sealed, num_open = len(shards.shards) + len(shards.damaged), len(shards.open_shard_paths)
    verdict = "OK" if not problems else f"FAILED ({len(problems)} problems)"
    print(f"{num_sealed} sealed shards, {num_open} without an index; {num_verified}/{num_records} records verified: "
          f"{verdict}", file=out)
    return not problems


def print_stats(data_dir: Path | str, *, out: TextIO) -> None:
    """Prints totals over the readable sealed shards: records, tokens, bytes, compression; damaged ones by name;
    for a folder, the codecs and the served drafts' acceptance (read from frame headers, no tensor decoded).
    data_dir may be an s3://bucket/prefix (its indexes are read, no shard)."""
    with open_shard_directory(data_dir, skip_damaged=True) as shards:
        raw_nbytes = sum(shard.raw_nbytes for shard in shards.shards)
        stored_nbytes = sum(shard.stored_nbytes for shard in shards.shards)
        shard_nbytes = sum(shard.shard_nbytes for shard in shards.shards)
        samples = list(shards.iter_index())
        num_tokens = sum(entry.num_tokens for entry in samples)
        rows = [
            ("sealed shards", f"{len(shards.shards):,}"),
            ("open shards", f"{len(shards.open_shard_paths):,} (not counted below)"),
            ("records", f"{len(samples):,}"),
            ("prefix blocks", f"{shards.num_records - len(samples):,} (shared prefixes' states, stored once)"),
            ("tokens", f"{num_tokens:,} (of the records)"),
            ("bytes per token", f"{shard_nbytes / num_tokens:,.1f}" if num_tokens else "-"),
            ("raw tensor bytes", f"{raw_nbytes:,} ({raw_nbytes / 2**30:.3f} GiB)"),
            ("stored tensor bytes", f"{stored_nbytes:,} ({stored_nbytes / 2**30:.3f} GiB)"),
            ("shard bytes", f"{shard_nbytes:,} ({shard_nbytes / 2**30:.3f} GiB)"),
            ("compression ratio", f"{raw_nbytes / stored_nbytes:.3f}" if stored_nbytes else "-"),
            ("damaged shards", f"{len(shards.damaged):,} (not counted above; see `eagle-tap shards repair`)"),
        ]
        damaged = [f"  {item.reason}" for item in shards.damaged]
    print(text_table(rows, align="<<"), file=out)
    for line in damaged:
        print(line, file=out)
    if is_remote(data_dir):  # codecs and metadata live in the frame headers, which stats does not fetch from a bucket
        print("codecs: not listed for an object store, nor the drafts that served records (stats reads its "
              "indexes only)", file=out)
        return
    served, served_problems = [], []
    images = [0, 0]  # records with images, their image positions

    def take_served_draft(entry: IndexEntry, info: FrameInfo) -> None:
        if is_prefix_block(entry.record_id):
            return  # shared-prefix blocks are parts of records, not records
        if info.input_embed_spans:
            images[0] += 1
            images[1] += num_span_positions(info.input_embed_spans)
        try:
            served.append(ServedDraft.from_metadata(info.metadata))
        except InvalidRecordError as err:
            served_problems.append(f"{entry.shard_path.name} record {entry.record_id}: {err}")

    for problem in _print_codecs(data_dir, out, on_header=take_served_draft):  # one pass over the headers
        print(f"  {problem}", file=out)
    if images[0]:
        print(f"records with images: {images[0]:,} ({images[1]:,} image positions, with the target's input "
              "embeddings there)", file=out)
    _print_served_drafts(served, served_problems, out)


def _print_served_drafts(served: list[ServedDraft | None], problems: list[str], out: TextIO) -> None:
    """The served acceptance of each draft that served the records, pooled; nothing when no record carries one."""
    tallies, num_without_draft = pool_served_drafts(served)
    if not tallies and not problems:
        return
    print("served drafts: what the drafts serving the records achieved on their generations, as SGLang counts it",
          file=out)
    header = tally_header(tallies)
    print(text_table(tally_rows(tallies), header=header, align="<<<" + ">" * (len(header) - 3), indent="  "),
          file=out)
    print(f"  records captured without a draft: {num_without_draft:,}", file=out)
    print("  (acceptance length: tokens per verify step, pooled over the records' steps; position j: share of "
          "verify steps that accepted draft token j)", file=out)
    for problem in problems:
        print(f"  {problem}", file=out)


def recode_directory(data_dir: Path, out_dir: Path, codec: str, *, out: TextIO) -> None:
    """Writes every record of data_dir's sealed shards into new shards in out_dir (empty or new), aux and final
    stored with codec; one shard per source shard. Records are read and verified as the trainer reads them."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty; recode writes into a new or empty folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    with ShardDirectory(data_dir) as shards:
        indexes = recode_shards(shards, out_dir, codec)
    raw_nbytes = sum(index.raw_nbytes for index in indexes)
    stored_nbytes = sum(index.stored_nbytes for index in indexes)
    num_records = sum(index.num_records for index in indexes)
    ratio = f"{raw_nbytes / stored_nbytes:.3f}" if stored_nbytes else "-"
    print(f"recoded {num_records:,} records of {data_dir} into {out_dir} with {codec}: compression ratio {ratio}",
          file=out)
    _print_codecs(out_dir, out)


def _needs_repair(shard_path: Path) -> bool:
    try:
        return not verify_shard(shard_path).ok
    except ShardError:
        return True


def repair_directory(data_dir: Path, *, out: TextIO) -> bool:
    """Repairs what verify finds wrong with each sealed shard (see the module docstring); True if all is well after."""
    files = list_shard_files(data_dir)
    quarantine = data_dir / QUARANTINE_DIR_NAME
    quarantined = list_shard_files(quarantine).sealed if quarantine.is_dir() else []
    num_repaired = num_kept = num_lost = 0
    for _, shard_path in [*files.sealed, *quarantined]:
        from_quarantine = shard_path.parent == quarantine
        if not from_quarantine and not _needs_repair(shard_path):
            continue
        report = repair_shard(shard_path)
        num_repaired += 1
        num_kept += report.num_records
        num_lost += len(report.dropped)
        cut = f", cut {report.bytes_cut} bytes ({report.stop_reason})" if report.bytes_cut else ""
        print(f"{shard_path.name}: index rebuilt, {report.num_records} records kept, "
              f"{len(report.dropped)} dropped{cut}", file=out)
        for reason in report.dropped:
            print(f"  dropped {reason}", file=out)
        if from_quarantine:
            if (data_dir / shard_path.name).exists():
                print(f"  left in {QUARANTINE_DIR_NAME}/: {data_dir / shard_path.name} exists", file=out)
                continue
            os.replace(index_path_for(shard_path), data_dir / index_path_for(shard_path).name)
            os.replace(shard_path, data_dir / shard_path.name)
            print(f"  moved back into {data_dir}", file=out)
    for _, index_path in files.indexes:
        stem = shard_stem(index_path.name)
        if not (data_dir / (stem + SEALED_SUFFIX)).exists() and not any(
                shard_stem(path.name) == stem for _, path in files.open):
            print(f"{index_path.name}: index without a shard: nothing to rebuild from; remove it", file=out)
    print(f"{num_repaired} shards repaired: {num_kept} records kept, {num_lost} dropped", file=out)
    with ShardDirectory(data_dir, skip_damaged=True) as shards:
        return not shards.damaged
