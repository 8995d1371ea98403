"""Long records through a real SGLang server (CPU) and a real collector: captured in parts, stored whole.

The tiny target with its declared context raised (RoPE runs past the 2,048 positions it was trained on;
the states are still the model's states, which is all a capture promises), bf16, prefill chunked at 2,048
tokens, parts of 1,024: a 12K-token prompt plus its answer leaves the plugin in a dozen parts. Oracles: a
prefill capture of the same ids (bf16 noise: decode rows are another kernel path) and HF transformers on a
sample of rows. 64K-token captures run in `eagle-tap bench --only long` (minutes each on 2 cores).

The kill tests hold on a machine whose cores are all busy with something else too:
`python scripts/busy_cores.py --seconds 900 & pytest tests/test_long_capture.py`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from capture_format import ShardDirectory
from capture_format.parts import SENDER_MAX_BACKOFF_S
from capture_format.tag import CaptureTag
from capture_helpers import (aux_as_float, final_as_float, locate,
                             median_token_error, read_stats, relative_error, wait_for)
from eagle_tap.testbed.collector_process import CollectorProcess
from eagle_tap.serve.http_api import post_json
from sglang_patch.selection import live_record_id

pytestmark = pytest.mark.sglang

PROMPT_TOKENS = 12_000
PART_TOKENS = 1024
CHUNK_TOKENS = 2048
BF16_MEDIAN_REL_TOL = 0.03
# Three of the plugin's longest waits between re-sends: after the collector's restart (from which its clock for
# parts it kept runs) the plugin tries again within one, and its spool drains in a few POSTs.
PART_TIMEOUT_S = 3 * SENDER_MAX_BACKOFF_S


@pytest.fixture(scope="module")
def long_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny target, its declared context raised to 32K positions (the weights are links to the original)."""
    folder = tmp_path_factory.mktemp("long-target")
    for path in Path(tiny_model_dir).iterdir():
        if path.name != "config.json":
            (folder / path.name).symlink_to(path)
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32_768}))
    return folder


@pytest.fixture(scope="module")
def long_collector(tmp_path_factory):
    """A collector on a fixed port (a test kills and restarts it), sealing within a second, parts expiring fast."""
    data_dir = tmp_path_factory.mktemp("long-collector") / "data"
    args = ("--seal-after-s", "1", "--part-timeout-s", str(PART_TIMEOUT_S))
    holder = {"process": CollectorProcess(data_dir, extra_args=args)}
    holder["restart"] = lambda: holder.update(process=CollectorProcess(data_dir, holder["process"].port, args))
    yield holder
    holder["process"].stop()


@pytest.fixture(scope="module")
def long_server(start_sglang, long_model_dir, long_collector, tmp_path_factory):
    spool_dir = tmp_path_factory.mktemp("spool-long")
    server = start_sglang(long_model_dir, extra_args=(
        "--chunked-prefill-size", str(CHUNK_TOKENS), "--context-length", "32768"), env={
        "EAGLE_TAP_COLLECTOR_URL": long_collector["process"].url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir),
        "EAGLE_TAP_LIVE_SAMPLE_RATE": "1.0", "EAGLE_TAP_PART_MAX_TOKENS": str(PART_TOKENS)})
    return server, spool_dir


def long_ids(seed: int, num_tokens: int = PROMPT_TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(7, 4096, num_tokens).tolist()  # past the special tokens


def request(server, ids: list[int], *, record_id: str | None = None, mode: str = "generate", max_new_tokens: int = 16,
            rid: str | None = None) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    if record_id is not None:
        params["custom_params"] = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=(),
                                             mode=mode).to_custom_params()
    payload = {"input_ids": ids, "sampling_params": params, **({"rid": rid} if rid else {})}
    return post_json(f"{server.url}/generate", payload, timeout_s=600)


def resolved(collector: CollectorProcess, record_id: str):
    """The record read back from sealed shards, its parts joined (capture_format's own resolution)."""
    locate(collector, record_id, timeout_s=120)

    def sealed():
        with ShardDirectory(collector.data_dir) as shards:
            entry = next((entry for entry in shards.iter_index() if entry.record_id == record_id), None)
            return shards.read_record(entry) if entry is not None else None

    return wait_for(sealed, 30, f"{record_id} in a sealed shard")



