"""The exported draft inside SGLang's own EAGLE-3 speculative decoding (CPU, the stand-in kernels).

Real servers, real drafts: the draft the trainer tests train (tests/test_trainer_export.py) and the
same run's untrained initialisation, both exported by `eagle-tap export`. Every acceptance figure
comes from SGLang's per-request `meta_info`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import trainer_data
from eagle_tap.cli import main
from eagle_tap.serve.draft import DraftMismatchError, SpeculativeConfig
from trainer.draft_fit import check_draft_fits
from eagle_tap.serve.evaluate import Config, evaluate_served, load_prompts, prompts_from_shards
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from test_trainer_export import trained_run

pytestmark = pytest.mark.sglang

# Prompts longer than this are prefilled in several chunks, by both servers.
CHUNKED_PREFILL_TOKENS = 24
# fp32: greedy outputs must then be equal token for token. In bf16 a verify batch of k+1 tokens and a
# one-token decode round differently, which can break a near-tie of the top two logits either way
# (eval-served reports each such case with the gap; the demo serves bf16).
SERVER_ARGS = ("--chunked-prefill-size", str(CHUNKED_PREFILL_TOKENS), "--dtype", "float32")
NUM_STEPS = 3


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, Path]:
    """{"trained": folder, "untrained": folder}, exported from one short training run."""
    root = tmp_path_factory.mktemp("drafts")
    run = trained_run()
    assert main(["export", "--checkpoint", str(run), "--out", str(root / "trained")]) == 0
    assert main(["export", "--checkpoint", str(run), "--out", str(root / "untrained"), "--untrained"]) == 0
    return {"trained": root / "trained", "untrained": root / "untrained"}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    """24 held-out conversations (never trained on) as OpenAI rows: 16 multi-turn, 8 single-turn."""
    path = tmp_path_factory.mktemp("prompts") / "heldout.jsonl"
    rows = []
    for index, messages in enumerate(trainer_data.conversations(64, 24)):
        rows.append({"messages": messages if index % 3 else messages[:3]})  # [:3]: system, user, assistant
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def baseline_server(start_sglang, tiny_model_dir):
    return start_sglang(tiny_model_dir, extra_args=SERVER_ARGS, env={"SGLANG_PLUGINS": "none-loaded"})


def served(draft: Path, tiny_model_dir: Path, prompts_file: Path, baseline_url: str, out: Path,
           max_prompts: int | None = None) -> dict:
    return evaluate_served(Config(target=tiny_model_dir, draft=draft, data=prompts_file, out_dir=out,
                                  num_steps=NUM_STEPS, max_new_tokens=32, baseline_server=baseline_url,
                                  server_args=SERVER_ARGS, max_prompts=max_prompts), log=lambda line: None)


def test_prompts_include_multi_turn_and_chunked_ones(prompts_file, tiny_model_dir):
    prompts, skipped = load_prompts(prompts_file, tiny_model_dir)
    assert len(prompts) == 24 and not skipped
    assert sum(len(prompt.input_ids) > CHUNKED_PREFILL_TOKENS for prompt in prompts) >= 20
    assert len({len(prompt.input_ids) for prompt in prompts}) > 10


def test_prompts_from_shards_stop_where_the_last_loss_span_starts():
    import capture_format as cf

    shards = trainer_data.shard_dir(64, 16)
    prompts, skipped = prompts_from_shards(shards)
    assert len(prompts) == 16 and not skipped
    with cf.ShardDirectory(shards) as directory:
        for prompt, entry in zip(prompts, directory.iter_index()):
            record = directory.read_record(entry)
            start = record.loss_spans[-1][0]
            assert prompt.key == record.record_id and prompt.input_ids == record.token_ids[:start].tolist()


@pytest.mark.timeout(1800)  # three servers' generations; on a loaded 2-core machine several minutes
def test_trained_draft_keeps_greedy_outputs_and_beats_the_untrained_one(drafts, prompts_file, baseline_server,
                                                                      tiny_model_dir, tmp_path, capsys):
    # The trained draft through the command a user runs; the untrained one through the same code in-process.
    assert main(["eval-served", "--target", str(tiny_model_dir), "--draft", str(drafts["trained"]),
                 "--data", str(prompts_file), "--out", str(tmp_path / "trained"), "--num-steps", str(NUM_STEPS),
                 "--max-new-tokens", "32", "--baseline-server", baseline_server.url, "--", *SERVER_ARGS]) == 0
    assert re.search(r"outputs identical to no draft +24/24", capsys.readouterr().out)
    trained = json.loads((tmp_path / "trained" / "eval_served.json").read_text())
    untrained = served(drafts["untrained"], tiny_model_dir, prompts_file, baseline_server.url, tmp_path / "untrained",
                       max_prompts=8)
    for result in (trained, untrained):
        assert result["num_identical_outputs"] == result["num_prompts"], result["mismatches"]
        assert result["num_verify_steps"] > 0
        assert sum(result["accepted_drafts_histogram"]) == result["num_verify_steps"]
    assert trained["num_prompts"] == 24 and untrained["num_prompts"] == 8
    # SGLang's own count: the trained draft gets clearly more tokens per verify step than its initialisation.
    assert trained["acceptance_length"] > untrained["acceptance_length"] + 0.3, (trained, untrained)
    assert trained["acceptance_rate_by_position"][0] > 0.3
    assert (tmp_path / "trained" / "eval_served.json").is_file()
    assert (tmp_path / "trained" / "acceptance_served.png").stat().st_size > 0


def _tiny_target_copy(tiny_model_dir: Path, destination: Path) -> Path:
    shutil.copytree(tiny_model_dir, destination)
    return destination


def _edited_draft(draft: Path, destination: Path, edit) -> Path:
    shutil.copytree(draft, destination)
    config = json.loads((destination / "config.json").read_text())
    edit(config)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def _other_tokenizer(target: Path) -> Path:
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]  # swap two tokens' ids: same size, other ids
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target


def _mismatches(draft: Path, tiny_model_dir: Path, root: Path) -> dict[str, tuple[Path, Path, str]]:
    """name -> (draft folder, target folder, a phrase the refusal must contain)."""

    def wrong_ids(config):
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]

    def wrong_hidden(config):
        config["target_hidden_size"] = 256

    return {
        "layer ids": (_edited_draft(draft, root / "ids", wrong_ids), tiny_model_dir, "layers [3, 5, 6]"),
        "hidden size": (_edited_draft(draft, root / "hidden", wrong_hidden), tiny_model_dir, "hidden size 256"),
        "tokenizer": (draft, _other_tokenizer(_tiny_target_copy(tiny_model_dir, root / "other-target")), "tokenizer"),
    }


def test_mismatched_drafts_are_refused_before_start_up(drafts, tiny_model_dir, tmp_path):
    before = {process.pid for process in psutil.process_iter()}
    for name, (draft, target, phrase) in _mismatches(drafts["trained"], tiny_model_dir, tmp_path).items():
        with pytest.raises(DraftMismatchError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
            check_draft_fits(draft, target_dir=target)
        result = subprocess.run(
            [sys.executable, "-m", "eagle_tap.cli", "serve", "--model", str(target), "--draft", str(draft)],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert result.stderr.count("\n") == 1 and phrase in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr and "serving at" not in result.stdout
        with pytest.raises(DraftMismatchError):  # the launcher refuses too, before starting anything
            SGLangServer(ServerConfig(model_path=target, speculative=SpeculativeConfig(draft_dir=draft))).start()
    # Only servers of these drafts or targets count: other tests may run servers on this machine meanwhile.
    ours = (str(tmp_path), str(drafts["trained"]))
    left = [process for process in psutil.process_iter(["cmdline"])
            if process.pid not in before and "sglang.launch_server" in (command := " ".join(process.info["cmdline"] or []))
            and any(path in command for path in ours)]
    assert not left


def test_matching_draft_passes_the_check(drafts, tiny_model_dir):
    checked = check_draft_fits(drafts["trained"], target_dir=tiny_model_dir)
    assert checked["capture_layers"] == [3, 5, 6] and checked["aux_layer_ids"] == [2, 4, 5]
    assert checked["tokenizer_fingerprint"].startswith("tok:")
