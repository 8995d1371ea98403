"""`eagle-tap export`: a trained draft as a folder SGLang serves with `--speculative-algorithm EAGLE3`.

The folder holds:
- config.json: the draft config (architectures ["LlamaForCausalLMEagle3"], or
  ["Eagle3DeepseekV2ForCausalLM"] for the MLA layout; one layer, the target's
  vocab_size, draft_vocab_size, tie_word_embeddings false, hidden/intermediate sizes, heads, head
  dim, norm eps, rope, max positions, torch_dtype) with `eagle_config.eagle_aux_hidden_state_layer_ids`
  recomputed from the capture layers by capture_format.layers for the target's architecture;
- model.safetensors: the draft's weights under the names the layout's SGLang class's `load_weights`
  reads, matrices and norms in torch_dtype, plus d2t (int64 offsets, read as hot token ids) and t2d
  (bool, skipped by SGLang); no embed_tokens (SGLang shares the target's embedding);
- README.md: a model card (training data, capture layers, vocab coverage, offline acceptance).

What must hold: nothing is written unless every required tensor is present with the shape the
config implies (a ValueError names the tensor); the folder appears whole or not at all (written
in a temporary folder next to it, then renamed).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainer.draft_config import LAYOUT_ARCHITECTURES, draft_kv_bytes_per_token, draft_layout
from trainer.run_folder import resolve_checkpoint, run_inputs

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def attention_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The attention's tensors (under `midlayer.self_attn.`) of the config's layout, with their shapes."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if draft_layout(config) == "mla":
        nope, rope, value = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        q_rank, latent = config["q_lora_rank"], config["kv_lora_rank"]
        return {"q_a_proj.weight": (q_rank, 2 * hidden), "q_a_layernorm.weight": (q_rank,),
                "q_b_proj.weight": (heads * (nope + rope), q_rank),
                "kv_a_proj_with_mqa.weight": (latent + rope, 2 * hidden), "kv_a_layernorm.weight": (latent,),
                "kv_b_proj.weight": (heads * (nope + value), latent), "o_proj.weight": (hidden, heads * value)}
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    return {"q_proj.weight": (heads * head_dim, 2 * hidden), "k_proj.weight": (kv_heads * head_dim, 2 * hidden),
            "v_proj.weight": (kv_heads * head_dim, 2 * hidden), "o_proj.weight": (hidden, heads * head_dim)}


def required_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor SGLang's class for the config's layout needs from the folder, with its shape."""
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    num_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    target_hidden = config.get("target_hidden_size", hidden)
    layer = "midlayer"
    fc_norm = {f"fc_norm.{index}.weight": (target_hidden,) for index in range(num_aux)} if config.get("fc_norm") else {}
    return {
        "fc.weight": (hidden, num_aux * target_hidden),
        **fc_norm,
        f"{layer}.hidden_norm.weight": (hidden,),
        f"{layer}.input_layernorm.weight": (hidden,),
        **{f"{layer}.self_attn.{name}": shape for name, shape in attention_shapes(config).items()},
        f"{layer}.post_attention_layernorm.weight": (hidden,),
        f"{layer}.mlp.gate_proj.weight": (intermediate, hidden),
        f"{layer}.mlp.up_proj.weight": (intermediate, hidden),
        f"{layer}.mlp.down_proj.weight": (hidden, intermediate),
        "norm.weight": (hidden,),
        "lm_head.weight": (config["draft_vocab_size"], hidden),
        "d2t": (config["draft_vocab_size"],),
        "t2d": (config["vocab_size"],),
    }


