"""Capture under EAGLE-3 speculative decoding, without a server: verify steps' rows, the draft's signal, refusals.

The real-server tests are in tests/test_spec_capture.py; here the assembler is driven as the hooks drive it
(`on_verify` after each verify forward, `on_verify_processed` after the scheduler processed the step), with rows
whose values name their token position, so a row taken from the wrong place shows.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from capture_format.tag import CaptureTag
from sglang_patch import capture
from sglang_patch.capture import CaptureAssembler
from sglang_patch.speculative import (
    METADATA_KEY,
    SpecCaptureRefused,
    SpecServing,
    accepted_from_metadata,
    draft_digest,
    served_draft_metadata,
    spec_capture_layers,
    spec_serving,
    verified_steps,
)
from sglang_patch.stats import CaptureStats

NUM_LAYERS, HIDDEN = 3, 4
CHAIN = SpecServing(algorithm="EAGLE3", draft_path="draft", num_steps=3, topk=1, num_draft_tokens=4)


def positions_rows(number: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """aux (n, K*H), final (n, H): every value of the row of token position p of request `number` is 1000 * number + p."""
    values = (1000 * number + torch.tensor(positions, dtype=torch.float32))[:, None]
    return values.expand(-1, NUM_LAYERS * HIDDEN).clone(), values.expand(-1, HIDDEN).clone()


class SpecReq(SimpleNamespace):
    """A request as SGLang's scheduler holds it under speculative decoding."""

    def __init__(self, number: int, prompt_len: int):
        tag = CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(), mode="generate")
        super().__init__(number=number, rid=f"rid-{number}", origin_input_ids=list(range(100 * number, 100 * number + prompt_len)),
                         output_ids=[], finished_len=None, finished_reason=None, spec_verify_ct=0,
                         sampling_params=SimpleNamespace(custom_params=tag.to_custom_params()))

    @property
    def full_untruncated_fill_ids(self):
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None


@pytest.fixture
def assembler():
    emitted: list = []
    stats = CaptureStats()
    served = {"value": ("d" * 32, CHAIN)}
    asm = CaptureAssembler(stats=stats, emit=emitted.append, served_draft=lambda: served["value"])
    for number in range(1, 4):
        asm.selector.on_request(SimpleNamespace(rid=f"rid-{number}", sampling_params=SimpleNamespace(
            custom_params=CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(),
                                     mode="generate").to_custom_params()), cache_salt=None, input_embeds=None, mm_inputs=None))
    return asm, emitted, stats


def prefill(asm, reqs: list[SpecReq]) -> None:
    """The extend forward of the prompts, then the first token each (sampled from the prefill, no verify)."""
    auxes, finals = zip(*(positions_rows(req.number, list(range(len(req.origin_input_ids)))) for req in reqs))
    asm.on_extend(reqs, [0] * len(reqs), [len(req.origin_input_ids) for req in reqs], torch.cat(auxes), torch.cat(finals))
    for req in reqs:
        req.output_ids.append(7000)
    asm.on_finished(reqs)


def verify(asm, reqs: list[SpecReq], accepted: list[int], *, width: int = 4, tree: bool = False,
           finish: set[str] = frozenset()) -> None:
    """One verify step: request i accepts accepted[i] drafts. Chain: the path is each block's front. Tree (D = 6):
    SGLang has moved the path's aux rows to the front, while the final rows stay where the tree has them."""
    num_draft_tokens = 6 if tree else width
    aux = torch.full((len(reqs) * num_draft_tokens, NUM_LAYERS * HIDDEN), -1.0)
    final = torch.full((len(reqs) * num_draft_tokens, HIDDEN), -1.0)
    accept_index = torch.full((len(reqs), width), -1, dtype=torch.int32)
    for i, (req, count) in enumerate(zip(reqs, accepted)):
        newest = len(req.full_untruncated_fill_ids) - 1
        path_aux, path_final = positions_rows(req.number, list(range(newest, newest + count + 1)))
        nodes = [0, 2, 5, 3][: count + 1] if tree else list(range(count + 1))
        aux[i * num_draft_tokens : i * num_draft_tokens + count + 1] = path_aux
        for node, row in zip(nodes, path_final):
            final[i * num_draft_tokens + node] = row
            accept_index[i, nodes.index(node)] = i * num_draft_tokens + node
    asm.on_verify(reqs, aux, final, accept_index, num_draft_tokens)
    for req, count in zip(reqs, accepted):  # the scheduler processes the step
        if not req.finished():
            req.output_ids.extend(8000 + len(req.output_ids) + j for j in range(count + 1))
            req.spec_verify_ct += 1
        if req.rid in finish:
            req.finished_reason = type("FINISH_LENGTH", (), {})()
    asm.on_verify_processed(reqs, accepted)
    asm.on_finished(reqs)


