"""Data-parallel attention (`--tp 2 --dp 2 --enable-dp-attention`, as DeepSeek-V3 / Kimi-K2.5 are served) on a real
SGLang server (CPU), with the capture plugin shipping to a real collector.

Per architecture one server, each a TP group of two ranks that are two DP attention groups of one rank:
- `deepseek_v3` (MLA, MoE) also with expert parallelism (`--ep 2`): the MoE output goes back to each group
  through a reduce-scatter and each rank computes only its own experts;
- `qwen3` (dense) without: its MLP output goes back through an all-reduce and a scatter.
Both run fp32, so SGLang's answers and states can be held to HF transformers' fp32 forward: greedy tokens
equal, every captured row within relative error 1e-4 (as in test_capture_parity.py).

What must hold under DP attention: requests spread over both groups; each group's requests are captured by
that group alone (its attention-TP rank 0), so each record is stored once; each group keeps its own stats
file (`<spool>/dp<rank>/stats.json`); prefill captures (tagged requests) and one-pass live captures with
decode rows (a decoding group runs beside an idle one, whose forward is an IDLE batch) both equal HF.
The CPU measures that make this run are in `eagle_tap/testbed/cpu_standins/_eagle_tap_dp_attention_cpu.py`.

One multi-rank server at a time (three processes of about 1.5 GB each); on 2 cores each starts in 40-140 s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from capture_helpers import check_rows_equal_transformers, generate, hf_greedy, read_stats, stored_record, wait_for
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.serve.http_api import post_json

pytestmark = pytest.mark.sglang

NUM_DP_GROUPS = 2
FP32_ARGS = ("--dtype", "float32", "--max-total-tokens", "8192")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    arch: str
    ep: int = 1


CASES = [Case(arch="deepseek_v3", ep=2), Case(arch="qwen3")]


@dataclasses.dataclass(kw_only=True)
class Target:
    case: Case
    server: SGLangServer
    spool: Path
    hf_model: torch.nn.Module


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.arch)
def target(request, random_target, collector, tmp_path_factory):
    """One architecture's DP-attention server (live sampling of every untagged request); stopped before the next."""
    from transformers import AutoModelForCausalLM

    case: Case = request.param
    model_dir = random_target(case.arch)
    spool = tmp_path_factory.mktemp(f"spool-{case.arch}")
    # tp 2 ranks, each its own core (the launcher sets SGLANG_CPU_OMP_THREADS_BIND), in 2 attention groups.
    server = SGLangServer(ServerConfig(
        model_path=model_dir, tp=2, dp=NUM_DP_GROUPS, dp_attention=True, ep=case.ep, extra_args=FP32_ARGS,
        log_path=tmp_path_factory.mktemp(f"dp-{case.arch}") / "server.log",
        env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool),
             "EAGLE_TAP_LIVE_SAMPLE_RATE": "1.0"}))
    try:
        server.start()
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        yield Target(case=case, server=server, spool=spool, hf_model=hf_model)
    finally:
        server.stop()


def random_ids(seed: int, num_tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(7, 4096, num_tokens).tolist()  # past the special tokens


def dp_stats(spool: Path) -> dict[str, dict]:
    """Each DP group's stats file, by folder name (`dp0`, `dp1`)."""
    return {path.name: read_stats(spool, path.name) for path in sorted(spool.iterdir()) if path.is_dir()}


def wait_for_captures(spool: Path, before: dict[str, dict], counter: str, total: int) -> dict[str, int]:
    """Per DP group, how much `counter` grew since `before`, once the groups together count `total` more."""
    def grown():
        now = dp_stats(spool)
        deltas = {name: stats.get(counter, 0) - before.get(name, {}).get(counter, 0) for name, stats in now.items()}
        return deltas if sum(deltas.values()) >= total else None

    return wait_for(grown, 30, f"{total} more {counter} in the stats files")


def test_greedy_answers_equal_transformers_and_each_group_captures_its_own_requests(target, collector):
    arch = target.case.arch
    inputs = {f"dp-{arch}-{i}": random_ids(i, 20 + 9 * i) for i in range(6)}
    before, stored_before = dp_stats(target.spool), collector.stats()["num_records"]
    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        answers = dict(zip(inputs, pool.map(
            lambda record_id: generate(target.server, inputs[record_id], record_id=record_id, max_new_tokens=4),
            inputs)))
    for record_id, ids in inputs.items():
        assert answers[record_id]["output_ids"] == hf_greedy(target.hf_model, ids, 4), record_id
        record = stored_record(collector, record_id)
        assert record.token_ids.tolist() == ids and record.num_states == len(ids)
        check_rows_equal_transformers(record, target.hf_model, record_id)

    per_group = wait_for_captures(target.spool, before, "captured", len(inputs))
    assert sorted(per_group) == [f"dp{rank}" for rank in range(NUM_DP_GROUPS)]
    assert sum(per_group.values()) == len(inputs) and min(per_group.values()) >= 1, per_group  # spread, each once
    stats = collector.stats()
    assert stats["num_records"] - stored_before == len(inputs) and stats["num_duplicates"] == 0


def test_live_generations_are_captured_once_with_decode_rows_equal_to_transformers(target, collector):
    arch = target.case.arch
    inputs = {f"dplive{arch.replace('_', '')}{i}": random_ids(100 + i, 15 + 11 * i) for i in range(4)}
    max_new_tokens = {rid: 3 + i for i, rid in enumerate(inputs)}  # groups finish at different steps
    before, stored_before = dp_stats(target.spool), collector.stats()["num_records"]

    def ask(rid: str) -> dict:
        return post_json(f"{target.server.url}/generate", {
            "rid": rid, "input_ids": inputs[rid],
            "sampling_params": {"max_new_tokens": max_new_tokens[rid], "temperature": 0}})

    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        answers = dict(zip(inputs, pool.map(ask, inputs)))
    for rid, ids in inputs.items():
        generated = answers[rid]["output_ids"]
        assert generated == hf_greedy(target.hf_model, ids, max_new_tokens[rid]), rid
        record = stored_record(collector, f"live-{rid}")
        assert record.token_ids.tolist() == ids + generated and record.num_states == len(ids) + len(generated) - 1
        check_rows_equal_transformers(record, target.hf_model, rid)

    per_group = wait_for_captures(target.spool, before, "captured_live", len(inputs))
    assert sum(per_group.values()) == len(inputs) and min(per_group.values()) >= 1, per_group
    stats = collector.stats()
    assert stats["num_records"] - stored_before == len(inputs) and stats["num_duplicates"] == 0
