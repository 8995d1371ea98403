"""Targets whose tokenizer is code shipped with the model (Kimi-K2's is): refused by default, loaded when asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from client.spans import ChatTokenizer
from eagle_tap.cli import main
from eagle_tap.demo import CONVERSATIONS_PATH
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from trainer.vocab import template_token_ids


@pytest.fixture(scope="module")
def remote_code_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with its tokenizer declared as a class in the model folder's own Python file."""
    target = tmp_path_factory.mktemp("remote-code") / "target"
    shutil.copytree(TINY_MODEL_DIR, target)
    (target / "remote_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass RemoteTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="RemoteTokenizer", auto_map={"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]})
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_fire_loads_a_remote_code_tokenizer_only_when_trusted(remote_code_target: Path) -> None:
    with pytest.raises(ValueError, match="custom code"):
        ChatTokenizer.from_pretrained(remote_code_target)
    chat = ChatTokenizer.from_pretrained(remote_code_target, trust_remote_code=True)
    assert type(chat.tokenizer).__name__ == "RemoteTokenizer"
    reference = ChatTokenizer.from_pretrained(TINY_MODEL_DIR)
    messages = [{"role": "user", "content": "What does `shutil.copyfile` do?"}, {"role": "assistant", "content": "It copies."}]
    assert chat.render_text(messages, add_generation_prompt=False) == reference.render_text(messages, add_generation_prompt=False)


def test_vocab_finds_template_tokens_of_a_remote_code_tokenizer(remote_code_target: Path) -> None:
    with pytest.raises(ValueError, match="custom code"):
        template_token_ids(remote_code_target)
    assert template_token_ids(remote_code_target, trust_remote_code=True) == template_token_ids(TINY_MODEL_DIR)


def test_the_flag_reaches_the_tokenizer_through_both_commands(
        remote_code_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frequencies = tmp_path / "frequencies.json"
    frequencies.write_text(json.dumps({str(token_id): 10 for token_id in range(40)}))
    vocab = ["vocab", "--target", str(remote_code_target), "--draft-vocab-size", "32", "--frequencies",
             str(frequencies)]
    assert main([*vocab, "--out", str(tmp_path / "refused")]) == 2
    assert "custom code" in capsys.readouterr().err
    assert main([*vocab, "--out", str(tmp_path / "vocab"), "--trust-remote-code"]) == 0
    assert (tmp_path / "vocab" / "vocab.json").exists()

    # fire loads the tokenizer before it sends anything: refused without the flag; with it, the run gets as far
    # as the (absent) server.
    fire = ["fire", "--server", "http://127.0.0.1:9", "--collector", "http://127.0.0.1:9", "--data",
            str(CONVERSATIONS_PATH), "--tokenizer", str(remote_code_target), "--max-attempts", "1", "--max-samples", "1",
            "--progress", "off"]
    assert main([*fire, "--out", str(tmp_path / "fire-refused")]) == 2
    assert "custom code" in capsys.readouterr().err
    assert main([*fire, "--out", str(tmp_path / "fire"), "--trust-remote-code"]) == 2
    err = capsys.readouterr().err
    assert "custom code" not in err and "does not answer" in err
