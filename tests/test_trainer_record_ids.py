"""Training and evaluating on a chosen set of records (data.record_ids, `eval --record-ids`): only those records,
in the file's order, dealt to ranks like a whole shard set; ids the shards lack and empty selections are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import capture_format as cf
from eagle_tap.cli import main
from trainer import data
from trainer.evaluate import evaluate

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402
from test_object_store import s3, training_bucket  # noqa: E402,F401  (fixtures: a moto S3 server and its bucket)
from test_trainer_train import run_config  # noqa: E402


def shard_record_ids(shards: Path) -> list[str]:
    with cf.ShardDirectory(shards) as directory:
        return [entry.record_id for entry in directory.iter_index()]


def write_ids(path: Path, record_ids: list[str], header: str = "# chosen records\n") -> Path:
    path.write_text(header + "".join(f"{record_id}\n" for record_id in record_ids))
    return path


def test_a_record_id_file_has_one_id_a_line_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "ids.txt"
    path.write_text("# held out\nrec-00070\n\n  rec-00064   # the first\nrec-00065#tight\n")
    assert data.read_record_ids(path) == ["rec-00070", "rec-00064", "rec-00065"]
    for text, message in (("a\nb\na\n", r"ids.txt:3: record id 'a' is listed again \(first on line 1\)"),
                          ("# nothing\n\n", "lists no record id: the selection would be empty"),
                          ("a b\n", r"ids.txt:1: record_id 'a b' is not allowed")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            data.read_record_ids(path)
    with pytest.raises(ValueError, match="cannot read the record id file"):
        data.read_record_ids(tmp_path / "missing.txt")


def test_a_selection_is_read_in_its_order_and_split_between_ranks(tmp_path: Path) -> None:
    shards = trainer_data.prepared_inputs()["heldout_shards"]  # rec-00064 .. rec-00079
    chosen = ["rec-00077", "rec-00064", "rec-00070", "rec-00071", "rec-00066", "rec-00079", "rec-00065", "rec-00072"]
    ids_file = write_ids(tmp_path / "ids.txt", chosen)
    config = data.Config(shards=str(shards), batch_size=3, max_length=256, shuffle=False, record_ids=str(ids_file))
    dataset = data.ShardDataset(config, num_epochs=1, equal_per_rank=False)
    assert [entry.record_id for entry in dataset.entries] == chosen
    assert [record_id for batch in data.make_loader(dataset) for record_id in batch["record_ids"]] == chosen

    shuffled = data.Config(shards=str(shards), batch_size=2, max_length=256, record_ids=str(ids_file))
    read = [{record_id for batch in data.make_loader(data.ShardDataset(shuffled, rank=rank, world_size=2,
                                                                       num_epochs=1))
             for record_id in batch["record_ids"]} for rank in range(2)]
    assert read[0].isdisjoint(read[1]) and read[0] | read[1] == set(chosen) and len(read[0]) == 4


def test_ids_the_shards_lack_are_named_and_counted(tmp_path: Path) -> None:
    shards = trainer_data.prepared_inputs()["heldout_shards"]
    missing = [f"rec-9{number:04d}" for number in range(7)]
    ids_file = write_ids(tmp_path / "ids.txt", ["rec-00064", *missing])
    with pytest.raises(ValueError, match=rf"7 of 8 record ids of {ids_file} are not in {shards}: "
                                         r"rec-90000, rec-90001, rec-90002, rec-90003, rec-90004, \.\.\.$"):
        data.require_records(data.Config(shards=str(shards), record_ids=str(ids_file)))


def test_train_on_some_records_and_evaluate_on_the_rest_of_the_same_shards(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    shards = trainer_data.prepared_inputs()["heldout_shards"]
    record_ids = shard_record_ids(shards)
    trained_on, held_out = record_ids[::2], record_ids[1::2]
    train_ids, eval_ids = write_ids(tmp_path / "train.txt", trained_on), write_ids(tmp_path / "eval.txt", held_out)
    config = run_config(tmp_path / "run", shards, num_steps=3, log_every=1, log_record_ids=True,
                        data__batch_size=4, data__max_length=128, data__record_ids=str(train_ids),
                        objective__ttt_steps=2)
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 0
    read = {line.split("\t")[1] for line in (tmp_path / "run" / "record_ids.rank0.txt").read_text().splitlines()}
    assert read == set(trained_on)  # 3 steps of 4 records: 8 selected records, 1.5 epochs
    listed = json.loads((tmp_path / "run" / "training_records.json").read_text())["record_ids"]
    assert listed == trained_on

    result = evaluate(tmp_path / "run", shards, record_ids=eval_ids, batch_size=4, max_length=128)
    assert result["num_records"] == len(held_out) and result["record_ids"] == str(eval_ids)
    assert result["held_out"]["num_training_records"] == len(trained_on)
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "run"), "--shards", str(shards), "--record-ids", str(train_ids),
                 "--out", str(tmp_path / "eval")]) == 2
    assert f"{len(trained_on)} records of {shards} were in the run's training records" in capsys.readouterr().err


def test_a_selection_from_a_bucket_fetches_only_the_chosen_records(training_bucket: dict[str, str],  # noqa: F811
                                                                   tmp_path: Path) -> None:
    import os

    chosen = shard_record_ids(trainer_data.prepared_inputs()["train_shards"])[5:17]
    ids_file = write_ids(tmp_path / "ids.txt", chosen)
    read = []
    for rank in range(2):
        config = data.Config(shards=training_bucket["train_shards"], batch_size=3, max_length=256,
                             record_ids=str(ids_file), cache_dir=str(tmp_path / f"cache-{rank}"))
        dataset = data.ShardDataset(config, rank=rank, world_size=2, num_epochs=1)
        read.append({record_id for batch in data.make_loader(dataset) for record_id in batch["record_ids"]})
        assert len(os.listdir(tmp_path / f"cache-{rank}")) == 6  # one cached frame per chosen record of this rank
    assert read[0].isdisjoint(read[1]) and read[0] | read[1] == set(chosen)
