"""Targets whose tokenizer is code shipped with the model (Kimi-K2's is): refused by default, loaded when asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from client.cli import config_from_args
from client.spans import ChatTokenizer
from eagle_tap.cli import build_parser
from eagle_tap.demo import CONVERSATIONS_PATH
from eagle_tap.tiny_model import TINY_MODEL_DIR
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


def test_the_flag_reaches_both_commands(tmp_path: Path) -> None:
    parser = build_parser()
    fire = ["fire", "--server", "http://s", "--collector", "http://c", "--data", str(CONVERSATIONS_PATH),
            "--out", str(tmp_path / "run")]
    assert config_from_args(parser.parse_args([*fire, "--trust-remote-code"])).trust_remote_code
    assert not config_from_args(parser.parse_args(fire)).trust_remote_code
    vocab = parser.parse_args(["vocab", "--target", "t", "--draft-vocab-size", "8", "--out", "o", "--shards", "s",
                               "--trust-remote-code"])
    assert vocab.trust_remote_code
