"""The capture plugin inside a real SGLang server (CPU), shipping to a real collector on loopback.

Oracles: SGLang's own `return_hidden_states` output of the same forward (aux states, exact), and HF
transformers' `hidden_states` for the tiny model (aux and final, within bf16 tolerance).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from capture_format import decode_frame, float32_from_bfloat16_bits
from capture_format.tag import CaptureTag
from eagle_tap.collector_process import CollectorProcess

pytestmark = pytest.mark.sglang

CAPTURE_LAYERS = (3, 5, 6)  # the default [3, L//2 + 1, L - 2] for the 8-layer tiny model
BF16_REL_TOL = 0.03


def post_json(url: str, payload: dict, timeout_s: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def generate(server, input_ids: list[int], *, record_id: str | None = None, spans=None, max_new_tokens: int = 1,
             cache_salt: str | None = "fresh", return_hidden_states: bool = False) -> dict:
    sampling_params: dict = {"max_new_tokens": max_new_tokens, "temperature": 0}
    payload: dict = {"input_ids": input_ids, "sampling_params": sampling_params}
    if record_id is not None:
        tag = CaptureTag(record_id=record_id, sample_id=f"sample-{record_id}", loss_spans=spans or ((0, len(input_ids)),),
                         metadata={"test": True})
        sampling_params["custom_params"] = tag.to_custom_params()
    if cache_salt is not None:
        payload["cache_salt"] = uuid.uuid4().hex if cache_salt == "fresh" else cache_salt
    if return_hidden_states:
        payload["return_hidden_states"] = True
    return post_json(f"{server.url}/generate", payload)


def read_stats(spool_dir: Path) -> dict:
    path = spool_dir / "dp0" / "stats.json"
    return json.loads(path.read_text()) if path.exists() else {}


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def locate(collector: CollectorProcess, record_id: str, timeout_s: float = 60.0) -> dict:
    """The collector's answer to GET /v1/records/{id}, once it has the record."""
    def lookup():
        try:
            with urllib.request.urlopen(f"{collector.url}/v1/records/{record_id}", timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    return wait_for(lookup, timeout_s, f"record {record_id} at the collector")


def stored_record(collector: CollectorProcess, record_id: str, timeout_s: float = 60.0):
    """The record as the collector stored it, read back from its shard and fully verified."""
    location = locate(collector, record_id, timeout_s)
    shard_path = next(path for path in collector.data_dir.iterdir() if path.name.startswith(location["shard"]))
    with open(shard_path, "rb") as shard:
        shard.seek(location["offset"])
        frame = shard.read(location["frame_nbytes"])
    return decode_frame(frame)


def collector_stats(collector: CollectorProcess) -> dict:
    with urllib.request.urlopen(f"{collector.url}/v1/stats", timeout=10) as response:
        return json.loads(response.read())


def aux_as_float(record) -> np.ndarray:
    return float32_from_bfloat16_bits(np.asarray(record.aux))  # (T, K, H)


def final_as_float(record) -> np.ndarray:
    return float32_from_bfloat16_bits(np.asarray(record.final))  # (T, H)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()


def hf_states(hf_model, input_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF's aux (T, K, H) at the inputs of CAPTURE_LAYERS, and its final post-norm state (T, H)."""
    with torch.no_grad():
        out = hf_model(torch.tensor([input_ids]), output_hidden_states=True)
    hidden = out.hidden_states  # hidden[i] = input of decoder layer i; hidden[-1] = after the final norm
    aux = torch.stack([hidden[layer][0] for layer in CAPTURE_LAYERS], dim=1)
    return aux.float().numpy(), hidden[-1][0].float().numpy()


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    process = CollectorProcess(tmp_path_factory.mktemp("collector") / "data")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def capture_server(start_sglang, tiny_model_dir, collector, tmp_path_factory):
    spool_dir = tmp_path_factory.mktemp("spool")
    server = start_sglang(tiny_model_dir, env={"EAGLE_TAP_COLLECTOR_URL": collector.url,
                                               "EAGLE_TAP_SPOOL_DIR": str(spool_dir)})
    return server, spool_dir


def prompt_ids(tokenizer, index: int, num_tokens: int) -> list[int]:
    text = f"# example {index}\n" + "".join(f"value_{index}_{i} = compute({i}, {index})\n" for i in range(200))
    return tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_capture_equals_sglang_own_output_and_transformers(capture_server, collector, hf_model, tokenizer):
    server, _ = capture_server
    input_ids = prompt_ids(tokenizer, 0, 40)
    response = generate(server, input_ids, record_id="oracle-0", spans=((10, 40),), return_hidden_states=True)
    record = stored_record(collector, "oracle-0")

    assert record.token_ids.tolist() == input_ids
    assert record.capture_layers == CAPTURE_LAYERS and record.loss_spans == ((10, 40),)
    assert record.metadata == {"test": True} and record.sample_id == "sample-oracle-0"
    aux, final = aux_as_float(record), final_as_float(record)
    assert aux.shape == (40, 3, hf_model.config.hidden_size) and final.shape == (40, hf_model.config.hidden_size)

    # SGLang's own return_hidden_states: the packed aux rows of the same forward, as JSON floats.
    own = np.asarray(response["meta_info"]["hidden_states"][0], dtype=np.float32)  # (T, K*H)
    np.testing.assert_array_equal(aux.reshape(40, -1), own)

    hf_aux, hf_final = hf_states(hf_model, input_ids)
    assert relative_error(aux, hf_aux) < BF16_REL_TOL
    assert relative_error(final, hf_final) < BF16_REL_TOL
    # Each slot is its own layer: swapping two slots must be far off.
    assert relative_error(aux[:, [1, 0, 2]], hf_aux) > 5 * BF16_REL_TOL


def test_concurrent_tagged_and_untagged_requests_are_not_mixed_up(capture_server, collector, hf_model, tokenizer):
    server, spool_dir = capture_server
    records_before = collector_stats(collector)["num_records"]
    lengths = [5, 17, 33, 64, 9, 48, 21, 70, 3, 40, 12, 55]
    jobs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        for index, length in enumerate(lengths):
            ids = prompt_ids(tokenizer, index + 1, length)
            record_id = f"mix-{index}" if index % 3 != 2 else None
            jobs.append((record_id, ids, pool.submit(generate, server, ids, record_id=record_id, max_new_tokens=2)))
            # Untagged traffic that shares prefixes with tagged requests must not disturb them.
            pool.submit(generate, server, ids[: max(1, length // 2)], max_new_tokens=3, cache_salt=None)
        for _, _, future in jobs:
            assert len(future.result()["output_ids"]) == 2
    tagged = [(record_id, ids) for record_id, ids, _ in jobs if record_id is not None]
    for record_id, ids in tagged:
        record = stored_record(collector, record_id)
        assert record.token_ids.tolist() == ids, record_id
        hf_aux, hf_final = hf_states(hf_model, ids)
        assert relative_error(aux_as_float(record), hf_aux) < BF16_REL_TOL, record_id
        assert relative_error(final_as_float(record), hf_final) < BF16_REL_TOL, record_id
    num_records = collector_stats(collector)["num_records"]
    assert num_records == records_before + len(tagged), "untagged requests must never be captured"
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("sent") == num_records and s, 30, "fresh plugin stats")
    assert stats["captured"] == num_records and stats["dropped"] == {}


def test_repeated_prompt_with_fresh_salt_is_captured_whole_and_a_cached_prefix_is_dropped(
        capture_server, collector, tokenizer):
    server, spool_dir = capture_server
    ids = prompt_ids(tokenizer, 99, 50)
    generate(server, ids, max_new_tokens=1, cache_salt="shared-salt")  # warms the radix cache
    first = generate(server, ids, record_id="salted-a")  # fresh salt
    second = generate(server, ids, record_id="salted-b")
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] == 0
    for record_id in ("salted-a", "salted-b"):
        assert stored_record(collector, record_id).token_ids.tolist() == ids

    dropped_before = read_stats(spool_dir).get("dropped", {}).get("cached_prefix", 0)
    reused = generate(server, ids, record_id="salted-c", cache_salt="shared-salt")
    assert reused["meta_info"]["cached_tokens"] > 0
    wait_for(lambda: read_stats(spool_dir).get("dropped", {}).get("cached_prefix", 0) == dropped_before + 1,
             10, "the cached-prefix drop to be counted")


def test_chunked_prefill_gives_the_same_record(start_sglang, tiny_model_dir, collector, capture_server, tokenizer,
                                               tmp_path_factory):
    unchunked_server, _ = capture_server
    spool_dir = tmp_path_factory.mktemp("spool-chunked")
    chunked_server = start_sglang(tiny_model_dir, extra_args=("--chunked-prefill-size", "16"),
                                  env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir)})
    ids = prompt_ids(tokenizer, 7, 100)
    generate(unchunked_server, ids, record_id="whole-100")
    generate(chunked_server, ids, record_id="chunked-100")
    whole, chunked = stored_record(collector, "whole-100"), stored_record(collector, "chunked-100")
    assert chunked.token_ids.tolist() == whole.token_ids.tolist() == ids
    assert relative_error(aux_as_float(chunked), aux_as_float(whole)) < BF16_REL_TOL
    assert relative_error(final_as_float(chunked), final_as_float(whole)) < BF16_REL_TOL
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("sent") == 1 and s, 30, "the chunked server's stats")
    assert stats["started"] == 1 and stats["dropped"] == {}
