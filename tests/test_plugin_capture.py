"""The capture plugin inside a real SGLang server (CPU), shipping to a real collector on loopback.

Oracles: SGLang's own `return_hidden_states` output of the same forward (aux states, exact), and HF
transformers' `hidden_states` for the tiny model (aux and final, within bf16 tolerance).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

from capture_helpers import (
    aux_as_float,
    collector_stats,
    final_as_float,
    generate,
    read_stats,
    relative_error,
    stored_record,
    wait_for,
)

pytestmark = pytest.mark.sglang

CAPTURE_LAYERS = (3, 5, 6)  # the default [3, L//2 + 1, L - 2] for the 8-layer tiny model
BF16_REL_TOL = 0.03


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


def test_a_tagged_prompt_already_in_the_radix_cache_is_still_captured_whole(capture_server, collector, tokenizer):
    server, spool_dir = capture_server
    ids = prompt_ids(tokenizer, 99, 50)
    generate(server, ids, max_new_tokens=1, cache_salt="shared-salt")  # warms the radix cache
    untagged = generate(server, ids, max_new_tokens=1, cache_salt="shared-salt")
    assert untagged["meta_info"]["cached_tokens"] > 0  # requests not captured keep their cache hits
    # The plugin gives each captured request its own cache namespace, whatever salt it came with.
    for record_id, salt in (("salted-a", "fresh"), ("salted-b", "shared-salt"), ("salted-c", None)):
        answer = generate(server, ids, record_id=record_id, cache_salt=salt)
        assert answer["meta_info"]["cached_tokens"] == 0, record_id
        assert stored_record(collector, record_id).token_ids.tolist() == ids
    assert read_stats(spool_dir).get("dropped", {}).get("cached_prefix", 0) == 0


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
