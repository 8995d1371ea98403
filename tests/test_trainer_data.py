"""Trainer data: the read-time shift on a hand-made record, batch plans, rank/worker split, resume, corruption."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import capture_format as cf
from trainer import data

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402


def hand_made_record(num_tokens: int = 5, spans=((2, 5),), record_id: str = "hand-0") -> cf.CaptureRecord:
    """T tokens 10, 11, ...; aux[t, k, :] = 100 t + k; final[t, :] = 1000 + t (exact in bf16)."""
    t = np.arange(num_tokens, dtype=np.float32)
    aux = np.broadcast_to(100 * t[:, None, None] + np.arange(2, dtype=np.float32)[None, :, None], (num_tokens, 2, 4))
    final = np.broadcast_to(1000 + t[:, None], (num_tokens, 4))
    return cf.CaptureRecord(
        record_id=record_id, sample_id="s", model_fingerprint="tiny@test", capture_layers=(1, 2), hidden_size=4,
        dtype="float32", token_ids=np.arange(10, 10 + num_tokens, dtype=np.int32), loss_spans=spans,
        aux=np.ascontiguousarray(aux), final=np.ascontiguousarray(final),
    )


def test_shift_on_a_hand_made_record_matches_the_documented_example() -> None:
    # ids a..e = 10..14, loss span (2, 5): the docstring's worked example.
    rows = data.shift_record(hand_made_record(), max_length=100)
    assert rows["aux"][:, 0].tolist() == [0, 100, 200, 300]  # aux[r], first capture layer, first feature
    assert rows["aux"][:, 4].tolist() == [1, 101, 201, 301]  # second capture layer follows the first H values
    assert rows["input_ids"].tolist() == [11, 12, 13, 14]  # token r+1
    assert rows["final"][:, 0].tolist() == [1001, 1002, 1003, 1004]  # final[r+1]: distribution of token r+2
    assert rows["loss_mask"].tolist() == [True, True, True, False]  # mask[r+2]; nothing past the record
    assert rows["label_ids"].tolist() == [12, 13, 14, -1]  # token r+2


def test_shift_cuts_long_records_and_keeps_the_mask_aligned() -> None:
    rows = data.shift_record(hand_made_record(num_tokens=8, spans=((3, 4), (6, 8))), max_length=4)
    assert rows["input_ids"].tolist() == [11, 12, 13, 14]
    assert rows["label_ids"].tolist() == [12, 13, 14, 15]
    assert rows["loss_mask"].tolist() == [False, True, False, False]  # token 3 is in a span; 4 and 5 are not


def test_collate_packs_records_apart_and_pads() -> None:
    first = data.shift_record(hand_made_record(), 100)
    second = data.shift_record(hand_made_record(num_tokens=3, spans=((2, 3),), record_id="hand-1"), 100)
    batch = data.collate([[first, second], [second]], ["hand-0", "hand-1", "hand-1"], state_dtype="float32",
                         aux_width=8, hidden=4)
    assert batch["aux"].shape == (2, 6, 8) and batch["final"].shape == (2, 6, 4)
    assert batch["doc_ids"].tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, -1, -1, -1, -1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert batch["input_ids"][0].tolist() == [11, 12, 13, 14, 11, 12]
    assert batch["loss_mask"][0].tolist() == [True, True, True, False, True, False]
    assert not batch["loss_mask"][1, 2:].any()


def test_epoch_plans_are_deterministic_disjoint_across_ranks_and_reshuffled_per_epoch() -> None:
    lengths = [5 + i % 7 for i in range(40)]
    config = data.Config(shards="unused", batch_size=3, max_length=16, seed=11)

    def records(rank: int, world_size: int, epoch: int) -> list[int]:
        return [i for batch in data.plan_epoch(lengths, config, epoch, rank, world_size) for row in batch for i in row]

    assert records(0, 2, 0) == records(0, 2, 0)
    assert set(records(0, 2, 0)).isdisjoint(records(1, 2, 0))
    assert sorted(records(0, 1, 0)) == list(range(40))
    assert records(0, 1, 0) != records(0, 1, 1)
    assert len(data.plan_epoch(lengths, config, 0, 0, 3)) == len(data.plan_epoch(lengths, config, 0, 2, 3))
    packed = data.plan_epoch(lengths, data.Config(shards="unused", batch_size=2, max_length=16, packing=True), 0, 0, 1)
    assert all(sum(lengths[i] for i in row) <= 16 for batch in packed for row in batch)
    assert sorted(i for batch in packed for row in batch for i in row) == list(range(40))


def _batches(dataset: data.ShardDataset, count: int, num_workers: int = 0) -> list[dict]:
    dataset.config.num_workers = num_workers
    loader = iter(data.make_loader(dataset))
    return [next(loader) for _ in range(count)]


def _same(a: dict, b: dict) -> bool:
    keys = ("aux", "final", "input_ids", "loss_mask", "position_ids", "doc_ids")
    return a["record_ids"] == b["record_ids"] and all(torch.equal(a[key], b[key]) for key in keys)


def test_dataset_resumes_from_its_batch_count_and_splits_by_worker_in_order() -> None:
    shards = trainer_data.shard_dir(64, 16)
    config = data.Config(shards=str(shards), batch_size=3, max_length=64, packing=True, seed=3)
    uninterrupted = _batches(data.ShardDataset(config), 8)  # crosses into the second epoch
    assert {batch["epoch"] for batch in uninterrupted} == {0, 1}
    resumed = _batches(data.ShardDataset(config, start_batch=5), 3)
    assert all(_same(a, b) for a, b in zip(uninterrupted[5:], resumed, strict=True))
    with_workers = _batches(data.ShardDataset(config), 8, num_workers=2)
    assert [batch["batch_number"] for batch in with_workers] == list(range(8))
    assert all(_same(a, b) for a, b in zip(uninterrupted, with_workers, strict=True))


def test_ranks_read_disjoint_records() -> None:
    config = data.Config(shards=str(trainer_data.shard_dir(64, 16)), batch_size=2, max_length=64)
    seen = []
    for rank in range(2):
        dataset = data.ShardDataset(config, rank=rank, world_size=2, num_epochs=1)
        seen.append({record_id for batch in data.make_loader(dataset) for record_id in batch["record_ids"]})
    assert seen[0].isdisjoint(seen[1]) and len(seen[0]) == len(seen[1]) == 8


def test_a_corrupt_record_is_reported_and_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shards = shutil.copytree(trainer_data.shard_dir(64, 16), tmp_path / "shards")
    with cf.ShardDirectory(shards) as directory:
        entry = list(directory.iter_index())[2]
    with open(entry.shard_path, "r+b") as file:  # flip a byte of the record's states, near its end
        file.seek(entry.offset + entry.length - 10)
        byte = file.read(1)
        file.seek(entry.offset + entry.length - 10)
        file.write(bytes([byte[0] ^ 0xFF]))
    config = data.Config(shards=str(shards), batch_size=4, max_length=64, shuffle=False)
    with caplog.at_level(logging.ERROR, logger="trainer.data"):
        batches = list(data.make_loader(data.ShardDataset(config, num_epochs=1)))
    read = [record_id for batch in batches for record_id in batch["record_ids"]]
    assert entry.record_id not in read and len(read) == 15
    assert sum(batch["skipped_record_ids"] == [entry.record_id] for batch in batches) == 1
    assert entry.record_id in caplog.text


def test_dataset_refuses_records_the_draft_cannot_read() -> None:
    config = data.Config(shards=str(trainer_data.shard_dir(64, 16)))
    with pytest.raises(ValueError, match=r"capture_layers \[\(3, 5, 6\)\]; the draft expects \(2, 5, 6\)"):
        data.ShardDataset(config, capture_layers=(2, 5, 6))
    with pytest.raises(ValueError, match="model_fingerprint"):
        data.ShardDataset(config, model_fingerprint="LlamaForCausalLM:0000000000000000")


def test_a_record_without_the_last_tokens_state_trains_like_a_prefill_capture_of_the_same_tokens() -> None:
    prefill = hand_made_record(num_tokens=6, spans=((3, 6),))
    generated = cf.CaptureRecord(
        record_id="gen-0", sample_id="s", model_fingerprint="tiny@test", capture_layers=(1, 2), hidden_size=4,
        dtype="float32", token_ids=prefill.token_ids, loss_spans=prefill.loss_spans,
        aux=prefill.aux[:5], final=prefill.final[:5])
    want, got = data.shift_record(prefill, max_length=100), data.shift_record(generated, max_length=100)
    assert got["loss_mask"].tolist() == [False, True, True, True, False]  # the last token (15) is learned
    assert got["label_ids"].tolist() == [12, 13, 14, 15, -1]
    for name in ("aux", "input_ids", "loss_mask", "label_ids"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # Only the masked last row differs: its target is the state the generated record never had.
    np.testing.assert_array_equal(got["final"][:4], want["final"][:4])
    assert got["final"][4].tolist() == [0, 0, 0, 0]
    assert data.shift_record(generated, max_length=3)["final"][:, 0].tolist() == [1001, 1002, 1003]
