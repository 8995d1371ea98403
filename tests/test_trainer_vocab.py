"""Vocab mapping: invariants, coverage on a known distribution, forced tokens, too few tokens, tokenizer checks, CLI."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import capture_format as cf
from capture_format.token_ids import read_token_ids
from eagle_tap.cli import main
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR
from trainer import vocab

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402


@pytest.mark.parametrize("draft_vocab_size", [1, 7, 300, 1000])
def test_mapping_invariants_and_round_trip(tmp_path: Path, draft_vocab_size: int) -> None:
    counts = np.random.default_rng(draft_vocab_size).zipf(1.3, size=1000).astype(np.int64)
    target_ids, _ = vocab.select_draft_tokens(counts, draft_vocab_size)
    mapping = vocab.VocabMapping.from_target_ids(target_ids, 1000, {"format": vocab.MAPPING_FORMAT,
                                                                    "format_version": vocab.MAPPING_FORMAT_VERSION})
    t2d, d2t = mapping.t2d, mapping.d2t
    assert t2d.dtype == np.bool_ and t2d.shape == (1000,) and d2t.dtype == np.int64
    assert t2d.sum() == draft_vocab_size == d2t.size
    assert t2d[np.arange(draft_vocab_size) + d2t].all()
    assert np.all(np.diff(np.arange(draft_vocab_size) + d2t) > 0)
    mapping.save(tmp_path)
    loaded = vocab.load_vocab_mapping(tmp_path)
    assert np.array_equal(loaded.t2d, t2d) and np.array_equal(loaded.d2t, d2t)
    assert torch.equal(torch.load(tmp_path / "d2t.pt"), torch.from_numpy(d2t))
    assert torch.equal(torch.load(tmp_path / "t2d.pt"), torch.from_numpy(t2d))


def test_coverage_on_a_known_distribution() -> None:
    counts = np.zeros(10, dtype=np.int64)
    counts[[4, 2, 7, 0]] = [50, 30, 15, 5]
    assert vocab.coverage_at(counts, [1, 2, 3, 4, 10]) == {1: 0.5, 2: 0.8, 3: 0.95, 4: 1.0, 10: 1.0}
    assert vocab.select_draft_tokens(counts, 2)[0].tolist() == [2, 4]  # the two most frequent, sorted by id
    ids, _ = vocab.select_draft_tokens(counts, 3, forced_ids=[9])  # a forced token takes a slot first
    assert ids.tolist() == [2, 4, 9]
    counts[[1, 3]] = 30  # ties with id 2: lower ids win
    assert vocab.select_draft_tokens(counts, 3)[0].tolist() == [1, 2, 4]
    assert vocab.ladder_sizes(200_000, 32_000) == [8192, 16384, 32000, 32768, 65536, 200_000]


def test_fewer_distinct_tokens_than_asked_is_explicit() -> None:
    counts = np.zeros(100, dtype=np.int64)
    counts[[5, 6, 50]] = [3, 2, 1]
    with pytest.raises(ValueError, match=r"only 4 distinct tokens .* draft vocab of 10. Pick --draft-vocab-size 4"):
        vocab.select_draft_tokens(counts, 10, forced_ids=[1])
    with pytest.warns(UserWarning, match="shrinks to 4"):
        assert vocab.select_draft_tokens(counts, 10, [1], "shrink")[0].tolist() == [1, 5, 6, 50]
    with pytest.warns(UserWarning, match="filled 6 slots"):
        ids, num_filled = vocab.select_draft_tokens(counts, 10, [1], "fill")
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 50] and num_filled == 6


def test_template_tokens_of_the_tiny_model() -> None:
    # <|bos|> 0, <|eos|> 1, <|system|> 3, <|user|> 4, <|assistant|> 5, <|end|> 6; <|pad|> 2 never appears.
    assert vocab.template_token_ids(TINY_MODEL_DIR) == [0, 1, 3, 4, 5, 6]


def test_token_id_reader_matches_full_records_and_catches_corruption(tmp_path: Path) -> None:
    shards = shutil.copytree(trainer_data.shard_dir(64, 16), tmp_path / "shards")
    with cf.ShardDirectory(shards) as directory:
        entries = list(directory.iter_index())
        for entry in entries:
            record, tokens = directory.read_record(entry), read_token_ids(entry)
            assert np.array_equal(record.token_ids, tokens.token_ids)
            assert np.array_equal(record.loss_mask(), tokens.loss_mask())
    entry = entries[3]
    frame = entry.shard_path.read_bytes()[entry.offset : entry.offset + entry.length]
    ids_offset = entry.offset + frame.index(cf.decode_frame(frame).token_ids.astype("<i4").tobytes())  # stored raw
    with open(entry.shard_path, "r+b") as file:
        file.seek(ids_offset)
        file.write(bytes([frame[ids_offset - entry.offset] ^ 0x40]))
    with pytest.raises(cf.ChecksumError, match="token_ids"):
        read_token_ids(entry)
    with pytest.warns(UserWarning, match="skipping a corrupt record"):
        _, source = vocab.count_shard_tokens(shards, 4096)
    assert source["num_records"] == 15 and source["num_skipped_records"] == 1


def test_vocab_command_from_shards_and_from_its_own_frequency_file(tmp_path: Path, capsys) -> None:
    shards = trainer_data.shard_dir(64, 16)
    out = tmp_path / "vocab"
    assert main(["vocab", "--target", str(TINY_MODEL_DIR), "--shards", str(shards), "--draft-vocab-size", "200",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chosen draft vocab 200 covers" in printed and "(full vocab)" in printed
    for name in ("t2d.npy", "d2t.npy", "t2d.pt", "d2t.pt", "vocab.json", "token_frequencies.json", "coverage.png"):
        assert (out / name).is_file(), name
    meta = json.loads((out / "vocab.json").read_text())
    expected = np.zeros(4096, dtype=np.int64)  # a recount from fully decoded records
    with cf.ShardDirectory(shards) as directory:
        for entry in directory.iter_index():
            record = directory.read_record(entry)
            np.add.at(expected, record.token_ids[record.loss_mask().astype(bool)], 1)
    assert meta["num_counted_tokens"] == expected.sum() and meta["draft_vocab_size"] == 200
    assert meta["forced_token_ids"] == [0, 1, 3, 4, 5, 6]
    mapping = vocab.load_vocab_mapping(out, TINY_MODEL_DIR)
    assert meta["coverage"] == pytest.approx(expected[mapping.draft_token_ids].sum() / expected.sum())
    again = tmp_path / "again"
    assert main(["vocab", "--target", str(TINY_MODEL_DIR), "--frequencies", str(out / "token_frequencies.json"),
                 "--draft-vocab-size", "200", "--out", str(again)]) == 0
    assert np.array_equal(np.load(again / "d2t.npy"), mapping.d2t)


def test_a_mapping_for_another_tokenizer_is_refused(tmp_path: Path) -> None:
    shards = trainer_data.shard_dir(64, 16)
    vocab.build_vocab_mapping(target_dir=TINY_MODEL_DIR, draft_vocab_size=100, out_dir=tmp_path / "vocab",
                              shard_dir=shards)
    other = shutil.copytree(TINY_MODEL_DIR, tmp_path / "other-model")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"][0]["content"] = "<|start|>"
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="was made for tokenizer tok:.*Rebuild it"):
        vocab.load_vocab_mapping(tmp_path / "vocab", other)
    assert main(["vocab", "--target", str(other), "--shards", str(shards), "--draft-vocab-size", "100",
                 "--out", str(tmp_path / "x")]) == 2  # the captures' fingerprint is not this target's
