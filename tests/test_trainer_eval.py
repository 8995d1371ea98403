"""Offline evaluation: the acceptance simulation on known answers, the chain's inputs, and a run against baselines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dataclasses

import pytest
import torch

import capture_format as cf
from eagle_tap.cli import main
from trainer import evaluate

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402
from test_capture_format_served_draft import DRAFT_A, DRAFT_B, SERVING_A, SERVING_B, served  # noqa: E402
from test_trainer_export import trained_run  # noqa: E402


def test_acceptance_length_on_a_hand_made_case() -> None:
    matches = torch.tensor([
        [1, 1, 0, 1],  # accepts 2, then the third proposal fails: the fourth never counts
        [0, 1, 1, 1],  # the first proposal fails: nothing accepted
        [1, 1, 1, 1],  # all accepted
        [1, 1, 1, 1],  # not a start row (outside the loss mask)
    ], dtype=torch.bool)
    counted = torch.tensor([True, True, True, False])
    lengths = evaluate.acceptance_lengths(matches, counted)
    # k=1: (2 + 1 + 2) / 3; k=2: (3 + 1 + 3) / 3; k=3: (3 + 1 + 4) / 3; k=4: (3 + 1 + 5) / 3
    torch.testing.assert_close(torch.tensor(lengths), torch.tensor([5 / 3, 7 / 3, 8 / 3, 3.0]))


def test_the_served_walk_on_hand_made_cases() -> None:
    # A step at row r emits tokens r+2 .. r+2+a and the next step starts at row r + a + 1.
    assert evaluate.served_walk(torch.zeros(20, dtype=torch.long), 7, 10) == (4, 4)  # nothing accepted: 1 per step
    assert evaluate.served_walk(torch.full((20,), 3), 7, 10) == (4, 1)  # 3 accepted + the target's own token
    assert evaluate.served_walk(torch.full((20,), 1), 7, 10) == (4, 2)
    assert evaluate.served_walk(torch.full((20,), 3), 7, 8) == (2, 1)  # capped at the turn's end
    leading = torch.tensor([0, 0, 2, 0, 0, 1, 0, 0])
    assert evaluate.served_walk(leading, 2, 7) == (6, 3)  # rows 2 (3 tokens), 5 (2 tokens), 7 (1 token)


def test_last_turn_rows_per_record() -> None:
    counted = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 0], dtype=torch.bool)
    doc_ids = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1, -1])
    assert evaluate.last_turn_rows(counted, doc_ids) == [(4, 6), (8, 9)]  # record 0's second turn, record 1's turn


def test_target_argmax_of_later_steps_stays_inside_the_record() -> None:
    argmax = torch.tensor([[10, 11, 12, 20, 21]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1]])
    wanted = evaluate.shifted_target_argmax(argmax, doc_ids, 3)
    assert wanted[0].tolist() == [[10, 11, 12], [11, 12, -1], [12, -1, -1], [20, 21, -1], [21, -1, -1]]


def test_the_chain_feeds_the_drafts_own_proposals() -> None:
    # Where the draft's first proposal is the real next token, its second proposal must be the TTT unroll's
    # (teacher-forced) step-1 guess; step 0 is the unroll's step 0 everywhere.
    from trainer import data

    trained, _, _ = evaluate.load_drafts(trained_run())
    trained.config.ttt_steps = 2
    dataset = data.ShardDataset(data.Config(shards=str(trainer_data.prepared_inputs()["heldout_shards"]),
                                            batch_size=4, max_length=128, shuffle=False), num_epochs=1)
    batch = next(iter(data.make_loader(dataset)))
    hot_ids = torch.arange(trained.draft.d2t.numel()) + trained.draft.d2t
    with torch.no_grad():
        proposals = evaluate.chain_proposals(trained.draft, batch, 2)  # (B, S, 2)
        unrolled = [hot_ids[out["logits"].argmax(-1)] for out in trained.unroll(batch)]  # (B, S) per step
    assert torch.equal(proposals[..., 0], unrolled[0])
    real_next = torch.cat([batch["input_ids"][:, 1:], torch.full_like(batch["input_ids"][:, :1], -1)], dim=1)
    same = (proposals[..., 0] == real_next) & (batch["doc_ids"] >= 0)
    assert same.sum() > 20
    assert torch.equal(proposals[..., 1][same], unrolled[1][same])


def test_eval_against_baselines_and_the_model_card(tmp_path: Path) -> None:
    run = trained_run()
    heldout = trainer_data.prepared_inputs()["heldout_shards"]
    assert main(["eval", "--checkpoint", str(run), "--shards", str(heldout), "--out", str(tmp_path / "eval"),
                 "--max-length", "256"]) == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert (tmp_path / "eval" / "acceptance.png").stat().st_size > 1000
    assert result["num_records"] == 16 and result["chain_lengths"] == [1, 2, 3, 4, 5, 6, 7]
    drafts = result["drafts"]
    assert set(drafts) == {"draft", "untrained", "unigram"}
    for values in drafts.values():
        lengths = values["acceptance_length"]
        assert all(1.0 <= a <= b <= a + 1 for a, b in zip(lengths, lengths[1:]))  # never shrinks, +1 at most per k
        assert len(values["step_accuracy"]) == 7
    # Step-0 acceptance equals 1 + step-0 accuracy's hits (same rows, same argmax).
    assert abs(drafts["draft"]["acceptance_length"][0] - 1 - drafts["draft"]["step_accuracy"][0]) < 1e-6
    for values in drafts.values():  # the served walk: between 1 and 1 + k tokens per verify step
        assert all(1.0 <= walk <= 1 + k for k, walk in enumerate(values["served_walk_acceptance_length"], start=1))
    assert drafts["draft"]["served_walk_acceptance_length"][2] > drafts["untrained"]["served_walk_acceptance_length"][2]
    assert drafts["draft"]["acceptance_length"][-1] > drafts["untrained"]["acceptance_length"][-1] + 0.1
    assert drafts["draft"]["acceptance_length"][-1] > drafts["unigram"]["acceptance_length"][-1] + 0.1
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "draft"),
                 "--eval-result", str(tmp_path / "eval" / "eval.json")]) == 0
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "acceptance length k=7" in card and "unigram" in card
    assert result["held_out"]["num_training_records"] == 64 and "token ids" in result["held_out"]["rule"]


def test_eval_refuses_records_the_run_trained_on(tmp_path: Path, capsys) -> None:
    run = trained_run()
    training_shards = trainer_data.prepared_inputs()["train_shards"]
    assert main(["eval", "--checkpoint", str(run), "--shards", str(training_shards), "--out", str(tmp_path)]) == 2
    assert "were in the run's training records" in capsys.readouterr().err


def test_eval_reports_what_the_serving_draft_achieved_on_exactly_the_records_evaluated(tmp_path: Path) -> None:
    with cf.ShardDirectory(trainer_data.prepared_inputs()["heldout_shards"]) as shards:
        records = [shards.read_record(entry) for entry in shards.iter_index()]
    # Batches of 4 in file order and max_records 5: records 0-7 are evaluated (two batches), 8-15 are not.
    # Draft A (3 steps): steps 3,1,0,2 | 2,1 | none | 0: 7 steps, 9 accepted: (9 + 7) / 7 tokens per step;
    # steps accepting >= 1: 5 of 7, >= 2: 3 of 7, >= 3: 1 of 7. Draft B (2 steps): 0,0 | 1: 3 steps, 1 accepted:
    # 4 / 3; >= 1: 1 of 3, >= 2: 0. Records 1 and 5 carry no draft. Records 8-15 would pull draft A up to 4.
    evaluated = [served(DRAFT_A, SERVING_A, [3, 1, 0, 2]), {}, served(DRAFT_B, SERVING_B, [0, 0]),
                 served(DRAFT_A, SERVING_A, [2, 1]), served(DRAFT_A, SERVING_A, []), {"source": "x"},
                 served(DRAFT_A, SERVING_A, [0]), served(DRAFT_B, SERVING_B, [1])]
    not_evaluated = [served(DRAFT_A, SERVING_A, [3, 3, 3, 3])] * (len(records) - len(evaluated))
    shards_dir = tmp_path / "heldout-served"
    cf.write_shards([dataclasses.replace(record, metadata=metadata)
                     for record, metadata in zip(records, evaluated + not_evaluated, strict=True)],
                    shards_dir, records_per_shard=6)

    result = evaluate.evaluate(trained_run(), shards_dir, max_records=5, batch_size=4, max_length=256)
    assert result["num_records"] == 8
    first, second = result["served_records"]["drafts"]
    assert result["served_records"]["num_records_without_draft"] == 2
    assert (first["draft"], first["num_steps"], first["num_records"], first["verify_steps"]) == (DRAFT_A, 3, 4, 7)
    assert first["acceptance_length"] == pytest.approx(16 / 7)
    assert first["position_acceptance"] == pytest.approx([5 / 7, 3 / 7, 1 / 7])
    assert (second["draft"], second["num_records"], second["verify_steps"]) == (DRAFT_B, 2, 3)
    assert second["acceptance_length"] == pytest.approx(4 / 3)
    assert second["position_acceptance"] == pytest.approx([1 / 3, 0.0])

    lines = evaluate.format_table(result).splitlines()
    assert lines[0].split() == ["draft", "untrained", "unigram"]  # the simulated table comes first, as before
    served_rows = {line.split()[3]: line.split()[4:] for line in lines if line.startswith("served (records) draft")}
    assert served_rows == {"a1a1a1a1a1a1": ["EAGLE3", "3/1", "4", "7", "2.286", "0.714", "0.429", "0.143"],
                           "b2b2b2b2b2b2": ["EAGLE3", "2/1", "2", "3", "1.333", "0.333", "0.000", "-"]}
    assert any("what the serving draft achieved on these records' generations" in line for line in lines)
    assert "served (records): 2 records captured without a draft" in lines


def test_eval_of_records_without_a_serving_draft_has_no_served_rows() -> None:
    result = {"drafts": {"draft": {"step_accuracy": [0.5], "acceptance_length": [1.5]}}, "chain_lengths": [1]}
    assert "served (records)" not in evaluate.format_table(result)


def test_an_exported_draft_evaluates_like_its_run(tmp_path: Path, capsys) -> None:
    import shutil

    from trainer.export import export

    inputs = trainer_data.prepared_inputs()
    run = tmp_path / "run"  # the run with a float32 draft config: its export holds the very weights eval reads
    shutil.copytree(trained_run(), run)
    draft_config = json.loads((run / "final" / "config.json").read_text())
    (run / "final" / "config.json").write_text(json.dumps({**draft_config, "torch_dtype": "float32"}))
    draft = export(run, tmp_path / "draft")
    settings = dict(max_records=8, batch_size=4, max_length=256)
    of_run = evaluate.evaluate(run, inputs["heldout_shards"], **settings)
    of_export = evaluate.evaluate(draft, inputs["heldout_shards"], target=inputs["target"], vocab=run / "vocab",
                                  **settings)
    assert of_run.keys() == of_export.keys() and of_export["checkpoint_kind"] == "exported"
    assert of_export["held_out"]["rule"].startswith("not checked")
    for name in ("draft", "untrained", "unigram"):
        for key in ("acceptance_length", "served_walk_acceptance_length", "step_accuracy"):
            assert of_export["drafts"][name][key] == pytest.approx(of_run["drafts"][name][key], abs=1e-6), (name, key)

    # An export needs its target and vocab mapping, and refuses another mapping, before building a model.
    with pytest.raises(ValueError, match="exported draft, which records no target: pass target="):
        evaluate.evaluate(draft, inputs["heldout_shards"], vocab=run / "vocab")
    from test_trainer_init_from import other_vocab_mapping

    with pytest.raises(ValueError, match="has another vocab mapping than what it is evaluated with"):
        evaluate.evaluate(draft, inputs["heldout_shards"], target=inputs["target"],
                          vocab=other_vocab_mapping(tmp_path / "other-vocab"))
    assert main(["eval", "--run", str(draft), "--shards", str(inputs["heldout_shards"]), "--target",
                 str(inputs["target"]), "--vocab", str(run / "vocab")]) == 2  # no --out: nothing written into it
    assert "pass --out" in capsys.readouterr().err
    assert sorted(path.name for path in draft.iterdir()) == ["README.md", "config.json", "model.safetensors"]
