"""Ingest: stored vs duplicate, lookups, stats and metrics, concurrency, group commit, disk limits."""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

import capture_format.shards
from capture_format import ShardDirectory, encode_frame, inspect_frame, verify_shard
from collector_service.settings import CollectorSettings
from collector_service.writer import WriteJob, WriterThread
from test_collector_support import ThreadedCollector, disk_snapshot, make_frame, make_record


@pytest.fixture
def collector(tmp_path):
    with ThreadedCollector(data_dir=tmp_path / "data") as running:
        yield running


def test_store_lookup_stats_and_metrics(collector: ThreadedCollector) -> None:
    frames = [make_frame(f"rec-{index}", num_tokens=5 + index) for index in range(3)]
    for index, frame in enumerate(frames):
        response = collector.post(frame)
        assert response.status_code == 201, response.text
        body = response.json()
        assert body["status"] == "stored" and body["durable"] is True
        assert body["record_id"] == f"rec-{index}" and body["shard"] == "shard-000001.etap.open"
        assert body["frame_nbytes"] == len(frame) and body["num_tokens"] == 5 + index

    lookup = collector.client.get("/v1/records/rec-1").json()
    assert lookup["stored"] is True and lookup["offset"] == len(frames[0]) and lookup["sealed"] is False
    missing = collector.client.get("/v1/records/never-sent")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"

    stats = collector.stats()
    infos = [inspect_frame(frame) for frame in frames]
    assert stats["num_records"] == 3 and stats["num_ingested"] == 3
    assert stats["num_tokens"] == 5 + 6 + 7
    assert stats["raw_nbytes"] == sum(info.raw_nbytes for info in infos)
    assert stats["stored_nbytes"] == sum(info.stored_nbytes for info in infos)
    assert stats["frame_nbytes"] == sum(map(len, frames))
    assert stats["open_shards"] == ["shard-000001.etap.open"] and stats["num_sealed_shards"] == 0
    assert stats["num_rejects"] == 0 and stats["durability"] == "fsync"

    metrics = collector.client.get("/metrics").text
    assert "eagle_tap_collector_records 3.0" in metrics
    assert "eagle_tap_collector_ingested_records_total 3.0" in metrics
    assert "eagle_tap_collector_group_commit_seconds_count" in metrics
    assert collector.client.get("/healthz").json() == {"status": "ok", "durability": "fsync"}


def test_duplicates_are_acknowledged_and_not_written(collector: ThreadedCollector) -> None:
    record = make_record("dup-1")
    frame = encode_frame(record)
    assert collector.post(frame).status_code == 201
    disk_before = disk_snapshot(collector.settings.data_dir)

    again = collector.post(frame)
    assert again.status_code == 200
    assert again.json()["status"] == "duplicate" and again.json()["same_frame"] is True
    reencoded = collector.post(encode_frame(record, codec="raw"))  # same id, other bytes
    assert reencoded.status_code == 200
    assert reencoded.json()["status"] == "duplicate" and reencoded.json()["same_frame"] is False

    assert disk_snapshot(collector.settings.data_dir) == disk_before
    stats = collector.stats()
    assert stats["num_records"] == 1 and stats["num_duplicates"] == 2


def test_concurrent_posts_of_one_new_id_store_it_once(collector: ThreadedCollector) -> None:
    frame = make_frame("raced", num_tokens=64, hidden_size=256)
    barrier = threading.Barrier(8)

    def post(_: int) -> int:
        barrier.wait()
        return collector.post(frame).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(post, range(8)))
    assert statuses == [200] * 7 + [201]
    assert collector.stats()["num_records"] == 1
    assert os.path.getsize(collector.settings.data_dir / "shard-000001.etap.open") == len(frame)


def test_concurrent_senders_all_stored_and_verified(tmp_path) -> None:
    num_senders, per_sender = 6, 12
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        def send(sender: int) -> list[int]:
            return [collector.post(make_frame(f"s{sender}-r{index}", num_tokens=16, hidden_size=128)).status_code
                    for index in range(per_sender)]

        with ThreadPoolExecutor(num_senders) as pool:
            statuses = [status for result in pool.map(send, range(num_senders)) for status in result]
        assert statuses == [201] * (num_senders * per_sender)
        stats = collector.stats()
        assert stats["num_records"] == num_senders * per_sender
        assert 1 <= stats["num_group_commits"] <= num_senders * per_sender
    with ShardDirectory(tmp_path / "data") as shards:  # the clean stop sealed the open shard
        assert shards.num_records == num_senders * per_sender and not shards.open_shard_paths
        assert all(verify_shard(shard.shard_path).ok for shard in shards.shards)
        for entry in shards.iter_index():
            shards.read_record(entry)


