"""Row-to-request mapping and chunk assembly, on hand-made batches whose every row names its owner.

Each row of `aux` holds (request number, token position) so a misattributed or missing row shows up
as a wrong value. The same code runs inside the real server in tests/test_plugin_capture.py.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch

from capture_format.tag import CaptureTag
from sglang_patch import capture
from sglang_patch.capture import CaptureAssembler, is_sampled
from sglang_patch.selection import Selector, live_record_id
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


def arrival(req, cache_salt=None):
    """What the BEFORE hook on Scheduler.handle_generate_request sees of a request."""
    return SimpleNamespace(rid=req.rid, sampling_params=req.sampling_params, cache_salt=cache_salt,
                           input_embeds=None, mm_inputs=None)


class ArrivingAssembler(CaptureAssembler):
    """The scheduler's order of events: a request reaches the selector before its first forward."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: set[str] = set()

    def on_extend(self, reqs, *rest) -> None:
        for req in reqs:
            if req.rid not in self.seen:
                self.seen.add(req.rid)
                self.selector.on_request(arrival(req))
        super().on_extend(reqs, *rest)


@pytest.fixture
def assembler():
    emitted = []
    stats = CaptureStats()
    return ArrivingAssembler(stats=stats, emit=emitted.append), emitted, stats


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
    asm = ArrivingAssembler(stats=stats, emit=emitted.append, partial_ttl_s=5.0)
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


@pytest.mark.parametrize("rate", [0.1, 0.25])
def test_ids_that_differ_in_a_digit_or_two_are_sampled_independently(rate):
    # The spec-capture benchmark's request ids, 100 runs of 96 consecutive ones: the number sampled in each should
    # spread as independent draws do (binomial variance). With CRC32 it spread 6.4 times as much at 10% (0 to 22 of
    # 96: the benchmark's quick run sampled none) and not at all at 25% (24 every time).
    ids = [f"spec{round_}xlive{rate:g}x{index:04d}" for round_ in range(600) for index in range(16)]
    counts = [sum(is_sampled(rid, rate) for rid in ids[start : start + 96]) for start in range(0, len(ids), 96)]
    spread = statistics.pvariance(counts) / (96 * rate * (1 - rate))
    assert 0.5 < spread < 2.0 and abs(statistics.mean(counts) - 96 * rate) < 1.0, (spread, min(counts), max(counts))


def test_stats_summary_names_counts_and_drop_reasons():
    stats = CaptureStats()
    stats.status = "capturing"
    stats.add("captured", 3)
    stats.add("sent", 2)
    stats.drop("spool_full")
    line = stats.summary()
    assert line.startswith("eagle-tap capture [capturing]:")
    assert "captured=3" in line and "sent=2" in line and "spooled=0" in line and "'spool_full': 1" in line


# Generate mode: prompt rows, one row per decode step, one record when the request finishes ----------


class GeneratingReq(SimpleNamespace):
    """A request as the scheduler holds it while generating: outputs grow after each processed batch."""

    def __init__(self, number: int, prompt_len: int, *, tag: CaptureTag | None = None, custom_params=None):
        tag = tag or CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(), mode="generate")
        params = custom_params if custom_params is not None else tag.to_custom_params()
        prompt = list(range(100 * number, 100 * number + prompt_len))
        super().__init__(rid=f"rid-{number}", origin_input_ids=prompt, output_ids=[], finished_len=None,
                         finished_reason=None, sampling_params=SimpleNamespace(custom_params=params))

    @property
    def full_untruncated_fill_ids(self):
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None


def decode_rows(numbered_reqs):
    """A DECODE batch: one row per request, the state of its newest token (position len(tokens) - 1)."""
    auxes, finals = zip(*(rows(number, len(req.full_untruncated_fill_ids) - 1, 1) for req, number in numbered_reqs))
    return [req for req, _ in numbered_reqs], torch.cat(auxes), torch.cat(finals)


def sample(asm, reqs, finish: set[str] = frozenset(), reason: str = "FINISH_LENGTH"):
    """The scheduler processes the batch: each request gains a token; some finish."""
    for req in reqs:
        req.output_ids.append(9000 + len(req.output_ids))
        if req.rid in finish:
            req.finished_reason = type(reason, (), {})()
    asm.on_finished(reqs)


