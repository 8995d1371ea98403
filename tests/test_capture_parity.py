"""Captures equal HF transformers' states on every architecture family eagle-tap supports, through the real
SGLang server (CPU), plugin and collector.

Per architecture (the committed tiny Llama, a random Qwen3, a random DeepSeek-V3 with MLA and MoE, and a
random Kimi-K2.5: SGLang's `KimiK25ForConditionalGeneration`, a MoonViT tower and projector around the
DeepSeek-V3 language model, with its processor as remote code; its reference is transformers' DeepSeek-V3
on the `language_model.` weights), two servers with the plugin shipping to one collector:
- `fp32`: `--dtype float32`, the default capture layers the plugin picks; every aux slot and the final
  state within relative error 1e-4 of HF's fp32 forward, and every row within 1e-5 (which also checks
  that fp32 serving captures at all: its states need a codec other than bf16-split);
- `custom`: bf16 serving, capture layers set by hand (SGLang's own `--return-aux-hidden-state-layer-ids`,
  or `EAGLE_TAP_CAPTURE_LAYERS`); per-token median relative error <= 0.03.
HF's `hidden_states[c]` is the input of decoder layer c, `hidden_states[-1]` the post-norm final state,
so each slot must match its claimed layer, and match it far better than the layers next to it: this is
what pins down each SGLang class's layer-id rule (DeepSeek shifts ids only when the first is 1).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from capture_helpers import (aux_as_float, final_as_float, generate, generate_in_one_batch, median_token_error,
                             read_stats, relative_error, row_errors, stored_record, wait_for)
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

pytestmark = pytest.mark.sglang

FP32_REL_TOL = 1e-4
FP32_ROW_REL_TOL = 1e-5  # every row (token) of an fp32 record; measured 4-6e-7 on the tiny Kimi-K2.5
BF16_MEDIAN_REL_TOL = 0.03
NEIGHBOUR_MARGIN = 20  # a neighbouring layer must be at least this many times further off than the claimed one


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    arch: str
    default_layers: tuple[int, ...]
    """What the plugin must pick for 8 layers: [3, L//2 + 1, L - 2]."""
    custom_args: tuple[str, ...] = ()
    custom_env: tuple[tuple[str, str], ...] = ()
    custom_layers: tuple[int, ...]
    """The capture layers the custom server's setting means for this architecture's SGLang class."""
    server_args: tuple[str, ...] = ()
    """Flags both servers need (Kimi-K2.5's processor is remote code of its checkpoint)."""


def _hand_ids(*ids: int) -> tuple[str, ...]:
    return ("--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *map(str, ids))


CASES = [
    Case(arch="llama", default_layers=(3, 5, 6), custom_env=(("EAGLE_TAP_CAPTURE_LAYERS", "1,4,7"),),
         custom_layers=(1, 4, 7)),
    Case(arch="qwen3", default_layers=(3, 5, 6), custom_args=_hand_ids(0, 2, 6), custom_layers=(1, 3, 7)),
    # Ids 3 5 6 (the default) are taken as they are; a first id of 1 shifts every id by one.
    Case(arch="deepseek_v3", default_layers=(3, 5, 6), custom_args=_hand_ids(1, 3, 5), custom_layers=(2, 4, 6)),
    # The wrapper hands the ids to its language model: DeepSeek's rule.
    # Its custom server also samples all live traffic: the image test sends it an untagged image request.
    Case(arch="kimi_k25", default_layers=(3, 5, 6), custom_args=_hand_ids(1, 3, 5), custom_layers=(2, 4, 6),
         custom_env=(("EAGLE_TAP_LIVE_SAMPLE_RATE", "1.0"),), server_args=("--trust-remote-code",)),
]


def reference_model(arch: str, model_dir: Path) -> torch.nn.Module:
    """transformers' fp32 model of the target; for Kimi-K2.5, DeepSeek-V3 built from `text_config` and loaded
    with the `language_model.` weights (transformers has no Kimi-K2.5 class; the tower plays no part in text)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    if arch != "kimi_k25":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    import json

    from safetensors.torch import load_file

    text_config = json.loads((model_dir / "config.json").read_text())["text_config"]
    text_config.pop("model_type", None)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**text_config), dtype=torch.float32)
    weights = {name.removeprefix("language_model."): tensor.float()
               for name, tensor in load_file(model_dir / "model.safetensors").items()
               if name.startswith("language_model.")}
    model.load_state_dict(weights, strict=True)
    return model.eval()


@dataclasses.dataclass(kw_only=True)
class Target:
    case: Case
    hf_model: torch.nn.Module
    fp32: SGLangServer
    fp32_spool: Path
    custom: SGLangServer


def _start(model_dir, tmp_path_factory, collector, *, name: str, args=(), env=()) -> tuple[SGLangServer, Path]:
    spool = tmp_path_factory.mktemp(f"spool-{name}")
    server = SGLangServer(ServerConfig(
        model_path=model_dir, extra_args=tuple(args), log_path=tmp_path_factory.mktemp(name) / "server.log",
        env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool), **dict(env)}))
    server.start()
    return server, spool


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.arch)
def target(request, random_target, collector, tmp_path_factory):
    """One architecture's two capture servers; stopped before the next architecture's start."""
    case: Case = request.param
    model_dir = TINY_MODEL_DIR if case.arch == "llama" else random_target(case.arch)
    hf_model = reference_model(case.arch, model_dir)
    servers = []
    try:
        fp32, fp32_spool = _start(model_dir, tmp_path_factory, collector, name=f"{case.arch}-fp32",
                                  args=("--dtype", "float32", *case.server_args))
        servers.append(fp32)
        custom, _ = _start(model_dir, tmp_path_factory, collector, name=f"{case.arch}-custom",
                           args=(*case.server_args, *case.custom_args), env=case.custom_env)
        servers.append(custom)
        yield Target(case=case, hf_model=hf_model, fp32=fp32, fp32_spool=fp32_spool, custom=custom)
    finally:
        for server in servers:
            server.stop()


def hf_hidden_states(hf_model, input_ids: list[int]) -> np.ndarray:
    """(L + 1, T, H): [c] = input of decoder layer c for c < L, [L] = final state after the norm."""
    with torch.no_grad():
        hidden = hf_model(torch.tensor([input_ids]), output_hidden_states=True).hidden_states
    return torch.stack([state[0] for state in hidden]).float().numpy()



def layer_errors(record, hidden: np.ndarray, metric) -> tuple[list[float], list[float], float]:
    """Per slot: error against its claimed layer and against the closest other layer; then the final's error."""
    aux = aux_as_float(record)  # (T, K, H)
    claimed, nearest_other = [], []
    for slot, layer in enumerate(record.capture_layers):
        errors = [metric(aux[:, slot], hidden[index]) for index in range(len(hidden))]
        claimed.append(errors[layer])
        nearest_other.append(min(error for index, error in enumerate(errors) if index != layer))
    return claimed, nearest_other, metric(final_as_float(record), hidden[-1])


def worst_row_error(record, hidden: np.ndarray) -> float:
    """The largest relative error of one row (token) over the claimed layers and the final state."""
    aux = aux_as_float(record)  # (T, K, H)
    errors = [row_errors(aux[:, slot], hidden[layer]).max() for slot, layer in enumerate(record.capture_layers)]
    return float(max(*errors, row_errors(final_as_float(record), hidden[-1]).max()))


def check_record(record, hidden: np.ndarray, *, layers: tuple[int, ...], metric, tolerance: float, what: str,
                 row_tolerance: float | None = None) -> str:
    """Assert the record holds `layers` equal to HF's within tolerance (and each row within row_tolerance, if
    given); return a line of the measured errors."""
    assert record.capture_layers == layers, what
    claimed, nearest_other, final_error = layer_errors(record, hidden, metric)
    assert max(claimed) <= tolerance and final_error <= tolerance, (what, claimed, final_error)
    for slot, (own, other) in enumerate(zip(claimed, nearest_other)):
        assert other > NEIGHBOUR_MARGIN * max(own, tolerance / NEIGHBOUR_MARGIN), (what, slot, own, other)
    worst_row = worst_row_error(record, hidden)
    assert row_tolerance is None or worst_row < row_tolerance, (what, worst_row)
    return (f"{what}: " + ", ".join(f"layer {layer} {own:.2e} (next best {other:.2f})"
                                    for layer, own, other in zip(layers, claimed, nearest_other))
            + f", final {final_error:.2e}, worst row {worst_row:.2e}")


def random_ids(seed: int, num_tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(7, 4096, num_tokens).tolist()  # past the special tokens


def test_fp32_capture_of_the_default_layers_equals_transformers(target, collector):
    arch = target.case.arch
    input_ids = random_ids(1, 45)
    generate(target.fp32, input_ids, record_id=f"{arch}-fp32")
    record = stored_record(collector, f"{arch}-fp32")
    assert record.dtype == "float32" and record.token_ids.tolist() == input_ids
    print(check_record(record, hf_hidden_states(target.hf_model, input_ids), layers=target.case.default_layers,
                       metric=relative_error, tolerance=FP32_REL_TOL, row_tolerance=FP32_ROW_REL_TOL,
                       what=f"{arch} fp32 default"))
    log = target.fp32.log_path.read_text(errors="replace")
    assert "float32 states, codec zstd:1" in log  # the plugin says which codec it chose for fp32 states


def test_bf16_capture_of_hand_set_layers_equals_transformers(target, collector):
    arch = target.case.arch
    input_ids = random_ids(2, 38)
    generate(target.custom, input_ids, record_id=f"{arch}-bf16-custom")
    record = stored_record(collector, f"{arch}-bf16-custom")
    assert record.dtype == "bfloat16"
    print(check_record(record, hf_hidden_states(target.hf_model, input_ids), layers=target.case.custom_layers,
                       metric=median_token_error, tolerance=BF16_MEDIAN_REL_TOL, what=f"{arch} bf16 custom"))


def test_concurrent_requests_of_different_lengths_split_into_their_own_records(target, collector):
    """Several requests in one EXTEND forward: each record holds exactly its own rows."""
    arch = target.case.arch
    log_before = len(target.fp32.log_path.read_text(errors="replace"))
    sent_before = read_stats(target.fp32_spool).get("sent", 0)
    lengths = [5, 31, 12, 64, 3, 47, 20, 9]
    requests = {f"{arch}-batch-{index}": random_ids(100 + index, length) for index, length in enumerate(lengths)}
    assert len(generate_in_one_batch(target.fp32, requests)) == len(requests)

    def prefill_batch_sizes() -> list[int]:
        log = target.fp32.log_path.read_text(errors="replace")[log_before:]
        return [int(size) for size in re.findall(r"Prefill batch.*?#new-seq: (\d+)", log)]

    # the scheduler logs a prefill batch after it streams the batch's outputs: a one-token answer can come back first
    batch_sizes = wait_for(lambda: (sizes := prefill_batch_sizes()) and sum(sizes) >= len(requests) and sizes, 30,
                           "the scheduler's prefill batch lines")
    assert max(batch_sizes) >= 2, f"no prefill batch held more than one request: {batch_sizes}"
    hf_model = target.hf_model
    for record_id, ids in requests.items():
        record = stored_record(collector, record_id)
        assert record.token_ids.tolist() == ids, record_id
        check_record(record, hf_hidden_states(hf_model, ids), layers=target.case.default_layers,
                     metric=relative_error, tolerance=FP32_REL_TOL, row_tolerance=FP32_ROW_REL_TOL,
                     what=record_id)
    stats = wait_for(lambda: (s := read_stats(target.fp32_spool)).get("sent", 0) >= sent_before + len(requests) and s, 30,
                     "the plugin's stats")
    assert stats["dropped"] == {}


def test_fp32_greedy_answers_equal_transformers(target):
    """What the server answers is what the reference model answers: the served class runs the same weights."""
    input_ids = random_ids(3, 29)
    served = generate(target.fp32, input_ids, max_new_tokens=12)["output_ids"]
    with torch.no_grad():
        reference = target.hf_model.generate(torch.tensor([input_ids]), max_new_tokens=12, do_sample=False,
                                             eos_token_id=None, pad_token_id=2)[0, len(input_ids):].tolist()
    assert served == reference, (target.case.arch, served, reference)


def kimi_image_features(model_dir: Path, image: Path) -> np.ndarray:
    """(features, H) fp32: transformers' own Kimi-K2.5 vision tower and projector (`Kimi_K25Model.get_image_features`,
    an implementation independent of SGLang's) on the image as the checkpoint's processor prepares it, with the
    checkpoint's weights. transformers' config names the tower's settings otherwise (Kimi-K2.6's layout): they are
    mapped from the checkpoint's `vision_config`."""
    import json

    from PIL import Image
    from transformers import AutoProcessor
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    raw = json.loads((model_dir / "config.json").read_text())
    vision = raw["vision_config"]
    config = Kimi_K25Config(
        text_config=raw["text_config"], tie_word_embeddings=False, image_token_id=raw["media_placeholder_token_id"],
        projection_hidden_size=vision["vt_hidden_size"], projection_layer_norm_eps=vision["projector_ln_eps"],
        vision_config={"patch_size": vision["patch_size"], "pos_emb_height": vision["init_pos_emb_height"],
                       "pos_emb_width": vision["init_pos_emb_width"], "pos_emb_time": vision["init_pos_emb_time"],
                       "num_attention_heads": vision["vt_num_attention_heads"],
                       "num_hidden_layers": vision["vt_num_hidden_layers"], "hidden_size": vision["vt_hidden_size"],
                       "intermediate_size": vision["vt_intermediate_size"],
                       "merge_kernel_size": vision["merge_kernel_size"]})
    model = Kimi_K25ForConditionalGeneration.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    processed = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True).image_processor.preprocess(
        [{"type": "image", "image": Image.open(image).convert("RGB")}], return_tensors="pt")
    with torch.no_grad():
        features = model.model.get_image_features(processed["pixel_values"].float(),
                                                  image_grid_thw=processed["grid_thws"]).pooler_output
    return features[0].numpy()


@pytest.mark.for_params("kimi_k25")  # the one target here that takes images
def test_a_tagged_image_request_is_captured_with_the_input_embeddings_the_language_model_read(target, collector,
                                                                                           random_target, tmp_path):
    """Kimi-K2.5's tower runs on SGLang's CPU path. The record holds the ids as the server expanded them (the
    placeholder once per image feature), marks the image positions, holds the target's input embeddings
    there (equal to transformers' Kimi-K2.5 vision tower and projector on the same image, fp32), and its states
    equal transformers' DeepSeek-V3 run on exactly those embeddings (fp32): wrong rows
    of embeddings, or a placeholder's embedding in their place, would give other states. The same image as live
    traffic of the bf16 server (captured in one pass), and in a conversation fired by `eagle-tap fire`, as
    is and regenerated: the same embeddings, the answer's span moved past the image."""
    import base64
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from capture_format import float32_from_bfloat16_bits
    from client.conversations import read_conversations
    from client.spans import ChatTokenizer

    from capture_format.tag import CaptureTag
    from eagle_tap.serve.http_api import post_json

    media_pad, num_features = 4096, 6  # a 56x70 image: 4x6 patches, 2x3 merged features
    tokenizer = AutoTokenizer.from_pretrained(random_target("kimi_k25"), trust_remote_code=True)
    expanded = tokenizer("<|user|>look" + "<|media_pad|>" * num_features + "here<|end|><|assistant|>",
                         add_special_tokens=False)["input_ids"]
    num_tokens = len(expanded)
    image = Path(__file__).parent / "fixtures" / "images" / "noise-56x70.png"  # scripts/make_test_images.py
    num_sent = num_tokens - (num_features - 1)  # a tag counts each image as one token, its placeholder
    tag = CaptureTag(record_id="kimi-image", sample_id="kimi-image", loss_spans=((num_sent - 3, num_sent),),
                     metadata={})
    answer = post_json(f"{target.fp32.url}/generate", {
        "text": "<|user|>look<|media_pad|>here<|end|><|assistant|>",
        "image_data": ["data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "custom_params": tag.to_custom_params()}})
    assert answer["meta_info"]["image_tokens"] == num_features
    record = stored_record(collector, "kimi-image")
    assert record.schema_version == 2 and record.token_ids.tolist() == expanded
    first = expanded.index(media_pad)
    assert record.input_embed_spans == ((first, first + num_features),)
    assert record.loss_spans == ((num_tokens - 3, num_tokens),)  # moved past the image's other 5 tokens
    assert record.input_embeds.shape == (num_features, record.hidden_size) and record.dtype == "float32"
    hf_model = target.hf_model
    with torch.no_grad():
        embeds = hf_model.get_input_embeddings()(torch.tensor([expanded]))  # (1, T, H)
        placeholder = embeds[0, first].clone()
        embeds[0, first : first + num_features] = torch.from_numpy(np.array(record.input_embeds))
        hidden = hf_model(inputs_embeds=embeds, output_hidden_states=True).hidden_states
    reference = torch.stack([state[0] for state in hidden]).float().numpy()  # (L + 1, T, H)
    print(check_record(record, reference, layers=target.case.default_layers, metric=relative_error,
                       tolerance=FP32_REL_TOL, row_tolerance=FP32_ROW_REL_TOL, what="kimi image fp32"))
    assert not torch.allclose(placeholder, torch.from_numpy(np.array(record.input_embeds[0])), atol=1e-3)
    # The embeddings themselves: transformers' Kimi-K2.5 tower and projector on the same image and weights.
    tower = kimi_image_features(random_target("kimi_k25"), image)  # (6, H)
    tower_error = relative_error(np.array(record.input_embeds), tower)
    print(f"kimi image fp32: input embeddings against transformers' vision tower and projector {tower_error:.2e}")
    assert tower_error < 1e-5, tower_error
    other = kimi_image_features(random_target("kimi_k25"), image.with_name("gradient-84x56.png"))  # also 6 features
    assert relative_error(np.array(record.input_embeds), other) > 0.1  # the check tells images apart
    # Live: an untagged image request to the bf16 server that samples all traffic is captured in one pass.
    image_data = ["data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()]
    post_json(f"{target.custom.url}/generate", {
        "text": "<|user|>look<|media_pad|>here<|end|><|assistant|>", "image_data": image_data,
        "rid": "kimi-live-image", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    live = stored_record(collector, "live-kimi-live-image")
    assert live.token_ids.tolist()[:num_tokens] == expanded and live.num_tokens == num_tokens + 3
    assert live.input_embed_spans == record.input_embed_spans and live.loss_spans == ((num_tokens, num_tokens + 3),)
    live_error = median_token_error(float32_from_bfloat16_bits(live.input_embeds), np.array(record.input_embeds))
    print(f"kimi live image bf16: input embeddings' median token error against the fp32 record {live_error:.2e}")
    assert live.dtype == "bfloat16" and live_error < 0.01, live_error
    stats = wait_for(lambda: (s := read_stats(target.fp32_spool)).get("captured_images") and s, 30,
                     "the plugin's count of image captures")
    assert stats["captured_images"] == 1 and "tagged_not_token_ids" not in stats["dropped"]
    generate(target.fp32, random_ids(4, 9), record_id="kimi-after-image")  # a later text record is schema 1
    after = stored_record(collector, "kimi-after-image")
    assert after.token_ids.tolist() == random_ids(4, 9) and after.schema_version == 1

    data = tmp_path / "images.jsonl"
    data.write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is "},
                                     {"type": "image_url", "image_url": {"url": str(image)}}]},
        {"role": "assistant", "content": "a picture of noise"}]}) + "\n")
    fired = subprocess.run([sys.executable, "-m", "eagle_tap.cli", "fire", "--server", target.fp32.url,
                            "--collector", collector.url, "--data", str(data), "--out", str(tmp_path / "run"),
                            "--run-id", "kimi-fire", "--tokenizer", str(random_target("kimi_k25")),
                            "--trust-remote-code", "--progress", "off"], capture_output=True, text=True, timeout=300)
    assert fired.returncode == 0, fired.stdout[-2000:] + fired.stderr[-2000:]
    (conversation,) = read_conversations(data)
    chat = ChatTokenizer.from_pretrained(random_target("kimi_k25"), trust_remote_code=True)
    sent = chat.tokenize_conversation(conversation.messages)  # one placeholder for the image
    fire_record = stored_record(collector, f"kimi-fire:{conversation.key}:conv")
    at = sent.input_ids.index(media_pad)
    assert fire_record.token_ids.tolist() == [*sent.input_ids[:at], *[media_pad] * num_features,
                                              *sent.input_ids[at + 1 :]]
    assert fire_record.input_embed_spans == ((at, at + num_features),)
    assert fire_record.loss_spans == tuple((start + num_features - 1, end + num_features - 1)
                                           for start, end in sent.spans)
    np.testing.assert_array_equal(fire_record.input_embeds, record.input_embeds)  # one image, one tower output

    # --regenerate: the target answers with the image in its prompt, captured in that one pass.
    regenerated = subprocess.run([sys.executable, "-m", "eagle_tap.cli", "fire", "--server", target.fp32.url,
                                  "--collector", collector.url, "--data", str(data), "--out", str(tmp_path / "regen"),
                                  "--run-id", "kimi-regen", "--regenerate", "--temperature", "0",
                                  "--max-new-tokens", "4", "--tokenizer", str(random_target("kimi_k25")),
                                  "--trust-remote-code", "--progress", "off"], capture_output=True, text=True,
                                 timeout=300)
    assert regenerated.returncode == 0, regenerated.stdout[-2000:] + regenerated.stderr[-2000:]
    regen_record = stored_record(collector, f"kimi-regen:{conversation.key}:conv")
    sent_prompt = chat.render_ids(conversation.messages[:1], add_generation_prompt=True)  # one placeholder
    prompt_length = len(sent_prompt) + num_features - 1
    assert regen_record.token_ids.tolist()[: at + num_features] == fire_record.token_ids.tolist()[: at + num_features]
    assert regen_record.input_embed_spans == ((at, at + num_features),)
    assert regen_record.loss_spans == ((prompt_length, regen_record.num_tokens),)  # the generated answer
    np.testing.assert_array_equal(regen_record.input_embeds, record.input_embeds)


def random_mla_draft(target_dir: Path, out: Path) -> Path:
    """An exported MLA draft (`draft-config --layout mla`) of the target with its seed-0 initialisation, fp32."""
    import json

    from safetensors.torch import save_file

    from trainer import model
    from trainer.draft_config import build_draft_config
    from trainer.export import export

    config = build_draft_config(target_dir, draft_vocab_size=256, layout="mla", overrides={"torch_dtype": "float32"})
    torch.manual_seed(0)
    draft = model.Eagle3Draft(model.Config.from_draft_config(config))
    with torch.no_grad():
        draft.t2d.zero_()[torch.arange(256)] = True  # d2t 0: the draft predicts the first 256 ids
    final = out / "final"
    final.mkdir(parents=True)
    save_file(model.trainable_state_dict(draft), final / "model.safetensors")
    (final / "config.json").write_text(json.dumps(config))
    return export(final, out / "draft")


@pytest.mark.for_params("kimi_k25")
def test_a_kimi_replica_serving_an_mla_draft_stores_the_image_record_a_draftless_one_stores(
        target, collector, random_target, start_sglang_for_test, tmp_path):
    """Kimi-K2.5 serving an EAGLE-3 draft of the MLA layout (SGLang's Eagle3DeepseekV2ForCausalLM, reading the
    target's input embeddings at the image positions): the same tagged image request stores the record the
    draftless fp32 server stores (ids, image positions, input embeddings, states), and the same answer."""
    import base64

    from capture_format.tag import CaptureTag
    from eagle_tap.serve.draft import SpeculativeConfig
    from eagle_tap.serve.http_api import post_json
    from sglang_patch.speculative import METADATA_KEY

    model_dir = random_target("kimi_k25")
    draft = random_mla_draft(model_dir, tmp_path / "mla")
    spool = tmp_path / "spool"
    served = start_sglang_for_test(model_dir, extra_args=(
        "--dtype", "float32", "--trust-remote-code",
        *SpeculativeConfig(draft_dir=draft, num_steps=3).server_args()),
        env={"EAGLE_TAP_COLLECTOR_URL": collector.url, "EAGLE_TAP_SPOOL_DIR": str(spool)})
    image = Path(__file__).parent / "fixtures" / "images" / "gradient-84x56.png"  # 6x4 patches: 6 features
    text = "<|user|>what is<|media_pad|>this<|end|><|assistant|>"
    answers, records = {}, {}
    for name, server in (("draftless", target.fp32), ("mla-draft", served)):
        tag = CaptureTag(record_id=f"kimi-image-{name}", sample_id=f"kimi-image-{name}", loss_spans=(), metadata={})
        answers[name] = post_json(f"{server.url}/generate", {
            "text": text, "image_data": ["data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "custom_params": tag.to_custom_params()}})
        records[name] = stored_record(collector, f"kimi-image-{name}")
    reference, record = records["draftless"], records["mla-draft"]
    assert answers["mla-draft"]["output_ids"] == answers["draftless"]["output_ids"]
    assert answers["mla-draft"]["meta_info"]["spec_verify_ct"] > 0 and answers["mla-draft"]["meta_info"]["image_tokens"] == 6
    assert record.schema_version == reference.schema_version == 2
    assert record.token_ids.tolist() == reference.token_ids.tolist()
    assert record.input_embed_spans == reference.input_embed_spans and len(record.input_embed_spans) == 1
    assert record.num_states == reference.num_states and record.num_tokens == reference.num_tokens
    np.testing.assert_allclose(np.asarray(record.input_embeds), np.asarray(reference.input_embeds), rtol=0, atol=1e-6)
    for states in (aux_as_float, final_as_float):
        errors = row_errors(states(record), states(reference))
        assert errors.max() < FP32_REL_TOL, errors.max()
    assert METADATA_KEY in record.metadata and METADATA_KEY not in reference.metadata
    stats = wait_for(lambda: (s := read_stats(spool)).get("captured_images") and s, 30,
                     "the plugin's count of image captures")
    assert stats.get("dropped", {}) == {} and stats.get("hook_errors", 0) == 0 and stats["captured_images"] == 1
