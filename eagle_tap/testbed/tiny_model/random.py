"""Tiny random-weight targets of the architectures eagle-tap captures from, built on demand.

    python -m eagle_tap.testbed.tiny_model.random --arch deepseek_v3 --out DIR

The committed tiny Llama is trained; these are not. They exist so that capture can be checked,
through a real SGLang server, against HF transformers on the architectures whose SGLang classes
differ in what matters here (layer-id rule, attention, MoE), without committing weights:

- `llama`: `LlamaForCausalLM` (the shape of the committed tiny Llama, random weights);
- `qwen3`: `Qwen3ForCausalLM` (per-head q/k norms, GQA);
- `deepseek_v3`: `DeepseekV3ForCausalLM`, the architecture of Kimi-K2.5's language model: MLA attention
  with small q/kv LoRA ranks, 8 routed experts + 1 shared, the first layer dense
  (`first_k_dense_replace=1`), noaux_tc sigmoid routing and DeepSeek-V3's own yarn rope settings;
- `kimi_k25`: `KimiK25ForConditionalGeneration`, the class SGLang serves Kimi-K2.5 as: the `deepseek_v3`
  language model (4,160 vocabulary rows) under `language_model.`, its settings under
  `text_config`, and a MoonViT vision tower of one layer and the patch-merger projector under
  `vision_config`, laid out as the real checkpoint's config.json and weight names are
  (`vision_tower.encoder.blocks.N.wqkv`, `mm_projector.proj.0`, ...). The tokenizer is the tiny
  Llama's plus Kimi's image placeholder `<|media_pad|>` (id 4096; the text vocabulary is 4,160 rows).

What must hold:
- deterministic: the same arch and seed give the same weights (seeded CPU init);
- the folder is a plain HF checkpoint (config, bf16 safetensors, the tiny Llama's tokenizer and chat
  template) that transformers and SGLang load as they load any model;
- 8 decoder layers, so the default capture layers `[3, L//2 + 1, L - 2]` = 3/5/6 are distinct;
- written atomically: a folder that exists is complete (built in a temporary sibling, then renamed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

ARCHITECTURES = ("llama", "qwen3", "deepseek_v3", "kimi_k25")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

# Kimi-K2.5's image placeholder, one id per image feature row after the processor expands it.
MEDIA_PLACEHOLDER = "<|media_pad|>"
MEDIA_PLACEHOLDER_ID = 4096
KIMI_TEXT_VOCAB = 4160  # the tokenizer's 4,097 ids, rounded up to a multiple of 64 as real checkpoints pad

# DeepSeek-V3's published rope settings (its config.json), which SGLang's CPU rope path requires.
DEEPSEEK_V3_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
}


@dataclasses.dataclass(kw_only=True, slots=True)
class Config:
    """What decides one random target."""

    arch: str
    """One of ARCHITECTURES."""
    seed: int = 0
    """Seed of the weight init."""
    num_layers: int = 8
    """Decoder layers."""
    initializer_range: float = 0.02
    """Std of the weight init (HF's default). Larger values make attention so peaky and MoE routing so close
    to ties that bf16 rounding flips them (0.1: bf16 states 0.03-0.09 off fp32 ones, against 0.005-0.01 here)."""
    lm_head_scale: float = 1.0
    """Factor on lm_head after the init. At 1 the logits' std is about 0.2 (0.02 x sqrt(128)): every next-token
    distribution is nearly flat (entropy near ln 4096), greedy answers are near-ties and a draft has nothing to
    learn. 30 gives peaked distributions, as a trained model's, without changing any state a capture stores."""


def hf_config(config: Config):
    """The transformers config of the target `config` describes (vocab and special ids of the tiny tokenizer)."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    common = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=config.num_layers, num_attention_heads=4,
                  max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  tie_word_embeddings=False, initializer_range=config.initializer_range)
    if config.arch == "llama":
        return LlamaConfig(**common, intermediate_size=384, num_key_value_heads=2, head_dim=32,
                           architectures=["LlamaForCausalLM"])
    if config.arch == "qwen3":
        return Qwen3Config(**common, intermediate_size=384, num_key_value_heads=2, head_dim=32,
                           rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                           architectures=["Qwen3ForCausalLM"])
    if config.arch in ("deepseek_v3", "kimi_k25"):
        if config.arch == "kimi_k25":
            common["vocab_size"] = KIMI_TEXT_VOCAB
        common["max_position_embeddings"] = 163_840  # what yarn factor 40 over 4,096 positions gives
        return DeepseekV3Config(
            **common, num_key_value_heads=4, intermediate_size=384, moe_intermediate_size=64,
            q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, num_mtp_layers=0,
            # Keys of DeepSeek-V3's config.json that SGLang reads and transformers' class does not declare.
            moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",
            rope_parameters=dict(DEEPSEEK_V3_YARN), architectures=["DeepseekV3ForCausalLM"])
    raise ValueError(f"unknown architecture {config.arch!r}; available: {', '.join(ARCHITECTURES)}")


# The tiny MoonViT: one encoder layer of width 32 (2 heads of 16), 14-pixel patches, a 2x2 patch merger, so a
# 56x56 image is 4x4 patches and 4 image features. Kimi-K2.5's config.json names the tower's sizes `vt_*`;
# SGLang's `KimiK25VisionConfig` builds the tower from the plain names and the projector from
# `vt_hidden_size`, so both are written, equal.
KIMI_VISION = {
    "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "video_attn_type": "spatial_temporal", "mm_projector_type": "patchmerger", "mm_hidden_size": 32,
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": 128,
    "vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
}


# What SGLang's `kimi_k25` processor reads from Kimi's `media_processor.media_proc_cfg` (Kimi-K2.5's own
# preprocessor_config.json values, but far fewer patches: at most 64, 16 to a side).
KIMI_MEDIA_PROC_CFG = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 64, "patch_limit_on_one_side": 16,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
KIMI_PROCESSOR_DIR = Path(__file__).resolve().parent / "kimi_k25_processor"
"""Remote code the tiny Kimi-K2.5 ships (served with `--trust-remote-code`), as Kimi-K2.5's checkpoint does."""


def kimi_vision_weights(vision: dict, generator, init_std: float) -> dict:
    """name -> fp32 tensor of the vision tower and projector, named as Kimi-K2.5's checkpoint names them."""
    import torch

    width, mlp, patch = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = width * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes = {
        "vision_tower.patch_embed.proj.weight": (width, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (width,),
        "vision_tower.patch_embed.pos_emb.weight": (vision["init_pos_emb_height"], vision["init_pos_emb_width"], width),
    }
    for layer in range(vision["vt_num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{layer}"
        shapes |= {f"{block}.wqkv.weight": (3 * width, width), f"{block}.wqkv.bias": (3 * width,),
                   f"{block}.wo.weight": (width, width), f"{block}.wo.bias": (width,),
                   f"{block}.mlp.fc0.weight": (mlp, width), f"{block}.mlp.fc0.bias": (mlp,),
                   f"{block}.mlp.fc1.weight": (width, mlp), f"{block}.mlp.fc1.bias": (width,)}
        shapes |= {f"{block}.{norm}.{kind}": (width,) for norm in ("norm0", "norm1") for kind in ("weight", "bias")}
    shapes |= {f"vision_tower.encoder.final_layernorm.{kind}": (width,) for kind in ("weight", "bias")}
    shapes |= {f"mm_projector.pre_norm.{kind}": (width,) for kind in ("weight", "bias")}
    shapes |= {"mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
               "mm_projector.proj.2.weight": (vision["text_hidden_size"], merged),
               "mm_projector.proj.2.bias": (vision["text_hidden_size"],)}
    weights = {}
    for name, shape in shapes.items():
        if "norm" in name:  # LayerNorms start as the identity with a small random tilt, so they are exercised
            base = 1.0 if name.endswith("weight") else 0.0
            weights[name] = base + 0.1 * torch.randn(shape, generator=generator)
        else:
            weights[name] = init_std * torch.randn(shape, generator=generator) * (50 if "pos_emb" in name else 1)
    return weights


def kimi_k25_config(text_config) -> dict:
    """Kimi-K2.5's config.json layout: the DeepSeek-V3 settings under `text_config`, the tower's under `vision_config`."""
    text = text_config.to_dict()
    # The weights are bf16, as the checkpoint's; SGLang's `--dtype auto` reads the dtype recorded here.
    text |= {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "dtype": "bfloat16"}
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "vision_config": dict(KIMI_VISION),
        "media_placeholder_token_id": MEDIA_PLACEHOLDER_ID, "pad_token_id": 2, "bos_token_id": 0,
        "eos_token_id": 1, "ignore_index": -100, "use_unified_vision_chunk": False,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    }


def write_kimi_k25(config: Config, language_model, staging: Path) -> None:
    """The random DeepSeek-V3 renamed under `language_model.`, the vision weights, Kimi's config.json layout, the
    placeholder added to the tokenizer already copied into `staging`, and the processor."""
    import json

    import torch
    from safetensors.torch import save_file

    weights = {f"language_model.{name}": tensor for name, tensor in language_model.state_dict().items()}
    weights |= kimi_vision_weights(KIMI_VISION, torch.Generator().manual_seed(config.seed + 1), config.initializer_range)
    save_file({name: tensor.to(torch.bfloat16).contiguous() for name, tensor in weights.items()},
              staging / "model.safetensors", metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(kimi_k25_config(language_model.config), indent=2) + "\n")
    tokenizer = json.loads((staging / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) == MEDIA_PLACEHOLDER_ID, "the placeholder id must follow the vocabulary"
    tokenizer["added_tokens"].append({"id": MEDIA_PLACEHOLDER_ID, "content": MEDIA_PLACEHOLDER, "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (staging / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    for source in sorted(KIMI_PROCESSOR_DIR.glob("*.py")):
        shutil.copyfile(source, staging / source.name)
    auto_map = {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
                "AutoProcessor": "processing_kimi_k25.KimiK25Processor"}
    (staging / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "KimiK25VisionProcessor", "processor_class": "KimiK25Processor",
        "auto_map": auto_map, "media_proc_cfg": dict(KIMI_MEDIA_PROC_CFG)}, indent=2) + "\n")
    (staging / "processor_config.json").write_text(json.dumps({
        "processor_class": "KimiK25Processor", "auto_map": auto_map}, indent=2) + "\n")


def build(config: Config, out_dir: Path) -> Path:
    """Write the random target to out_dir (which must not exist yet) and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    model_config = hf_config(config)  # raises for an unknown arch before anything is written
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; pick a new folder (a built target is never overwritten)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        torch.manual_seed(config.seed)
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        if config.lm_head_scale != 1.0:
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(config.lm_head_scale)
        for name in TOKENIZER_FILES:
            shutil.copyfile(TINY_MODEL_DIR / name, staging / name)
        if config.arch == "kimi_k25":
            write_kimi_k25(config, model, staging)
        else:
            model.to(torch.bfloat16).save_pretrained(staging)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def build_wide_llama(out_dir: Path, *, hidden_size: int, num_layers: int, intermediate_size: int, head_dim: int,
                     num_heads: int, num_kv_heads: int) -> Path:
    """A random bf16 Llama of any width in out_dir (seed 0), with the tiny tokenizer's vocab and files: the random
    llama of `hf_config` with these shapes, for benchmarks that need states of a production width."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(Config(arch="llama", num_layers=num_layers))
    config.hidden_size, config.intermediate_size, config.head_dim = hidden_size, intermediate_size, head_dim
    config.num_attention_heads, config.num_key_value_heads = num_heads, num_kv_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TINY_MODEL_DIR / name, Path(out_dir) / name)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, choices=ARCHITECTURES)
    parser.add_argument("--out", required=True, type=Path, help="folder to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-head-scale", type=float, default=1.0,
                        help="factor on lm_head: 30 gives peaked next-token distributions (default 1: nearly flat)")
    args = parser.parse_args(argv)
    try:
        out_dir = build(Config(arch=args.arch, seed=args.seed, lm_head_scale=args.lm_head_scale), args.out)
    except (ValueError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote a random {args.arch} target to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
