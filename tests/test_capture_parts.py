"""A long capture leaves the plugin in parts and becomes one record at the collector, only once it is whole.

The assembler, the sender and the collector here are the real ones (the collector served over loopback);
only the batches are hand-made, every row naming its token (tests/test_plugin_assembler.py). The same path
inside a real SGLang server: tests/test_long_capture.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from capture_format import ShardDirectory, encode_frame
from capture_format.frames import inspect_frame_header
from capture_format.parts import PartsDigest
from capture_format.prefix_blocks import is_prefix_block
from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler, CapturedSequence
from sglang_patch.device_copy import HostRows
from sglang_patch.sender import to_records
from sglang_patch.stats import CaptureStats
from test_collector_support import ThreadedCollector
from test_plugin_sender import MODEL, start_sender, wait_for_count

HIDDEN, NUM_LAYERS = MODEL.hidden_size, len(MODEL.capture_layers)


def token_rows(start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of tokens [start, start + count): every value is the token's position (exact in bf16 below 256)."""
    values = torch.arange(start, start + count, dtype=torch.float32)[:, None]  # (count, 1)
    return (values.expand(count, NUM_LAYERS * HIDDEN).to(torch.bfloat16),  # (count, K*H)
            values.expand(count, HIDDEN).to(torch.bfloat16))  # (count, H)


