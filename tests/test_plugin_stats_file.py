"""The plugin's stats file: rewritten in place about once a second, never read torn."""

from __future__ import annotations

import json
import os
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
