"""`eagle-tap fire` end to end: a real capture-enabled SGLang server (CPU, tiny model) and a real collector.

Oracles: the client's own tokenization and spans (as-is), the server's own /generate answers seen on the
wire (regenerate: a record is the prompt plus the generated ids, verbatim), the collector's stored frames
read back from its shards, and its stats (a re-run adds no record and no duplicate).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest

from capture_format.tag import CaptureTag
from client.conversations import Conversation, read_conversations
from capture_format.token_frequencies import read_token_frequencies as read_frequencies
from client.manifest import Manifest
from client.spans import ChatTokenizer
from capture_helpers import stored_record
from eagle_tap.cli import main

pytestmark = pytest.mark.sglang

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = FIXTURES / "conversations_small.jsonl"
BROKEN = FIXTURES / "conversations_broken.jsonl"
NUM_SMALL = 6


@pytest.fixture(scope="module")
def server(capture_server):
    return capture_server[0]


@pytest.fixture(scope="module")
def chat(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(tiny_model_dir)


def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


def fire_argv(server, collector, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["fire", "--server", server.url, "--collector", collector.url, "--data", str(data), "--out", str(run_dir),
            "--progress", "off", "--confirm-timeout-s", "60", *extra]


def run_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def manifest_records(run_dir: Path) -> list[dict]:
    manifest = Manifest(run_dir)
    try:
        return manifest.records()
    finally:
        manifest.close()


def conversations(path: Path) -> list[Conversation]:
    return [item for item in read_conversations(path) if isinstance(item, Conversation)]


class WireLog(httpx.AsyncBaseTransport):
    """A real transport that logs every /generate request (as it leaves) and answer, and can press Ctrl-C
    once the Nth capture request was answered."""

    def __init__(self, interrupt_after_captures: int | None = None) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.requests: list[dict] = []
        self.exchanges: list[tuple[dict, dict]] = []  # answered ones only
        self.interrupt_after_captures = interrupt_after_captures

    def captured_ids(self) -> list[str]:
        """Record ids of the capture requests sent, answered or not (a cancelled one may still be served)."""
        return [tag.record_id for request in self.requests
                if (tag := CaptureTag.from_custom_params(request["sampling_params"].get("custom_params")))]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return await self._inner.handle_async_request(request)
        body = json.loads(request.content)
        self.requests.append(body)
        response = await self._inner.handle_async_request(request)
        await response.aread()
        self.exchanges.append((body, json.loads(response.content)))
        num_answered = sum(CaptureTag.from_custom_params(sent["sampling_params"].get("custom_params")) is not None
                           for sent, _ in self.exchanges)
        if num_answered == self.interrupt_after_captures:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does; handled by the run's event loop
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def test_as_is_end_to_end_and_a_rerun_sends_nothing(server, collector, chat, tmp_path):
    run_dir = tmp_path / "run"
    argv = fire_argv(server, collector, SMALL, run_dir)
    assert main(argv) == 0
    run_id = run_summary(run_dir)["run_id"]
    records = manifest_records(run_dir)
    assert [record["state"] for record in records] == ["confirmed"] * NUM_SMALL

    expected_counts: collections.Counter = collections.Counter()
    for conversation in conversations(SMALL):
        sequence = chat.tokenize_conversation(conversation.messages)
        record = stored_record(collector, f"{run_id}:{conversation.key}:conv")
        assert record.token_ids.tolist() == list(sequence.input_ids)
        assert record.loss_spans == sequence.spans and record.sample_id == conversation.key
        assert record.metadata["line"] == conversation.line and record.metadata["mode"] == "as-is"
        expected_counts.update(sequence.loss_token_ids())
    assert read_frequencies(run_dir / "token_frequencies.json") == dict(expected_counts)

    stats_before = get_json(f"{collector.url}/v1/stats")
    assert main(argv) == 0
    stats_after = get_json(f"{collector.url}/v1/stats")
    assert stats_after["num_records"] == stats_before["num_records"]
    assert stats_after["num_duplicates"] == stats_before["num_duplicates"]
    assert run_summary(run_dir)["this_run"]["num_capture_requests"] == 0
    assert run_summary(run_dir)["this_run"]["num_samples_skipped"] == NUM_SMALL
    assert {record["num_sends"] for record in manifest_records(run_dir)} == {1}


@pytest.mark.parametrize("records_per,passes", [("turn", 1), ("conversation", 1), ("turn", 2), ("conversation", 2)])
def test_regenerate_captures_exactly_what_the_target_generated(server, collector, chat, tmp_path, records_per,
                                                               passes):
    from client.cli import config_from_args
    from client.fire import run_fire
    from eagle_tap.cli import build_parser

    run_dir = tmp_path / "run"
    args = build_parser().parse_args(fire_argv(server, collector, SMALL, run_dir, "--regenerate", "--records-per",
                                               records_per, "--max-new-tokens", "12", "--temperature", "0.9",
                                               *(["--two-pass"] if passes == 2 else [])))
    wire = WireLog()
    assert run_fire(config_from_args(args), transport=wire) == 0
    run_id = run_summary(run_dir)["run_id"]
    generations = [(request, answer) for request, answer in wire.exchanges
                   if request["sampling_params"]["max_new_tokens"] == 12]
    assert len(generations) == 8  # every assistant turn of the dataset, in order
    num_records = 8 if records_per == "turn" else NUM_SMALL
    tagged = [request for request, _ in wire.exchanges
              if CaptureTag.from_custom_params(request["sampling_params"].get("custom_params"))]
    # What fire does not capture itself is kept out of the server's live sampling.
    assert all(request["sampling_params"]["custom_params"] == {"eagle_tap": {"opt_out": True}}
               for request, _ in wire.exchanges if request not in tagged)
    if passes == 1:  # the generation requests themselves are the captures: no second request
        assert len(wire.exchanges) == 8 and len(tagged) == num_records
    else:
        assert len(wire.exchanges) == 8 + num_records
        assert all(request["sampling_params"]["max_new_tokens"] == 0 for request in tagged)
    outputs = {tuple(request["input_ids"]): answer["output_ids"] for request, answer in generations}

    for conversation in conversations(SMALL):
        turns = [index for index, message in enumerate(conversation.messages) if message["role"] == "assistant"]
        first_prompt = chat.render_ids(conversation.messages[: turns[0]], add_generation_prompt=True)
        parts = [f"t{turn}" for turn in turns] if records_per == "turn" else ["conv"]
        for part in parts:
            record = stored_record(collector, f"{run_id}:{conversation.key}:{part}")
            ids = record.token_ids.tolist()
            start, end = record.loss_spans[-1]
            assert end == len(ids) and outputs[tuple(ids[:start])] == ids[start:], "the target's ids, verbatim"
            assert ids[: len(first_prompt)] == first_prompt
            assert record.metadata["mode"] == "regenerate"
            if passes == 1:  # the last token never went through the model: it has no state
                assert record.num_states == len(ids) - 1 and record.metadata["passes"] == 1
                reasons = [record.metadata["finish_reason"]]
            else:
                assert record.num_states == len(ids)
                reasons = record.metadata["finish_reasons"]
            for (start, end), reason in zip(record.loss_spans[::-1], reasons[::-1]):
                assert reason in ("stop", "length")
                if reason == "stop":
                    assert ids[end - 1] in chat.stop_token_ids
            if records_per == "conversation":
                assert len(record.loss_spans) == len(turns)
    assert all(record["state"] == "confirmed" for record in manifest_records(run_dir))


def test_broken_rows_are_reported_by_line_and_skipped(server, collector, chat, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(fire_argv(server, collector, BROKEN, run_dir)) == 0
    err = capsys.readouterr().err
    assert "conversations_broken.jsonl:4: bad row: message 0: unknown role 'wizard'" in err
    assert "conversations_broken.jsonl:10: bad row: no assistant message to capture (--regenerate" in err
    # JSON's own "line 1" (inside the row) is not given: it read as the file's line, one off
    assert "conversations_broken.jsonl:2: bad row: not valid JSON at column 56: Invalid control character" in err
    assert "conversations_broken.jsonl:13: bad row: the conversation starts with an assistant message" in err
    manifest = Manifest(run_dir)
    assert [line for line, _, _ in manifest.bad_rows()] == [2, 3, 4, 5, 6, 7, 8, 10, 12, 13]
    assert [(record["line"], record["state"]) for record in manifest.records()] == [(1, "confirmed"), (11, "confirmed")]
    assert manifest.totals()["num_bad_rows"] == 10
    assert manifest.totals()["records_by_state"]["failed"] == 0  # a bad row is not a failed sample
    manifest.close()


def test_limited_then_interrupted_run_resumes_without_sending_anything_twice(server, collector, chat, tmp_path):
    from client.cli import config_from_args
    from client.fire import run_fire
    from eagle_tap.cli import build_parser

    run_dir = tmp_path / "run"
    argv = fire_argv(server, collector, SMALL, run_dir, "--concurrency", "2")
    config = config_from_args(build_parser().parse_args(argv))
    sent: list[str] = []

    first = WireLog()
    config.max_samples = 2
    assert run_fire(config, transport=first) == 0
    sent += first.captured_ids()
    assert len(sent) == 2

    interrupted = WireLog(interrupt_after_captures=1)
    config.max_samples = None
    assert run_fire(config, transport=interrupted) == 130
    assert set(interrupted.captured_ids()).isdisjoint(sent), "confirmed records are never sent again"
    sent += interrupted.captured_ids()
    states = collections.Counter(record["state"] for record in manifest_records(run_dir))
    assert 2 <= states["confirmed"] < NUM_SMALL, "stopped before the end"
    assert run_summary(run_dir)["this_run"]["interrupted"] is True

    confirmed_before = {record["record_id"] for record in manifest_records(run_dir) if record["state"] == "confirmed"}
    resumed = WireLog()
    assert run_fire(config, transport=resumed) == 0
    assert set(resumed.captured_ids()).isdisjoint(confirmed_before)
    sent += resumed.captured_ids()
    records = manifest_records(run_dir)
    assert [record["state"] for record in records] == ["confirmed"] * NUM_SMALL
    assert set(sent) == {record["record_id"] for record in records}
    for record_id in set(sent):
        assert stored_record(collector, record_id).token_ids.size > 0

    again = WireLog()
    assert run_fire(config, transport=again) == 0
    assert again.requests == [], "a finished run sends nothing"
