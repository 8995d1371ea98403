"""Capture on tensor-parallel servers (CPU, one core per rank): TP 2 stores what TP 1 stores.

The committed tiny Llama served by a TP 1 and a TP 2 server, both serving the trained demo-style draft (a
chain of 3), fp32, with the plugin capturing tagged prefills (two sharing 16-token prefix blocks), a
tagged generation and live traffic at 100%, and SGLang retracting running requests every third step
(`SGLANG_TEST_RETRACT`): TP 2 answers exactly what TP 1 answers, every TP 2 record has the TP 1 record's
token ids and states within 1e-5 relative (the ranks' all-reduces add in another order), each request
is stored once, by rank 0, and rank 1's stats say it sends nothing and decided exactly what rank 0
decided. A random Qwen3 and a random DeepSeek-V3 (MLA, MoE) at TP 2 answer what transformers answers
greedily, with rows within 1e-5 of its fp32 states (their DP-attention shape: tests/test_dp_attention.py).
The TP 2 replica also takes in-place draft swaps (SGLang's weight-update API, one payload per rank) that land on
both ranks. The rule that keeps ranks alike is checked without a server too: a rank that decides otherwise stops
capture loudly instead of storing rows of batches the ranks no longer compute alike.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from capture_format.tag import CaptureTag
from capture_helpers import (aux_as_float, check_rows_equal_transformers, final_as_float, hf_greedy, read_stats,
                             relative_error, resolved_record, wait_for)
from eagle_tap.cli import main
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.serve.http_api import post_json
from eagle_tap.serve.draft import SpeculativeConfig
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from sglang_patch.forward_hook import CaptureHook
from sglang_patch.selection import DECISION_CHECKPOINT, live_record_id
from sglang_patch.settings import CaptureSettings
from sglang_patch.speculative import METADATA_KEY
from sglang_patch.stats import read_stats_file
from test_trainer_export import trained_run

FP32_REL_TOL = 1e-5
FP32 = ("--dtype", "float32", "--chunked-prefill-size", "32")
PLUGIN_ENV = {"EAGLE_TAP_LIVE_SAMPLE_RATE": "1.0", "EAGLE_TAP_PREFIX_BLOCK_TOKENS": "16", "SGLANG_TEST_RETRACT": "1"}
MAX_NEW_TOKENS = 8


def start(model_dir: Path, collector, tmp_path_factory, label: str, *, tp: int,
          speculative: SpeculativeConfig | None = None) -> tuple[SGLangServer, Path]:
    spool = tmp_path_factory.mktemp(f"spool-{label}")
    server = SGLangServer(ServerConfig(
        model_path=model_dir, tp=tp, extra_args=FP32, speculative=speculative,
        env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool), **PLUGIN_ENV},
        log_path=tmp_path_factory.mktemp(label) / "server.log"))
    server.start()
    return server, spool


def requests(seed: int) -> list[dict]:
    """What each server is sent: two tagged prefills sharing 40 tokens, a tagged generation, five untagged."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(7, 4096, 40).tolist()
    prompts = [shared + rng.integers(7, 4096, 30).tolist(), shared + rng.integers(7, 4096, 25).tolist(),
               rng.integers(7, 4096, 50).tolist()] + [rng.integers(7, 4096, 20).tolist() for _ in range(5)]
    modes = ["prefill", "prefill", "generate"] + [None] * 5  # None: untagged (captured live)
    return [{"ids": ids, "mode": mode, "name": f"r{index}"} for index, (ids, mode) in enumerate(zip(prompts, modes))]


def send(server: SGLangServer, label: str, request: dict) -> tuple[str, dict]:
    """Sends one request; returns (record id it is stored under, SGLang's answer)."""
    params = {"max_new_tokens": 1 if request["mode"] == "prefill" else MAX_NEW_TOKENS, "temperature": 0}
    payload = {"input_ids": request["ids"], "sampling_params": params}
    if request["mode"] is None:
        payload["rid"] = f"{label}-{request['name']}"
        record_id = live_record_id(payload["rid"])
    else:
        record_id = f"{label}-{request['name']}"
        params["custom_params"] = CaptureTag(record_id=record_id, sample_id=request["name"], loss_spans=(),
                                             mode=request["mode"]).to_custom_params()
    return record_id, post_json(f"{server.url}/generate", payload)


