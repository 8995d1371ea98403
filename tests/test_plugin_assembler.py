"""Row-to-request mapping and chunk assembly, on hand-made batches whose every row names its owner.

Each row of `aux` holds (request number, token position) so a misattributed or missing row shows up
as a wrong value. The same code runs inside the real server in tests/test_plugin_capture.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler, is_sampled
from sglang_patch.stats import CaptureStats

HIDDEN = 4
NUM_LAYERS = 2


def make_req(number: int, length: int, *, tagged: bool = True, custom_params=None):
    tag = CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=((0, length),))
    params = custom_params if custom_params is not None else (tag.to_custom_params() if tagged else None)
    return SimpleNamespace(rid=f"rid-{number}", full_untruncated_fill_ids=list(range(100 * number, 100 * number + length)),
                           sampling_params=SimpleNamespace(custom_params=params))


def rows(number: int, start: int, count: int):
    """Rows for tokens [start, start+count) of request `number`, every value 1000 * number + position."""
    values = (1000 * number + torch.arange(start, start + count, dtype=torch.float32))[:, None]  # (count, 1)
    return values.expand(count, NUM_LAYERS * HIDDEN).to(torch.bfloat16), values.expand(count, HIDDEN).to(torch.bfloat16)


def batch(chunks):
    """chunks: [(req, number, prefix_len, extend_len)] -> the arguments of on_extend."""
    auxes, finals = zip(*(rows(number, prefix, extend) for _, number, prefix, extend in chunks))
    return ([req for req, *_ in chunks], [prefix for *_, prefix, _ in chunks], [extend for *_, extend in chunks],
            torch.cat(auxes), torch.cat(finals))


@pytest.fixture
def assembler():
    emitted = []
    stats = CaptureStats()
    return CaptureAssembler(stats=stats, emit=emitted.append), emitted, stats


def check_record(captured, number: int, length: int):
    expected_aux, expected_final = rows(number, 0, length)
    assert captured.tag.record_id == f"rec-{number}"
    assert captured.token_ids == list(range(100 * number, 100 * number + length))
    aux, final = captured.states()
    assert torch.equal(aux, expected_aux) and torch.equal(final, expected_final)


def test_rows_of_a_mixed_batch_go_to_their_own_requests(assembler):
    asm, emitted, stats = assembler
    a, b, untagged, c = make_req(1, 5), make_req(2, 3), make_req(3, 7, tagged=False), make_req(4, 1)
    asm.on_extend(*batch([(a, 1, 0, 5), (b, 2, 0, 3), (untagged, 3, 0, 7), (c, 4, 0, 1)]))
    assert [captured.tag.record_id for captured in emitted] == ["rec-1", "rec-2", "rec-4"]
    for captured, (number, length) in zip(emitted, [(1, 5), (2, 3), (4, 1)]):
        check_record(captured, number, length)
    assert stats.snapshot()["captured"] == 3


def test_chunks_interleaved_with_other_requests_assemble_in_order(assembler):
    asm, emitted, _ = assembler
    long_req, short_req = make_req(1, 10), make_req(2, 2)
    asm.on_extend(*batch([(long_req, 1, 0, 4)]))
    asm.on_extend(*batch([(short_req, 2, 0, 2), (long_req, 1, 4, 4)]))
    assert [captured.tag.record_id for captured in emitted] == ["rec-2"]
    asm.on_extend(*batch([(long_req, 1, 8, 2)]))
    check_record(emitted[-1], 1, 10)
    assert asm.num_partials == 0


def test_first_chunk_with_a_cached_prefix_is_dropped_once(assembler):
    asm, emitted, stats = assembler
    req = make_req(1, 8)
    asm.on_extend(*batch([(req, 1, 3, 3)]))
    asm.on_extend(*batch([(req, 1, 6, 2)]))
    assert emitted == [] and stats.snapshot()["dropped"] == {"cached_prefix": 1}


def test_a_gap_between_chunks_drops_the_capture(assembler):
    asm, emitted, stats = assembler
    req = make_req(1, 12)
    asm.on_extend(*batch([(req, 1, 0, 4)]))
    asm.on_extend(*batch([(req, 1, 6, 6)]))
    assert emitted == [] and stats.snapshot()["dropped"] == {"gap": 1} and asm.num_partials == 0


def test_a_restarted_request_is_captured_from_its_new_start(assembler):
    asm, emitted, stats = assembler
    req = make_req(1, 6)
    asm.on_extend(*batch([(req, 1, 0, 3)]))
    asm.on_extend(*batch([(req, 1, 0, 6)]))
    check_record(emitted[0], 1, 6)
    assert stats.snapshot()["restarted"] == 1


def test_partials_that_never_finish_expire(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("sglang_patch.capture.time.monotonic", lambda: clock[0])
    emitted, stats = [], CaptureStats()
    asm = CaptureAssembler(stats=stats, emit=emitted.append, partial_ttl_s=5.0)
    asm.on_extend(*batch([(make_req(1, 10), 1, 0, 4)]))
    clock[0] += 10.0
    asm.on_extend(*batch([(make_req(2, 2, tagged=False), 2, 0, 2)]))
    assert stats.snapshot()["dropped"] == {"expired": 1} and asm.num_partials == 0 and emitted == []


@pytest.mark.parametrize("custom_params", [
    {"eagle_tap": {"record_id": "../etc"}},
    {"eagle_tap": {"record_id": "ok", "spans": [[5, 2]]}},
    {"eagle_tap": "yes"},
])
def test_invalid_tags_are_counted_and_not_captured(assembler, custom_params):
    asm, emitted, stats = assembler
    asm.on_extend(*batch([(make_req(1, 4, custom_params=custom_params), 1, 0, 4)]))
    assert emitted == [] and stats.snapshot()["dropped"] == {"invalid_tag": 1}


def test_spans_past_the_sequence_end_are_refused(assembler):
    asm, emitted, stats = assembler
    params = CaptureTag(record_id="r", sample_id="s", loss_spans=((2, 9),)).to_custom_params()
    asm.on_extend(*batch([(make_req(1, 4, custom_params=params), 1, 0, 4)]))
    assert emitted == [] and stats.snapshot()["dropped"] == {"spans_out_of_range": 1}


def test_sampling_is_deterministic_and_close_to_the_rate():
    ids = [f"record-{i}" for i in range(4000)]
    kept = [record_id for record_id in ids if is_sampled(record_id, 0.25)]
    assert 900 < len(kept) < 1100
    assert kept == [record_id for record_id in ids if is_sampled(record_id, 0.25)]
    assert all(is_sampled(record_id, 1.0) for record_id in ids[:10])
    assert not any(is_sampled(record_id, 0.0) for record_id in ids[:100])


def test_stats_summary_names_counts_and_drop_reasons():
    stats = CaptureStats()
    stats.status = "capturing"
    stats.add("captured", 3)
    stats.add("sent", 2)
    stats.drop("spool_full")
    line = stats.summary()
    assert line.startswith("eagle-tap capture [capturing]:")
    assert "captured=3" in line and "sent=2" in line and "spooled=0" in line and "'spool_full': 1" in line
