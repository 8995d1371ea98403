"""One-pass capture inside a real SGLang server (CPU): prompt and decode rows of generating requests,
tagged ("mode": "generate") or sampled from ordinary traffic, shipped to a real collector on loopback.

Oracle: a prefill capture of the same token ids (prompt + generated) by the same server; a decode row is
a different kernel path from a prefill row, so they agree within bf16 noise, not bit for bit.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.request
import uuid

import pytest

from capture_format.tag import CaptureTag
from capture_helpers import aux_as_float, final_as_float, generate, read_stats, relative_error, stored_record, wait_for
from eagle_tap.serve.http_api import post_json
from sglang_patch.selection import is_sampled

pytestmark = pytest.mark.sglang

BF16_REL_TOL = 0.03
LIVE_RATE = 0.5
SYSTEM_PROMPT = "You are a careful assistant. " + " ".join(f"Rule {i}: answer plainly and check facts." for i in range(40))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def live_server(start_sglang, tiny_model_dir, collector, tmp_path_factory):
    """(server, spool dir): live sampling at LIVE_RATE, prefill chunked at 32 tokens."""
    spool_dir = tmp_path_factory.mktemp("spool-live")
    server = start_sglang(tiny_model_dir, extra_args=("--chunked-prefill-size", "32"), env={
        "EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir),
        "EAGLE_TAP_LIVE_SAMPLE_RATE": str(LIVE_RATE)})
    return server, spool_dir


def prompt_ids(tokenizer, index: int, num_tokens: int) -> list[int]:
    text = f"# notes {index}\n" + "".join(f"item_{index}_{i} = {i} * {index} + 1\n" for i in range(200))
    return tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]


def generate_tagged(server, ids: list[int], record_id: str, max_new_tokens: int, rid: str | None = None) -> dict:
    tag = CaptureTag(record_id=record_id, sample_id=record_id, loss_spans=(), mode="generate")
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                     "custom_params": tag.to_custom_params()}}
    if rid is not None:
        payload["rid"] = rid
    return post_json(f"{server.url}/generate", payload)


def check_against_prefill_capture(server, collector, record, label: str) -> None:
    """The one-pass record's rows equal a prefill capture of the same ids within bf16 noise."""
    ids = record.token_ids.tolist()
    generate(server, ids, record_id=f"{label}-prefill")
    prefill = stored_record(collector, f"{label}-prefill")
    assert prefill.num_states == len(ids)
    rows = record.num_states
    assert relative_error(aux_as_float(record), aux_as_float(prefill)[:rows]) < BF16_REL_TOL
    assert relative_error(final_as_float(record), final_as_float(prefill)[:rows]) < BF16_REL_TOL


def test_a_generate_capture_is_prompt_and_answer_with_decode_rows_equal_to_a_prefill_capture(
        live_server, collector, tokenizer):
    server, _ = live_server
    ids = prompt_ids(tokenizer, 1, 70)  # three prefill chunks of 32
    answer = generate_tagged(server, ids, "gen-one", max_new_tokens=12)
    record = stored_record(collector, "gen-one")
    generated = answer["output_ids"]
    assert len(generated) == answer["meta_info"]["completion_tokens"] >= 1
    assert record.token_ids.tolist() == ids + generated
    assert record.num_states == len(ids) + len(generated) - 1  # the last token never ran through the model
    assert record.loss_spans == ((len(ids), len(ids) + len(generated)),)
    check_against_prefill_capture(server, collector, record, "gen-one")


def test_concurrent_generations_of_different_lengths_each_get_their_own_rows(live_server, collector, tokenizer):
    server, _ = live_server
    lengths = [(40, 3), (90, 17), (20, 9), (64, 1), (33, 24)]

    def one(index: int) -> dict:
        prompt_len, new_tokens = lengths[index]
        return generate_tagged(server, prompt_ids(tokenizer, 10 + index, prompt_len), f"conc-{index}", new_tokens)

    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        answers = list(pool.map(one, range(len(lengths))))
    for index, ((prompt_len, _), answer) in enumerate(zip(lengths, answers)):
        record = stored_record(collector, f"conc-{index}")
        assert record.token_ids.tolist() == prompt_ids(tokenizer, 10 + index, prompt_len) + answer["output_ids"]
    check_against_prefill_capture(server, collector, stored_record(collector, "conc-4"), "conc-4")


def test_live_sampling_captures_exactly_the_sampled_chat_requests_and_respects_opt_out(
        live_server, collector, tokenizer):
    server, spool_dir = live_server
    rids = [f"livetest{i:04d}" for i in range(12)]
    opted_out = rids[0] if is_sampled(rids[0], LIVE_RATE) else next(r for r in rids if is_sampled(r, LIVE_RATE))

    def chat(rid: str) -> dict:
        body = {"model": "tiny", "rid": rid, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": f"Question {rid}: what is 2 + {rid[-2:]}?"}]}
        if rid == opted_out:
            body["custom_params"] = {"eagle_tap": {"opt_out": True}}
        return post_json(f"{server.url}/v1/chat/completions", body)

    before = read_stats(spool_dir)
    answers = {rid: chat(rid) for rid in rids}
    sampled = [rid for rid in rids if is_sampled(rid, LIVE_RATE) and rid != opted_out]
    assert sampled, "the rate should select some of these request ids"
    for rid in sampled:
        record = stored_record(collector, f"live-{rid}")
        finish = answers[rid]["choices"][0]["finish_reason"]  # "stop" or "length", as the client was told
        assert record.metadata == {"source": "live", "live_sample_rate": LIVE_RATE, "finish_reason": finish}
        text = tokenizer.decode(record.token_ids.tolist())
        assert SYSTEM_PROMPT in text and f"Question {rid}" in text  # complete context despite the cache
        answer = answers[rid]["choices"][0]["message"]["content"]
        assert text.rstrip().endswith(answer.strip()[-8:]) or answer.strip() == ""
        assert record.loss_spans[-1][1] == record.num_tokens == record.num_states + 1
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("captured_live", 0) - before.get("captured_live", 0)
                     >= len(sampled) and s, 30, "the live captures to be counted")
    assert stats["live_opted_out"] - before.get("live_opted_out", 0) == 1
    for rid in rids:
        if rid not in sampled:
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(f"{collector.url}/v1/records/live-{rid}", timeout=10)


