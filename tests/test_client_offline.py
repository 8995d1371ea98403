"""`fire` against a scripted server and collector (httpx.MockTransport): retries, failures by reason,
confirmation deadlines and resume, token counts, and exactly what regeneration sends and captures."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from capture_format.tag import CaptureTag
from client.endpoints import HttpConfig
from client.fire import FireConfig, run_fire
from capture_format.token_frequencies import read_token_frequencies as read_frequencies
from client.manifest import Manifest
from client.regenerate import SamplingConfig
from client.spans import ChatTokenizer

SMALL = Path(__file__).parent / "fixtures" / "conversations_small.jsonl"
NUM_SMALL = 6


class FakeServing:
    """/generate (regeneration answers with `answer_text`; capture requests "ship" their tag) and /v1/records."""

    def __init__(self, chat: ChatTokenizer, *, answer_text: str = "Sure.") -> None:
        self.answer_ids = chat.encode(answer_text) + [chat.tokenizer.eos_token_id]
        self.stores = True  # whether a capture request reaches the collector
        self.stored: dict[str, dict] = {}
        self.captures: list[dict] = []
        self.prompts: list[dict] = []
        self.scripted_errors: list[int | type[Exception]] = []  # consumed one per /generate call

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/healthz", "/get_model_info"):  # fire's check that both answer
            return httpx.Response(200, json={"status": "ok", "model_path": "tiny"})
        if request.url.host == "collector":
            record_id = request.url.path.rsplit("/", 1)[-1]
            if record_id in self.stored:
                return httpx.Response(200, json={"stored": True, "record_id": record_id})
            return httpx.Response(404, json={"error": "not_found"})
        assert request.url.path == "/generate"
        if self.scripted_errors:
            error = self.scripted_errors.pop(0)
            if isinstance(error, int):
                return httpx.Response(error, text=f"scripted {error}")
            raise error("scripted", request=request)
        body = json.loads(request.content)
        tag = CaptureTag.from_custom_params(body["sampling_params"].get("custom_params"))
        if tag is None or tag.mode == "generate":
            self.prompts.append(body)
            if tag is not None:  # one pass: the plugin records prompt + answer, the answer added to the spans
                self.captures.append(body)
                prompt_len, ids = len(body["input_ids"]), body["input_ids"] + self.answer_ids
                spans = list(tag.loss_spans)
                if spans and spans[-1][1] == prompt_len:
                    spans[-1] = (spans[-1][0], len(ids))
                else:
                    spans.append((prompt_len, len(ids)))
                if self.stores:
                    self.stored.setdefault(tag.record_id, {"input_ids": ids, "spans": tuple(spans), "passes": 1})
            return httpx.Response(200, json={"output_ids": self.answer_ids, "text": "",
                                             "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}})
        self.captures.append(body)
        if self.stores:
            self.stored.setdefault(tag.record_id, {"input_ids": body["input_ids"], "spans": tag.loss_spans})
        return httpx.Response(200, json={"output_ids": [], "text": "", "meta_info": {"finish_reason": None}})


@pytest.fixture(scope="module")
def chat(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(tiny_model_dir)


def fire(tmp_path: Path, serving: FakeServing, tiny_model_dir: Path, **overrides) -> int:
    settings = dict(server_url="http://server", collector_url="http://collector", data_path=SMALL,
                    run_dir=tmp_path / "run", tokenizer_path=str(tiny_model_dir), progress="off",
                    confirm_timeout_s=5.0, http=HttpConfig(max_attempts=3, backoff_base_s=0.001))
    settings.update(overrides)
    return run_fire(FireConfig(**settings), transport=httpx.MockTransport(serving))


def states(tmp_path: Path) -> dict[str, str]:
    manifest = Manifest(tmp_path / "run")
    try:
        return manifest.states()
    finally:
        manifest.close()


def test_transient_errors_are_retried_and_a_bad_request_fails_by_reason(tmp_path, chat, tiny_model_dir, capsys):
    serving = FakeServing(chat)
    serving.scripted_errors = [503, httpx.ConnectError, 400]  # 1st request: 503, connect error; 2nd request: 400
    assert fire(tmp_path, serving, tiny_model_dir, concurrency=1) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["totals"]["records_by_state"] == {"sent": 0, "served": 0, "confirmed": NUM_SMALL - 1, "failed": 1}
    assert summary["totals"]["failed_by_reason"] == {"http_4xx": 1}
    assert "failed: http_4xx: HTTP 400 /generate: scripted 400" in capsys.readouterr().err
    assert len(serving.captures) == NUM_SMALL - 1

    # A re-run sends only the failed sample again; nothing confirmed goes out twice.
    assert fire(tmp_path, serving, tiny_model_dir) == 0
    assert len(serving.captures) == NUM_SMALL
    assert len({capture["sampling_params"]["custom_params"]["eagle_tap"]["record_id"]
                for capture in serving.captures}) == NUM_SMALL


def test_a_server_that_stays_down_fails_samples_with_connection_reason(tmp_path, chat, tiny_model_dir):
    serving = FakeServing(chat)
    serving.scripted_errors = [httpx.ConnectError] * 3 * NUM_SMALL
    assert fire(tmp_path, serving, tiny_model_dir, max_samples=2) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["totals"]["failed_by_reason"] == {"connection": 2} and serving.scripted_errors == [
        httpx.ConnectError] * 3 * (NUM_SMALL - 2)


def test_unconfirmed_records_are_rechecked_before_anything_is_resent(tmp_path, chat, tiny_model_dir):
    serving = FakeServing(chat)
    serving.stores = False  # the plugin's records are late (collector down, spooling)
    assert fire(tmp_path, serving, tiny_model_dir, confirm_timeout_s=0.3) == 1
    assert set(states(tmp_path).values()) == {"served"}
    manifest = Manifest(tmp_path / "run")
    assert all(record["reason"].startswith("unconfirmed: not stored within") for record in manifest.records())
    manifest.close()
    counts = read_frequencies(tmp_path / "run" / "token_frequencies.json")

    for capture in serving.captures:  # the spooled records arrive
        tag = capture["sampling_params"]["custom_params"]["eagle_tap"]
        serving.stored[tag["record_id"]] = {"input_ids": capture["input_ids"], "spans": tag["spans"]}
    assert fire(tmp_path, serving, tiny_model_dir) == 0
    assert len(serving.captures) == NUM_SMALL, "confirmed on re-check, never re-sent"
    assert set(states(tmp_path).values()) == {"confirmed"}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["this_run"]["num_rechecked_confirmed"] == NUM_SMALL
    assert read_frequencies(tmp_path / "run" / "token_frequencies.json") == counts


def test_token_counts_include_each_record_once_however_often_it_is_sent(tmp_path, chat, tiny_model_dir):
    serving = FakeServing(chat)
    serving.stores = False
    assert fire(tmp_path, serving, tiny_model_dir, confirm_timeout_s=0.1) == 1
    assert fire(tmp_path, serving, tiny_model_dir, confirm_timeout_s=0.1) == 1  # still missing: re-sent
    assert len(serving.captures) == 2 * NUM_SMALL
    expected: dict[int, int] = {}
    for capture in serving.captures[:NUM_SMALL]:
        tag = capture["sampling_params"]["custom_params"]["eagle_tap"]
        for start, end in tag["spans"]:
            for token in capture["input_ids"][start:end]:
                expected[token] = expected.get(token, 0) + 1
    assert read_frequencies(tmp_path / "run" / "token_frequencies.json") == expected
    manifest = Manifest(tmp_path / "run")
    assert {record["num_sends"] for record in manifest.records()} == {2}
    manifest.close()


@pytest.mark.parametrize("two_pass", [False, True])
def test_regenerate_sends_the_conversation_so_far_and_captures_the_generated_ids_verbatim(tmp_path, chat,
                                                                                          tiny_model_dir, two_pass):
    serving = FakeServing(chat, answer_text="Sure, here it is.")
    sampling = SamplingConfig(temperature=0.5, top_p=0.9, max_new_tokens=7)
    assert fire(tmp_path, serving, tiny_model_dir, mode="regenerate", records_per="turn", sampling=sampling,
                two_pass=two_pass) == 0
    first_prompt = serving.prompts[0]["sampling_params"]
    assert first_prompt["temperature"] == 0.5 and first_prompt["top_p"] == 0.9 and first_prompt["max_new_tokens"] == 7
    assert first_prompt["stop_token_ids"] == [chat.tokenizer.eos_token_id]
    if two_pass:  # generated untagged (and out of live sampling), then captured by a prefill-only request
        assert first_prompt["custom_params"] == {"eagle_tap": {"opt_out": True}} and len(serving.captures) == 8
        assert all(capture["sampling_params"]["max_new_tokens"] == 0 for capture in serving.captures)
    else:  # each turn's own generation request is the capture
        tag = CaptureTag.from_custom_params(first_prompt["custom_params"])
        assert tag.mode == "generate" and tag.loss_spans == () and tag.metadata["passes"] == 1
        assert serving.captures == [prompt for prompt in serving.prompts
                                    if CaptureTag.from_custom_params(prompt["sampling_params"]["custom_params"])]

    multi_turn = [json.loads(line) for line in SMALL.read_text().splitlines()][2]["messages"]
    second_turn = chat.render_ids([multi_turn[0], {"role": "assistant", "content": "Sure, here it is."},
                                   multi_turn[2]], add_generation_prompt=True)
    assert second_turn in [prompt["input_ids"] for prompt in serving.prompts], "history holds the target's answer"
    for record in serving.stored.values():
        (start, end), = record["spans"]
        assert record["input_ids"][start:] == serving.answer_ids and end == len(record["input_ids"])
        assert record["input_ids"][:start] in [prompt["input_ids"] for prompt in serving.prompts]
    assert len(serving.stored) == 8  # one record per assistant turn: 1 + 1 + 2 + 1 + 2 + 1


@pytest.mark.parametrize("two_pass", [False, True])
def test_regenerate_one_record_per_conversation_masks_every_generated_turn(tmp_path, chat, tiny_model_dir, two_pass):
    serving = FakeServing(chat, answer_text="Yes.")
    assert fire(tmp_path, serving, tiny_model_dir, mode="regenerate", two_pass=two_pass) == 0
    assert len(serving.stored) == NUM_SMALL and len(serving.prompts) == 8
    assert len(serving.captures) == NUM_SMALL  # one pass tags only each conversation's last generation
    for record in serving.stored.values():
        for start, end in record["spans"]:
            assert chat.decode(record["input_ids"][start:end]) == "Yes.<|eos|>"
        assert record["spans"][-1][1] == len(record["input_ids"])


def test_a_different_command_on_the_same_run_dir_is_refused(tmp_path, chat, tiny_model_dir):
    serving = FakeServing(chat)
    assert fire(tmp_path, serving, tiny_model_dir, max_samples=1) == 0
    with pytest.raises(ValueError, match="mode='as-is'"):
        fire(tmp_path, serving, tiny_model_dir, mode="regenerate")