def export_config(draft: dict[str, Any]) -> dict[str, Any]:
    """The served config: the draft config with SGLang's aux layer ids recomputed for the target."""
    from capture_format.layers import capture_layers_to_sglang_ids

    tap = draft.get("eagle_tap")
    if not tap:
        raise ValueError("the draft config lacks its `eagle_tap` section (capture layers, target architecture); "
                         "write it with `eagle-tap draft-config`")
    layer_ids = capture_layers_to_sglang_ids(tap["target_architecture"], tap["capture_layers"],
                                             tap["target_num_hidden_layers"])
    config = dict(draft)
    config.update(architectures=[LAYOUT_ARCHITECTURES[draft_layout(draft)]], num_hidden_layers=1,
                  tie_word_embeddings=False,
                  num_aux_hidden_states=len(layer_ids))
    config["eagle_config"] = {**(draft.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": layer_ids,
                              "use_aux_hidden_state": True}
    config.setdefault("torch_dtype", "bfloat16")
    if config["torch_dtype"] not in EXPORT_DTYPES:
        raise ValueError(f"torch_dtype {config['torch_dtype']!r} is not supported; "
                         f"accepted: {', '.join(EXPORT_DTYPES)}")
    return config


def checked_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors to write (floats cast to torch_dtype), or a ValueError naming the first bad one."""
    required = required_shapes(config)
    for name, shape in required.items():
        if name not in tensors:
            raise ValueError(f"the checkpoint lacks tensor {name!r}, which SGLang needs; refusing to export")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}; the config implies {shape}")
    if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
        raise ValueError(f"d2t must be int64 and t2d bool; got {tensors['d2t'].dtype} and {tensors['t2d'].dtype}")
    hot_ids = torch.arange(config["draft_vocab_size"]) + tensors["d2t"]  # (D,)
    if int(hot_ids.min()) < 0 or int(hot_ids.max()) >= config["vocab_size"] or not bool(tensors["t2d"][hot_ids].all()):
        raise ValueError("tensors 'd2t' and 't2d' disagree: d2t names target ids that t2d does not mark")
    dtype = EXPORT_DTYPES[config["torch_dtype"]]
    return {name: tensors[name].to(dtype).contiguous() if tensors[name].is_floating_point() else
            tensors[name].contiguous() for name in required}


def model_card(config: dict[str, Any], run_config: dict[str, Any] | None, evaluation: dict[str, Any] | None) -> str:
    tap = config["eagle_tap"]
    if draft_layout(config) == "mla":
        attention = (f"multi-latent attention (DeepSeek-V2), heads {config['num_attention_heads']}, q_lora_rank "
                     f"{config['q_lora_rank']}, kv_lora_rank {config['kv_lora_rank']}")
    else:
        attention = f"heads {config['num_attention_heads']}/{config['num_key_value_heads']}"
    lines = ["# EAGLE-3 draft (eagle-tap)", "",
             f"Draft for target `{tap.get('target_architecture')}` "
             f"(fingerprint `{tap.get('target_model_fingerprint')}`), "
             "served with SGLang `--speculative-algorithm EAGLE3 --speculative-draft-model-path <this folder>`.", "",
             "## Architecture", "",
             f"- `{config['architectures'][0]}`: one decoder layer, hidden {config['hidden_size']}, {attention}, "
             f"intermediate {config['intermediate_size']}; draft KV cache {draft_kv_bytes_per_token(config)} bytes "
             "per token in bf16",
             f"- capture layers (inputs of target layers) {tap['capture_layers']}; SGLang "
             f"`eagle_aux_hidden_state_layer_ids` {config['eagle_config']['eagle_aux_hidden_state_layer_ids']}",
             f"- draft vocab {config['draft_vocab_size']} of {config['vocab_size']} target tokens", ""]
    if run_config is not None:
        lines += ["## Training data", "",
                  f"- shards: `{Path(run_config['data']['shards']).name}`; {run_config['num_steps']} optimizer steps of "
                  f"{run_config['data']['batch_size']} rows (max length {run_config['data']['max_length']})",
                  f"- TTT steps {run_config['objective']['ttt_steps']}, seed {run_config['seed']}", ""]
        vocab_meta = Path(run_config["vocab"]) / "vocab.json"
        if vocab_meta.is_file():
            meta = json.loads(vocab_meta.read_text(encoding="utf-8"))
            lines += ["## Vocab coverage", "",
                      f"The draft vocab covers {meta['coverage']:.1%} of {meta['num_counted_tokens']} loss-masked "
                      f"captured tokens ({meta['num_distinct_tokens']} distinct).", ""]
    if evaluation is not None:
        from trainer.evaluate import format_table

        lines += ["## Offline evaluation", "", f"Held-out shards `{Path(str(evaluation.get('shards'))).name}`, "
                  f"{evaluation['num_start_positions']} start positions.", "",
                  "```", format_table(evaluation), "```", ""]
    return "\n".join(lines)


def untrained_tensors(run_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The draft a run starts from (its seed, its vocab mapping, no training step), under the saved names."""
    from trainer.model import trainable_state_dict
    from trainer.train import initial_objective

    return trainable_state_dict(initial_objective(run_config).draft)


def export(checkpoint: str | Path, out_dir: str | Path, eval_result: str | Path | None = None,
           untrained: bool = False) -> Path:
    """Writes the SGLang-loadable folder out_dir from a trained run; returns out_dir.

    untrained: export the run's initialisation instead of its trained weights (a baseline to serve)."""
    from safetensors.torch import load_file, save_file

    final, run_config_path = resolve_checkpoint(checkpoint)
    out = Path(out_dir)
    if out.exists():
        raise ValueError(f"{out} already exists; export into a new folder")
    if untrained and run_config_path is None:
        raise ValueError(f"no training config.json next to {final}: the untrained draft is rebuilt from the run's "
                         "config (target, vocab, seed)")
    config = export_config(json.loads((final / "config.json").read_text(encoding="utf-8")))
    run_config = None
    if run_config_path is not None:  # the run's own copy of its vocab, so a moved run folder still exports
        run_config = run_inputs(run_config_path.parent, json.loads(run_config_path.read_text(encoding="utf-8")))
    weights = untrained_tensors(run_config) if untrained else load_file(final / "model.safetensors")
    tensors = checked_tensors(weights, config)
    evaluation = None if untrained or not eval_result else json.loads(Path(eval_result).read_text(encoding="utf-8"))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        card = model_card(config, run_config, evaluation)
        if untrained:
            card += "\n**Untrained**: the run's initialisation (its seed), not trained; a baseline to serve.\n"
        (staging / "README.md").write_text(card, encoding="utf-8")
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