def test_a_long_generation_is_captured_in_parts_tagged_and_live_equal_to_a_prefill_capture_and_transformers(
        long_server, long_collector, long_model_dir):
    server, spool_dir = long_server
    collector = long_collector["process"]
    ids = long_ids(1)
    tagged = request(server, ids, record_id="long-tagged")
    live = request(server, ids, rid="long-live-1")
    generated = tagged["output_ids"]
    assert live["output_ids"] == generated and len(generated) == 16
    record = resolved(collector, "long-tagged")
    live_record = resolved(collector, live_record_id("long-live-1"))
    whole = ids + generated
    assert record.token_ids.tolist() == whole and live_record.token_ids.tolist() == whole
    assert record.num_states == len(whole) - 1 and record.loss_spans == ((len(ids), len(whole)),)
    assert record.metadata["capture_parts"]["count"] == len(whole) // PART_TOKENS

    request(server, whole, record_id="long-prefill", mode="prefill", max_new_tokens=1)
    prefill = resolved(collector, "long-prefill")
    assert prefill.num_states == len(whole)
    rows = record.num_states
    for got in (record, live_record):
        assert relative_error(aux_as_float(got), aux_as_float(prefill)[:rows]) < BF16_MEDIAN_REL_TOL
        assert relative_error(final_as_float(got), final_as_float(prefill)[:rows]) < BF16_MEDIAN_REL_TOL

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(long_model_dir, dtype=torch.float32).eval()
    torch.set_num_threads(2)
    with torch.no_grad():
        hidden = hf_model(torch.tensor([whole]), output_hidden_states=True).hidden_states  # L+1 of (1, T, H)
    sample = np.r_[0:64, PART_TOKENS - 8 : PART_TOKENS + 8, len(whole) - 64 : len(whole)]  # ends and a part boundary
    aux = aux_as_float(prefill)[sample]  # (n, K, H)
    for slot, layer in enumerate(prefill.capture_layers):
        assert median_token_error(aux[:, slot], hidden[layer][0, sample].numpy()) < BF16_MEDIAN_REL_TOL, layer
    assert median_token_error(final_as_float(prefill)[sample], hidden[-1][0, sample].numpy()) < BF16_MEDIAN_REL_TOL

    stats = read_stats(spool_dir)
    assert stats["dropped"] == {} and stats["parts_sent"] >= 3 * (len(ids) // PART_TOKENS)
    assert stats["most_rows_held"] <= PART_TOKENS + CHUNK_TOKENS, stats["most_rows_held"]
    parts = collector.stats()["parts"]
    assert parts["captures_closed"] >= 3 and parts["open_captures"] == 0


def wait_for_parts(collector: CollectorProcess, key: str, at_least: int, timeout_s: float = 120) -> dict:
    return wait_for(lambda: (stats := collector.stats()["parts"]).get(key, 0) >= at_least and stats,
                    timeout_s, f"{key} >= {at_least} at the collector")


def test_killing_the_collector_mid_record_loses_no_part_and_stores_the_record_once(long_server, long_collector):
    server, spool_dir = long_server
    ids = long_ids(2)
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(request(server, ids, record_id="long-killed-collector",
                                                                   max_new_tokens=48)))
    thread.start()
    try:
        wait_for_parts(long_collector["process"], "parts_staged", 1)
        os.kill(long_collector["process"].process.pid, signal.SIGKILL)  # mid-record: parts kept, more coming
        long_collector["process"].process.wait()
        # The collector stays down until the plugin has met the closed port and spooled a frame: a fixed sleep
        # let a loaded machine send nothing in the gap, and the spool path went untested.
        wait_for(lambda: read_stats(spool_dir).get("spooled", 0) >= 1, 120, "the plugin to spool a frame")
        long_collector["restart"]()
    finally:
        thread.join(timeout=600)
    collector = long_collector["process"]

    def stored_or_refused() -> bool:
        parts = collector.stats()["parts"]
        assert parts["records_refused_parts_expired"] == 0 and parts["captures_expired"] == 0, (
            f"parts expired while the plugin was still re-sending them (not a lost record): {parts}")
        return collector.has_record("long-killed-collector")

    wait_for(stored_or_refused, 120, "long-killed-collector at the collector")
    record = resolved(collector, "long-killed-collector")
    assert record.token_ids.tolist() == ids + answer["output_ids"]
    # The stats file is rewritten about once a second: the record can be stored before it counts the resend.
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("resent_from_spool", 0) >= 1 and s, 30,
                     "the plugin to count a frame resent from its spool")
    assert stats["dropped"] == {}
    with ShardDirectory(collector.data_dir) as shards:
        stored = [entry.record_id for shard in shards.shards for entry in shard.entries]
    assert len(stored) == len(set(stored)), "a record or part was stored twice"
    assert collector.stats()["parts"]["open_captures"] == 0


def test_killing_the_server_mid_capture_leaves_no_record_and_its_parts_are_removed(long_server, long_collector):
    """Last in the module: the server does not come back."""
    server, _ = long_server
    collector = long_collector["process"]
    before = collector.stats()
    ids = long_ids(3)

    def generate_until_killed() -> None:
        try:
            request(server, ids, record_id="long-killed-server", max_new_tokens=200)
        except OSError:
            pass  # the server was killed under it

    thread = threading.Thread(target=generate_until_killed, daemon=True)
    thread.start()
    wait_for_parts(collector, "open_captures", 1)
    os.killpg(server.pid, signal.SIGKILL)
    expired = before["parts"].get("captures_expired", 0) + 1
    parts = wait_for_parts(collector, "captures_expired", expired, timeout_s=PART_TIMEOUT_S * 4)
    assert parts["open_captures"] == 0 and parts["parts_expired"] >= 1
    assert not any((collector.data_dir / "parts").iterdir())
    assert collector.stats()["num_records"] == before["num_records"], "a part of the killed capture was stored"
    assert collector.stats()["parts"]["captures_closed"] == before["parts"]["captures_closed"]
