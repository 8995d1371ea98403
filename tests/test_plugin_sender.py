"""The sender coalesces what is queued into few POSTs against a real collector, each frame acknowledged
on its own, and drains its spool in batches once the collector is back."""

from __future__ import annotations

import time

from sglang_patch import sender as sender_module
from sglang_patch.sender import ModelIdentity, Sender
from sglang_patch.settings import CaptureSettings
from sglang_patch.spool import Spool
from sglang_patch.stats import CaptureStats, read_stats_file
from test_collector_support import TOKEN, ThreadedCollector
from test_plugin_hostile_collector import captured

MODEL = ModelIdentity(capture_layers=(1, 3), hidden_size=16, model_fingerprint="test", state_dtype="bfloat16",
                      codec="bf16-split")


def start_sender(tmp_path, collector_url: str, **settings) -> tuple[Sender, CaptureStats, Spool]:
    config = CaptureSettings(collector_url=collector_url, token=TOKEN, spool_dir=tmp_path / "spool", **settings)
    stats = CaptureStats()
    spool = Spool(config.spool_dir / "dp0", config.spool_max_bytes)
    return Sender(settings=config, model=MODEL, stats=stats, spool=spool, stats_path=tmp_path / "stats.json"), stats, spool


def wait_for_count(stats: CaptureStats, name: str, count: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (snapshot := stats.snapshot()).get(name, 0) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return snapshot


def test_queued_captures_share_posts_and_each_is_stored(tmp_path) -> None:
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        sender, stats, _ = start_sender(tmp_path, collector.url, batch_max_age_s=0.5)
        try:
            for index in range(20):
                sender.submit(captured(f"batched-{index}"))
            snapshot = wait_for_count(stats, "sent", 20)
        finally:
            sender.close()
        assert snapshot["sent"] == 20 and snapshot["dropped"] == {}
        assert snapshot["posts"] <= 3, f"20 captures queued together took {snapshot['posts']} POSTs"
        assert all(collector.store.lookup(f"batched-{index}") is not None for index in range(20))


def test_a_full_batch_goes_at_once_and_a_lone_capture_after_its_age(tmp_path) -> None:
    """The sender thread is woken by a first capture and by a full batch, not by each capture between them."""
    size = captured("probe").raw_nbytes
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        sender, stats, _ = start_sender(tmp_path, collector.url, batch_max_age_s=5.0, batch_max_bytes=3 * size)
        try:
            started = time.monotonic()
            for index in range(3):
                sender.submit(captured(f"full-{index}"))
                time.sleep(0.3)  # the sender thread is waiting for the batch's age by the next one
            full = wait_for_count(stats, "sent", 3)
            full_s = time.monotonic() - started
            sender.submit(captured("lone"))
            time.sleep(1.0)
            early = stats.snapshot()["sent"]
            lone = wait_for_count(stats, "sent", 4)
            lone_s = time.monotonic() - started
        finally:
            sender.close()
        assert full["sent"] == 3 and full["posts"] == 1 and full_s < 3.0, (full, full_s)
        assert early == 3, "a lone capture waits for more up to batch_max_age_s"
        assert lone["sent"] == 4 and lone_s >= 5.0, (lone, lone_s)


def test_a_batch_is_full_of_raw_bytes_not_of_what_the_records_keep_alive(tmp_path) -> None:
    """Records whose unjoined rows keep large forwards alive (`CapturedSequence.run_held_nbytes`, on CPU) count
    them against the in-flight bound, not toward a full batch: they still wait for the batch's age together."""
    size = captured("probe").raw_nbytes
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        sender, stats, _ = start_sender(tmp_path, collector.url, batch_max_age_s=1.0, batch_max_bytes=3 * size)
        try:
            for index in range(2):
                record = captured(f"held-{index}")
                record.run_held_nbytes = 10 * size  # alone past batch_max_bytes
                assert sender.submit(record)
            time.sleep(0.5)
            early = stats.snapshot().get("sent", 0)
            snapshot = wait_for_count(stats, "sent", 2)
        finally:
            sender.close()
    assert early == 0, "records were posted before the batch's age, as if their held bytes filled it"
    assert snapshot["sent"] == 2 and snapshot["posts"] == 1 and snapshot["dropped"] == {}


def test_a_spool_filled_while_the_collector_was_down_drains_in_batches(tmp_path) -> None:
    down_url = "http://127.0.0.1:9"
    sender, stats, spool = start_sender(tmp_path, down_url, batch_max_age_s=0.0)
    try:
        for index in range(12):
            sender.submit(captured(f"late-{index}"))
        wait_for_count(stats, "spooled", 12)
    finally:
        sender.close()
    assert len(spool) == 12
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        sender, stats, spool = start_sender(tmp_path, collector.url)  # a restart finds the spool
        try:
            snapshot = wait_for_count(stats, "resent_from_spool", 12)
        finally:
            sender.close()
        assert snapshot["resent_from_spool"] == 12 and len(spool) == 0 and snapshot["posts"] == 1
        offsets = [collector.store.lookup(f"late-{index}").offset for index in range(12)]
        assert offsets == sorted(offsets), "spooled frames reach the collector in capture order"


def test_the_sender_thread_yields_the_cpu_to_serving(tmp_path) -> None:
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        for nice, expected in ((7, min(base + 7, 19)), (0, base)):
            sender, _, _ = start_sender(tmp_path, collector.url, sender_nice=nice)
            try:
                deadline = time.monotonic() + 10
                while os.getpriority(os.PRIO_PROCESS, sender._thread.native_id) != expected \
                        and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert os.getpriority(os.PRIO_PROCESS, sender._thread.native_id) == expected
            finally:
                sender.close()
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # only the sender's own thread


def test_an_idle_sender_marks_its_stats_quiet_and_sleeps_until_something_changes(tmp_path, monkeypatch) -> None:
    """Nothing queued and nothing changed for a second: the stats file says so (`quiet`) and the sender thread
    sleeps, writing nothing, until a change wakes it; a reader asking for a fresh snapshot takes a quiet one."""
    monkeypatch.setattr(sender_module, "_STATS_EVERY_S", 0.2)
    path = tmp_path / "stats.json"

    def file_once(condition, what: str) -> dict:
        deadline = time.monotonic() + 10
        while not condition(stats := read_stats_file(path)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert condition(stats), f"the stats file never showed {what}: {stats}"
        return stats

    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        sender, stats, _ = start_sender(tmp_path, collector.url, batch_max_age_s=0.0)
        try:
            quiet = file_once(lambda read: read.get("quiet"), "a quiet snapshot")
            cpu_ns = stats.snapshot()["sender_cpu_ns"]
            time.sleep(1.0)  # five periods of the file
            assert read_stats_file(path)["snapshot"] == quiet["snapshot"], "a quiet file is not rewritten"
            assert stats.snapshot()["sender_cpu_ns"] == cpu_ns, "the sleeping sender thread ran"
            started = time.monotonic()
            assert read_stats_file(path, newer_than=time.time())["snapshot"] == quiet["snapshot"]
            assert time.monotonic() - started < 0.5, "a quiet snapshot is current: no wait for a newer one"

            monkeypatch.setattr(sender_module, "_STATS_EVERY_S", 30.0)
            changed = time.monotonic()
            stats.add("captured")  # the forward hook's thread, say
            woken = file_once(lambda read: read.get("captured") == 1, "the change")
            assert time.monotonic() - changed < 1.0, "the change after a quiet snapshot is written at once"
            assert woken["quiet"] is False and woken["snapshot"] > quiet["snapshot"]
            monkeypatch.setattr(sender_module, "_STATS_EVERY_S", 0.2)
            sender.submit(captured("after-quiet"))
            sent = file_once(lambda read: read.get("sent") == 1 and read.get("quiet"), "the capture sent, then quiet")
            assert sent["inflight_bytes"] == 0 and collector.store.lookup("after-quiet") is not None
        finally:
            sender.close()
