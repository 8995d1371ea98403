"""SIGKILL the collector process while several clients send; restart it; nothing acknowledged is lost.

After the restart every acknowledged record is stored and verifies, no shard is corrupt, and
re-sending everything (acknowledged or not) stores no record twice.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from capture_format import ShardDirectory
from collector_service.shard_tools import verify_directory
from test_collector_support import OCTET_STREAM, CollectorProcess, client_for, make_frame

NUM_SENDERS = 4
RECORDS_PER_SENDER = 400
KILL_AFTER_ACKS = 200
SHARED_IDS = 40
"""Records every sender sends too, so the same new id races between connections."""


def frames_for(sender: int) -> list[tuple[str, bytes]]:
    """The sender's own records, with the shared ones interleaved at the start (every sender, same order)."""
    record_ids = []
    for index in range(RECORDS_PER_SENDER - SHARED_IDS):
        if index < SHARED_IDS:
            record_ids.append(f"shared-{index:03d}")
        record_ids.append(f"s{sender}-{index:04d}")
    return [(record_id, make_frame(record_id, num_tokens=24, hidden_size=128)) for record_id in record_ids]


def send_until_failure(url: str, frames: list[tuple[str, bytes]], acknowledged: set[str], lock: threading.Lock,
                       stop: threading.Event) -> None:
    with client_for(url) as client:
        for record_id, frame in frames:
            if stop.is_set():
                return
            try:
                response = client.post("/v1/records", content=frame, headers=OCTET_STREAM)
            except httpx.TransportError:
                return  # the collector died under us: this record was never acknowledged
            assert response.status_code in (200, 201), response.text
            with lock:
                acknowledged.add(record_id)


def test_sigkill_while_sending_loses_nothing_acknowledged(tmp_path) -> None:
    data_dir = tmp_path / "data"
    log_path = tmp_path / "collector.log"
    all_frames = [frames_for(sender) for sender in range(NUM_SENDERS)]
    collector = CollectorProcess(data_dir, "--seal-after-bytes", "400000", log_path=log_path)

    acknowledged: set[str] = set()
    lock, stop = threading.Lock(), threading.Event()
    senders = [threading.Thread(target=send_until_failure, args=(collector.url, frames, acknowledged, lock, stop))
               for frames in all_frames]
    for sender in senders:
        sender.start()
    deadline = time.monotonic() + 60
    while len(acknowledged) < KILL_AFTER_ACKS and time.monotonic() < deadline:
        time.sleep(0.005)
    collector.kill()  # SIGKILL, mid-traffic
    stop.set()
    for sender in senders:
        sender.join(30)
    assert KILL_AFTER_ACKS <= len(acknowledged) < NUM_SENDERS * RECORDS_PER_SENDER, "the kill missed the traffic"

    collector = CollectorProcess(data_dir, "--seal-after-bytes", "400000", log_path=log_path)
    try:
        stats = collector.client.get("/v1/stats").json()
        assert stats["num_records"] >= len(acknowledged)
        for record_id in sorted(acknowledged):
            assert collector.client.get(f"/v1/records/{record_id}").status_code == 200, record_id

        def resend(frames: list[tuple[str, bytes]]) -> Counter[int]:
            statuses: Counter[int] = Counter()
            with client_for(collector.url) as client:
                for record_id, frame in frames:
                    response = client.post("/v1/records", content=frame, headers=OCTET_STREAM)
                    statuses[response.status_code] += 1
                    if record_id in acknowledged:  # acknowledged before the kill: must be a duplicate now
                        assert response.status_code == 200 and response.json()["status"] == "duplicate", record_id
            return statuses

        with ThreadPoolExecutor(NUM_SENDERS) as pool:  # everything again, concurrently
            statuses = sum(pool.map(resend, all_frames), Counter())
        assert set(statuses) <= {200, 201} and statuses[200] >= len(acknowledged)
    finally:
        collector.stop()

    distinct_ids = {record_id for frames in all_frames for record_id, _ in frames}
    with ShardDirectory(data_dir) as shards:
        stored = Counter(entry.record_id for entry in shards.iter_index())
        assert not shards.open_shard_paths
    assert set(stored) == distinct_ids and max(stored.values()) == 1
    with open(tmp_path / "verify.txt", "w") as out:
        assert verify_directory(data_dir, out=out), (tmp_path / "verify.txt").read_text()
