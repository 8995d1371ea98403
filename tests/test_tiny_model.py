"""The committed tiny Llama checkpoint: loadable, bf16, GQA, trained, with a working chat template."""

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

# Written for this test, so it is in no training file; ordinary Python the model should find predictable.
UNSEEN_CODE = '''import os
import sys


class Inventory:
    """Keep track of items and their counts."""

    def __init__(self, name):
        self.name = name
        self.items = {}

    def add(self, item, count=1):
        """Add count copies of item."""
        if count < 0:
            raise ValueError("count must be positive")
        self.items[item] = self.items.get(item, 0) + count
        return self.items[item]

    def remove(self, item):
        if item not in self.items:
            raise KeyError(item)
        del self.items[item]

    def __len__(self):
        return len(self.items)


def load_inventory(path):
    """Return an Inventory read from the file at path."""
    inventory = Inventory(os.path.basename(path))
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, count = line.split(",")
            inventory.add(name, int(count))
    return inventory


if __name__ == "__main__":
    print(len(load_inventory(sys.argv[1])))
'''

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What does `math.isqrt` do?"},
    {"role": "assistant", "content": "Return the integer part of the square root."},
    {"role": "user", "content": "Show me its signature."},
    {"role": "assistant", "content": "```python\ndef isqrt(n, /)\n```"},
]
RENDERED_CONVERSATION = (
    "<|bos|><|system|>You are a helpful assistant.<|end|>"
    "<|user|>What does `math.isqrt` do?<|end|>"
    "<|assistant|>Return the integer part of the square root.<|eos|>"
    "<|user|>Show me its signature.<|end|>"
    "<|assistant|>```python\ndef isqrt(n, /)\n```<|eos|>"
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()


def test_package_import_stays_light():
    code = "import sys, eagle_tap.testbed.tiny_model as m; assert m.TINY_MODEL_DIR.is_dir(); print(sorted(set(sys.modules) & {'torch', 'transformers'}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_folder_is_small_and_weights_are_bf16():
    num_bytes = sum(p.stat().st_size for p in TINY_MODEL_DIR.iterdir())
    assert num_bytes < 8 * 2**20, f"checkpoint folder is {num_bytes} bytes"
    with safe_open(TINY_MODEL_DIR / "model.safetensors", framework="pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"BF16"}


def test_config_is_a_small_gqa_llama(tokenizer):
    config = AutoConfig.from_pretrained(TINY_MODEL_DIR)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.dtype == torch.bfloat16
    assert config.num_hidden_layers == 8
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.hidden_size == config.num_attention_heads * config.head_dim
    assert not config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer) == 4096


def test_special_token_ids_agree_everywhere(tokenizer):
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(TINY_MODEL_DIR)
    expected = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    assert {key: config[key] for key in expected} == expected
    assert {key: getattr(generation, key) for key in expected} == expected
    assert len(set(expected.values())) == 3


def test_loaded_model_is_bf16(model):
    assert model.dtype == torch.bfloat16


@torch.no_grad()
def test_model_predicts_unseen_code_far_better_than_uniform(model, tokenizer):
    ids = [tokenizer.bos_token_id] + tokenizer.encode(UNSEEN_CODE)
    input_ids = torch.tensor([ids])  # (1, T)
    logits = model(input_ids=input_ids).logits.float()  # (1, T, V)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], input_ids[0, 1:]).item()
    uniform = math.log(model.config.vocab_size)
    # A randomly initialised model scores about ln(V) = 8.3 nats on this text; the committed one about 3.0.
    assert loss < 0.6 * uniform, f"loss {loss:.3f} nats on unseen code; uniform is {uniform:.3f}"


def test_chat_template_renders_markers_and_round_trips(tokenizer):
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == RENDERED_CONVERSATION
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"] == ids
    assert tokenizer.decode(ids) == rendered
    for marker in ("<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|eos|>"):
        assert ids.count(tokenizer.convert_tokens_to_ids(marker)) == rendered.count(marker), marker


def test_generation_prompt_ends_with_assistant_marker(tokenizer):
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|bos|><|system|>You are a helpful assistant.<|end|><|user|>What does `math.isqrt` do?<|end|><|assistant|>"
    no_system = tokenizer.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=True, tokenize=False)
    assert no_system == "<|bos|><|user|>What does `math.isqrt` do?<|end|><|assistant|>"


def test_assistant_mask_covers_answers_and_their_eos(tokenizer):
    encoded = tokenizer.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assistant_text = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert assistant_text == "Return the integer part of the square root.<|eos|>```python\ndef isqrt(n, /)\n```<|eos|>"


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii with  double  spaces\tand tabs\r\n",
        "naïve café, Straße, Ελληνικά, кириллица",
        "中文字符和日本語のテキスト",
        "emoji 🚀🧪 and a ZWJ family 👩‍👩‍👧",
        "combining e\u0301 and control \x00\x07\x1b[0m",
        "  leading spaces, trailing spaces  ",
    ],
)
def test_byte_level_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
