"""The draft's config.json, derived from the target's: what SGLang's `LlamaForCausalLMEagle3` loads.

A Llama config with one decoder layer, the target's hidden size, heads, KV heads, head dim,
intermediate size, norm eps, rope settings and max positions, the target's vocab size (the
embedding) and the draft vocab size (lm_head), plus:
- `num_aux_hidden_states` and `eagle_config.eagle_aux_hidden_state_layer_ids`: SGLang's layer ids
  for the capture layers, translated by capture_format.layers for the target's architecture;
- `eagle_tap`: the capture layers themselves and the target's fingerprint, which training checks
  every record against, and its tokenizer's fingerprint, which serving checks the target against.
Values the derivation gets wrong for an unusual target are set with `--set key=value` (JSON values).

Two layouts (`--layout`), each one SGLang class:
- "llama" (the default): `LlamaForCausalLMEagle3`, grouped-query attention with the target's heads, KV
  heads and head dim;
- "mla": `Eagle3DeepseekV2ForCausalLM`, for an MLA target (DeepSeek-V3, Kimi-K2.x): DeepSeek-V2 multi-latent
  attention with the target's q_lora_rank, kv_lora_rank and head dims, written as a `deepseek_v3` config so
  SGLang builds it as an MLA model (its draft KV cache then holds one latent per token).
Both write `fc_norm` and `norm_output` (EAGLE3.1, false unless set), which both SGLang classes read.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_DRAFT_VOCAB_SIZE = 32000
LAYOUT_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}
"""The SGLang class each draft layout is served as."""
MLA_TARGET_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def draft_layout(config: dict[str, Any]) -> str:
    """The layout a draft config's `architectures` names (a config without it is a Llama one)."""
    architectures = config.get("architectures") or [LAYOUT_ARCHITECTURES["llama"]]
    for layout, architecture in LAYOUT_ARCHITECTURES.items():
        if architectures[0] == architecture:
            return layout
    raise ValueError(f"draft architecture {architectures[0]!r} is not one eagle-tap trains; known: "
                     f"{', '.join(LAYOUT_ARCHITECTURES.values())}")


def draft_kv_bytes_per_token(config: dict[str, Any], bytes_per_value: int = 2) -> int:
    """What the served draft's KV cache holds per token (its one layer): per-head keys and values (llama), or one
    latent and the shared rope key (mla, as SGLang's MLA pool stores it)."""
    if draft_layout(config) == "mla":
        return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * bytes_per_value
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_key_value_heads"] * head_dim * bytes_per_value


def rope_parameters(target: dict[str, Any]) -> dict[str, Any]:
    """The target's rope settings in transformers' `rope_parameters` form (rope_type, rope_theta, ...)."""
    if target.get("rope_parameters"):
        parameters = dict(target["rope_parameters"])
    else:
        scaling = dict(target.get("rope_scaling") or {})
        if "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        parameters = {"rope_type": "default", **scaling, "rope_theta": target.get("rope_theta", 10000.0)}
    parameters.setdefault("rope_type", "default")
    return parameters


def build_draft_config(
    target_dir: str | Path,
    *,
    draft_vocab_size: int | None = None,
    capture_layers: Sequence[int] | None = None,
    overrides: dict[str, Any] | None = None,
    layout: str = "llama",
) -> dict[str, Any]:
    """The draft config for the target in target_dir (see the module docstring)."""
    import capture_format as cf
    from capture_format.fingerprint import model_fingerprint
    from trainer.vocab import read_model_config, tokenizer_fingerprint

    target = read_model_config(target_dir)
    architecture = (json.loads((Path(target_dir) / "config.json").read_text())["architectures"] or ["unknown"])[0]
    num_layers = target["num_hidden_layers"]
    layers = cf.validate_capture_layers(
        capture_layers if capture_layers is not None else cf.default_capture_layers(num_layers), num_layers
    )
    vocab_size = target["vocab_size"]
    draft_vocab_size = draft_vocab_size or min(DEFAULT_DRAFT_VOCAB_SIZE, vocab_size)
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be within 1..{vocab_size} (the target's vocab)")
    if layout not in LAYOUT_ARCHITECTURES:
        raise ValueError(f"unknown draft layout {layout!r}; known: {', '.join(LAYOUT_ARCHITECTURES)}")
    heads = target["num_attention_heads"]
    rope = rope_parameters(target)
    if layout == "mla":
        missing = [key for key in MLA_TARGET_KEYS if not target.get(key)]
        if missing:
            raise ValueError(f"the MLA layout takes its attention shapes from an MLA target; {target_dir} has no "
                             f"{', '.join(missing)} (use --layout llama for this target)")
        attention = {"model_type": "deepseek_v3", "num_key_value_heads": heads,
                     **{key: target[key] for key in MLA_TARGET_KEYS}, "rope_interleave": True}
    else:
        # An MLA target's head_dim is its rope width (transformers' DeepseekV3Config writes qk_rope_head_dim there),
        # not a head of its attention: the Llama draft then takes hidden / heads.
        mla_target = all(target.get(key) for key in MLA_TARGET_KEYS)
        attention = {"model_type": "llama", "num_key_value_heads": target.get("num_key_value_heads") or heads,
                     "head_dim": (None if mla_target else target.get("head_dim")) or target["hidden_size"] // heads}
    config: dict[str, Any] = {
        "architectures": [LAYOUT_ARCHITECTURES[layout]],
        "model_type": attention.pop("model_type"),
        "num_hidden_layers": 1,
        "hidden_size": target["hidden_size"],
        "target_hidden_size": target["hidden_size"],
        "num_aux_hidden_states": len(layers),
        "num_attention_heads": heads,
        **attention,
        "intermediate_size": target["intermediate_size"],
        "hidden_act": "silu",
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target["max_position_embeddings"],
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "fc_norm": False,
        "norm_output": False,
        "torch_dtype": "bfloat16",
        **{key: target[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in target},
        "eagle_tap": {
            "capture_layers": layers,
            "target_architecture": architecture,
            "target_num_hidden_layers": num_layers,
            "target_model_fingerprint": model_fingerprint(target_dir),
            "target_tokenizer_fingerprint": tokenizer_fingerprint(target_dir),
        },
    }
    try:
        layer_ids = cf.capture_layers_to_sglang_ids(architecture, layers, num_layers)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    except cf.LayerConfigError as error:
        warnings.warn(f"no eagle_config written: {error}", stacklevel=2)
    for key, value in (overrides or {}).items():
        if key not in config:
            raise ValueError(f"unknown draft config key {key!r}; known: {', '.join(sorted(config))}")
        config[key] = value
    return config


def load_draft_config(path: str | Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the draft config {path}: {error}") from None
    if "eagle_tap" not in config:
        raise ValueError(f"{path} lacks the `eagle_tap` section; write it with `eagle-tap draft-config`")
    return config