def test_an_unsampled_request_keeps_its_radix_hits_and_a_sampled_one_is_computed_whole(live_server, collector):
    server, _ = live_server
    rids = [f"radix{i:04d}" for i in range(40)]
    unsampled = [rid for rid in rids if not is_sampled(rid, LIVE_RATE)][:2]
    sampled = next(rid for rid in rids if is_sampled(rid, LIVE_RATE))
    prefix = list(range(300, 520))

    def run(rid: str, tail: int) -> dict:
        return post_json(f"{server.url}/generate", {"rid": rid, "input_ids": prefix + [tail, tail + 1],
                                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}})

    run(unsampled[0], 7)  # puts the shared prefix into the cache
    assert run(unsampled[1], 9)["meta_info"]["cached_tokens"] >= len(prefix)
    answer = run(sampled, 11)
    assert answer["meta_info"]["cached_tokens"] == 0
    record = stored_record(collector, f"live-{sampled}")
    assert record.token_ids.tolist() == prefix + [11, 12] + answer["output_ids"]


def test_an_aborted_generation_is_counted_and_never_stored(live_server, collector, tokenizer):
    server, spool_dir = live_server
    before = read_stats(spool_dir).get("dropped", {}).get("aborted", 0)
    rid = f"abort-{uuid.uuid4().hex}"
    result: dict = {}

    def long_generation() -> None:
        try:
            result["answer"] = generate_tagged(server, prompt_ids(tokenizer, 3, 40), "aborted-one", 1500, rid=rid)
        except Exception as error:  # the server may answer an aborted request with an error
            result["error"] = error

    thread = threading.Thread(target=long_generation)
    thread.start()
    time.sleep(2.0)  # mid-generation
    request = urllib.request.Request(f"{server.url}/abort_request", data=json.dumps({"rid": rid}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:  # answers with an empty body
        assert response.status == 200
    thread.join(60)
    wait_for(lambda: read_stats(spool_dir).get("dropped", {}).get("aborted", 0) == before + 1, 30,
             "the aborted capture to be counted")
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{collector.url}/v1/records/aborted-one", timeout=10)


def test_generations_retracted_under_kv_pressure_give_correct_records(start_sglang, tiny_model_dir, collector,
                                                                      tokenizer, tmp_path_factory):
    spool_dir = tmp_path_factory.mktemp("spool-retract")
    # A small KV pool, and SGLang's own test switch, which retracts running requests every few decode steps
    # (without it this pool admits requests cautiously enough that none is ever retracted).
    server = start_sglang(tiny_model_dir, extra_args=("--max-total-tokens", "400", "--chunked-prefill-size", "64"),
                          env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool_dir),
                               "SGLANG_TEST_RETRACT": "1"})
    prompts = [prompt_ids(tokenizer, 40 + i, 48) for i in range(6)]

    def one(index: int) -> dict:
        return generate_tagged(server, prompts[index], f"retract-{index}", max_new_tokens=90)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, range(len(prompts))))
    stats = wait_for(lambda: (s := read_stats(spool_dir)).get("captured", 0) + sum(s.get("dropped", {}).values())
                     >= len(prompts) and s, 60, "every generation to be captured or dropped")
    assert "Retract requests" in server.log_tail(2000) or "Testing retraction" in server.log_tail(2000), \
        "SGLang should have retracted running requests"
    assert stats.get("restarted", 0) >= 1, stats  # a retracted capture prefilled again
    stored = 0
    for index, answer in enumerate(answers):
        try:
            record = stored_record(collector, f"retract-{index}", timeout_s=5)
        except AssertionError:
            continue  # dropped and counted, never wrong
        stored += 1
        assert record.token_ids.tolist() == prompts[index] + answer["output_ids"]
        check_against_prefill_capture(server, collector, record, f"retract-{index}")
    assert stored + sum(stats.get("dropped", {}).values()) >= len(prompts)


def test_a_generation_ended_by_a_stop_string_stores_what_the_client_received(live_server, collector, tokenizer):
    server, _ = live_server
    ids = prompt_ids(tokenizer, 5, 30)
    sampling = {"max_new_tokens": 24, "temperature": 0}
    free = post_json(f"{server.url}/generate", {"input_ids": ids, "sampling_params": sampling})
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # ends the answer half way
    assert stop.strip(), f"the tiny model's answer has no usable middle: {text!r}"
    tag = CaptureTag(record_id="stopped", sample_id="stopped", loss_spans=(), mode="generate")
    answer = post_json(f"{server.url}/generate", {"input_ids": ids, "sampling_params": {
        **sampling, "stop": [stop], "custom_params": tag.to_custom_params()}})
    assert answer["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(answer["output_ids"]) < len(free["output_ids"])
    record = stored_record(collector, "stopped")
    assert record.token_ids.tolist() == ids + answer["output_ids"]
    assert record.metadata["finish_reason"] == "stop" and record.num_states == record.num_tokens - 1