def check_rows(captured, number: int) -> None:
    aux, final = captured.states()
    want_aux, want_final = positions_rows(number, list(range(captured.num_states)))
    assert torch.equal(aux, want_aux) and torch.equal(final, want_final)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_steps_keep_the_accepted_rows_in_order(assembler, tree):
    asm, emitted, stats = assembler
    a, b = SpecReq(1, 5), SpecReq(2, 3)
    prefill(asm, [a, b])
    verify(asm, [a, b], [3, 0], tree=tree)
    verify(asm, [a, b], [1, 2], tree=tree, finish={"rid-2"})
    verify(asm, [a], [0], tree=tree, finish={"rid-1"})
    assert [captured.tag.record_id for captured in emitted] == ["rec-2", "rec-1"]
    record_b, record_a = emitted
    assert record_a.token_ids == a.full_untruncated_fill_ids and record_a.num_states == len(a.full_untruncated_fill_ids) - 1
    check_rows(record_a, 1)
    check_rows(record_b, 2)
    assert record_a.record_metadata()[METADATA_KEY]["accepted_per_step"] == "310"
    assert record_b.record_metadata()[METADATA_KEY]["accepted_per_step"] == "02"
    assert record_a.record_metadata()[METADATA_KEY]["accepted_at_position"] == [2, 1, 1]
    assert stats.snapshot()["dropped"] == {}


@pytest.mark.parametrize("scan_max", [0, 100], ids=["a look-up per request", "a scan per capture"])
def test_each_capture_takes_its_own_rows_whichever_way_its_request_is_found(monkeypatch, scan_max):
    """A verify step finds its captured requests by a scan of the batch per capture (few captures) or by a look-up
    per request of the batch (many: `capture._SCAN_MAX_CAPTURES`); either way each of eight captures, among
    requests that are not captured, takes its own rows."""
    monkeypatch.setattr(capture, "_SCAN_MAX_CAPTURES", scan_max)
    emitted: list = []
    asm = CaptureAssembler(stats=CaptureStats(), emit=emitted.append, served_draft=lambda: ("d" * 32, CHAIN))
    captured = [SpecReq(number, 3 + number % 3) for number in range(1, 9)]
    for req in captured:
        asm.selector.on_request(SimpleNamespace(rid=req.rid, sampling_params=req.sampling_params, cache_salt=None,
                                                input_embeds=None, mm_inputs=None))
    reqs = [captured[0], SpecReq(20, 4), *captured[1:5], SpecReq(21, 4), *captured[5:]]  # 20, 21: not tagged here
    prefill(asm, reqs)
    for step in range(3):
        verify(asm, reqs, [(number + step) % 4 for number in range(len(reqs))],
               finish={req.rid for req in reqs} if step == 2 else set())
    assert sorted(record.tag.record_id for record in emitted) == sorted(f"rec-{number}" for number in range(1, 9))
    for record in emitted:
        check_rows(record, int(record.tag.record_id.removeprefix("rec-")))
        assert record.record_metadata()[METADATA_KEY]["verify_steps"] == 3


def test_a_step_sglang_does_not_count_takes_no_rows(assembler):
    """A request already finished when a verify ran (the overlap scheduler's extra step) gets no rows from it."""
    asm, emitted, _ = assembler
    a = SpecReq(1, 4)
    prefill(asm, [a])
    a.finished_reason = type("FINISH_LENGTH", (), {})()  # finished, but still in the next verify batch
    verify(asm, [a], [2])
    assert len(emitted) == 1 and emitted[0].num_states == 4  # the prompt; the first token has no state
    assert emitted[0].record_metadata()[METADATA_KEY]["verify_steps"] == 0


