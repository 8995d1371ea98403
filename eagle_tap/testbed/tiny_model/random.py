"""Tiny random-weight targets of the architectures eagle-tap captures from, built on demand.

    python -m eagle_tap.testbed.tiny_model.random --arch deepseek_v3 --out DIR

The committed tiny Llama is trained; these are not. They exist so that capture can be checked,
through a real SGLang server, against HF transformers on the architectures whose SGLang classes
differ in what matters here (layer-id rule, attention, MoE), without committing weights:

- `llama`: `LlamaForCausalLM` (the shape of the committed tiny Llama, random weights);
- `qwen3`: `Qwen3ForCausalLM` (per-head q/k norms, GQA);
- `deepseek_v3`: `DeepseekV3ForCausalLM`, the architecture of Kimi-K2.5: MLA attention with small
  q/kv LoRA ranks, 8 routed experts + 1 shared, the first layer dense (`first_k_dense_replace=1`),
  noaux_tc sigmoid routing and DeepSeek-V3's own yarn rope settings.

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

ARCHITECTURES = ("llama", "qwen3", "deepseek_v3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

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
    if config.arch == "deepseek_v3":
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
        model.to(torch.bfloat16).save_pretrained(staging)
        for name in TOKENIZER_FILES:
            shutil.copyfile(TINY_MODEL_DIR / name, staging / name)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, choices=ARCHITECTURES)
    parser.add_argument("--out", required=True, type=Path, help="folder to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out_dir = build(Config(arch=args.arch, seed=args.seed), args.out)
    except (ValueError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote a random {args.arch} target to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
