"""Damage is contained: a damaged sealed shard is quarantined by the collector, skipped (by name) by the
trainer, and repaired by `eagle-tap shards repair`; an index that lies about a record is caught on read."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from capture_format import FrameError, ShardDirectory, ShardError, verify_shard, write_shards
from eagle_tap.testbed.collector_process import CollectorProcess
from test_capture_format_shards import make_record
from test_collector_support import make_frame

EAGLE_TAP = [sys.executable, "-m", "eagle_tap.cli"]


def _three_shards(data_dir: Path) -> list[Path]:
    """Shards 1..3 of 4 records each; returns the sealed shard paths."""
    indexes = write_shards([make_record(index) for index in range(12)], data_dir, records_per_shard=4)
    return [index.shard_path for index in indexes]


def _flip_index_byte(shard_path: Path) -> None:
    index_path = shard_path.with_name(shard_path.name.replace(".etap", ".index.json"))
    text = bytearray(index_path.read_bytes())
    text[text.index(b'"num_tokens"') + 15] ^= 0x01  # a digit of the first count: still JSON, now wrong
    index_path.write_bytes(bytes(text))


def _truncate_one_byte(shard_path: Path) -> None:
    with open(shard_path, "r+b") as file:
        file.truncate(shard_path.stat().st_size - 1)


@pytest.mark.parametrize("damage", [_flip_index_byte, _truncate_one_byte], ids=["flipped index byte", "truncated"])
def test_a_damaged_shard_is_quarantined_served_around_and_repaired(tmp_path: Path, damage, caplog) -> None:
    data_dir = tmp_path / "data"
    shards = _three_shards(data_dir)
    damage(shards[1])
    with pytest.raises(ShardError):  # strict readers still refuse
        ShardDirectory(data_dir)

    # the trainer's reader serves the other two shards and names the damaged one
    from trainer.data import require_records

    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        assert len(require_records(data_dir)) == 8
    assert "skipping 1 damaged shard(s)" in caplog.text and shards[1].name in caplog.text

    collector = CollectorProcess(data_dir)  # starts (it used to refuse the whole directory)
    try:
        stats = collector.stats()
        assert stats["num_records"] == 8 and stats["num_quarantined_shards"] == 1
        assert shards[1].name in stats["quarantined_shards"][0]
        response = httpx.post(f"{collector.url}/v1/records", content=make_frame("after-damage"),
                              headers={"Content-Type": "application/octet-stream"})
        assert response.status_code == 201, response.text
        assert collector.stats()["num_records"] == 9
    finally:
        collector.stop()
    assert (data_dir / "quarantine" / shards[1].name).exists() and not shards[1].exists()

    repaired = subprocess.run([*EAGLE_TAP, "shards", "repair", "--shards", str(data_dir)],
                              capture_output=True, text=True, timeout=120)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "moved back" in repaired.stdout
    kept = 3 if damage is _truncate_one_byte else 4  # the torn last frame is cut; every other record is kept
    assert f"{kept} records kept" in repaired.stdout
    with ShardDirectory(data_dir) as directory:  # strict again: nothing damaged is left
        assert directory.num_records == 8 + kept + 1
        assert all(verify_shard(shard.shard_path).ok for shard in directory.shards)
    verified = subprocess.run([*EAGLE_TAP, "shards", "verify", "--shards", str(data_dir)],
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0 and "OK" in verified.stdout, verified.stdout


@pytest.mark.parametrize("field,value", [("sample_id", "someone-else"), ("ids_xxh3_64", "0" * 16)])
def test_an_index_that_lies_about_a_record_is_caught(tmp_path: Path, field: str, value: str) -> None:
    shard_path = _three_shards(tmp_path)[0]
    index_path = shard_path.with_name("shard-000001.index.json")
    index = json.loads(index_path.read_text())
    index["records"][2][field] = value
    index_path.write_text(json.dumps(index))
    with ShardDirectory(tmp_path) as directory:
        entry = list(directory.iter_index())[2]
        with pytest.raises(FrameError, match=f"frame has {field}"):
            directory.read_record(entry)
    assert any(f"the index says {value!r}" in problem for problem in verify_shard(shard_path).problems)


def test_a_shard_deleted_with_its_index_left_behind_is_reported(tmp_path: Path, caplog) -> None:
    shards = _three_shards(tmp_path)
    shards[2].unlink()
    with pytest.raises(ShardError, match="index without a shard"):
        ShardDirectory(tmp_path)
    from trainer.data import require_records

    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        assert len(require_records(tmp_path)) == 8
    assert "index without a shard" in caplog.text