def test_rows_that_disagree_with_the_tokens_drop_the_capture(assembler):
    asm, emitted, stats = assembler
    a = SpecReq(1, 4)
    prefill(asm, [a])
    a.output_ids.append(1)  # a token the capture never saw a row for
    verify(asm, [a], [1])
    assert emitted == [] and stats.snapshot()["dropped"] == {"misaligned": 1}


def test_a_prefill_record_on_a_draft_serving_replica_says_no_step_ran(assembler):
    asm, emitted, _ = assembler
    asm.selector.on_request(SimpleNamespace(rid="rid-9", sampling_params=SimpleNamespace(custom_params=CaptureTag(
        record_id="rec-9", sample_id="s", loss_spans=((0, 3),)).to_custom_params()), cache_salt=None,
        input_embeds=None, mm_inputs=None))
    req = SimpleNamespace(rid="rid-9", full_untruncated_fill_ids=[1, 2, 3], sampling_params=None)
    aux, final = positions_rows(9, [0, 1, 2])
    asm.on_extend([req], [0], [3], aux, final)
    served = emitted[0].record_metadata()[METADATA_KEY]
    assert served["verify_steps"] == 0 and served["accepted_per_step"] == "" and served["draft"] == "d" * 32


def test_verified_steps_leave_out_steps_past_the_finish():
    assert verified_steps([3, 0, 2, 1], num_generated=1) == []
    assert verified_steps([3, 0, 2, 1], num_generated=5) == [3]  # 1 + 4 tokens
    assert verified_steps([3, 0, 2, 1], num_generated=6) == [3, 0]
    assert verified_steps([3, 0, 2, 1], num_generated=100) == [3, 0, 2, 1]


def test_served_draft_metadata_round_trips_and_stays_small():
    metadata = served_draft_metadata(draft="ab" * 16, spec=CHAIN, accepted=[3, 0, 2, 1])
    assert accepted_from_metadata(metadata) == [3, 0, 2, 1]
    assert metadata["accepted_at_position"] == [3, 2, 1] and metadata["accepted_drafts"] == 6
    long = served_draft_metadata(draft="ab" * 16, spec=CHAIN, accepted=[1] * 40_000)
    assert "accepted_per_step" not in long and long["verify_steps"] == 40_000
    assert len(json.dumps(long)) < 1024


def write_draft(tmp_path, layer_ids):
    eagle_config = {} if layer_ids is None else {"eagle_aux_hidden_state_layer_ids": layer_ids}
    (tmp_path / "config.json").write_text(json.dumps({"eagle_config": eagle_config}))
    return str(tmp_path)


def test_what_cannot_be_captured_is_refused_by_name(tmp_path):
    draft = write_draft(tmp_path, [2, 4, 5])
    llama = ("LlamaForCausalLM", 8)
    assert spec_capture_layers(SpecServing(algorithm="EAGLE3", draft_path=draft), *llama, None) == [3, 5, 6]
    with pytest.raises(SpecCaptureRefused, match="drafts with NGRAM"):
        spec_capture_layers(SpecServing(algorithm="NGRAM", draft_path=None), *llama, None)
    with pytest.raises(SpecCaptureRefused, match=r"EAGLE_TAP_CAPTURE_LAYERS=\[1, 4, 7\].*\[3, 5, 6\]"):
        spec_capture_layers(SpecServing(algorithm="EAGLE3", draft_path=draft), *llama, [1, 4, 7])
    with pytest.raises(SpecCaptureRefused, match="names no eagle_config"):
        spec_capture_layers(SpecServing(algorithm="EAGLE3", draft_path=write_draft(tmp_path, None)), *llama, None)
    assert spec_serving(SimpleNamespace(speculative_algorithm=None)) is None
    named = spec_serving(SimpleNamespace(speculative_algorithm=SimpleNamespace(name="EAGLE3"),
                                         speculative_draft_model_path="d", speculative_eagle_topk=2))
    assert named.algorithm == "EAGLE3" and named.topk == 2 and named.num_steps is None


