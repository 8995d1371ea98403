"""The draft's config.json, derived from the target's: what SGLang's `LlamaForCausalLMEagle3` loads.

A Llama config with one decoder layer, the target's hidden size, heads, KV heads, head dim,
intermediate size, norm eps, rope settings and max positions, the target's vocab size (the
embedding) and the draft vocab size (lm_head), plus:
- `num_aux_hidden_states` and `eagle_config.eagle_aux_hidden_state_layer_ids`: SGLang's layer ids
  for the capture layers, translated by capture_format.layers for the target's architecture;
- `eagle_tap`: the capture layers themselves and the target's fingerprint, which training checks
  every record against, and its tokenizer's fingerprint, which serving checks the target against.
Values the derivation gets wrong for an unusual target (an MLA target's KV heads, say) are set
with `--set key=value` (JSON values).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_DRAFT_VOCAB_SIZE = 32000


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
    heads = target["num_attention_heads"]
    rope = rope_parameters(target)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": target["hidden_size"],
        "target_hidden_size": target["hidden_size"],
        "num_aux_hidden_states": len(layers),
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads") or heads,
        "head_dim": target.get("head_dim") or target["hidden_size"] // heads,
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