def make_request(record_id: str, length: int, mode: str = "prefill"):
    tag = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=((length // 2, length),), mode=mode)
    ids = list(range(1000, 1000 + length))
    return SimpleNamespace(rid=f"rid-{record_id}", origin_input_ids=ids, output_ids=[], full_untruncated_fill_ids=ids,
                           sampling_params=SimpleNamespace(custom_params=tag.to_custom_params()), cache_salt=None,
                           input_embeds=None, mm_inputs=None)


def prefill(assembler: CaptureAssembler, req, chunk_tokens: int) -> int:
    """Runs the request's prompt through the assembler in chunks; returns the most rows it ever held."""
    assembler.selector.on_request(req)
    most = 0
    for start in range(0, len(req.origin_input_ids), chunk_tokens):
        count = min(chunk_tokens, len(req.origin_input_ids) - start)
        assembler.on_extend([req], [start], [count], *token_rows(start, count))
        partial = assembler._partials.get(req.rid)
        most = max(most, partial.num_rows if partial is not None else 0)
    return most


def test_a_long_prefill_capture_is_sent_in_parts_and_stored_whole_once_closed(tmp_path) -> None:
    with ThreadedCollector(data_dir=tmp_path / "data", seal_after_s=0.2) as collector:
        sender, stats, _ = start_sender(tmp_path, collector.url)
        assembler = CaptureAssembler(stats=stats, emit=sender.submit, part_max_tokens=8)
        try:
            most = prefill(assembler, make_request("long-1", 50), chunk_tokens=6)
            snapshot = wait_for_count(stats, "sent", 1 + 6)
        finally:
            sender.close()
        assert most < 8 + 6, f"the assembler held {most} rows: more than a part plus a prefill chunk"
        assert snapshot["parts_cut"] == 6 and snapshot["parts_sent"] == 6 and snapshot["dropped"] == {}
        parts = collector.stats()["parts"]
        assert parts["parts_staged"] == 6 and parts["captures_closed"] == 1 and parts["open_captures"] == 0
        time.sleep(0.5)  # sealed after seal_after_s
    with ShardDirectory(tmp_path / "data") as shards:
        assert [entry.record_id for entry in shards.iter_index()] == ["long-1"]  # parts are never samples
        entries = {entry.record_id: entry for shard in shards.shards for entry in shard.entries}
        assert sorted(entry.num_tokens for record_id, entry in entries.items() if is_prefix_block(record_id)) == \
            [8, 16, 24, 32, 40, 48]
        record = shards.read_record(entries["long-1"])
    assert record.token_ids.tolist() == list(range(1000, 1050)) and record.loss_spans == ((25, 50),)
    assert np.array_equal(bf16_values(record.aux)[:, :, 0], np.arange(50, dtype=np.float32)[:, None].repeat(2, 1))
    assert np.array_equal(bf16_values(record.final)[:, 0], np.arange(50, dtype=np.float32))
    assert "capture_parts" in record.metadata and record.metadata["capture_parts"]["count"] == 6


def part_frames(record_id: str, length: int, part_tokens: int, offset: float = 0.0) -> tuple[list[bytes], bytes]:
    """The frames the sender makes of a capture of `length` tokens in parts of part_tokens: (parts, closing)."""
    tag = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=((0, length),))
    ids = list(range(2000, 2000 + length))
    digest, frames = PartsDigest(), []
    ends = list(range(part_tokens, length, part_tokens))
    for index, end in enumerate(ends):
        start = end - part_tokens
        aux, final = (rows + offset for rows in token_rows(start, part_tokens))
        part = CapturedSequence(tag=tag, token_ids=ids[:end], chunks=[HostRows(aux=aux, final=final)], loss_spans=(),
                                num_states=end, metadata={}, part_index=index, rows_start=start)
        frames.append(encode_frame(to_records(part, MODEL)[0], MODEL.codec))
        info = inspect_frame_header(frames[-1])
        digest.update(info.record_id, info.header_xxh3_64)
    aux, final = token_rows(ends[-1], length - ends[-1])
    closing = CapturedSequence(tag=tag, token_ids=ids, chunks=[HostRows(aux=aux, final=final)], loss_spans=((0, length),),
                               num_states=length, metadata={}, parts_before=len(ends), rows_start=ends[-1])
    return frames, encode_frame(to_records(closing, MODEL, digest.hexdigest())[0], MODEL.codec)


@pytest.fixture
def collector(tmp_path):
    with ThreadedCollector(data_dir=tmp_path / "data", part_timeout_s=1.0) as running:
        yield running


def test_a_resent_part_is_kept_once_and_the_record_is_stored_once(collector) -> None:
    parts, closing = part_frames("resent", 30, 10)
    assert [collector.post(frame).json()["status"] for frame in parts] == ["stored", "stored"]
    assert collector.post(parts[1]).json()["status"] == "duplicate"
    assert collector.post(closing).status_code == 201
    assert collector.post(closing).json()["status"] == "duplicate"
    assert collector.post(parts[0]).json()["status"] == "duplicate"  # its capture is closed: stored with it
    stats = collector.stats()
    assert stats["parts"]["parts_staged"] == 2 and stats["parts"]["captures_closed"] == 1
    assert stats["num_records"] == 3 and stats["parts"]["open_captures"] == 0
    metrics = collector.client.get("/metrics").text
    assert "eagle_tap_collector_part_captures_closed_total 1.0" in metrics
    assert "eagle_tap_collector_part_captures_open 0.0" in metrics


def test_a_record_missing_a_part_is_refused_and_unclosed_parts_expire(collector, tmp_path) -> None:
    parts, closing = part_frames("gappy", 40, 10)
    for frame in (parts[0], parts[2]):
        assert collector.post(frame).status_code == 201
    refused = collector.post(closing)
    assert refused.status_code == 409 and refused.json()["error"] == "parts_missing"
    assert "parts 1 were never received" in refused.json()["detail"]
    assert collector.store.lookup("gappy") is None
    deadline = time.monotonic() + 10
    while (parts_stats := collector.stats()["parts"])["open_captures"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert parts_stats["captures_expired"] == 1 and parts_stats["parts_expired"] == 2
    assert not any((tmp_path / "data" / "parts").iterdir())
    assert collector.stats()["num_records"] == 0
    # Its record coming after that is told apart from a record whose parts never came: counted and named.
    late = collector.post(closing)
    assert late.status_code == 409 and late.json()["error"] == "parts_expired", late.json()
    assert "--part-timeout-s" in late.json()["detail"]
    assert collector.stats()["parts"]["records_refused_parts_expired"] == 1
    assert "eagle_tap_collector_part_records_refused_expired_total 1.0" in collector.client.get("/metrics").text


def test_parts_left_by_an_earlier_run_expire_no_sooner_than_the_timeout_after_the_restart(tmp_path) -> None:
    """The time a collector was down, when no plugin could send, never counts against a capture."""
    import os

    parts, closing = part_frames("across-restart", 30, 10)
    with ThreadedCollector(data_dir=tmp_path / "data", part_timeout_s=5.0) as first:
        for frame in parts:
            assert first.post(frame).status_code == 201
    long_ago = time.time() - 3600  # as if the collector had been down for an hour
    for path in (tmp_path / "data" / "parts").rglob("*"):
        os.utime(path, (long_ago, long_ago))
    with ThreadedCollector(data_dir=tmp_path / "data", part_timeout_s=5.0) as second:
        deadline = time.monotonic() + 4
        while not second.stats()["parts"]["open_captures"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the first sweep lists the folder (and, timed from the files alone, removed it)
        parts_stats = second.stats()["parts"]
        assert parts_stats["open_captures"] == 1 and parts_stats["captures_expired"] == 0, parts_stats
        assert second.post(closing).status_code == 201


def test_parts_of_another_attempt_do_not_close_a_record(collector) -> None:
    first, _ = part_frames("attempt", 30, 10, offset=0.5)
    second, closing = part_frames("attempt", 30, 10)
    for frame in first:
        assert collector.post(frame).status_code == 201
    refused = collector.post(closing)
    assert refused.status_code == 409 and refused.json()["error"] == "parts_differ"
    assert collector.store.lookup("attempt") is None
    for frame in second:  # the same indexes, other states: the newer part replaces the older
        assert collector.post(frame).json()["status"] == "stored"
    assert collector.post(closing).status_code == 201


def bf16_values(states: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as float32."""
    return torch.from_numpy(states.view(np.int16).copy()).view(torch.bfloat16).float().numpy()


# The assembler alone: what it hands the sender, joined back part by part.

def joined(emitted: list[CapturedSequence], record_id: str) -> tuple[torch.Tensor, CapturedSequence]:
    """The aux rows of a capture's parts and record, in order, after checking they follow one another."""
    mine = [captured for captured in emitted if captured.tag.record_id == record_id and not captured.blocks_only]
    *parts, record = mine
    assert [part.part_index for part in parts] == list(range(len(parts))) and record.parts_before == len(parts)
    auxes, end = [], parts[0].first_row if parts else record.first_row
    for captured in mine:
        assert captured.first_row == end, "a part does not start where the one before it ended"
        aux, _ = captured.states()
        auxes.append(aux)
        end = captured.num_states
    return torch.cat(auxes), record


def test_a_long_generation_retracted_midway_keeps_the_parts_it_sent(tmp_path) -> None:
    from test_plugin_assembler import GeneratingReq, batch, decode_rows, rows, sample

    emitted: list[CapturedSequence] = []
    stats = CaptureStats()
    asm = CaptureAssembler(stats=stats, emit=emitted.append, part_max_tokens=4)
    req = GeneratingReq(0, 10)  # number 0: every row holds its position, exact in bf16
    asm.selector.on_request(SimpleNamespace(rid=req.rid, sampling_params=req.sampling_params, cache_salt=None,
                                            input_embeds=None, mm_inputs=None))
    asm.on_extend(*batch([(req, 0, 0, 10)]))
    sample(asm, [req])
    for _ in range(7):
        asm.on_decode(*decode_rows([(req, 0)]))
        sample(asm, [req])
    sent_before = len(emitted)
    # Retracted, then prefilled again from scratch over its 17 tokens: rows already sent are not taken again.
    asm.on_extend(*batch([(req, 0, 0, len(req.full_untruncated_fill_ids))]))
    sample(asm, [req])
    for step in range(3):
        asm.on_decode(*decode_rows([(req, 0)]))
        sample(asm, [req], finish={"rid-0"} if step == 2 else set())
    aux, record = joined(emitted, "rec-0")
    assert sent_before >= 3 and stats.snapshot()["restarted"] == 1
    assert len(record.token_ids) == 10 + 12 and record.num_states == 21
    assert aux[:, 0].tolist() == list(range(21))
    assert stats.snapshot()["most_rows_held"] <= 4 + 10  # a part plus the largest forward's rows


def test_a_plans_blocks_go_as_their_rows_come_and_the_records_resolve() -> None:
    """Shared-prefix blocks of a long prompt leave as soon as their rows are held (a prompt's blocks cover
    all but its last few tokens, so holding them until the end would hold the whole prompt)."""
    from capture_format.prefix_blocks import resolve_prefix
    from sglang_patch.selection import Selector
    from test_prefix_blocks import arrival

    emitted: list[CapturedSequence] = []
    stats = CaptureStats()
    selector = Selector(stats=stats, sample_rate=1.0, live_sample_rate=1.0, prefix_block_tokens=8)
    asm = CaptureAssembler(stats=stats, emit=emitted.append, selector=selector, part_max_tokens=8)
    system = list(range(500, 520))  # blocks end at 8 and 16 in both prompts
    prompts = {"one": system + list(range(600, 640)), "two": system + list(range(700, 730))}
    for name, ids in prompts.items():
        tag = CaptureTag(record_id=name, sample_id=name, loss_spans=((20, len(ids)),))
        req = SimpleNamespace(rid=f"rid-{name}", origin_input_ids=ids, output_ids=[], full_untruncated_fill_ids=ids)
        selector.on_request(arrival(req.rid, ids, tag))
        first = 16 if name == "two" else 0  # the second reuses the first's blocks: its prefill starts there
        for start in range(first, len(ids), 12):
            count = min(12, len(ids) - start)
            asm.on_extend([req], [start], [count], *token_rows(start, count))
    assert [len(captured.block_ends) for captured in emitted if captured.blocks_only] == [1, 2, 1, 2, 1, 1, 2, 1]
    assert stats.snapshot()["most_rows_held"] <= 8 + 12  # never the whole prompt
    records = [record for captured in emitted for record in to_records(captured, MODEL)]
    blocks = {record.record_id: record for record in records if is_prefix_block(record.record_id)}
    assert len(blocks) == 7 + 4  # "one": 8..56; "two": 24..48 (8 and 16 reused)
    for name, ids in prompts.items():
        stored = next(record for record in records if record.record_id == name)
        assert stored.states_prefix.num_tokens == (len(ids) - 1) // 8 * 8
        whole = resolve_prefix(stored, blocks.get)
        assert whole.token_ids.tolist() == ids
        assert np.array_equal(bf16_values(whole.final)[:, 0], np.arange(len(ids), dtype=np.float32))
    assert stats.snapshot()["dropped"] == {}


def test_verified_rows_of_a_replica_serving_a_draft_go_in_parts_too() -> None:
    from test_spec_capture_units import CHAIN, SpecReq, prefill as spec_prefill, verify

    emitted: list[CapturedSequence] = []
    stats = CaptureStats()
    asm = CaptureAssembler(stats=stats, emit=emitted.append, served_draft=lambda: ("d" * 32, CHAIN), part_max_tokens=5)
    req = SpecReq(1, 12)
    asm.selector.on_request(SimpleNamespace(rid=req.rid, sampling_params=req.sampling_params, cache_salt=None,
                                            input_embeds=None, mm_inputs=None))
    spec_prefill(asm, [req])
    accepted = [3, 0, 2, 3, 1, 3, 3, 0]
    for step, count in enumerate(accepted):
        verify(asm, [req], [count], finish={req.rid} if step == len(accepted) - 1 else set())
    aux, record = joined(emitted, "rec-1")
    assert record.parts_before >= 4 and record.num_states == len(record.token_ids) - 1
    assert aux[:, 0].tolist() == [1000.0 + position for position in range(record.num_states)]
    assert record.record_metadata()["served_draft"]["accepted_per_step"] == "".join(map(str, accepted))
    assert stats.snapshot()["dropped"] == {}