def send_all(server: SGLangServer, label: str, seed: int) -> dict[str, tuple[str, dict]]:
    """Every request at once, so that they share batches and SGLang has running requests to retract."""
    batch = requests(seed)
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        sent = pool.map(lambda request: send(server, label, request), batch)
        return {request["name"]: answer for request, answer in zip(batch, sent)}


def settled_stats(spool: Path, *, peer: bool) -> tuple[dict, dict | None]:
    """(rank 0's stats, rank 1's) once rank 0 captured and sent every request and rank 1 (if any) has written
    as many decisions: the files are rewritten about once a second, and a server stopped earlier spools
    what it had not sent."""
    def settled() -> tuple[dict, dict | None] | None:
        sender = read_stats(spool)
        other = read_stats_file(next((spool / "dp0").glob("stats.attn-tp*.json"))) if peer else None
        done = (sender.get("captured", 0) >= len(requests(0)) and sender.get("inflight_bytes") == 0
                and sender.get("spool_frames") == 0 and (other is None or other.get("decisions") == sender["decisions"]))
        return (sender, other) if done else None

    return wait_for(settled, 60, f"the plugin's stats in {spool.name} to show every capture sent")


def check_ranks(sender: dict, peer: dict, collector, before: dict) -> None:
    """Rank 0 captured every request and rank 1 nothing, having decided alike; every frame the collector got
    meanwhile is one rank 0 counts (shared blocks it holds already are answered as duplicates)."""
    assert sender["dropped"] == {} and sender["status"] == "capturing"
    assert sender["captured"] == len(requests(0))
    assert sender["peer_ranks"] == 1 and not sender["quiet"]  # the rank's check runs each second: never quiet
    assert peer["status"].startswith("not sending: attention-TP rank 1") and peer["dropped"] == {}
    assert peer.get("sent", 0) == peer.get("captured", 0) == 0
    assert peer["decisions"] == sender["decisions"] >= DECISION_CHECKPOINT
    assert peer["decisions_checkpoint"] == sender["decisions_checkpoint"]
    after = collector.stats()
    assert after["num_ingested"] - before["num_ingested"] == sender["sent"]
    assert after["num_duplicates"] - before["num_duplicates"] == sender.get("duplicates", 0)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "trained"
    assert main(["export", "--checkpoint", str(trained_run()), "--out", str(out)]) == 0
    return out


def swap_away_and_back(server: SGLangServer, draft: Path, other: Path) -> None:
    """A draft swapped in place into a TP 2 replica lands on every rank: swapping `other` in moves each rank's
    draft checksum, swapping the served draft back gives each rank the checksum it had as a fresh server on
    that draft, and the answers are the ones it gave before."""
    from eagle_tap.serve.http_api import weights_checksums_by_rank
    from eagle_tap.serve.swap import swap_draft

    prompt = {"input_ids": requests(3)[2]["ids"], "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS,
                                                                       "temperature": 0}}
    answer = post_json(f"{server.url}/generate", prompt)["output_ids"]
    fresh = weights_checksums_by_rank(server.url, "draft")
    assert sorted(fresh) == [0, 1]
    away = swap_draft(server.url, other, serving_dir=draft, check_target=True)
    assert away.target_unchanged is True and away.num_tensors > 0
    moved = weights_checksums_by_rank(server.url, "draft")
    assert all(moved[rank] != fresh[rank] for rank in fresh), (moved, fresh)
    swap_draft(server.url, draft, serving_dir=draft)
    assert weights_checksums_by_rank(server.url, "draft") == fresh
    assert post_json(f"{server.url}/generate", prompt)["output_ids"] == answer


