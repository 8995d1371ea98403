"""The plugin's stats file: rewritten in place about once a second while the counts change, never read torn."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from sglang_patch import stats as stats_module
from sglang_patch.stats import CaptureStats, StatsFile, read_stats_file


def test_a_rewrite_goes_in_place_and_a_shorter_snapshot_still_reads_whole(tmp_path: Path) -> None:
    path = tmp_path / "dp0" / "stats.json"
    stats, stats_file = CaptureStats(), StatsFile(path)
    stats.add("captured", 10 ** 12)
    stats_file.write(stats.snapshot())
    inode, size = os.stat(path).st_ino, os.stat(path).st_size
    stats.set("captured", 1)  # 12 digits fewer: padded, the file never shrinks
    stats_file.write(stats.snapshot())
    assert (os.stat(path).st_ino, os.stat(path).st_size) == (inode, size)
    read = read_stats_file(path)
    assert read["captured"] == 1 and read["snapshot"] == read["snapshot_end"] == 2


def test_a_file_replaced_behind_the_writer_is_written_anew(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    stats, stats_file = CaptureStats(), StatsFile(path)
    stats_file.write(stats.snapshot())
    stats.status = "dormant: test"
    stats.write(path)  # temp file + rename (the hook when capture stops): the writer's descriptor is stale now
    stats.add("captured", 3)
    stats_file.write(stats.snapshot())
    assert read_stats_file(path)["captured"] == 3
    path.unlink()
    stats.add("captured", 1)
    stats_file.write(stats.snapshot())
    assert read_stats_file(path)["captured"] == 4
    stats_file.close()


def test_a_torn_read_is_read_again_and_never_taken_for_a_snapshot(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "stats.json"
    # What a read meeting a rewrite sees: the new snapshot's front and the old one's end, or text cut short.
    path.write_text(json.dumps({"snapshot": 8, "captured": 5, "snapshot_end": 7}))
    monkeypatch.setattr(stats_module, "_TORN_READS_RETRIED", 3)
    with pytest.raises(ValueError, match="whole snapshot"):
        read_stats_file(path)
    path.write_text('{"snapshot": 8, "captured": 5, "snap')
    with pytest.raises(ValueError, match="whole snapshot"):
        read_stats_file(path)
    path.write_text(json.dumps({"captured": 5}))  # written whole by temp file + rename: no numbers
    assert read_stats_file(path) == {"captured": 5}


def test_a_change_wakes_a_waiting_writer_once_and_its_own_bookkeeping_does_not(tmp_path: Path) -> None:
    """What lets an idle sender sleep: every change is counted and calls the waiting callback, once; the
    sender's CPU (`bookkeeping`) and a gauge set to the value it has are no change."""
    stats, woken = CaptureStats(), []
    stats.set("inflight_bytes", 0)  # a gauge's first value is a change
    stats.set_text("digest", "")
    _, since = stats.snapshot_and_changes()
    assert since == 2 and stats.call_on_change(lambda: woken.append("woken"), since)
    stats.add("sender_cpu_ns", 1234, bookkeeping=True)
    stats.set("inflight_bytes", 0)
    stats.set_text("digest", "")
    stats.add_many(("captured", 0))
    assert woken == [] and stats.snapshot_and_changes()[1] == since
    stats.set_text("digest", "ab")
    assert woken == ["woken"]
    assert not stats.call_on_change(lambda: woken.append("late"), since), "a change came since: do not wait"
    _, since = stats.snapshot_and_changes()
    assert stats.call_on_change(lambda: woken.append("woken"), since)
    stats.add_many(("captured", 2), ("captured_tokens", 90))
    stats.drop("inflight_budget")
    assert woken == ["woken"] * 2, "one call, at the first change"
    for change in (lambda: stats.add_hook_time(1, 1), lambda: stats.drop("x"), lambda: stats.set("spool_frames", 1),
                   lambda: setattr(stats, "status", "capturing"), lambda: stats.add("sent")):
        _, since = stats.snapshot_and_changes()
        assert stats.call_on_change(lambda: woken.append("again"), since)
        change()
    assert woken == ["woken"] * 2 + ["again"] * 5


def test_a_quiet_snapshot_is_current_for_a_reader_asking_for_a_newer_one(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    stats, stats_file = CaptureStats(), StatsFile(path)
    stats_file.write({**stats.snapshot(), "quiet": False})
    started = time.monotonic()
    assert read_stats_file(path, newer_than=time.time() + 60, timeout_s=0.5)["quiet"] is False
    assert time.monotonic() - started >= 0.5, "an old snapshot that is not quiet is waited for"
    stats_file.write({**stats.snapshot(), "quiet": True})
    started = time.monotonic()
    assert read_stats_file(path, newer_than=time.time() + 60, timeout_s=5)["quiet"] is True
    assert time.monotonic() - started < 0.5
    stats_file.close()
