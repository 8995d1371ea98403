"""The trainer feeds the draft what SGLang feeds it on an image request: at an image position the target's own
input embedding (captured in the record), shifted by one like the ids; elsewhere its embedding of the id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import capture_format as cf
from trainer import data, evaluate, model, ttt

HIDDEN, VOCAB, PAD = 16, 96, 95  # PAD: the image placeholder id
IMAGE_SPANS = ((3, 7), (12, 14))
NUM_TOKENS = 20


def image_record(seed: int = 0, spans=IMAGE_SPANS, record_id: str = "img") -> cf.CaptureRecord:
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, PAD, size=NUM_TOKENS).astype(np.int32)
    for start, end in spans:
        token_ids[start:end] = PAD
    num_embeds = sum(end - start for start, end in spans)
    loss = ((14, NUM_TOKENS),) if spans else ((2, NUM_TOKENS),)
    return cf.CaptureRecord(
        record_id=record_id, sample_id=record_id, model_fingerprint="tiny@1", capture_layers=(0, 1, 2),
        hidden_size=HIDDEN, dtype="float32", token_ids=token_ids, loss_spans=loss,
        aux=rng.standard_normal((NUM_TOKENS, 3, HIDDEN)).astype(np.float32),
        final=rng.standard_normal((NUM_TOKENS, HIDDEN)).astype(np.float32),
        input_embed_spans=spans, input_embeds=rng.standard_normal((num_embeds, HIDDEN)).astype(np.float32) * 5
        if spans else None)


def objective(ttt_steps: int = 3, checkpoint_steps: bool = False) -> ttt.Eagle3Objective:
    torch.manual_seed(0)
    config = model.Config(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_aux_hidden_states=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=32,
                          rms_norm_eps=1e-6, vocab_size=VOCAB, draft_vocab_size=VOCAB, max_position_embeddings=256)
    draft = model.Eagle3Draft(config)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_()
        draft.t2d[:] = True
    return ttt.Eagle3Objective(draft, torch.randn(VOCAB, HIDDEN) * 3,
                               ttt.Config(ttt_steps=ttt_steps, checkpoint_steps=checkpoint_steps))


def batch_of(*records: cf.CaptureRecord) -> dict:
    rows = [[data.shift_record(record)] for record in records]
    return data.collate(rows, [record.record_id for record in records], state_dtype="float32",
                        aux_width=3 * HIDDEN, hidden=HIDDEN)


def expected_inputs(record: cf.CaptureRecord, draft: model.Eagle3Draft, step: int) -> torch.Tensor:
    """(T - 1, H): what SGLang feeds the draft at row r and TTT step `step`: the input of token r + 1 + step."""
    table = draft.embed_tokens.weight.detach()
    by_position = table[torch.from_numpy(record.token_ids.astype(np.int64))].clone()  # (T, H)
    image_positions = np.flatnonzero(record.input_embed_mask()) if record.input_embeds is not None else []
    for row, position in enumerate(image_positions):
        by_position[position] = torch.from_numpy(np.array(record.input_embeds[row]))
    by_position = torch.cat([by_position, table[0].expand(step + 1, HIDDEN)])  # rows past the end read id 0
    return by_position[1 + step : NUM_TOKENS + step]


def midlayer_inputs(objective_: ttt.Eagle3Objective, batch: dict) -> list[torch.Tensor]:
    seen = []
    handle = objective_.draft.midlayer.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    try:
        objective_(batch)["loss"].backward()
    finally:
        handle.remove()
    return seen


def test_shifted_rows_carry_the_captured_embedding_of_the_next_token_where_it_is_an_image():
    record = image_record()
    rows = data.shift_record(record)
    mask = record.input_embed_mask().astype(bool)
    assert rows["input_embed_mask"].tolist() == mask[1:].tolist()  # row r: is token r + 1 an image position?
    assert rows["input_ids"][rows["input_embed_mask"]].tolist() == [PAD] * 6
    np.testing.assert_array_equal(rows["input_embeds"][rows["input_embed_mask"]], record.input_embeds)
    assert not rows["input_embeds"][~rows["input_embed_mask"]].any()
    assert not record.loss_mask()[mask].any(), "an image position is never predicted"
    assert "input_embeds" not in data.shift_record(image_record(spans=(), record_id="text"))


@pytest.mark.parametrize("checkpoint_steps", [False, True])
def test_every_ttt_step_reads_the_captured_embeddings_at_image_positions(checkpoint_steps):
    """A trainer that fed the placeholder id's embedding (or dropped the images) fails this."""
    image, text = image_record(), image_record(seed=1, spans=(), record_id="text")
    objective_ = objective(checkpoint_steps=checkpoint_steps)
    batch = batch_of(image, text)
    assert batch["input_embeds"].shape == (2, NUM_TOKENS - 1, HIDDEN) and batch["input_embed_mask"][1].sum() == 0
    seen = midlayer_inputs(objective_, batch)
    steps = [tensor for tensor in seen if tensor.shape[0] == 2][:3]  # checkpointed steps run twice
    for step, inputs in enumerate(steps):  # (B, n, H) each
        torch.testing.assert_close(inputs[0], expected_inputs(image, objective_.draft, step), rtol=0, atol=0)
        torch.testing.assert_close(inputs[1], expected_inputs(text, objective_.draft, step), rtol=0, atol=0)