def test_the_draft_identity_follows_its_weights_not_the_target_tensors_it_shares(tmp_path):
    target = torch.nn.Module()
    target.embed_tokens = torch.nn.Embedding(16, 4)
    draft = torch.nn.Module()
    draft.embed_tokens = target.embed_tokens  # SGLang's EAGLE-3 draft reads the target's embedding
    draft.fc = torch.nn.Linear(4, 4)
    config = tmp_path / "config.json"
    config.write_text("{}")
    before = draft_digest(draft, config, shared_with=target)
    with torch.no_grad():
        target.embed_tokens.weight.add_(1.0)
    assert draft_digest(draft, config, shared_with=target) == before
    with torch.no_grad():
        draft.fc.weight[0, 0] += 1e-3
    changed = draft_digest(draft, config, shared_with=target)
    assert changed != before and len(changed) == 32
    config.write_text('{"x": 1}')
    assert draft_digest(draft, config, shared_with=target) != changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_fingerprint_sees_one_changed_element_anywhere_and_any_swap(monkeypatch, dtype):
    import sglang_patch.speculative as speculative

    monkeypatch.setattr(speculative, "_FINGERPRINT_CHUNK", 7)  # many chunks, one partial
    tensor = (torch.arange(60) % 2).to(dtype) if dtype == torch.bool else torch.arange(60).to(dtype).reshape(6, 10)
    before = speculative.tensor_fingerprint(tensor)
    assert speculative.tensor_fingerprint(tensor.clone()) == before
    flat = tensor.reshape(-1)
    for index in (0, 6, 7, 59):
        changed = flat.clone()
        changed[index] = (~changed[index]) if dtype == torch.bool else changed[index] + 1
        assert speculative.tensor_fingerprint(changed) != before, index
    swapped = flat.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert speculative.tensor_fingerprint(swapped) != before


def test_a_weight_update_makes_the_plugin_identify_the_draft_again(tmp_path):
    from sglang_patch.forward_hook import CaptureHook
    from sglang_patch.settings import CaptureSettings

    draft_model, target_model = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    (tmp_path / "config.json").write_text("{}")
    hook = CaptureHook(CaptureSettings(collector_url="http://127.0.0.1:9"))
    hook._spec = SpecServing(algorithm="EAGLE3", draft_path=str(tmp_path), num_steps=3, topk=1, num_draft_tokens=4)
    hook.on_spec_forward_begin(SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(model=draft_model)),
                                               target_worker=SimpleNamespace(model_runner=SimpleNamespace(model=target_model))))
    first, spec = hook.served_draft()
    assert spec is hook._spec and len(first) == 32
    with torch.no_grad():
        draft_model.weight.add_(1.0)  # what /update_weights_from_tensor with selector "draft" does in place
    assert hook.served_draft()[0] == first  # known: not computed again per record
    hook.on_weights_updated(None, object())
    assert hook.served_draft()[0] not in (first, "unknown")


def test_a_part_the_sender_refuses_during_a_verify_step_drops_that_capture_alone():
    """`_cut_parts` removes a capture whose part found no room while `on_verify_processed` goes through the
    running captures: the others go on and close."""
    emitted: list = []

    def emit(captured) -> bool:
        if captured.part_index is not None and captured.tag.record_id == "rec-1":
            return False  # no room for rec-1's part
        emitted.append(captured)
        return True

    asm = CaptureAssembler(stats=CaptureStats(), emit=emit, served_draft=lambda: ("d" * 32, CHAIN),
                           part_max_tokens=6)
    for number in range(1, 3):
        asm.selector.on_request(SimpleNamespace(rid=f"rid-{number}", sampling_params=SimpleNamespace(
            custom_params=CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(),
                                     mode="generate").to_custom_params()), cache_salt=None, input_embeds=None,
            mm_inputs=None))
    a, b = SpecReq(1, 5), SpecReq(2, 5)
    prefill(asm, [a, b])
    for step in range(4):
        verify(asm, [a, b] if step < 2 else [b], [3, 3] if step < 2 else [3], finish={"rid-2"} if step == 3 else set())
    assert asm.num_partials == 0
    closing = [captured for captured in emitted if captured.part_index is None]
    assert [captured.tag.record_id for captured in closing] == ["rec-2"] and closing[0].parts_before >= 1