def test_jobs_queued_during_a_sync_share_the_next_one(tmp_path, monkeypatch) -> None:
    """Group commit, deterministically: while the first sync hangs, four more frames arrive; one sync covers them."""
    delivered: queue.Queue = queue.Queue()
    sync_entered, release_sync = threading.Event(), threading.Event()
    num_syncs = 0
    real_fdatasync = os.fdatasync

    def slow_fdatasync(fd: int) -> None:
        nonlocal num_syncs
        num_syncs += 1
        sync_entered.set()
        release_sync.wait(10)
        real_fdatasync(fd)

    monkeypatch.setattr(capture_format.shards.os, "fdatasync", slow_fdatasync)
    writer = WriterThread(tmp_path, durability="fsync", seal_after_bytes=1 << 30, seal_after_s=600,
                          max_group_commit_bytes=1 << 30, seal_on_shutdown=True,
                          deliver=lambda results, events: delivered.put(results))
    writer.start()
    frames = [make_frame(f"group-{index}") for index in range(5)]
    jobs = [WriteJob(view=memoryview(frame), info=inspect_frame(frame), token=index)
            for index, frame in enumerate(frames)]
    writer.submit(jobs[0])
    assert sync_entered.wait(10)
    for job in jobs[1:]:
        writer.submit(job)
    time.sleep(0.05)
    release_sync.set()
    first, second = delivered.get(timeout=10), delivered.get(timeout=10)
    assert [result.job.token for result in first] == [0]
    assert [result.job.token for result in second] == [1, 2, 3, 4]
    assert all(result.error is None for result in first + second)
    assert num_syncs == 2
    writer.stop()
    writer.join(10)


def test_restart_keeps_every_id_deduplicated(tmp_path) -> None:
    frames = [make_frame(f"keep-{index}") for index in range(3)]
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        assert [collector.post(frame).status_code for frame in frames] == [201] * 3
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        assert [collector.post(frame).status_code for frame in frames] == [200] * 3
        lookup = collector.client.get("/v1/records/keep-2").json()
        assert lookup["shard"] == "shard-000001.etap" and lookup["sealed"] is True
        stats = collector.stats()
        assert stats["num_records"] == 3 and stats["num_sealed_shards"] == 1 and stats["num_ingested"] == 0


def test_low_free_space_is_refused_with_507(tmp_path) -> None:
    with ThreadedCollector(data_dir=tmp_path / "data", min_free_bytes=1 << 62) as collector:
        response = collector.post(make_frame("no-room"))
        assert response.status_code == 507
        assert response.json()["error"] == "insufficient_storage" and "min_free_bytes" in response.json()["detail"]
        assert disk_snapshot(collector.settings.data_dir) == {}
        assert collector.stats()["rejects"] == {"insufficient_storage": 1}


def test_disk_full_mid_write_leaves_nothing_partial(collector: ThreadedCollector, monkeypatch) -> None:
    assert collector.post(make_frame("before-full")).status_code == 201
    shard_path = collector.settings.data_dir / "shard-000001.etap.open"
    size_before = os.path.getsize(shard_path)
    real_pwrite = os.pwrite

    def half_then_full(fd: int, data, offset: int) -> int:
        real_pwrite(fd, memoryview(data)[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(capture_format.shards.os, "pwrite", half_then_full)
    response = collector.post(make_frame("while-full"))
    monkeypatch.undo()
    assert response.status_code == 507 and response.json()["error"] == "insufficient_storage"
    assert os.path.getsize(shard_path) == size_before
    assert collector.client.get("/v1/records/while-full").status_code == 404
    assert collector.post(make_frame("after-full")).status_code == 201
    assert collector.post(make_frame("while-full")).status_code == 201


def test_failed_sync_stops_ingest_and_health(collector: ThreadedCollector, monkeypatch) -> None:
    def failing_fdatasync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(capture_format.shards.os, "fdatasync", failing_fdatasync)
    response = collector.post(make_frame("sync-fails"))
    assert response.status_code == 503 and response.json()["error"] == "storage_failed"
    monkeypatch.undo()
    assert collector.post(make_frame("after-sync-failure")).json()["error"] == "storage_failed"
    health = collector.client.get("/healthz")
    assert health.status_code == 503 and "Input/output error" in health.json()["detail"]
    assert collector.client.get("/v1/records/sync-fails").status_code == 404


def test_settings_refuse_an_open_port_without_a_token(tmp_path) -> None:
    with pytest.raises(ValidationError, match="not loopback and no token"):
        CollectorSettings(data_dir=tmp_path, host="0.0.0.0")
    assert CollectorSettings(data_dir=tmp_path, host="0.0.0.0", token="t").host == "0.0.0.0"
    assert CollectorSettings(data_dir=tmp_path).token is None


def test_settings_read_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EAGLE_TAP_COLLECTOR_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("EAGLE_TAP_COLLECTOR_DURABILITY", "none")
    monkeypatch.setenv("EAGLE_TAP_COLLECTOR_SEAL_AFTER_S", "2.5")
    settings = CollectorSettings()
    assert (settings.data_dir, settings.durability, settings.seal_after_s) == (tmp_path, "none", 2.5)
    with pytest.raises(ValidationError):
        CollectorSettings(durability="sometimes")