def test_the_images_change_the_loss_and_the_placeholder_does_not_stand_in_for_them():
    objective_ = objective()
    with_images = batch_of(image_record())
    placeholder = {key: value for key, value in with_images.items() if not key.startswith("input_embed")}
    loss_images = objective_(with_images)["loss"].item()
    loss_placeholder = objective_(placeholder)["loss"].item()
    assert abs(loss_images - loss_placeholder) > 1e-4 * abs(loss_placeholder)


def test_eval_proposes_from_the_captured_embedding_at_step_0_and_from_its_own_tokens_after():
    objective_ = objective()
    record = image_record()
    batch = batch_of(record)
    seen = []
    handle = objective_.draft.midlayer.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    try:
        proposals = evaluate.chain_proposals(objective_.draft, batch, steps=2)  # (B, S, J)
    finally:
        handle.remove()
    torch.testing.assert_close(seen[0][0], expected_inputs(record, objective_.draft, 0), rtol=0, atol=0)
    table = objective_.draft.embed_tokens.weight.detach()
    torch.testing.assert_close(seen[1][0], table[proposals[0, :, 0]], rtol=0, atol=0)


def test_image_records_need_a_draft_as_wide_as_the_target():
    draft = model.Eagle3Draft(model.Config(
        hidden_size=32, target_hidden_size=HIDDEN, num_aux_hidden_states=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=32, rms_norm_eps=1e-6, vocab_size=VOCAB,
        draft_vocab_size=VOCAB, max_position_embeddings=256))
    batch = batch_of(image_record())
    with pytest.raises(ValueError, match="a draft for images must be as wide as its target"):
        evaluate.chain_proposals(draft, batch, steps=1)


def test_image_records_reach_a_batch_through_shards_and_windows(tmp_path):
    records = [image_record(seed=seed, record_id=f"img-{seed}") for seed in range(2)]
    cf.write_shards(records, tmp_path, records_per_shard=2)
    with cf.ShardDirectory(tmp_path) as shards:
        entry = next(entry for entry in shards.iter_index() if entry.record_id == "img-1")
        windows = data.record_windows(entry.num_tokens, max_length=8, overlap=2)
        parts = data.read_windows(shards, entry, windows)
    shifted = [data.shift_window(part, first, end, 2) for part, (first, end) in zip(parts, windows)]
    whole = data.shift_record(records[1])
    for (first, end), rows in zip(windows, shifted):
        assert rows["input_embed_mask"].tolist() == whole["input_embed_mask"][first:end].tolist()
        np.testing.assert_array_equal(rows["input_embeds"], whole["input_embeds"][first:end])


def test_a_run_trains_and_evaluates_on_shards_mixing_image_and_text_records(tmp_path, monkeypatch):
    """The whole loader path (shards, windows, packing, collate) with image records in it:
    training and its held-out eval run to the end with finite losses."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import trainer_data
    from trainer.config_io import config_from_dict
    from trainer.train import Config, train

    inputs = trainer_data.prepared_inputs()
    text = trainer_data.capture_records(0, 12)
    rng = np.random.default_rng(3)
    mixed = []
    for index, record in enumerate(text):
        first_loss = record.loss_spans[0][0]
        if index % 2 or first_loss < 6:
            mixed.append(record)
            continue
        spans = ((2, min(6, first_loss)),)  # a prompt stretch before the first answer: an image there
        mixed.append(cf.CaptureRecord(
            record_id=f"img-{index}", sample_id=record.sample_id, model_fingerprint=record.model_fingerprint,
            capture_layers=record.capture_layers, hidden_size=record.hidden_size, dtype=record.dtype,
            token_ids=record.token_ids, loss_spans=record.loss_spans, aux=record.aux, final=record.final,
            input_embed_spans=spans, input_embeds=cf.bfloat16_bits_from_float32(
                rng.standard_normal((spans[0][1] - spans[0][0], record.hidden_size)).astype(np.float32))))
    assert sum(record.input_embeds is not None for record in mixed) >= 3
    shards = tmp_path / "shards"
    cf.write_shards(mixed, shards, records_per_shard=5)
    settings = {
        "target": str(inputs["target"]), "draft_config": str(inputs["draft_config"]), "vocab": str(inputs["vocab"]),
        "out_dir": str(tmp_path / "run"), "eval_shards": str(shards),
        "data": {"shards": str(shards), "batch_size": 3, "max_length": 64, "packing": True},
        "objective": {"ttt_steps": 2}, "num_steps": 4, "log_every": 2, "checkpoint_every": 0, "num_threads": 1,
        "progress_bar": False}
    with_images = []
    unroll = ttt.Eagle3Objective.unroll

    def counting_unroll(self, batch, *args, **kwargs):
        with_images.append(int(batch["input_embed_mask"].sum()) if "input_embed_mask" in batch else 0)
        return unroll(self, batch, *args, **kwargs)

    monkeypatch.setattr(ttt.Eagle3Objective, "unroll", counting_unroll)
    summary = train(config_from_dict(Config, settings))
    assert summary["eval"]["num_tokens"] > 0 and all(np.isfinite(summary["eval"]["step_losses"]))
    assert sum(count > 0 for count in with_images) >= 2, with_images  # training and eval batches with images
