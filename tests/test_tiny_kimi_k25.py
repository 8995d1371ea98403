"""The tiny random Kimi-K2.5 (`python -m eagle_tap.testbed.tiny_model.random --arch kimi_k25`): laid out as the
real checkpoint is, and its processor cuts images the way SGLang's `kimi_k25` processor expects.

That SGLang serves it and its captures equal transformers' DeepSeek-V3 is tests/test_capture_parity.py's job.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def kimi_dir(random_target):
    return random_target("kimi_k25")


def test_config_nests_the_language_model_and_the_tower_as_kimi_k25_does(kimi_dir):
    config = json.loads((kimi_dir / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    text, vision = config["text_config"], config["vision_config"]
    assert text["kv_lora_rank"] == 64 and text["n_routed_experts"] == 8 and text["num_hidden_layers"] == 8
    assert text["vocab_size"] == 4160 and config["media_placeholder_token_id"] == 4096
    assert vision["text_hidden_size"] == text["hidden_size"] == 128
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"):
        assert vision[name] == vision[f"vt_{name}"], name  # SGLang reads both spellings


def test_weights_are_named_as_the_checkpoint_names_them(kimi_dir):
    from safetensors import safe_open

    with safe_open(kimi_dir / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("language_model.model.embed_tokens.weight").shape == (4160, 128)
        assert weights.get_tensor("mm_projector.proj.2.weight").shape == (128, 128)  # 2x2 merged 32-wide patches
    assert all(name.startswith(("language_model.", "vision_tower.", "mm_projector.")) for name in names)
    assert {"vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.patch_embed.pos_emb.weight",
            "mm_projector.proj.0.bias", "language_model.lm_head.weight"} <= names


def test_processor_expands_and_patchifies_an_image(kimi_dir):
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(kimi_dir, trust_remote_code=True)
    assert processor.tokenizer.convert_tokens_to_ids("<|media_pad|>") == 4096
    pixels = np.random.default_rng(0).integers(0, 256, (56, 70, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    # 56x70 is within the patch limits: no resize, padded right to 84 (a multiple of 2 x 14): 4x6 patches, 2x3 features.
    assert processor.media_processor.media_tokens_calculator({"type": "image", "image": image}) == 6
    out = processor(text=["a" + "<|media_pad|>" * 6 + "b"], medias=[{"type": "image", "image": image}])
    assert out["input_ids"][0].tolist().count(4096) == 6
    assert out["grid_thws"].tolist() == [[1, 4, 6]] and out["pixel_values"].shape == (24, 3, 14, 14)
    normalised = (pixels.astype(np.float32) / 255 - 0.5) / 0.5
    patch_1_2 = torch.from_numpy(normalised[14:28, 28:42].transpose(2, 0, 1).copy())  # patch row 1, column 2
    assert torch.equal(out["pixel_values"][1 * 6 + 2], patch_1_2)
    assert torch.count_nonzero(out["pixel_values"][5, :, :, 0:14]) == 0  # the last column is all padding


def test_processor_refuses_what_is_not_an_image(kimi_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(kimi_dir, trust_remote_code=True)
    with pytest.raises(ValueError, match="images only, not 'video'"):
        processor.media_processor.media_tokens_calculator({"type": "video", "video": None})