@pytest.mark.sglang
def test_tp2_serving_a_draft_stores_each_request_once_with_the_tp1_records(draft, collector, tmp_path_factory):
    chain = SpeculativeConfig(draft_dir=draft, num_steps=3)
    answers, stats_before = {}, {}
    for tp in (1, 2):  # one server at a time: a TP 2 server is three processes
        server, spool = start(TINY_MODEL_DIR, collector, tmp_path_factory, f"llama-tp{tp}", tp=tp, speculative=chain)
        try:
            stats_before[tp] = collector.stats()
            answers[tp] = send_all(server, f"llama-tp{tp}", seed=1)
            sender, peer = settled_stats(spool, peer=tp == 2)
            if tp == 2:
                check_ranks(sender, peer, collector, stats_before[2])
                untrained = tmp_path_factory.mktemp("draft") / "untrained"
                assert main(["export", "--checkpoint", str(trained_run()), "--out", str(untrained), "--untrained"]) == 0
                swap_away_and_back(server, draft, untrained)
        finally:
            server.stop()
    assert sum(answer["meta_info"].get("num_retractions", 0) for _, answer in answers[2].values()) >= 1
    for request in requests(1):
        name = request["name"]
        (one_id, one_answer), (two_id, two_answer) = answers[1][name], answers[2][name]
        assert one_answer["output_ids"] == two_answer["output_ids"], name
        one, two = resolved_record(collector, one_id), resolved_record(collector, two_id)
        assert one.token_ids.tolist() == two.token_ids.tolist() and one.num_states == two.num_states, name
        assert relative_error(aux_as_float(two), aux_as_float(one)) < FP32_REL_TOL, name
        assert relative_error(final_as_float(two), final_as_float(one)) < FP32_REL_TOL, name
    served = {tp: [resolved_record(collector, answers[tp][request["name"]][0]).metadata[METADATA_KEY]
                   for request in requests(1) if request["mode"] != "prefill"] for tp in (1, 2)}
    acceptance = {tp: 1 + sum(entry["accepted_drafts"] for entry in entries) / sum(entry["verify_steps"]
                                                                                 for entry in entries)
                  for tp, entries in served.items()}
    print(f"served acceptance (tokens per verify step, chain of 3): TP 1 {acceptance[1]:.3f}, TP 2 {acceptance[2]:.3f}")
    assert acceptance[2] > 1.0


@pytest.mark.sglang
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_tp2_answers_and_captures_what_transformers_computes(arch, random_target, collector, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = random_target(arch)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    server, spool = start(model_dir, collector, tmp_path_factory, f"{arch}-tp2", tp=2)
    try:
        before = collector.stats()
        answers = send_all(server, f"{arch}-tp2", seed=2)
        check_ranks(*settled_stats(spool, peer=True), collector, before)
    finally:
        server.stop()
    for request in requests(2):
        record_id, answer = answers[request["name"]]
        new_tokens = len(answer["output_ids"])
        assert answer["output_ids"] == hf_greedy(hf_model, request["ids"], new_tokens), (arch, request["name"])
        record = resolved_record(collector, record_id)
        expected = request["ids"] + (answer["output_ids"] if request["mode"] != "prefill" else [])
        assert record.token_ids.tolist() == expected
        check_rows_equal_transformers(record, hf_model, f"{arch} {request['name']}", tolerance=FP32_REL_TOL)


def test_a_rank_that_decided_otherwise_stops_capture_loudly(tmp_path) -> None:
    """No server: the sending rank's check against a peer's stats file, as the sender thread runs it."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    hook = CaptureHook(CaptureSettings(collector_url="http://127.0.0.1:9", spool_dir=spool, live_sample_rate=1.0))
    for index in range(DECISION_CHECKPOINT):
        hook.selector.on_request(SimpleNamespace(rid=f"req-{index}", input_ids=[1, 2, 3], cache_salt=None,
                                                 input_embeds=None, mm_inputs=None,
                                                 sampling_params=SimpleNamespace(custom_params=None, n=1)))
    (count, digest), = hook.selector.checkpoints.items()
    peer = spool / "dp0" / "stats.attn-tp1.cp0.json"
    peer.parent.mkdir()
    peer.write_text(json.dumps({"decisions_checkpoint": f"{count}:{digest}"}))
    hook._check_peers()
    assert not hook._disabled and hook.stats.status == "starting"
    peer.write_text(json.dumps({"decisions_checkpoint": f"{count}:{'0' * 16}"}))
    hook._check_peers()
    assert hook._disabled and hook.stats.snapshot()["dropped"] == {"ranks_disagree": 1}
    assert hook.stats.status.startswith("stopped: stats.attn-tp1.cp0.json decided otherwise than this rank by "
                                        f"decision {count}")
