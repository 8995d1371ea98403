"""Trainer data: the read-time shift on a hand-made record, batch plans, rank/worker split, resume, corruption."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

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
    rows = data.shift_record(hand_made_record())
    assert rows["aux"][:, 0].tolist() == [0, 100, 200, 300]  # aux[r], first capture layer, first feature
    assert rows["aux"][:, 4].tolist() == [1, 101, 201, 301]  # second capture layer follows the first H values
    assert rows["input_ids"].tolist() == [11, 12, 13, 14]  # token r+1
    assert rows["final"][:, 0].tolist() == [1001, 1002, 1003, 0]  # final[r+1]: distribution of token r+2
    assert rows["loss_mask"].tolist() == [True, True, True, False]  # mask[r+2]; nothing past the record
    assert rows["label_ids"].tolist() == [12, 13, 14, -1]  # token r+2


def _window(record: cf.CaptureRecord, first: int, end: int, overlap: int) -> dict[str, np.ndarray]:
    entry = SimpleNamespace(num_tokens=record.num_tokens)
    return data.shift_window(data.read_windows(_OneRecord(record), entry, [(first, end)])[0], first, end, overlap)


class _OneRecord:
    """Shards of one record, for data.read_windows: its rows [start, end) as IndexedShards.read_window gives them."""

    def __init__(self, record: cf.CaptureRecord) -> None:
        self.record = record

    def read_window(self, entry: object, start: int, end: int) -> cf.RecordWindow:
        record = self.record
        return cf.RecordWindow(
            record_id=record.record_id, sample_id=record.sample_id, model_fingerprint=record.model_fingerprint,
            capture_layers=record.capture_layers, hidden_size=record.hidden_size, dtype=record.dtype,
            token_ids=record.token_ids, loss_spans=record.loss_spans, metadata=record.metadata,
            num_states=record.num_states, start=start, end=end, aux=record.aux[start:end],
            final=record.final[start:end])


def test_windows_of_the_documented_example() -> None:
    # T = 12 (11 rows), max_length 5, ttt_steps 3 (overlap 2): the module docstring's window table.
    assert data.record_windows(12, 5, 2) == [(0, 5), (3, 8), (6, 11)]
    assert data.record_windows(6, 5, 2) == [(0, 5)] and data.record_windows(1, 5, 2) == []
    with pytest.raises(ValueError, match="max_length 3 must exceed the rows each window repeats \\(3"):
        data.record_windows(12, 3, 3)
    record = hand_made_record(num_tokens=12, spans=((0, 12),))
    windows = [_window(record, first, end, 2) for first, end in data.record_windows(12, 5, 2)]
    assert [w["loss_mask"].tolist() for w in windows] == [[True] * 5, [False, False, True, True, True],
                                                          [False, False, True, True, False]]
    assert [w["start_mask"].tolist() for w in windows] == [[True, True, True, False, False],
                                                           [True, True, True, False, False],
                                                           [True, True, True, True, False]]
    assert windows[1]["positions"].tolist() == [3, 4, 5, 6, 7]  # the record's own positions
    assert windows[1]["input_ids"].tolist() == [14, 15, 16, 17, 18]  # token r+1
    assert windows[1]["aux"][:, 0].tolist() == [300, 400, 500, 600, 700]  # aux[r]
    assert windows[1]["final"][:, 0].tolist() == [1004, 1005, 1006, 1007, 1008]  # final[r+1]
    assert windows[2]["label_ids"].tolist() == [18, 19, 20, 21, -1]  # token r+2


def test_a_window_keeps_the_mask_aligned() -> None:
    rows = _window(hand_made_record(num_tokens=8, spans=((3, 4), (6, 8))), 0, 4, 0)
    assert rows["input_ids"].tolist() == [11, 12, 13, 14]
    assert rows["label_ids"].tolist() == [12, 13, 14, 15]
    assert rows["loss_mask"].tolist() == [False, True, False, False]  # token 3 is in a span; 4 and 5 are not


def test_collate_packs_records_apart_and_pads() -> None:
    first = data.shift_record(hand_made_record())
    second = data.shift_record(hand_made_record(num_tokens=3, spans=((2, 3),), record_id="hand-1"))
    batch = data.collate([[first, second], [second]], ["hand-0", "hand-1", "hand-1"], state_dtype="float32",
                         aux_width=8, hidden=4)
    assert batch["aux"].shape == (2, 6, 8) and batch["final"].shape == (2, 6, 4)
    assert batch["doc_ids"].tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, -1, -1, -1, -1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert batch["input_ids"][0].tolist() == [11, 12, 13, 14, 11, 12]
    assert batch["loss_mask"][0].tolist() == [True, True, True, False, True, False]
    assert not batch["loss_mask"][1, 2:].any()


def test_epoch_plans_are_deterministic_disjoint_across_ranks_and_reshuffled_per_epoch() -> None:
    windows = [(i, 0, 5 + i % 7) for i in range(40)]
    config = data.Config(shards="unused", batch_size=3, max_length=16, seed=11)

    def records(rank: int, world_size: int, epoch: int) -> list[int]:
        return [window[0] for batch in data.plan_epoch(windows, config, epoch, rank, world_size)
                for row in batch for window in row]

    assert records(0, 2, 0) == records(0, 2, 0)
    assert set(records(0, 2, 0)).isdisjoint(records(1, 2, 0))
    assert sorted(records(0, 1, 0)) == list(range(40))
    assert records(0, 1, 0) != records(0, 1, 1)
    assert len(data.plan_epoch(windows, config, 0, 0, 3)) == len(data.plan_epoch(windows, config, 0, 2, 3))
    packed = data.plan_epoch(windows, data.Config(shards="unused", batch_size=2, max_length=16, packing=True), 0, 0, 1)
    assert all(sum(end - first for _, first, end in row) <= 16 for batch in packed for row in batch)
    assert sorted(window for batch in packed for row in batch for window in row) == windows


def _batches(dataset: data.ShardDataset, count: int, num_workers: int = 0) -> list[dict]:
    dataset.config.num_workers = num_workers
    loader = iter(data.make_loader(dataset))
    return [next(loader) for _ in range(count)]


def _same(a: dict, b: dict) -> bool:
    keys = ("aux", "final", "input_ids", "loss_mask", "start_mask", "position_ids", "doc_ids")
    return (a["record_ids"] == b["record_ids"] and a["windows"] == b["windows"]
            and all(torch.equal(a[key], b[key]) for key in keys))


def test_dataset_resumes_from_its_batch_count_and_splits_by_worker_in_order() -> None:
    # max_length 48 with overlap 2: most of these records (68-151 tokens) are read as windows.
    shards = trainer_data.shard_dir(64, 16)
    config = data.Config(shards=str(shards), batch_size=3, max_length=48, packing=True, seed=3)
    per_epoch = len(data.ShardDataset(config, window_overlap=2).plan(0))
    uninterrupted = _batches(data.ShardDataset(config, window_overlap=2), per_epoch + 2)
    assert {batch["epoch"] for batch in uninterrupted} == {0, 1}
    assert any(first > 0 for batch in uninterrupted for _, _, first, _, _ in batch["windows"])
    start = per_epoch - 1  # the state after start batches: resume crosses into the second epoch
    resumed = _batches(data.ShardDataset(config, window_overlap=2, start_batch=start), 3)
    assert all(_same(a, b) for a, b in zip(uninterrupted[start:], resumed, strict=True))
    with_workers = _batches(data.ShardDataset(config, window_overlap=2), per_epoch + 2, num_workers=2)
    assert [batch["batch_number"] for batch in with_workers] == list(range(per_epoch + 2))
    assert all(_same(a, b) for a, b in zip(uninterrupted, with_workers, strict=True))


def test_ranks_read_disjoint_windows() -> None:
    # The 16 records have 68-151 tokens: one window each at max_length 256, so the ranks' records are disjoint.
    config = data.Config(shards=str(trainer_data.shard_dir(64, 16)), batch_size=2, max_length=256)
    seen = []
    for rank in range(2):
        dataset = data.ShardDataset(config, rank=rank, world_size=2, num_epochs=1)
        seen.append({record_id for batch in data.make_loader(dataset) for record_id in batch["record_ids"]})
    assert seen[0].isdisjoint(seen[1]) and len(seen[0]) == len(seen[1]) == 8
    windowed = data.Config(shards=str(trainer_data.shard_dir(64, 16)), batch_size=2, max_length=40)
    plans = [data.ShardDataset(windowed, rank=rank, world_size=2, window_overlap=3).plan(0) for rank in range(2)]
    dealt = [{window for batch in plan for row in batch for window in row} for plan in plans]
    assert dealt[0].isdisjoint(dealt[1]) and len(plans[0]) == len(plans[1])


def test_a_corrupt_record_is_reported_and_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shards = shutil.copytree(trainer_data.shard_dir(64, 16), tmp_path / "shards")
    with cf.ShardDirectory(shards) as directory:
        entry = list(directory.iter_index())[2]
    with open(entry.shard_path, "r+b") as file:  # flip a byte of the record's states, near its end
        file.seek(entry.offset + entry.length - 10)
        byte = file.read(1)
        file.seek(entry.offset + entry.length - 10)
        file.write(bytes([byte[0] ^ 0xFF]))
    config = data.Config(shards=str(shards), batch_size=4, max_length=256, shuffle=False)  # one window a record
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
    want, got = data.shift_record(prefill), data.shift_record(generated)
    assert got["loss_mask"].tolist() == [False, True, True, True, False]  # the last token (15) is learned
    assert got["label_ids"].tolist() == [12, 13, 14, 15, -1]
    for name in ("aux", "input_ids", "loss_mask", "label_ids"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # The masked last row's target is past the record: zeros for both (the generated record never had it).
    np.testing.assert_array_equal(got["final"], want["final"])
    assert got["final"][4].tolist() == [0, 0, 0, 0]
    assert _window(generated, 0, 3, 0)["final"][:, 0].tolist() == [1001, 1002, 1003]
    assert _window(generated, 2, 5, 1)["final"][:, 0].tolist() == [1003, 1004, 0]