@pytest.mark.parametrize("scan_max", [0, 100], ids=["a look-up per request", "a scan per capture"])
def test_a_generate_capture_has_prompt_and_decode_rows_and_no_state_for_its_last_token(assembler, monkeypatch,
                                                                                       scan_max):
    monkeypatch.setattr(capture, "_SCAN_MAX_CAPTURES", scan_max)  # either way of finding them in a decode batch
    asm, emitted, stats = assembler
    a, b = GeneratingReq(1, 5), GeneratingReq(2, 3)
    asm.on_extend(*batch([(a, 1, 0, 5), (b, 2, 0, 3)]))
    sample(asm, [a, b])
    assert emitted == [] and asm.generating
    for step in range(3):
        asm.on_decode(*decode_rows([(a, 1), (b, 2)]))
        sample(asm, [a, b], finish={"rid-2"} if step == 0 else {"rid-1"} if step == 2 else set())
    assert [captured.tag.record_id for captured in emitted] == ["rec-2", "rec-1"]
    for captured, number, prompt_len, generated in ((emitted[1], 1, 5, 4), (emitted[0], 2, 3, 2)):
        tokens = prompt_len + generated
        assert captured.token_ids == list(range(100 * number, 100 * number + prompt_len)) + \
            [9000 + i for i in range(generated)]
        assert captured.num_states == tokens - 1 and captured.loss_spans == ((prompt_len, tokens),)
        aux, final = captured.states()
        expected_aux, expected_final = rows(number, 0, tokens - 1)
        assert torch.equal(aux, expected_aux) and torch.equal(final, expected_final)
    assert not asm.generating and asm.num_partials == 0 and stats.snapshot()["captured"] == 2


def test_given_spans_are_kept_and_joined_to_the_generated_tokens(assembler):
    asm, emitted, _ = assembler
    touching = GeneratingReq(1, 4, tag=CaptureTag(record_id="r1", sample_id="s", loss_spans=((1, 4),), mode="generate"))
    apart = GeneratingReq(2, 4, tag=CaptureTag(record_id="r2", sample_id="s", loss_spans=((0, 2),), mode="generate"))
    asm.on_extend(*batch([(touching, 1, 0, 4), (apart, 2, 0, 4)]))
    sample(asm, [touching, apart], finish={"rid-1", "rid-2"})  # finished in its prefill: one token, no decode
    assert [captured.loss_spans for captured in emitted] == [((1, 5),), ((0, 2), (4, 5))]
    assert [captured.num_states for captured in emitted] == [4, 4]


def test_an_aborted_generation_and_one_missing_a_step_are_dropped_not_stored(assembler):
    asm, emitted, stats = assembler
    aborted, skipped = GeneratingReq(1, 3), GeneratingReq(2, 3)
    asm.on_extend(*batch([(aborted, 1, 0, 3), (skipped, 2, 0, 3)]))
    sample(asm, [aborted, skipped])
    asm.on_decode(*decode_rows([(aborted, 1)]))  # the second request's step is never seen
    sample(asm, [aborted], finish={"rid-1"}, reason="FINISH_ABORT")
    sample(asm, [skipped], finish={"rid-2"})
    assert emitted == [] and stats.snapshot()["dropped"] == {"aborted": 1, "missing_rows": 1}
    assert not asm.generating


def test_a_retracted_generation_keeps_its_rows_and_takes_only_new_ones_from_the_new_prefill(assembler):
    asm, emitted, stats = assembler
    req, other = GeneratingReq(1, 4), GeneratingReq(2, 4)
    asm.on_extend(*batch([(req, 1, 0, 4), (other, 2, 0, 4)]))
    sample(asm, [req, other])
    asm.on_decode(*decode_rows([(req, 1), (other, 2)]))
    sample(asm, [req, other])  # req: 4 prompt + 2 generated tokens, 5 rows
    # Retracted, then prefilled again over all 6 tokens: once with 3 cached (rows 3..5 recomputed),
    asm.on_extend(*batch([(req, 1, 3, 3)]))
    # and the other from scratch.
    asm.on_extend(*batch([(other, 2, 0, 6)]))
    sample(asm, [req, other], finish={"rid-1", "rid-2"})
    assert stats.snapshot()["restarted"] == 1
    for captured, number in zip(emitted, (1, 2)):
        assert len(captured.token_ids) == 7 and captured.num_states == 6
        aux, _ = captured.states()
        assert torch.equal(aux, rows(number, 0, 6)[0])


