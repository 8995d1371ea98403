"""The sender's encoder threads: captures encoded side by side still reach a real collector in capture order,
a capture's parts in order and closed by the right digest, with the same bytes as one thread makes."""

from __future__ import annotations

import threading

import pytest
import torch

from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler, CapturedSequence
from sglang_patch.device_copy import HostRows
from sglang_patch.sender import ModelIdentity, Sender, default_encode_threads
from sglang_patch.settings import CaptureSettings
from sglang_patch.spool import Spool
from sglang_patch.stats import CaptureStats
from test_capture_parts import make_request, prefill
from test_collector_support import TOKEN, ThreadedCollector
from test_plugin_sender import MODEL, wait_for_count

WIDE = ModelIdentity(capture_layers=(1, 3), hidden_size=512, model_fingerprint="test", state_dtype="bfloat16",
                     codec="bf16-split")


def start(tmp_path, url: str, model: ModelIdentity, **settings) -> tuple[Sender, CaptureStats]:
    config = CaptureSettings(collector_url=url, token=TOKEN, spool_dir=tmp_path / "spool", **settings)
    stats = CaptureStats()
    return Sender(settings=config, model=model, stats=stats, spool=Spool(config.spool_dir / "dp0", 1 << 30),
                  stats_path=tmp_path / "stats.json"), stats


def whole(record_id: str, num_tokens: int, model: ModelIdentity = WIDE) -> CapturedSequence:
    generator = torch.Generator().manual_seed(num_tokens)
    width = len(model.capture_layers) * model.hidden_size
    aux = torch.randn(num_tokens, width, generator=generator).to(torch.bfloat16)  # (T, K*H)
    final = torch.randn(num_tokens, model.hidden_size, generator=generator).to(torch.bfloat16)  # (T, H)
    tag = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=((0, num_tokens),))
    return CapturedSequence(tag=tag, token_ids=list(range(num_tokens)), chunks=[HostRows(aux=aux, final=final)],
                            loss_spans=tag.loss_spans, num_states=num_tokens, metadata={})


# A large capture first, then small ones: encoded side by side, the small ones are ready first.
SIZES = [4000, 3, 5, 2000, 1, 7, 2, 1500, 4, 6]


@pytest.mark.parametrize("threads", [1, 3])
def test_captures_encoded_side_by_side_reach_the_collector_in_capture_order(tmp_path, threads: int) -> None:
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        before = set(threading.enumerate())
        sender, stats = start(tmp_path, collector.url, WIDE, sender_threads=threads, batch_max_age_s=0.3)
        try:
            assert sender.num_encode_threads == threads
            for index, size in enumerate(SIZES):
                assert sender.submit(whole(f"ordered-{index}", size))
            snapshot = wait_for_count(stats, "sent", len(SIZES))
            encoders = [thread for thread in set(threading.enumerate()) - before
                        if thread.name.startswith("eagle-tap-encode")]
            assert len(encoders) == (threads if threads > 1 else 0)
        finally:
            sender.close()
        assert snapshot["sent"] == len(SIZES) and snapshot["dropped"] == {}
        assert snapshot["sender_threads"] == threads and sender.idle(), "every capture's buffers released"
        offsets = [collector.store.lookup(f"ordered-{index}").offset for index in range(len(SIZES))]
        assert offsets == sorted(offsets), "frames reach the collector in capture order"


def test_parts_of_interleaved_long_captures_close_with_their_digests(tmp_path) -> None:
    with ThreadedCollector(data_dir=tmp_path / "data") as collector:
        config = CaptureSettings(collector_url=collector.url, token=TOKEN, spool_dir=tmp_path / "spool",
                                 sender_threads=4, batch_max_age_s=0.2)
        stats = CaptureStats()
        sender = Sender(settings=config, model=MODEL, stats=stats, spool=Spool(config.spool_dir / "dp0", 1 << 30),
                        stats_path=tmp_path / "stats.json")
        assembler = CaptureAssembler(stats=stats, emit=sender.submit, part_max_tokens=4)
        try:
            for index, length in enumerate((41, 23, 37)):  # their parts queued together, many per batch
                prefill(assembler, make_request(f"long-{index}", length), chunk_tokens=5)
            num_parts = 10 + 5 + 9
            snapshot = wait_for_count(stats, "sent", num_parts + 3)
        finally:
            sender.close()
        assert snapshot["parts_sent"] == num_parts and snapshot["dropped"] == {}, snapshot
        parts = collector.stats()["parts"]
        assert parts["parts_staged"] == num_parts and parts["captures_closed"] == 3 and parts["open_captures"] == 0


def test_one_or_many_encoder_threads_store_the_same_bytes(tmp_path) -> None:
    stored = {}
    for threads in (1, 2):
        with ThreadedCollector(data_dir=tmp_path / f"data{threads}") as collector:
            sender, stats = start(tmp_path / f"s{threads}", collector.url, WIDE, sender_threads=threads)
            try:
                for index, size in enumerate(SIZES[:5]):
                    sender.submit(whole(f"same-{index}", size))
                wait_for_count(stats, "sent", 5)
            finally:
                sender.close()
            locations = [collector.store.lookup(f"same-{index}") for index in range(5)]
            # The header's checksum covers the payload's checksums: equal headers, equal frames.
            stored[threads] = [(location.frame_nbytes, location.header_xxh3_64) for location in locations]
    assert stored[1] == stored[2]


@pytest.mark.parametrize(("bytes_per_token", "cores", "threads"), [
    (57_344, 64, 3),  # Kimi-K2's width: 573 MB/s at 10,000 tokens/s, 200 MB/s a thread
    (57_344, 8, 2),  # at most a quarter of the cores
    (57_344, 2, 1),  # always one
    (1_024, 64, 1),  # the tiny target: one thread is plenty
    (4 * 16_384 * 2, 256, 7),
    (10 * 65_536 * 4, 256, 8),  # at most 8 by default
])
def test_the_default_pool_is_sized_from_the_width_and_the_cores(bytes_per_token: int, cores: int, threads: int) -> None:
    assert default_encode_threads(bytes_per_token, cores) == threads


def test_a_bad_thread_count_is_refused_with_its_bounds() -> None:
    with pytest.raises(ValueError, match="sender_threads"):
        CaptureSettings(collector_url="http://127.0.0.1:1", sender_threads=-1)
    with pytest.raises(ValueError, match="sender_threads"):
        CaptureSettings(collector_url="http://127.0.0.1:1", sender_threads=65)
    assert CaptureSettings(collector_url="http://127.0.0.1:1").sender_threads == 0
