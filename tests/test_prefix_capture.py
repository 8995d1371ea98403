"""Shared prefixes stored once, inside a real SGLang server (CPU) shipping to a real collector on loopback.

With `EAGLE_TAP_PREFIX_BLOCK_TOKENS` set, a sampled request keeps the radix cache's hits on the blocks an
earlier capture already sent, its record refers to them, and a reader joins them back. Oracle: the
tiny model in transformers (fp32) on the same token ids; the server runs bf16, so rows agree within
bf16 noise per token (as in tests/test_capture_parity.py).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

import capture_format as cf
from capture_format.prefix_blocks import record_namespace
from capture_format.tag import CaptureTag
from capture_helpers import (aux_as_float, final_as_float, median_token_error, read_stats, resolved_record,
                             stored_record, wait_for)
from eagle_tap.serve.http_api import post_json

pytestmark = pytest.mark.sglang

BLOCK = 16
BF16_MEDIAN_REL_TOL = 0.03
SYSTEM_PROMPT = "You are a careful assistant. " + " ".join(f"Rule {i}: answer plainly and check facts." for i in range(30))


@pytest.fixture(scope="module")
def prefix_server(start_sglang, tiny_model_dir, collector, tmp_path_factory):
    """(server, spool dir): every chat request sampled, prefixes cut into 16-token blocks, prefill chunked at 64."""
    spool_dir = tmp_path_factory.mktemp("spool-prefix")
    server = start_sglang(tiny_model_dir, extra_args=("--chunked-prefill-size", "64"), env={
        "EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir),
        "EAGLE_TAP_LIVE_SAMPLE_RATE": "1.0", "EAGLE_TAP_PREFIX_BLOCK_TOKENS": str(BLOCK)})
    return server, spool_dir




def test_sampled_chats_keep_cache_hits_on_shared_blocks_and_resolve_to_the_models_states(
        prefix_server, collector, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    server, spool_dir = prefix_server
    rids = [f"shared{i:03d}" for i in range(4)]
    answers = {}
    for rid in rids:  # one after another: each finds the blocks of those before it
        answers[rid] = post_json(f"{server.url}/v1/chat/completions", {
            "model": "tiny", "rid": rid, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": f"Question {rid}: what is 3 + {rid[-1]}?"}]})
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("captured_live", 0) >= len(rids) and s, 60,
                     "the live captures")
    stored = {rid: stored_record(collector, f"live-{rid}") for rid in rids}
    first_prefix = stored[rids[0]].first_state_token
    assert first_prefix >= 10 * BLOCK  # the system prompt's blocks
    for rid in rids[1:]:
        # Its record refers to the shared blocks and holds only its own rows past them.
        assert stored[rid].first_state_token >= first_prefix - BLOCK
        assert stored[rid].num_states < stored[rid].num_tokens - 10 * BLOCK
    assert stats["prefix_tokens_reused"] >= 3 * 10 * BLOCK  # requests 2-4 were served their blocks by the cache
    assert stats.get("dropped", {}) == {} and stats.get("hook_errors", 0) == 0
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for rid in rids:
        record = resolved_record(collector, f"live-{rid}")
        usage = answers[rid]["usage"]
        assert record.num_tokens == usage["prompt_tokens"] + usage["completion_tokens"]
        check_against_transformers(hf_model, record, rid)


def check_against_transformers(hf_model, record: cf.CaptureRecord, what: str) -> None:
    """A resolved generate-mode record holds the model's states of its ids, every layer, within bf16 noise."""
    assert record.num_states == record.num_tokens - 1 and record.states_prefix is None, what
    with torch.no_grad():
        hidden = hf_model(torch.tensor([record.token_ids.tolist()]), output_hidden_states=True).hidden_states
    hidden = torch.stack([state[0] for state in hidden]).float().numpy()[:, : record.num_states]  # (L+1, S, H)
    aux = aux_as_float(record)
    for slot, layer in enumerate(record.capture_layers):
        assert median_token_error(aux[:, slot], hidden[layer]) < BF16_MEDIAN_REL_TOL, (what, layer)
    assert median_token_error(final_as_float(record), hidden[-1]) < BF16_MEDIAN_REL_TOL, what


def test_generations_retracted_under_kv_pressure_resolve_to_the_models_states(
        start_sglang, tiny_model_dir, collector, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    spool_dir = tmp_path_factory.mktemp("spool-prefix-retract")
    # SGLang's own test switch retracts running requests every few decode steps (as a full KV pool would).
    server = start_sglang(tiny_model_dir, extra_args=("--chunked-prefill-size", "64"), env={
        "EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir),
        "EAGLE_TAP_PREFIX_BLOCK_TOKENS": str(BLOCK), "SGLANG_TEST_RETRACT": "1"})
    shared = list(range(900, 940))  # 40 tokens: two shared blocks
    prompts = [shared + list(range(1000 + 20 * i, 1008 + 20 * i)) for i in range(6)]

    def one(index: int) -> dict:
        tag = CaptureTag(record_id=f"pretract-{index}", sample_id=f"pretract-{index}", loss_spans=(), mode="generate")
        return post_json(f"{server.url}/generate", {"input_ids": prompts[index], "sampling_params": {
            "max_new_tokens": 90, "temperature": 0, "custom_params": tag.to_custom_params()}})

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, range(len(prompts))))
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("captured", 0) + sum(s.get("dropped", {}).values())
                     >= len(prompts) and s, 60, "every generation to be captured or dropped")
    assert "Testing retraction" in server.log_tail(2000), "SGLang should have retracted running requests"
    assert stats.get("restarted", 0) >= 1, stats  # a retracted capture prefilled again from its first row
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    stored = 0
    for index, answer in enumerate(answers):
        try:
            record = resolved_record(collector, f"pretract-{index}")
        except AssertionError:
            continue  # dropped and counted, never wrong
        stored += 1
        assert record.token_ids.tolist() == prompts[index] + answer["output_ids"]
        check_against_transformers(hf_model, record, f"pretract-{index}")
    assert stored >= 1 and stored + sum(stats.get("dropped", {}).values()) >= len(prompts)


def test_a_record_whose_blocks_are_missing_is_skipped_by_readers_never_read_wrong(prefix_server, collector, tmp_path):
    server, spool_dir = prefix_server
    answer = post_json(f"{server.url}/generate", {"rid": "dangle0", "input_ids": list(range(600, 700)),
                                                  "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    record = stored_record(collector, "live-dangle0")
    assert record.token_ids.tolist() == list(range(600, 700)) + answer["output_ids"]
    assert record.first_state_token == 96  # 6 blocks of 16 before the last prompt token
    # A shard set holding the record but only some of its blocks: the reader refuses it, by name.
    space = record_namespace(record)
    blocks = [stored_record(collector, cf.block_record_id(cf.prefix_key(list(range(600, 600 + end)), space)))
              for end in range(BLOCK, 97, BLOCK)]
    cf.write_shards([*blocks[:3], *blocks[4:], record], tmp_path / "partial", records_per_shard=8)
    cf.write_shards([*blocks, record], tmp_path / "whole", records_per_shard=8)
    with cf.ShardDirectory(tmp_path / "partial") as shards:
        (entry,) = shards.iter_index()
        with pytest.raises(cf.DanglingPrefixError, match="not in the shards read"):
            shards.read_record(entry)
    with cf.ShardDirectory(tmp_path / "whole") as shards:
        (entry,) = shards.iter_index()
        assert shards.read_record(entry).num_states == record.num_tokens - 1
