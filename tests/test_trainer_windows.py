"""Long records as windows: every loss token is learned once per TTT step, eval counts every position once."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import capture_format as cf
from trainer import data, evaluate, ttt

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402
from test_trainer_export import trained_run  # noqa: E402

NUM_STEPS = 4
"""TTT steps of the counting test: windows repeat NUM_STEPS - 1 rows."""


def scored_targets(config: data.Config, overlap: int) -> tuple[Counter, Counter]:
    """Over one epoch: how often each (record, token, step) is a scored target, and each (record, row) a chain start."""
    targets, starts = Counter(), Counter()
    for batch in data.make_loader(data.ShardDataset(config, num_epochs=1, window_overlap=overlap)):
        doc_of = {(b, doc): record_id for record_id, (b, doc, *_) in zip(batch["record_ids"], batch["windows"])}
        for step in range(NUM_STEPS):
            for b, position in ttt.scored_rows(batch["loss_mask"], batch["doc_ids"], step).nonzero().tolist():
                record_id = doc_of[(b, int(batch["doc_ids"][b, position]))]
                # Start row r scores row r + step, which predicts token r + step + 2.
                targets[(record_id, int(batch["position_ids"][b, position]) + step + 2, step)] += 1
        for b, position in (batch["start_mask"] & (batch["doc_ids"] >= 0)).nonzero().tolist():
            starts[(doc_of[(b, int(batch["doc_ids"][b, position]))], int(batch["position_ids"][b, position]))] += 1
    return targets, starts


@pytest.mark.parametrize("packing", [False, True])
def test_every_loss_token_of_a_long_record_is_a_target_once_per_step_across_its_windows(packing: bool) -> None:
    shards = trainer_data.shard_dir(64, 16)  # 16 records of 68-151 tokens
    with cf.ShardDirectory(shards) as directory:
        records = {entry.record_id: directory.read_token_ids(entry) for entry in directory.iter_index()}
    want_targets, want_starts = Counter(), Counter()
    for record_id, record in records.items():
        num_tokens = len(record.token_ids)
        for start, end in record.loss_spans:
            for token in range(max(start, 2), end):
                want_starts[(record_id, token - 2)] += 1
                for step in range(NUM_STEPS):
                    if token - 2 - step >= 0:  # a start row exists NUM_STEPS - 1 rows back at most
                        want_targets[(record_id, token, step)] += 1
        assert num_tokens - 1 > 4 * 12  # far longer than the windows below
    windowed = data.Config(shards=str(shards), batch_size=3, max_length=12, packing=packing, seed=5)
    targets, starts = scored_targets(windowed, overlap=NUM_STEPS - 1)
    assert targets == want_targets and set(targets.values()) == {1}
    assert starts == want_starts and set(starts.values()) == {1}
    whole = data.Config(shards=str(shards), batch_size=3, max_length=256, packing=packing, seed=5)
    assert scored_targets(whole, overlap=NUM_STEPS - 1) == (targets, starts)


def test_eval_of_long_records_counts_every_position_once() -> None:
    # The unigram draft ignores context, so windowed eval must give exactly the whole-record numbers; the
    # drafts' attention sees less across a boundary, but every position is counted once all the same.
    run, heldout = trained_run(), trainer_data.prepared_inputs()["heldout_shards"]
    settings = dict(max_records=3, batch_size=1, steps=4)  # one window a batch: 3 records either way
    whole = evaluate.evaluate(run, heldout, max_length=256, **settings)
    windowed = evaluate.evaluate(run, heldout, max_length=16, **settings)
    assert windowed["num_records"] == whole["num_records"] == 3
    assert windowed["num_start_positions"] == whole["num_start_positions"]
    assert windowed["drafts"]["unigram"] == whole["drafts"]["unigram"]
    for name in ("draft", "untrained"):
        for key in ("acceptance_length", "served_walk_acceptance_length", "step_accuracy"):
            assert windowed["drafts"][name][key] == pytest.approx(whole["drafts"][name][key], abs=0.25), (name, key)


def test_the_stitcher_joins_a_record_from_windows_in_separate_batches() -> None:
    # One record of 11 rows in windows (0, 5), (3, 8), (6, 11) with overlap 2: rows 0-2, 3-5, 6-10 start chains.
    stitcher = evaluate.RecordStitcher(overlap=2)
    done = []
    for first, end in data.record_windows(12, 5, 2):
        n = end - first
        rows = torch.arange(first, end)  # (n,)
        batch = {"record_ids": ["r"], "windows": [(0, 0, first, end, 11)], "doc_ids": torch.zeros(1, n, dtype=torch.long)}
        leading = {"draft": (rows * 10).view(1, n, 1)}  # (1, n, 1): row r carries 10 r
        done += stitcher.add(batch, (rows % 2 == 0).view(1, n), leading)
        assert len(done) == (end == 11)
    counted, leading = done[0]
    assert counted.tolist() == [r % 2 == 0 for r in range(11)]
    assert leading["draft"][:, 0].tolist() == [10 * r for r in range(11)] and not stitcher.open
