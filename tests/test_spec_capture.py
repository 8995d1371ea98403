"""Capture on replicas that serve an EAGLE-3 draft: real SGLang servers (CPU), the plugin, a real collector.

The draft is the one the trainer tests train and export (tests/test_trainer_export.py). Servers of this module:
- `plain`: no draft, fp32, the plugin capturing: the reference records;
- `chain` and `tree`: the draft, fp32, a chain of 3 (top-k 1) and a top-k 2 tree of 3 steps, the plugin capturing;
- `unplugged`: the chain without the plugin, and `refused`: the chain with capture layers the draft does not read
  (the plugin refuses it): both must answer exactly as `chain` does;
- `live`: the chain in bf16, live sampling at 10%, shared prefix blocks of 16 tokens, requests sent concurrently;
- `retract`: the chain in bf16 with SGLang retracting running requests (`SGLANG_TEST_RETRACT`).
Every server but `retract` prefills in chunks of 24 tokens, shorter than every prompt.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer_data
from capture_format.tag import CaptureTag
from capture_helpers import aux_as_float, final_as_float, read_stats, row_errors, stored_record, wait_for
from eagle_tap.cli import main
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.serve.http_api import post_json
from eagle_tap.serve.draft import DraftMismatchError, SpeculativeConfig
from eagle_tap.serve.swap import swap_draft
from eagle_tap.serve.http_api import weights_checksum
from sglang_patch.selection import is_sampled
from sglang_patch.speculative import METADATA_KEY, accepted_from_metadata
from capture_helpers import resolved_record
from test_prefix_capture import check_against_transformers
from test_trainer_export import trained_run

pytestmark = pytest.mark.sglang

CHUNK = ("--chunked-prefill-size", "24")
FP32 = ("--dtype", "float32", *CHUNK)
TREE = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
        "--speculative-num-draft-tokens", "6")
FP32_ROW_REL_TOL = 1e-5
LIVE_RATE = 0.1
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "trained"
    assert main(["export", "--checkpoint", str(trained_run()), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def untrained_draft(tmp_path_factory) -> Path:
    """The same run's initialisation: same config and vocab mapping, other weights."""
    out = tmp_path_factory.mktemp("draft") / "untrained"
    assert main(["export", "--checkpoint", str(trained_run()), "--out", str(out), "--untrained"]) == 0
    return out


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    """Six held-out conversations' first user turns, rendered with the chat template (27-31 tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = []
    for messages in trainer_data.conversations(64, 6):
        ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True)
        rendered.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    assert all(len(ids) > 24 for ids in rendered)
    return rendered


class Servers:
    """The module's servers by name, started on first use; a test releases those no later test needs, so that
    no more than four (about 2 GB each) run at once."""

    def __init__(self, tiny_model_dir: Path, collector, draft: Path, tmp_path_factory) -> None:
        self._model, self._collector, self._draft, self._tmp = tiny_model_dir, collector, draft, tmp_path_factory
        self._started: dict[str, tuple[SGLangServer, Path]] = {}

    def __call__(self, name: str) -> tuple[SGLangServer, Path]:
        if name not in self._started:
            spool = self._tmp.mktemp(f"spool-{name}")
            plugin = {"EAGLE_TAP_COLLECTOR_URL": self._collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool)}
            chain = SpeculativeConfig(draft_dir=self._draft, num_steps=3).server_args()
            args, env = {
                "plain": (FP32, plugin),
                "chain": ((*FP32, *chain), plugin),
                "tree": ((*FP32, *TREE, "--speculative-draft-model-path", str(self._draft)), plugin),
                "unplugged": ((*FP32, *chain), {"SGLANG_PLUGINS": "none-loaded"}),
                "refused": ((*FP32, *chain), {**plugin, "EAGLE_TAP_CAPTURE_LAYERS": "1,4,7"}),
                "live": ((*CHUNK, *chain), {**plugin, "EAGLE_TAP_LIVE_SAMPLE_RATE": str(LIVE_RATE),
                                            "EAGLE_TAP_PREFIX_BLOCK_TOKENS": "16"}),
                # SGLang's own switch retracts running requests; a small pool makes it retract them again and again.
                "retract": (("--max-total-tokens", "600", "--chunked-prefill-size", "64", *chain),
                            {**plugin, "SGLANG_TEST_RETRACT": "1"}),
            }[name]
            server = SGLangServer(ServerConfig(model_path=self._model, extra_args=args, env=env,
                                               log_path=self._tmp.mktemp(name) / "server.log"))
            server.start()
            self._started[name] = server, spool
        return self._started[name]

    def release(self, *names: str) -> None:
        """Stops the servers named (every one when none is named)."""
        for name in names or list(self._started):
            if name in self._started:
                self._started.pop(name)[0].stop()


@pytest.fixture(scope="module")
def servers(tiny_model_dir, collector, draft, tmp_path_factory):
    pool = Servers(tiny_model_dir, collector, draft, tmp_path_factory)
    try:
        yield pool
    finally:
        pool.release()


def generate(server, ids: list[int], record_id: str | None = None, rid: str | None = None,
             max_new_tokens: int = MAX_NEW_TOKENS, **sampling_params) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling_params}
    if record_id is not None:
        sampling["custom_params"] = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=(),
                                               mode="generate").to_custom_params()
    payload = {"input_ids": ids, "sampling_params": sampling}
    if rid is not None:
        payload["rid"] = rid
    return post_json(f"{server.url}/generate", payload)


def check_served_draft_against_meta_info(record, answer: dict) -> None:
    """The steps a record carries are the ones SGLang counted for the same request."""
    served, meta = record.metadata[METADATA_KEY], answer["meta_info"]
    assert served["verify_steps"] == meta["spec_verify_ct"], (served, meta)
    assert served["accepted_drafts"] == meta["spec_num_correct_drafts"], (served, meta)
    per_step = accepted_from_metadata(served)
    assert len(per_step) == meta["spec_verify_ct"] and sum(per_step) == meta["spec_num_correct_drafts"]
    # Tokens: one from the prefill, then each step's accepted drafts and its bonus token (the last cut at the finish).
    assert 1 + sum(count + 1 for count in per_step[:-1]) < len(answer["output_ids"]) <= 1 + sum(c + 1 for c in per_step)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_draft_serving_replica_stores_the_records_a_draftless_one_stores(servers, collector, prompts, shape):
    plain, _ = servers("plain")
    spec, spool = servers(shape)
    num_correct = 0
    for index, ids in enumerate(prompts):
        reference_answer = generate(plain, ids, record_id=f"plain-{shape}-{index}")
        answer = generate(spec, ids, record_id=f"{shape}-{index}")
        assert answer["output_ids"] == reference_answer["output_ids"]
        reference, record = stored_record(collector, f"plain-{shape}-{index}"), stored_record(collector, f"{shape}-{index}")
        assert record.token_ids.tolist() == reference.token_ids.tolist() == ids + answer["output_ids"]
        assert record.num_states == reference.num_states == record.num_tokens - 1
        assert row_errors(aux_as_float(record), aux_as_float(reference)).max() < FP32_ROW_REL_TOL
        assert row_errors(final_as_float(record), final_as_float(reference)).max() < FP32_ROW_REL_TOL
        assert METADATA_KEY not in reference.metadata
        served = record.metadata[METADATA_KEY]
        assert served["algorithm"] == "EAGLE3" and served["topk"] == (2 if shape == "tree" else 1)
        assert served["num_steps"] == 3 and len(served["draft"]) == 32
        check_served_draft_against_meta_info(record, answer)
        num_correct += served["accepted_drafts"]
    assert num_correct > 0, "the draft never proposed a right token: these records would not test acceptance"
    stats = read_stats(spool)
    assert stats["status"] == "capturing" and stats.get("dropped", {}) == {} and stats.get("hook_errors", 0) == 0
    if shape == "tree":
        servers.release("tree")


def test_a_prefill_capture_on_a_draft_serving_replica_says_no_step_ran(servers, collector, prompts):
    chain, _ = servers("chain")
    ids = prompts[0] + prompts[1]
    tag = CaptureTag(record_id="chain-prefill", sample_id="chain-prefill", loss_spans=((0, len(ids)),))
    post_json(f"{chain.url}/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 0, "temperature": 0, "custom_params": tag.to_custom_params()}})
    record = stored_record(collector, "chain-prefill")
    assert record.num_states == len(ids) and record.metadata[METADATA_KEY]["verify_steps"] == 0
    tree_record = stored_record(collector, "tree-0")
    assert record.metadata[METADATA_KEY]["draft"] == tree_record.metadata[METADATA_KEY]["draft"]  # one draft


def test_capture_changes_nothing_a_user_receives_even_when_it_refuses(servers, prompts):
    chain, _ = servers("chain")
    unplugged, _ = servers("unplugged")
    refused, refused_spool = servers("refused")
    for index, ids in enumerate(prompts):
        captured = generate(chain, ids, record_id=f"same-{index}")
        for other in (unplugged, refused):
            answer = generate(other, ids, record_id=f"other-{index}")
            assert answer["output_ids"] == captured["output_ids"]
            assert answer["meta_info"]["spec_verify_ct"] == captured["meta_info"]["spec_verify_ct"]
    assert "eagle-tap capture disabled" in refused.log_tail(20_000)
    assert "serving draft reads layers [3, 5, 6]" in refused.log_tail(20_000)
    status = read_stats(refused_spool, rank_dir="")["status"]
    assert status.startswith("dormant") and "EAGLE_TAP_CAPTURE_LAYERS" in status
    servers.release("unplugged", "refused")


def test_records_name_the_draft_that_served_them_across_a_weight_swap(servers, collector, prompts, untrained_draft,
                                                                       draft):
    chain, _ = servers("chain")

    def served_by(label: str) -> tuple[str, float]:
        answer = generate(chain, prompts[4], record_id=label)
        served = stored_record(collector, label).metadata[METADATA_KEY]
        check_served_draft_against_meta_info(stored_record(collector, label), answer)
        return served["draft"], (served["accepted_drafts"] + served["verify_steps"]) / served["verify_steps"]

    trained, trained_acceptance = served_by("swap-before")
    to_untrained = swap_draft(chain.url, untrained_draft, serving_dir=draft, check_target=True)
    untrained, untrained_acceptance = served_by("swap-untrained")
    back = swap_draft(chain.url, draft, serving_dir=draft)  # the default: the draft's checksums only
    again, again_acceptance = served_by("swap-back")
    assert untrained != trained and again == trained  # the identity follows the weights, not the folder
    assert untrained_acceptance < trained_acceptance == again_acceptance
    # SGLang's own checksums: the draft moved and came back, the target never moved.
    assert to_untrained.target_unchanged is True and to_untrained.target_checksum_before is not None
    assert not back.target_checked and back.target_unchanged is None
    assert to_untrained.draft_checksum_after != to_untrained.draft_checksum_before == back.draft_checksum_after
    assert to_untrained.num_tensors > 0 and to_untrained.paused_s < 5


def test_a_draft_that_cannot_swap_in_place_is_refused_before_the_replica_is_touched(servers, draft, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    chain, _ = servers("chain")
    before = weights_checksum(chain.url, "draft")
    remapped = tmp_path / "remapped"
    shutil.copytree(draft, remapped)
    tensors = load_file(remapped / "model.safetensors")
    tensors["d2t"] = tensors["d2t"].flip(0)  # another vocab mapping: SGLang would keep using the old one
    save_file(tensors, remapped / "model.safetensors")
    with pytest.raises(DraftMismatchError, match="vocab mapping"):
        swap_draft(chain.url, remapped, serving_dir=draft)
    wider = tmp_path / "wider"
    shutil.copytree(draft, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(DraftMismatchError, match="intermediate_size"):
        swap_draft(chain.url, wider, serving_dir=draft)
    assert weights_checksum(chain.url, "draft") == before


def test_stop_strings_and_several_samples_keep_their_rules(servers, collector, prompts):
    chain, spool = servers("chain")
    free = generate(chain, prompts[2])
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"the tiny model's answer has no usable middle: {text!r}"
    stopped = generate(chain, prompts[2], record_id="chain-stopped", stop=[stop])
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    record = stored_record(collector, "chain-stopped")
    assert record.token_ids.tolist() == prompts[2] + stopped["output_ids"]  # what the client received
    assert record.metadata["finish_reason"] == "stop" and record.num_states == record.num_tokens - 1
    check_served_draft_against_meta_info(record, stopped)
    before = read_stats(spool).get("dropped", {}).get("generate_tag_with_n_samples", 0)
    generate(chain, prompts[3], record_id="chain-two-samples", n=2)
    # SGLang sends the tag with each sample and with its prefix warm-up request: every one is refused, none stored.
    wait_for(lambda: read_stats(spool).get("dropped", {}).get("generate_tag_with_n_samples", 0) >= before + 2, 30,
             "the refusal of a generate tag on two samples")
    with pytest.raises(AssertionError, match="timed out"):
        stored_record(collector, "chain-two-samples", timeout_s=2)
    servers.release("chain", "plain")


def test_live_sampling_on_a_draft_serving_replica(servers, collector, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server, spool = servers("live")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = "You answer questions about the notes below.\n" + "".join(f"note {i}: item {i} costs {3 * i}\n" for i in range(24))
    rids = [f"spec-{index:02d}" for index in range(24)]
    sampled = [rid for rid in rids if is_sampled(rid, LIVE_RATE)]
    assert len(sampled) == 4  # xxh3 of these ids (`is_sampled`): fixed

    def one(rid: str) -> dict:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"What does item {rid[-2:]} cost?"}]
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        return {"ids": ids, **generate(server, ids, rid=rid)}

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = dict(zip(rids, pool.map(one, rids)))
    stats = wait_for(lambda: (s := read_stats(spool)).get("captured_live", 0) >= len(sampled) and s, 60, "live captures")
    assert stats["captured_live"] == len(sampled) and stats.get("dropped", {}) == {}
    assert stats.get("hook_errors", 0) == 0 and stats.get("prefix_blocks_sent", 0) > 0
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for rid in sampled:  # coverage 1.0: every sampled request's record, complete and right
        record = resolved_record(collector, f"live-{rid}")
        answer = answers[rid]
        assert record.token_ids.tolist() == answer["ids"] + answer["output_ids"]
        check_against_transformers(hf_model, record, rid)
        check_served_draft_against_meta_info(record, answer)
    servers.release("live")


def test_retracted_generations_are_stored_whole(servers, collector, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server, spool = servers("retract")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "".join(f"item_{i} = {i} * 7 + 1\n" for i in range(60))
    prompts = [tokenizer(f"# notes {index}\n{text}", add_special_tokens=False)["input_ids"][:48] for index in range(4)]

    def one(index: int) -> dict:
        return generate(server, prompts[index], record_id=f"retract-{index}", max_new_tokens=40)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, range(len(prompts))))
    assert sum(answer["meta_info"]["num_retractions"] for answer in answers) >= 1, "SGLang should have retracted"
    stats = wait_for(lambda: (s := read_stats(spool)).get("captured", 0) >= len(prompts) and s, 60, "the captures")
    assert stats.get("dropped", {}) == {} and stats.get("hook_errors", 0) == 0
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for index, answer in enumerate(answers):
        record = stored_record(collector, f"retract-{index}")
        assert record.token_ids.tolist() == prompts[index] + answer["output_ids"]
        check_against_transformers(hf_model, record, f"retract-{index}")
        served = record.metadata[METADATA_KEY]
        assert served["verify_steps"] == answer["meta_info"]["spec_verify_ct"]
        assert served["accepted_drafts"] == answer["meta_info"]["spec_num_correct_drafts"]