def test_decode_batches_cost_nothing_without_a_generate_capture(assembler):
    asm, emitted, _ = assembler
    prefill_only = make_req(1, 3)
    asm.on_extend(*batch([(prefill_only, 1, 0, 3)]))
    assert len(emitted) == 1 and not asm.generating  # a prefill capture is done at its prefill's end


def test_an_extend_batch_is_skipped_only_while_no_capture_runs_nor_waits(assembler):
    """The forward hook returns before any work when the assembler is idle: a request selected but not yet
    forwarded, or a capture still taking rows, makes it not idle."""
    asm, emitted, _ = assembler
    assert asm.idle
    chunked = make_req(1, 6)
    asm.selector.on_request(arrival(chunked))
    assert not asm.idle  # selected, waiting for its first forward
    asm.seen.add(chunked.rid)
    asm.on_extend(*batch([(chunked, 1, 0, 4)]))
    assert not asm.idle and not emitted  # two of its prompt's rows are still to come
    asm.on_extend(*batch([(chunked, 1, 4, 2)]))
    assert asm.idle and len(emitted) == 1
    check_record(emitted[0], 1, 6)


def test_live_sampling_is_deterministic_skips_health_checks_and_opt_outs_and_salts_only_selected_requests():
    stats = CaptureStats()
    selector = Selector(stats=stats, sample_rate=1.0, live_sample_rate=0.3)
    plain = SimpleNamespace(custom_params=None)
    requests = [SimpleNamespace(rid=f"{i:032x}", sampling_params=plain, cache_salt=None, input_embeds=None,
                                mm_inputs=None) for i in range(2000)]
    for request in requests:
        selector.on_request(request)
    chosen = {request.rid for request in requests if request.cache_salt is not None}
    assert 500 < len(chosen) < 700 and chosen == {rid for rid in (r.rid for r in requests) if is_sampled(rid, 0.3)}
    assert all(request.cache_salt == f"eagle-tap:{request.rid}" for request in requests if request.rid in chosen)
    rid = sorted(chosen)[0]
    tag = selector.take(rid).tag
    assert tag.mode == "generate" and tag.metadata == {"source": "live", "live_sample_rate": 0.3}
    assert tag.record_id == f"live-{rid}" and selector.take(rid) is None  # taken once
    # Never: health checks, opted-out requests, requests given as embeddings; their salt is left alone.
    health = SimpleNamespace(rid=f"HEALTH_CHECK_{rid}", sampling_params=plain, cache_salt=None, input_embeds=None,
                             mm_inputs=None)
    opted = SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params={"eagle_tap": {"opt_out": True}}),
                            cache_salt="user-salt", input_embeds=None, mm_inputs=None)
    embeds = SimpleNamespace(rid=rid, sampling_params=plain, cache_salt=None, input_embeds=[[0.0]], mm_inputs=None)
    for request in (health, opted, embeds):
        selector.on_request(request)
    assert (health.cache_salt, opted.cache_salt, embeds.cache_salt) == (None, "user-salt", None)
    snapshot = stats.snapshot()
    assert snapshot["live_opted_out"] == 1 and snapshot["live_skipped_not_token_ids"] == 1
    assert snapshot["live_selected"] == len(chosen)
    # A tagged request given as embeddings is not captured either (no token of it is known), and the drop is
    # counted by name; a tagged request with an image is (its record holds the images' input embeddings).
    tagged = {"eagle_tap": {"record_id": "r-embeds", "spans": [[0, 3]]}}
    given = SimpleNamespace(rid="f" * 32, sampling_params=SimpleNamespace(custom_params=tagged), cache_salt=None,
                            input_embeds=[[0.0]], mm_inputs=None)
    selector.on_request(given)
    assert given.cache_salt is None and selector.take(given.rid) is None
    assert stats.snapshot()["dropped"]["tagged_not_token_ids"] == 1
    image = SimpleNamespace(rid="e" * 32, sampling_params=SimpleNamespace(custom_params=tagged), cache_salt=None,
                            input_embeds=None, mm_inputs=SimpleNamespace(mm_items=[object()]))
    selector.on_request(image)
    assert image.cache_salt == f"eagle-tap:{image.rid}" and selector.take(image.rid).images


