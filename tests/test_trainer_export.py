"""Export: SGLang's own LlamaForCausalLMEagle3 loads the folder and computes our draft's forward (on text and on an
image request's input embeddings); refusals; config."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from eagle_tap.cli import main
from eagle_tap.serve.sglang_server import free_port

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def trained_run() -> Path:
    """A short training run on the tiny model (out_dir with config.json and final/), built once per process."""
    from trainer.config_io import config_from_dict
    from trainer.config import Config
    from trainer.train import train

    inputs = trainer_data.prepared_inputs()
    out_dir = Path(tempfile.mkdtemp(prefix="eagle-tap-export-run-"))
    settings = {
        "target": str(inputs["target"]), "draft_config": str(inputs["draft_config"]), "vocab": str(inputs["vocab"]),
        "out_dir": str(out_dir), "data": {"shards": str(inputs["train_shards"]), "batch_size": 8, "max_length": 256},
        "objective": {"ttt_steps": 3}, "optimizer": {"learning_rate": 3e-3, "warmup_steps": 10},
        "num_steps": 40, "log_every": 10, "checkpoint_every": 0, "num_threads": 1, "progress_bar": False,
    }
    train(config_from_dict(Config, settings))
    return out_dir


def test_config_and_tensors_of_the_exported_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run = trained_run()
    out = tmp_path / "draft"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_tap"]["capture_layers"] == [3, 5, 6]  # the tiny Llama's default capture layers
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # SGLang shifts Llama ids by +1
    assert config["vocab_size"] == 4096 and config["draft_vocab_size"] == 512 and config["tie_word_embeddings"] is False
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "max_position_embeddings", "torch_dtype"):
        assert key in config, key
    weights = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in weights and weights["fc.weight"].dtype == torch.bfloat16
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    card = (out / "README.md").read_text()
    assert "[3, 5, 6]" in card and "[2, 4, 5]" in card and "Vocab coverage" in card
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 2  # never overwrites a folder


@pytest.mark.parametrize("change, message", [
    (lambda weights: weights.pop("midlayer.self_attn.k_proj.weight"),
     "lacks tensor 'midlayer.self_attn.k_proj.weight'"),
    (lambda weights: weights.update({"lm_head.weight": weights["lm_head.weight"][:-1]}),
     r"tensor 'lm_head.weight' has shape \(511, 128\); the config implies \(512, 128\)"),
    (lambda weights: weights.pop("d2t"), "lacks tensor 'd2t'"),
])
def test_the_exporter_refuses_a_missing_tensor_or_a_wrong_shape(tmp_path: Path, change, message) -> None:
    from safetensors.torch import load_file, save_file

    final = tmp_path / "run" / "final"
    shutil.copytree(trained_run() / "final", final)
    weights = load_file(final / "model.safetensors")
    change(weights)
    save_file(weights, final / "model.safetensors")
    from trainer.export import export

    with pytest.raises(ValueError, match=message):
        export(final, tmp_path / "draft")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # nothing written, no temp folder left


def compared(ours_out: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, logits: torch.Tensor) -> dict:
    """Our draft's (next hidden, logits) against SGLang's: the largest differences and each output's scale."""
    return {"max_out_diff": (ours_out[0] - out).abs().max().item(), "out_scale": out.abs().max().item(),
            "max_logit_diff": (ours_out[1] - logits).abs().max().item(), "logit_scale": logits.abs().max().item(),
            "argmax_agreement": (ours_out[1].argmax(-1) == logits.argmax(-1)).float().mean().item()}


def image_draft_extend(text_batch, embedding: torch.Tensor, input_ids: torch.Tensor, image_rows: torch.Tensor,
                       image_embeds: torch.Tensor) -> tuple[object, dict]:
    """(SGLang's forward batch of an image request's draft extend after the prefill, the trainer's image inputs),
    from text_batch (the stand-in batch of the same rows as text). SGLang's mm_input_embeds holds the target's
    input embeddings rotated by one like the ids, other embeddings (the vision tower's) at the rows whose next
    token is an image position, and the draft class embeds the appended next token (the last row) itself.
    embedding (V, H); input_ids (T,); image_rows (T,) bool; image_embeds (n, H), one per image row."""
    from types import SimpleNamespace

    mm_input_embeds = embedding[input_ids].clone()  # (T, H)
    mm_input_embeds[image_rows] = image_embeds
    batch = SimpleNamespace(**{
        **vars(text_batch), "mm_input_embeds": mm_input_embeds, "contains_mm_inputs": lambda: True,
        "extend_start_loc": torch.tensor([0]), "extend_seq_lens": torch.tensor([len(input_ids)]),
        "forward_mode": SimpleNamespace(**{**vars(text_batch.forward_mode), "is_extend": lambda: True})})
    embeds = torch.zeros(len(input_ids), embedding.shape[1])  # (T, H)
    embeds[image_rows] = image_embeds
    return batch, {"input_embeds": embeds[None], "input_embed_mask": image_rows[None]}


