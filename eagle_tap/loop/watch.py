"""Served acceptance over time: one window per tick of the loop, from the records that arrived since the last one.

A record captured on a replica that serves an EAGLE-3 draft carries SGLang's own verify counts
(`served_draft` metadata: verify steps, accepted drafts per step, the draft's identity; see
capture_format/served_draft.py). Each tick pools the records stored since the previous tick into a window
event: verify steps, accepted drafts, pooled acceptance length per draft identity, and which version the
registry had promoted then. The probes after each swap (SGLang's per-response `meta_info`) are in the swap
events. `eagle-tap loop status` prints both; `--plot` draws them with promotions and rollbacks marked.

Windows are by arrival (the tick that first saw a record), not by capture time: records carry none.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from eagle_tap.loop.rounds import shard_entries
from eagle_tap.loop.state import LoopState


def record_metadata(shards: str, entries: list[Any]) -> list[dict[str, Any]]:
    """The metadata of each entry's record: from its frame header alone for a local folder (the states are
    not read); a whole (checked) record from an object store."""
    import capture_format as cf

    if cf.is_remote(shards):
        with cf.open_shard_directory(shards, skip_damaged=True) as directory:
            return [directory.read_stored_record(entry).metadata for entry in entries]
    from capture_format.frames import read_frame_header

    out = []
    for shard_path, in_shard in itertools.groupby(entries, key=lambda entry: entry.shard_path):  # one open a shard
        fd = os.open(shard_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            out += [read_frame_header(fd, entry.offset)[1].metadata for entry in in_shard]
        finally:
            os.close(fd)
    return out


def record_window(loop: LoopState) -> dict[str, Any] | None:
    """Pools the records no window counted yet into one window event (None when none arrived)."""
    from capture_format.served_draft import ServedDraft, pool_served_drafts

    if not loop.watched:  # a restarted loop: windows already written cover what they counted
        for event in loop.registry.events():
            if event["kind"] == "window":
                loop.watched.update(event.get("record_ids", ()))
    entries = [entry for entry in shard_entries(loop.config.shards) if entry.record_id not in loop.watched]
    if not entries:
        return None
    from capture_format.errors import CaptureFormatError

    served, invalid = [], 0
    for metadata in record_metadata(loop.config.shards, entries):
        try:
            served.append(ServedDraft.from_metadata(metadata))
        except CaptureFormatError:  # counted, never pooled
            invalid += 1
    tallies, without = pool_served_drafts(served)
    verify_steps = sum(tally.verify_steps for tally in tallies)
    accepted = sum(tally.accepted_drafts for tally in tallies)
    state = loop.registry.state()
    window = {"records": len(entries), "records_without_draft": without, "records_invalid_served_draft": invalid,
              "verify_steps": verify_steps,
              "accepted_drafts": accepted,
              "acceptance_length": (accepted + verify_steps) / verify_steps if verify_steps else None,
              "drafts": [tally.to_json() for tally in tallies], "promoted": state["promoted"],
              "record_ids": [entry.record_id for entry in entries], "until": time.time()}
    loop.registry.event("window", **window)
    loop.watched.update(window["record_ids"])
    return {key: value for key, value in window.items() if key != "record_ids"}