def test_live_record_ids_are_valid_for_any_request_id():
    assert live_record_id("0a1b") == "live-0a1b"
    unsafe = live_record_id("../x y" * 40)
    assert unsafe.startswith("live-") and len(unsafe) == 5 + 16


def test_a_request_ended_outside_a_batch_frees_its_capture_and_a_nan_finish_is_not_stored(assembler):
    asm, emitted, stats = assembler
    queued, nan = GeneratingReq(1, 3), GeneratingReq(2, 3)
    asm.on_extend(*batch([(queued, 1, 0, 3), (nan, 2, 0, 3)]))
    sample(asm, [queued, nan])
    asm.on_aborted("rid-1")  # e.g. retracted, then aborted while waiting to be prefilled again
    nan.output_ids.append(1)
    nan.finished_reason = SimpleNamespace(matched="NaN happened")
    asm.on_finished([nan])
    assert emitted == [] and stats.snapshot()["dropped"] == {"aborted": 1, "nan": 1} and asm.num_partials == 0


def test_every_rank_salts_alike_but_only_the_capturing_one_keeps_decisions():
    capturing, other = (Selector(stats=CaptureStats(), sample_rate=1.0, live_sample_rate=1.0) for _ in range(2))
    other.keep_decisions = False  # another rank ships the rows
    for selector in (capturing, other):
        request = SimpleNamespace(rid="r1", sampling_params=SimpleNamespace(custom_params=None), cache_salt=None,
                                  input_embeds=None, mm_inputs=None)
        selector.on_request(request)
        assert request.cache_salt == "eagle-tap:r1"
    assert capturing.num_waiting == 1 and other.num_waiting == 0


def test_a_generate_tag_on_a_request_of_several_samples_is_refused_and_counted():
    stats = CaptureStats()
    selector = Selector(stats=stats, sample_rate=1.0, live_sample_rate=0.0)
    tag = CaptureTag(record_id="multi", sample_id="s", loss_spans=(), mode="generate")
    request = SimpleNamespace(rid="r-multi", sampling_params=SimpleNamespace(custom_params=tag.to_custom_params(), n=4),
                              cache_salt=None, input_embeds=None, mm_inputs=None)
    selector.on_request(request)
    assert request.cache_salt is None and selector.take("r-multi") is None
    assert stats.snapshot()["dropped"] == {"generate_tag_with_n_samples": 1}


def image_req(number: int, length: int, offsets, placeholder: int = 7):
    """A request whose prompt has images at `offsets` (SGLang's inclusive pairs), its ids there pad values; its
    tag's loss span covers every token, counted as the client does: one token per image."""
    req = make_req(number, length)
    sent_length = length - sum(end - start for start, end in offsets)
    tag = CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=((0, sent_length),))
    req.sampling_params = SimpleNamespace(custom_params=tag.to_custom_params())
    for start, end in offsets:
        req.full_untruncated_fill_ids[start : end + 1] = [900_000 + start] * (end - start + 1)
    req.multimodal_inputs = SimpleNamespace(mm_items=[SimpleNamespace(offsets=[pair]) for pair in offsets],
                                            im_token_id=placeholder)
    return req


class ImageArrivals(ArrivingAssembler):
    def on_extend(self, reqs, *rest) -> None:
        for req in reqs:
            if req.rid not in self.seen:
                self.seen.add(req.rid)
                arrived = arrival(req)
                arrived.mm_inputs = getattr(req, "multimodal_inputs", None)
                self.selector.on_request(arrived)
        CaptureAssembler.on_extend(self, reqs, *rest)


def embeds_of(chunks) -> torch.Tensor:
    """(rows, HIDDEN): input embeddings of the batch's tokens, -(50 * number + position) at every row (exact in bf16)."""
    values = [-(50 * number + torch.arange(prefix, prefix + extend, dtype=torch.float32)) for _, number, prefix, extend
              in chunks]
    return torch.cat(values)[:, None].expand(-1, HIDDEN).to(torch.bfloat16)


