"""The draft model: SGLang's names and math, the TTT unroll's alignment and causality, target weights, draft config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle_tap.cli import main
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from trainer import model, ttt
from trainer.draft_config import build_draft_config
from trainer.target_weights import load_embedding_and_lm_head

SMALL = dict(hidden_size=32, target_hidden_size=32, num_aux_hidden_states=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-5, vocab_size=64,
             draft_vocab_size=16, max_position_embeddings=256)


def small_draft(seed: int = 0, **changes) -> model.Eagle3Draft:
    torch.manual_seed(seed)
    draft = model.Eagle3Draft(model.Config(**{**SMALL, **changes}))
    with torch.no_grad():
        draft.embed_tokens.weight.normal_()
        for name, parameter in draft.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)  # not all ones, so a swapped norm shows
        draft.d2t.copy_(torch.arange(16) * 3)  # draft id i is target id 4i
        draft.t2d[draft.d2t + torch.arange(16)] = True
    return draft


def test_parameter_names_and_shapes_are_what_sglang_loads() -> None:
    shapes = {name: tuple(tensor.shape) for name, tensor in small_draft().state_dict().items()}
    assert shapes == {
        "embed_tokens.weight": (64, 32),
        "fc.weight": (32, 96),
        "midlayer.hidden_norm.weight": (32,),
        "midlayer.input_layernorm.weight": (32,),
        "midlayer.self_attn.q_proj.weight": (32, 64),  # input: cat(embedding, hidden)
        "midlayer.self_attn.k_proj.weight": (16, 64),
        "midlayer.self_attn.v_proj.weight": (16, 64),
        "midlayer.self_attn.o_proj.weight": (32, 32),
        "midlayer.post_attention_layernorm.weight": (32,),
        "midlayer.mlp.gate_proj.weight": (48, 32),
        "midlayer.mlp.up_proj.weight": (48, 32),
        "midlayer.mlp.down_proj.weight": (32, 48),
        "norm.weight": (32,),
        "lm_head.weight": (16, 32),
        "d2t": (16,),
        "t2d": (64,),
    }


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def sglang_reference(draft: model.Eagle3Draft, aux, input_ids, positions):
    """SGLang's LlamaForCausalLMEagle3 forward (fused residual norms), with torch SDPA and transformers' rope."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    c, layer, attention = draft.config, draft.midlayer, draft.midlayer.self_attn
    hidden_states = aux @ draft.fc.weight.T  # fc, since the width 3H differs from H
    residual = hidden_states
    x = torch.cat([rms(draft.embed_tokens.weight[input_ids], layer.input_layernorm.weight),
                   rms(hidden_states, layer.hidden_norm.weight)], dim=-1)
    S = x.shape[1]
    q = (x @ attention.q_proj.weight.T).view(1, S, c.num_attention_heads, c.head_dim).transpose(1, 2)
    k = (x @ attention.k_proj.weight.T).view(1, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    v = (x @ attention.v_proj.weight.T).view(1, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    rotary = LlamaRotaryEmbedding(LlamaConfig(
        hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rope_parameters=dict(c.rope_parameters)))
    cos, sin = rotary(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    residual = attended.transpose(1, 2).reshape(1, S, -1) @ attention.o_proj.weight.T + residual
    mlp_in = rms(residual, layer.post_attention_layernorm.weight)
    mlp = layer.mlp
    gated = F.silu(mlp_in @ mlp.gate_proj.weight.T) * (mlp_in @ mlp.up_proj.weight.T)
    residual = gated @ mlp.down_proj.weight.T + residual
    return residual, rms(residual, draft.norm.weight) @ draft.lm_head.weight.T


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_one_step_is_sglangs_math(rope: dict) -> None:
    draft = small_draft(rope_parameters=rope)
    torch.manual_seed(1)
    aux, input_ids = torch.randn(1, 10, 96), torch.randint(0, 64, (1, 10))
    positions = torch.arange(10)[None] + 100
    out, logits = draft(draft.fc(aux), input_ids, positions, model.causal_mask(torch.zeros(1, 10, dtype=torch.long)))
    expected_out, expected_logits = sglang_reference(draft, aux, input_ids, positions)
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=1e-4)


def make_batch(doc_ids: list[int], seed: int = 2) -> dict:
    generator = torch.Generator().manual_seed(seed)
    S = len(doc_ids)
    docs = torch.tensor([doc_ids])
    positions = torch.zeros(1, S, dtype=torch.long)
    for s in range(1, S):
        positions[0, s] = positions[0, s - 1] + 1 if doc_ids[s] == doc_ids[s - 1] else 0
    return {"aux": torch.randn(1, S, 96, generator=generator), "final": torch.randn(1, S, 32, generator=generator),
            "input_ids": torch.randint(0, 64, (1, S), generator=generator), "position_ids": positions,
            "loss_mask": docs >= 0, "doc_ids": docs}


def objective(steps: int = 4) -> ttt.Eagle3Objective:
    torch.manual_seed(3)
    return ttt.Eagle3Objective(small_draft(), torch.randn(64, 32), ttt.Config(ttt_steps=steps))


def test_ttt_step_reads_only_what_serving_would_have() -> None:
    # Step i at row r may see aux of rows <= r (what the target verified) and input tokens of rows <= r + i.
    unroll = objective()
    batch = make_batch([0] * 12)
    before = [out["logits"].detach() for out in unroll.unroll(batch)]
    row, step = 4, 2
    changed = {key: value.clone() for key, value in batch.items()}
    changed["aux"][0, row + 1 :] += 1.0
    changed["input_ids"][0, row + step + 1 :] = (changed["input_ids"][0, row + step + 1 :] + 1) % 64
    changed["final"][0] += 1.0  # targets never feed the draft
    after = [out["logits"].detach() for out in unroll.unroll(changed)]
    torch.testing.assert_close(after[step][0, row], before[step][0, row], atol=0, rtol=0)
    torch.testing.assert_close(after[0][0, : row + 1], before[0][0, : row + 1], atol=0, rtol=0)
    changed["input_ids"][0, row + step] = (changed["input_ids"][0, row + step] + 1) % 64
    after = [out["logits"].detach() for out in unroll.unroll(changed)]
    assert not torch.equal(after[step][0, row], before[step][0, row])  # but it reads the token of row r + i


def test_ttt_targets_and_masks_follow_the_shift_within_each_record() -> None:
    batch = make_batch([0] * 5 + [1] * 4 + [-1] * 3)  # two packed records and padding
    batch["loss_mask"][0, 2] = False
    unroll = objective()
    target_p, _ = unroll.target_distribution(batch["final"])
    for step, out in enumerate(unroll.unroll(batch)):
        counted = out["counted"][0].tolist()
        expected = [r + step < 5 and r != 2 - step for r in range(5)] + [r + step < 4 for r in range(4)] + [False] * 3
        assert counted == expected, step
        torch.testing.assert_close(out["target_p"][0, : 12 - step], target_p[0, step:])
    losses = unroll(batch)
    assert losses["total"].tolist() == [8, 6, 4, 3] and losses["loss"].requires_grad


def test_target_weights_are_read_alone_from_sharded_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    embedding, head, other = torch.randn(8, 4), torch.randn(8, 4), torch.randn(3, 3)
    save_file({"model.embed_tokens.weight": embedding, "model.layers.0.mlp.weight": other}, tmp_path / "a.safetensors")
    save_file({"lm_head.weight": head}, tmp_path / "b.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.weight": "a.safetensors",
        "lm_head.weight": "b.safetensors"}}))
    loaded_embedding, loaded_head = load_embedding_and_lm_head(tmp_path, tie_word_embeddings=False)
    assert torch.equal(loaded_embedding, embedding) and torch.equal(loaded_head, head)
    assert torch.equal(load_embedding_and_lm_head(tmp_path, tie_word_embeddings=True)[1], embedding)
    (tmp_path / "b.safetensors").unlink()
    save_file({"output.weight": head}, tmp_path / "b.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "a.safetensors", "output.weight": "b.safetensors"}}))
    with pytest.raises(ValueError, match="has none of the tensors lm_head.weight"):
        load_embedding_and_lm_head(tmp_path, tie_word_embeddings=False)


def test_draft_config_from_the_tiny_target(tmp_path: Path) -> None:
    target = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    out = tmp_path / "draft.json"
    assert main(["draft-config", "--target", str(TINY_MODEL_DIR), "--out", str(out), "--draft-vocab-size", "1000",
                 "--set", "intermediate_size=256"]) == 0
    draft = json.loads(out.read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "vocab_size"):
        assert draft[key] == target[key], key
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["num_hidden_layers"] == 1
    assert draft["draft_vocab_size"] == 1000 and draft["intermediate_size"] == 256
    assert draft["rope_parameters"] == target["rope_parameters"]
    assert draft["eagle_tap"]["capture_layers"] == [3, 5, 6]
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # Llama: ids one lower
    built = model.Eagle3Draft(model.Config.from_draft_config(draft))
    assert built.fc.weight.shape == (target["hidden_size"], 3 * target["hidden_size"])
    with pytest.raises(ValueError, match="unknown draft config key 'hidden_szie'"):
        build_draft_config(TINY_MODEL_DIR, overrides={"hidden_szie": 1})
    assert main(["draft-config", "--target", str(TINY_MODEL_DIR), "--out", str(out), "--capture-layers", "0,4"]) == 2
