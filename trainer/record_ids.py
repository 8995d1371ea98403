"""Record id files: the text file that names the records a run trains on or evaluates, and the selection it makes.

A file lists one record id a line, `#` starts a comment, blank lines are skipped; an id listed twice, a line
that is not a record id, or a file listing none is an error naming the line. The selection keeps the file's
order and names the ids the shards lack.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import capture_format as cf
from capture_format.errors import InvalidRecordError
from capture_format.records import check_record_id

MAX_NAMED_IDS = 5
"""Missing record ids an error names (it counts them all)."""


def read_record_ids(path: str | Path) -> list[str]:
    """The record ids of a text file, in order: one per line, `#` starts a comment, blank lines are skipped.

    ValueError when the file cannot be read, a line is not a record id, an id is listed twice, or none is."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the record id file {path}: {error}") from None
    record_ids: list[str] = []
    line_of: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        record_id = line.partition("#")[0].strip()
        if not record_id:
            continue
        try:
            check_record_id(record_id)
        except InvalidRecordError as error:
            raise ValueError(f"{path}:{number}: {error} (one id per line, # for comments)") from None
        if record_id in line_of:
            raise ValueError(f"{path}:{number}: record id {record_id!r} is listed again (first on line "
                             f"{line_of[record_id]}); list each record once")
        line_of[record_id] = number
        record_ids.append(record_id)
    if not record_ids:
        raise ValueError(f"{path} lists no record id: the selection would be empty")
    return record_ids


def select_records(entries: Sequence[cf.IndexEntry], record_ids: Sequence[str], shards: str,
                   source: str) -> list[cf.IndexEntry]:
    """The entries of record_ids, in their order; ValueError naming up to MAX_NAMED_IDS ids shards lack and the count.

    source names where the ids came from (a file) in the error."""
    by_id: dict[str, cf.IndexEntry] = {}
    for entry in entries:
        by_id.setdefault(entry.record_id, entry)
    missing = [record_id for record_id in record_ids if record_id not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} of {len(record_ids)} record ids of {source} are not in {shards}: "
                         f"{', '.join(missing[:MAX_NAMED_IDS])}{', ...' if len(missing) > MAX_NAMED_IDS else ''}")
    return [by_id[record_id] for record_id in record_ids]