def sglang_check(export_dir: str, record_shards: str, port: int) -> dict:
    """Run in a fresh process: load the folder with SGLang's class and compare its forward with our draft's."""
    from eagle_tap.serve.sglang_server import use_cpu_stand_ins_in_this_process

    use_cpu_stand_ins_in_this_process()
    import os
    from types import SimpleNamespace

    import torch.nn.functional as F
    from safetensors.torch import load_file
    from sglang.test.layer_ut_utils import init_single_process_dist
    from transformers import LlamaConfig

    import capture_format as cf
    from trainer import data, model
    from trainer.target_weights import load_embedding_and_lm_head

    os.environ["MASTER_PORT"] = str(port)
    init_single_process_dist(master_port=port)
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(export_dir)
    served = LlamaForCausalLMEagle3(config).float()
    with torch.no_grad():
        for parameter in served.parameters():
            parameter.fill_(float("nan"))  # so a parameter load_weights never wrote shows
    weights = load_file(Path(export_dir) / "model.safetensors")
    embedding, _ = load_embedding_and_lm_head(trainer_data.TINY_MODEL_DIR, tie_word_embeddings=False)
    served.load_weights(list(weights.items()) + [("embed_tokens.weight", embedding)])
    draft_vocab = config.draft_vocab_size
    unwritten = [name for name, parameter in served.named_parameters()
                 if torch.isnan(parameter[:draft_vocab] if name == "lm_head.weight" else parameter).any()]
    hot_ids_ok = torch.equal(served.get_hot_token_id(), torch.arange(draft_vocab) + weights["d2t"])

    class CausalAttention(torch.nn.Module):  # stands in for RadixAttention (paged KV cache, attention backend)
        def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

        def forward(self, q, k, v, forward_batch=None, **_):
            T = q.shape[0]
            q = q.view(T, self.heads, self.head_dim).transpose(0, 1)[None]  # (1, N, T, E)
            k, v = (x.view(T, self.kv_heads, self.head_dim).transpose(0, 1)[None] for x in (k, v))  # (1, G, T, E)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (1, N, T, E)
            return out[0].transpose(0, 1).reshape(T, -1)  # (T, N*E)

    served.model.layers[0].self_attn.attn = CausalAttention(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim)

    with cf.ShardDirectory(record_shards) as shards:
        record = shards.read_record(next(shards.iter_index()))
    rows = {name: value[:128] for name, value in data.shift_record(record).items()}
    aux = torch.from_numpy(rows["aux"].astype("float32"))  # (T, K*H)
    input_ids = torch.from_numpy(rows["input_ids"])  # (T,)
    positions = torch.arange(len(input_ids))  # (T,)
    forward_batch = SimpleNamespace(
        mm_input_embeds=None, spec_info=SimpleNamespace(hidden_states=aux),
        forward_mode=SimpleNamespace(is_extend=lambda: False, is_draft_extend_v2=lambda: False),
        contains_mm_inputs=lambda: False)
    with torch.no_grad():
        to_logits, (sglang_out,) = served.model(input_ids, positions, forward_batch)  # (T, H) each
        sglang_logits = to_logits @ served.lm_head.weight[:draft_vocab].T  # (T, D)

    image_rows = torch.zeros(len(input_ids), dtype=torch.bool)  # (T,): rows 20-31 of the record are image rows
    image_rows[20:32] = True
    image_embeds = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(7)) * embedding.std()
    image_batch, image_inputs = image_draft_extend(forward_batch, embedding.float(), input_ids, image_rows, image_embeds)
    with torch.no_grad():
        image_to_logits, (sglang_image_out,) = served.model(input_ids, positions, image_batch)  # (T, H) each
        sglang_image_logits = image_to_logits @ served.lm_head.weight[:draft_vocab].T  # (T, D)

    def ours(state: dict, images: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """images: the trainer's image inputs (input_embeds, input_embed_mask); None: every row embeds its id."""
        exported_config = json.loads((Path(export_dir) / "config.json").read_text())
        draft = model.Eagle3Draft(model.Config.from_draft_config(exported_config))
        draft.load_state_dict({**{name: tensor.float() if tensor.is_floating_point() else tensor
                                  for name, tensor in state.items()}, "embed_tokens.weight": embedding.float()})
        with torch.no_grad():
            out, logits = draft(draft.fc(aux[None]), input_ids[None], positions[None],
                                model.causal_mask(torch.zeros(1, len(input_ids), dtype=torch.long)), **(images or {}))
        return out[0], logits[0]

    trained = load_file(Path(export_dir).parent / "run-final.safetensors")  # the fp32 weights before export
    # Two exports with one pair of same-shaped tensors exchanged: what a wrong name or layout would load.
    kv_swapped = {**weights, "midlayer.self_attn.k_proj.weight": weights["midlayer.self_attn.v_proj.weight"],
                  "midlayer.self_attn.v_proj.weight": weights["midlayer.self_attn.k_proj.weight"]}
    gate_up_swapped = {**weights, "midlayer.mlp.gate_proj.weight": weights["midlayer.mlp.up_proj.weight"],
                       "midlayer.mlp.up_proj.weight": weights["midlayer.mlp.gate_proj.weight"]}
    results = {name: compared(ours(state), sglang_out, sglang_logits)
               for name, state in (("exported", weights), ("trained_fp32", trained),
                                   ("kv_swapped", kv_swapped), ("gate_up_swapped", gate_up_swapped))}
    results["image_captured"] = compared(ours(weights, image_inputs), sglang_image_out, sglang_image_logits)
    results["image_placeholder"] = compared(ours(weights), sglang_image_out, sglang_image_logits)
    return {"unwritten": unwritten, "hot_ids_ok": hot_ids_ok, "num_positions": len(input_ids), **results}


# About 8 fp32 steps (epsilon 1.2e-7). Measured: the exported weights agree within 2e-8 (outputs) and 7e-8
# (logits) of their scales; an export with two tensors exchanged differs by 2e-5 and 6e-5 or more.
RELATIVE_FP32_TOLERANCE = 1e-6


def same_math(result: dict, tolerance: float = RELATIVE_FP32_TOLERANCE) -> bool:
    """Both forwards agree to fp32 rounding, each output relative to its own scale."""
    return (result["max_out_diff"] <= tolerance * result["out_scale"]
            and result["max_logit_diff"] <= tolerance * result["logit_scale"])


def test_sglangs_own_eagle3_class_loads_the_folder_and_computes_our_forward(tmp_path: Path) -> None:
    run = trained_run()
    out = tmp_path / "draft"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    shutil.copy(run / "final" / "model.safetensors", tmp_path / "run-final.safetensors")
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_trainer_export as t; "
              "print('RESULT', json.dumps(t.sglang_check(sys.argv[2], sys.argv[3], int(sys.argv[4]))))")
    heldout = trainer_data.prepared_inputs()["heldout_shards"]
    result = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(out), str(heldout), str(free_port())],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240, env={**__import__("os").environ,
                                                                         "OMP_NUM_THREADS": "1"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    check = json.loads(lines[-1].removeprefix("RESULT "))
    print(check)
    assert check["unwritten"] == [] and check["hot_ids_ok"] and check["num_positions"] > 50
    # Same weights (the exported bf16 values, run in fp32 by both): the same math to fp32 rounding, which is
    # relative to each output's scale (the pre-norm residual reaches 1e4 here, where one fp32 step is 2^-9;
    # which CPU kernels run decides the last bits).
    assert same_math(check["exported"]), check["exported"]
    # The check can fail: an export with two same-shaped tensors exchanged is far outside it.
    assert not same_math(check["kv_swapped"]) and not same_math(check["gate_up_swapped"])
    # On an image request SGLang's draft reads the target's input embeddings at the image rows: the trainer's
    # input_embeds there give its forward; the embedding of the rows' ids (a draft fed placeholders) does not.
    assert same_math(check["image_captured"]), check["image_captured"]
    assert not same_math(check["image_placeholder"]), check["image_placeholder"]
    # The trained fp32 weights against SGLang on the exported bf16 ones: within bf16 tolerance.
    assert check["trained_fp32"]["max_logit_diff"] < 0.02 * check["trained_fp32"]["logit_scale"] + 0.05