def test_an_image_request_keeps_the_embeddings_of_its_image_positions_across_chunks():
    emitted = []
    asm = ImageArrivals(stats=CaptureStats(), emit=emitted.append)
    image, text = image_req(1, 12, [(2, 4), (8, 9)]), make_req(2, 5)
    first = [(image, 1, 0, 6), (text, 2, 0, 5)]
    asm.on_extend(*batch(first), embeds_of(first))
    second = [(image, 1, 6, 6)]
    asm.on_extend(*batch(second), embeds_of(second))
    by_id = {captured.tag.record_id: captured for captured in emitted}
    record = by_id["rec-1"]
    assert record.input_embed_spans == ((2, 5), (8, 10))
    assert record.token_ids[2:5] == [7, 7, 7] and record.token_ids[8:10] == [7, 7]  # the placeholder, not pads
    assert record.loss_spans == ((0, 2), (5, 8), (10, 12))  # no loss on an image position
    embeds = torch.cat(record.input_embeds)[:, 0].float()
    assert embeds.tolist() == [-(50 + position) for position in (2, 3, 4, 8, 9)]
    assert by_id["rec-2"].input_embed_spans == () and by_id["rec-2"].input_embeds == []
    # The sender's record: schema 2, the embeddings as bf16 bits, round trip through a frame.
    from capture_format import decode_frame, encode_frame, float32_from_bfloat16_bits
    from sglang_patch.sender import ModelIdentity, to_records

    model = ModelIdentity(capture_layers=(1, 3), hidden_size=HIDDEN, model_fingerprint="tiny@1",
                          state_dtype="bfloat16", codec="bf16-split")
    (stored,) = to_records(record, model)
    decoded = decode_frame(encode_frame(stored, model.codec))
    assert decoded.schema_version == 2 and decoded.input_embed_spans == ((2, 5), (8, 10))
    assert float32_from_bfloat16_bits(decoded.input_embeds)[:, 0].tolist() == [-52, -53, -54, -58, -59]
    assert to_records(by_id["rec-2"], model)[0].schema_version == 1


def test_an_image_request_whose_batch_gave_no_embeddings_is_dropped_by_name():
    emitted, stats = [], CaptureStats()
    asm = ImageArrivals(stats=stats, emit=emitted.append)
    chunks = [(image_req(1, 8, [(1, 3)]), 1, 0, 8)]
    asm.on_extend(*batch(chunks), None)
    assert emitted == [] and stats.snapshot()["dropped"] == {"image_embeds_missing": 1}


def test_live_sampling_takes_requests_with_images_and_plans_them_no_shared_prefix():
    stats = CaptureStats()
    selector = Selector(stats=stats, sample_rate=1.0, live_sample_rate=1.0, ttl_s=60.0, prefix_block_tokens=4)
    plain = SimpleNamespace(custom_params=None)
    image = SimpleNamespace(rid="a" * 32, sampling_params=plain, cache_salt=None, input_embeds=None,
                            input_ids=list(range(40)), mm_inputs=SimpleNamespace(mm_items=[object()]))
    text = SimpleNamespace(rid="b" * 32, sampling_params=plain, cache_salt=None, input_embeds=None,
                           input_ids=list(range(40)), mm_inputs=None)
    selector.on_request(image)
    selector.on_request(text)
    taken_image, taken_text = selector.take(image.rid), selector.take(text.rid)
    assert taken_image.images and taken_image.prefix is None and image.cache_salt == f"eagle-tap:{image.rid}"
    assert not taken_text.images and taken_text.prefix is not None  # text shares prefix blocks as before
    assert stats.snapshot()["live_selected"] == 2


@pytest.mark.parametrize("sent, expanded", [
    (((0, 2),), ((0, 2),)),  # before the first image
    (((3, 6),), ((5, 8),)),  # between the images: past the first one's 3 tokens
    (((0, 9),), ((0, 12),)),  # over both images: cut around them later (spans_without)
    (((2, 3),), ((2, 5),)),  # the first placeholder alone: its whole image
    (((7, 9),), ((10, 12),)),  # after the second image
])
def test_tag_spans_count_each_image_as_one_token_and_move_onto_the_expanded_ids(sent, expanded):
    from sglang_patch.capture import ImageInputs, spans_without

    images = ImageInputs(spans=((2, 5), (8, 10)), placeholder_id=7)  # sent ids: placeholders at 2 and 6
    assert images.expanded_spans(sent) == expanded
    assert spans_without(((0, 12),), images.spans) == ((0, 2), (5, 8), (10, 12))
