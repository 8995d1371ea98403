"""The MLA draft layout (SGLang's Eagle3DeepseekV2ForCausalLM) and the EAGLE3.1 options, in the trainer.

Its attention is transformers' DeepseekV3Attention (the reference the tiny DeepSeek-V3 target's captures are
checked against): the same weights give the same output, yarn rope and its softmax scale included; its TTT
objective equals the dense form; fc_norm and norm_output are what SGLang computes; `eagle-tap draft-config
--layout mla` takes the target's MLA shapes and refuses a target without them; SGLang's own
Eagle3DeepseekV2ForCausalLM loads `eagle-tap export`'s folder and computes the trainer's forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle_tap.cli import main
from eagle_tap.serve.sglang_server import free_port
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from eagle_tap.testbed.tiny_model.random import DEEPSEEK_V3_YARN
from trainer import model, ttt
from trainer.dense_reference import dense_objective
from test_trainer_export import compared, image_draft_extend, same_math
from trainer.draft_config import build_draft_config, draft_kv_bytes_per_token

MLA = dict(hidden_size=32, target_hidden_size=32, num_aux_hidden_states=3, num_attention_heads=4,
           num_key_value_heads=4, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6, vocab_size=64,
           draft_vocab_size=16, max_position_embeddings=163_840, layout="mla", q_lora_rank=24, kv_lora_rank=20,
           qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
"""Every MLA width different (nope 8, rope 6, value 10, latent 20), so a mixed-up split shows."""
YARN = dict(DEEPSEEK_V3_YARN)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def mla_draft(seed: int = 0, **changes) -> model.Eagle3Draft:
    torch.manual_seed(seed)
    draft = model.Eagle3Draft(model.Config(**{**MLA, "rope_parameters": YARN, **changes}))
    with torch.no_grad():
        draft.embed_tokens.weight.normal_()
        for name, parameter in draft.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm."):
                parameter.uniform_(0.5, 1.5)  # not all ones, so a swapped or skipped norm shows
            elif parameter.dim() == 2 and name != "embed_tokens.weight":
                parameter.normal_(std=0.15)
        draft.d2t.copy_(torch.arange(16) * 3)
        draft.t2d[draft.d2t + torch.arange(16)] = True
    return draft


def test_mla_parameter_names_and_shapes_are_what_sglangs_mla_class_loads() -> None:
    shapes = {name: tuple(tensor.shape) for name, tensor in mla_draft(fc_norm=True).state_dict().items()
              if name.startswith(("midlayer.self_attn.", "fc_norm."))}
    assert shapes == {
        "fc_norm.0.weight": (32,), "fc_norm.1.weight": (32,), "fc_norm.2.weight": (32,),
        "midlayer.self_attn.q_a_proj.weight": (24, 64),  # input: cat(embedding, hidden)
        "midlayer.self_attn.q_a_layernorm.weight": (24,),
        "midlayer.self_attn.q_b_proj.weight": (4 * (8 + 6), 24),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (20 + 6, 64),
        "midlayer.self_attn.kv_a_layernorm.weight": (20,),
        "midlayer.self_attn.kv_b_proj.weight": (4 * (8 + 10), 20),
        "midlayer.self_attn.o_proj.weight": (32, 4 * 10),
    }


@pytest.mark.parametrize("rope", [YARN, DEFAULT_ROPE], ids=["yarn", "default"])
def test_mla_attention_is_transformers_deepseek_v3_attention(rope: dict) -> None:
    """transformers' DeepseekV3Attention as wide as the layer's input (2H), given the same weights (its o_proj's
    extra rows zero): the same output at every position, rope interleave, yarn cos/sin scale and mscale included."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    draft = mla_draft(rope_parameters=rope)
    ours = draft.midlayer.self_attn
    c = draft.config
    hf_config = DeepseekV3Config(
        hidden_size=2 * c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, rope_parameters=dict(rope), rope_interleave=True,
        attention_bias=False, vocab_size=c.vocab_size)
    hf_config._attn_implementation = "eager"
    reference = DeepseekV3Attention(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
            getattr(reference, name).weight.copy_(getattr(ours, name).weight)
        reference.o_proj.weight.copy_(torch.cat([ours.o_proj.weight, torch.zeros_like(ours.o_proj.weight)]))
    S = 12
    x = torch.randn(1, S, 2 * c.hidden_size, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(S)[None] + 3000  # past yarn's original 4,096 / 40 wavelengths
    causal = torch.full((S, S), float("-inf")).triu(1)[None, None]  # (1, 1, S, S)
    with torch.no_grad():
        expected = reference(x, DeepseekV3RotaryEmbedding(hf_config)(x, positions), causal)[0][..., : c.hidden_size]
        cos, sin = draft.rope(positions, x.dtype)
        got = ours(x, cos, sin, model.causal_mask(torch.zeros(1, S, dtype=torch.long)), [])
    assert ours.scale == pytest.approx(reference.scaling, rel=1e-12)
    if rope is YARN:
        assert ours.scale > 1.5 * (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5  # mscale^2 = (0.1 ln 40 + 1)^2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_fc_norm_and_norm_output_are_what_sglang_computes() -> None:
    """fc_norm: an RMSNorm on each captured state before fc; norm_output: the next step reads norm(out)."""
    plain, options = mla_draft(), mla_draft(fc_norm=True, norm_output=True)
    with torch.no_grad():
        for name, parameter in plain.state_dict().items():
            options.state_dict()[name].copy_(parameter)
    aux = torch.randn(1, 5, 96) * 4
    chunks = aux.chunk(3, dim=-1)
    normed = torch.cat([norm.weight * chunk * torch.rsqrt(chunk.pow(2).mean(-1, keepdim=True) + 1e-6)
                        for norm, chunk in zip(options.fc_norm, chunks)], dim=-1)
    torch.testing.assert_close(options.project(aux), normed @ options.fc.weight.T)
    torch.testing.assert_close(plain.project(aux), aux @ plain.fc.weight.T)
    hidden, ids, positions = torch.randn(1, 5, 32), torch.randint(0, 64, (1, 5)), torch.arange(5)[None]
    mask = model.causal_mask(torch.zeros(1, 5, dtype=torch.long))
    out, logits = plain(hidden, ids, positions, mask)
    next_hidden, same_logits = options(hidden, ids, positions, mask)
    torch.testing.assert_close(same_logits, logits)
    torch.testing.assert_close(next_hidden, plain.norm(out))
    assert not torch.allclose(next_hidden, out)


def test_the_mla_objective_equals_its_dense_form_at_every_ttt_step(monkeypatch) -> None:
    """Loss, per-step losses and every gradient of 5 TTT steps over packed records (the chain keys of later steps
    are as wide as qk, the values as v: the fused attention's log-sum-exp merge must keep them apart)."""
    monkeypatch.setattr(model, "SCORE_CHUNK_BYTES", 4 * 2 * 4 * 20 * 6)  # the log-sum-exp in 4 chunks

    def step() -> dict[str, torch.Tensor]:
        draft = mla_draft(fc_norm=True)
        objective = ttt.Eagle3Objective(draft, torch.randn(64, 32, generator=torch.Generator().manual_seed(5)) * 3,
                                        ttt.Config(ttt_steps=5, loss_chunk_rows=7))
        generator = torch.Generator().manual_seed(6)
        doc_ids = torch.tensor([[0] * 8 + [1] * 10 + [-1] * 2, [2] * 20])
        batch = {"aux": torch.randn(2, 20, 96, generator=generator),
                 "final": torch.randn(2, 20, 32, generator=generator),
                 "input_ids": torch.randint(0, 64, (2, 20), generator=generator),
                 "position_ids": torch.stack([torch.cat([torch.arange(8), torch.arange(10), torch.zeros(2).long()]),
                                              torch.arange(20) + 40]),
                 "loss_mask": doc_ids >= 0, "doc_ids": doc_ids}
        out = objective(batch)
        out["loss"].backward()
        return {"loss": out["loss"].detach(), "step_losses": out["step_losses"].detach(),
                **{name: p.grad for name, p in draft.named_parameters() if p.grad is not None}}

    fused = step()
    with dense_objective():
        dense = step()
    assert fused.keys() == dense.keys()
    assert "midlayer.self_attn.kv_b_proj.weight" in fused and "fc_norm.0.weight" in fused
    for name, value in dense.items():
        torch.testing.assert_close(fused[name], value, rtol=1e-5, atol=1e-6, msg=lambda message: f"{name}: {message}")


def test_draft_config_of_the_mla_layout_takes_the_targets_mla_shapes(random_target, tmp_path: Path) -> None:
    target_dir = random_target("deepseek_v3")
    target = json.loads((target_dir / "config.json").read_text())
    out = tmp_path / "draft.json"
    assert main(["draft-config", "--target", str(target_dir), "--out", str(out), "--layout", "mla",
                 "--draft-vocab-size", "512"]) == 0
    draft = json.loads(out.read_text())
    assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and draft["model_type"] == "deepseek_v3"
    for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size"):
        assert draft[key] == target[key], key
    assert draft["num_key_value_heads"] == target["num_attention_heads"] and "head_dim" not in draft
    assert draft["fc_norm"] is False and draft["norm_output"] is False and draft["rope_interleave"] is True
    assert draft["rope_parameters"]["rope_type"] == "yarn"
    built = model.Eagle3Draft(model.Config.from_draft_config(draft))
    assert isinstance(built.midlayer.self_attn, model.MLAttention)
    # One latent and the shared rope key per token (64 + 16 values) against per-head keys and values.
    llama = build_draft_config(target_dir, draft_vocab_size=512)
    assert draft_kv_bytes_per_token(draft) == (64 + 16) * 2
    assert draft_kv_bytes_per_token(llama) == 2 * llama["num_key_value_heads"] * llama["head_dim"] * 2
    with pytest.raises(ValueError, match="has no q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                                         "v_head_dim .use --layout llama"):
        build_draft_config(TINY_MODEL_DIR, layout="mla")
    with pytest.raises(ValueError, match="an MLA draft config needs kv_lora_rank"):
        model.Config.from_draft_config({**draft, "kv_lora_rank": None})
    with pytest.raises(ValueError, match="rope_type 'llama3' is not supported by the MLA layout"):
        model.Config.from_draft_config({**draft, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="draft architecture 'Eagle3Foo' is not one eagle-tap trains"):
        model.Config.from_draft_config({**draft, "architectures": ["Eagle3Foo"]})


def sglang_mla_check(export_dir: str, embedding_path: str, port: int) -> dict:
    """Run in a fresh process: load the folder with SGLang's MLA class and compare its forward with our draft's.

    The class runs as SGLang runs it on a CPU (`_eagle_tap_mla_cpu.py`): the absorbed MLA method, queries
    projected into the latent space; RadixAttention (paged KV pool, attention backend) is stood in for by
    causal attention over the latent keys at SGLang's own softmax scale."""
    from eagle_tap.serve.sglang_server import use_cpu_stand_ins_in_this_process

    use_cpu_stand_ins_in_this_process()
    from types import SimpleNamespace

    import torch.nn.functional as F
    from safetensors.torch import load_file
    from sglang.test.layer_ut_utils import init_single_process_dist
    from transformers import AutoConfig

    os.environ["MASTER_PORT"] = str(port)
    init_single_process_dist(master_port=port)
    from sglang.srt.models.deepseek_v2 import AttnForwardMethod
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM

    config = AutoConfig.from_pretrained(export_dir)
    served = Eagle3DeepseekV2ForCausalLM(config).float()
    with torch.no_grad():
        for parameter in served.parameters():
            parameter.fill_(float("nan"))  # so a parameter load_weights never wrote shows
    weights = load_file(Path(export_dir) / "model.safetensors")
    embedding = load_file(embedding_path)["embedding"]
    served.load_weights(list(weights.items()) + [("embed_tokens.weight", embedding)])
    unwritten = [name for name, parameter in served.named_parameters() if torch.isnan(parameter).any()]
    hot_ids_ok = torch.equal(served.get_hot_token_id(), torch.arange(config.draft_vocab_size) + weights["d2t"])

    attention = served.model.midlayer.self_attn
    scale = attention.attn_mqa.scaling

    class LatentCausalAttention(torch.nn.Module):
        def forward(self, q, k, v, forward_batch=None, **_):  # (T, N, L+R), (T, 1, L+R), (T, 1, L)
            T, N, _ = q.shape
            k, v = (x.transpose(0, 1)[None].expand(1, N, T, -1) for x in (k, v))  # (1, N, T, L+R), (1, N, T, L)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale)
            return out[0].transpose(0, 1).reshape(T, -1)  # (T, N*L)

    def absorbed(forward_batch):
        attention.current_attention_backend = "torch_native"
        return AttnForwardMethod.MLA

    attention.attn_mqa = LatentCausalAttention()
    attention.dispatch_attn_forward_method = absorbed

    generator = torch.Generator().manual_seed(3)
    T = 96
    input_ids = torch.randint(0, config.vocab_size, (T,), generator=generator)  # (T,)
    positions = torch.arange(T) + 5  # (T,): not from 0, so a rope that ignores positions shows
    image_rows = torch.zeros(T, dtype=torch.bool)  # (T,): rows 20-31 of an image request's draft extend
    image_rows[20:32] = True
    input_ids[image_rows] = config.vocab_size - 1  # one placeholder id, as a record holds at image positions
    aux = torch.randn(T, config.num_aux_hidden_states * config.hidden_size, generator=generator) * 3  # (T, K*H)
    forward_batch = SimpleNamespace(
        mm_input_embeds=None, spec_info=SimpleNamespace(hidden_states=aux), attn_cp_metadata=None,
        forward_mode=SimpleNamespace(**{name: (lambda: False) for name in (
            "is_extend", "is_decode", "is_decode_or_idle", "is_target_verify", "is_draft_extend_v2", "is_idle")}),
        contains_mm_inputs=lambda: False)
    with torch.no_grad():
        to_logits, (sglang_next,) = served.model(input_ids, positions, forward_batch)  # (T, H) each
        sglang_logits = to_logits @ served.lm_head.weight.T  # (T, D)

    image_embeds = torch.randn(int(image_rows.sum()), config.hidden_size, generator=generator) * embedding.std()
    image_batch, image_inputs = image_draft_extend(forward_batch, embedding, input_ids, image_rows, image_embeds)
    with torch.no_grad():
        image_to_logits, (sglang_image_next,) = served.model(input_ids, positions, image_batch)  # (T, H) each
        sglang_image_logits = image_to_logits @ served.lm_head.weight.T  # (T, D)

    exported_config = json.loads((Path(export_dir) / "config.json").read_text())

    def ours(state: dict, images: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """images: the trainer's image inputs (input_embeds, input_embed_mask); None: every row embeds its id,
        the placeholder's embedding at the image rows (what a draft trained without the embeddings sees)."""
        draft = model.Eagle3Draft(model.Config.from_draft_config(exported_config))
        draft.load_state_dict({**{name: tensor.float() if tensor.is_floating_point() else tensor
                                  for name, tensor in state.items()}, "embed_tokens.weight": embedding})
        with torch.no_grad():
            next_hidden, logits = draft(draft.project(aux[None]), input_ids[None], positions[None],
                                        model.causal_mask(torch.zeros(1, T, dtype=torch.long)), **(images or {}))
        return next_hidden[0], logits[0]

    # Exports SGLang must not compute the same on: the nope and value rows of each head of kv_b_proj
    # exchanged (a mixed-up split; both 32 wide here), gate and up exchanged, and two captured states' norms.
    kv_b = weights["midlayer.self_attn.kv_b_proj.weight"]
    heads, nope = config.num_attention_heads, config.qk_nope_head_dim
    per_head = kv_b.view(heads, nope + config.v_head_dim, -1)
    sabotaged = {
        "kv_b_split_swapped": {**weights, "midlayer.self_attn.kv_b_proj.weight":
                               torch.cat([per_head[:, nope:], per_head[:, :nope]], dim=1).reshape(kv_b.shape)},
        "gate_up_swapped": {**weights, "midlayer.mlp.gate_proj.weight": weights["midlayer.mlp.up_proj.weight"],
                            "midlayer.mlp.up_proj.weight": weights["midlayer.mlp.gate_proj.weight"]},
    }
    if "fc_norm.0.weight" in weights:
        sabotaged["fc_norms_swapped"] = {**weights, "fc_norm.0.weight": weights["fc_norm.2.weight"],
                                         "fc_norm.2.weight": weights["fc_norm.0.weight"]}
    results = {name: compared(ours(state), sglang_next, sglang_logits)
               for name, state in (("exported", weights), *sabotaged.items())}
    images = {name: compared(ours(weights, inputs), sglang_image_next, sglang_image_logits)
              for name, inputs in (("captured", image_inputs), ("placeholder", None))}
    return {"unwritten": unwritten, "hot_ids_ok": hot_ids_ok, "num_positions": T,
            "has_fc_norm": served.model.fc_norm is not None, "norm_output": served.model.norm_output,
            "images": images, **results}


# SGLang runs the absorbed form (queries projected into the latent space, attention over 80-wide latents), the
# trainer the decompressed one (per-head keys and values): the same algebra, summed in another order. Measured:
# 7e-7 (eagle3) and 1.2e-6 (eagle3.1) of each output's scale; an export with two tensors exchanged differs by
# 0.2 to 0.7 of it.
MLA_RELATIVE_FP32_TOLERANCE = 1e-5


def same_mla_math(result: dict) -> bool:
    return same_math(result, MLA_RELATIVE_FP32_TOLERANCE)


@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])
def test_sglangs_mla_class_loads_the_export_and_computes_our_forward(random_target, tmp_path, options) -> None:
    from safetensors.torch import save_file

    from trainer.export import export

    target_dir = random_target("deepseek_v3")
    config = build_draft_config(target_dir, draft_vocab_size=256, layout="mla", overrides=options)
    draft = model.Eagle3Draft(model.Config.from_draft_config(config))
    torch.manual_seed(0)
    with torch.no_grad():  # weights far from the initialisation's, so every tensor matters
        for name, parameter in draft.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                parameter.uniform_(0.5, 1.5)
            elif name != "embed_tokens.weight":
                parameter.normal_(std=1.5 / parameter.shape[-1] ** 0.5)
        draft.d2t.copy_(torch.randperm(4096)[:256].sort().values - torch.arange(256))
        draft.t2d.zero_()[draft.d2t + torch.arange(256)] = True
    final = tmp_path / "final"
    final.mkdir()
    save_file(model.trainable_state_dict(draft), final / "model.safetensors")
    (final / "config.json").write_text(json.dumps(config))
    export(final, tmp_path / "draft")
    save_file({"embedding": torch.randn(4096, 128, generator=torch.Generator().manual_seed(4))},
              tmp_path / "embedding.safetensors")

    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_trainer_mla as t; "
              "print('RESULT', json.dumps(t.sglang_mla_check(sys.argv[2], sys.argv[3], int(sys.argv[4]))))")
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "draft"),
                           str(tmp_path / "embedding.safetensors"), str(free_port())],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    check = json.loads(lines[-1].removeprefix("RESULT "))
    print(check)
    assert check["unwritten"] == [] and check["hot_ids_ok"]
    assert check["has_fc_norm"] == bool(options) and check["norm_output"] == bool(options)
    # The exported bf16 values run in fp32 by both: the same math to fp32 rounding, relative to each output's scale.
    assert same_mla_math(check["exported"]), check["exported"]
    sabotaged = [name for name in check if name.endswith("_swapped")]
    assert len(sabotaged) == (3 if options else 2)
    for name in sabotaged:
        assert not same_mla_math(check[name]), (name, check[name])
    # On an image request SGLang's draft reads the target's input embeddings at the image rows: the trainer's
    # input_embeds there give its forward, the embedding of the rows' ids (a draft fed placeholders) does not.
    assert same_mla_math(check["images"]["captured"]), check["images"]
    assert not same_mla_math(check["images"]["placeholder"]), check["images"]
