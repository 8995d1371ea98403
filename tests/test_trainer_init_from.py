"""Warm starts: a run starts from another run's or an exported draft's weights, exactly, and refuses one that does
not fit (another vocab mapping, hidden size, capture layers, target) before anything is written."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle_tap.cli import main
from trainer.config_io import config_from_dict
from trainer.metrics import read_metrics
from trainer.train import Config, start_run, train

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402
from test_trainer_export import trained_run  # noqa: E402
from test_trainer_train import run_config  # noqa: E402


@functools.cache
def exported_draft() -> Path:
    """trained_run()'s export (bf16 weights, SGLang's names), built once per process."""
    from trainer.export import export

    return export(trained_run(), Path(tempfile.mkdtemp(prefix="eagle-tap-init-from-")) / "draft")


def first_loss(out_dir: Path) -> float:
    return read_metrics(out_dir / "metrics.jsonl", "train")[0]["loss"]


def weights_at_start(config: Config) -> dict[str, torch.Tensor]:
    """The draft's trainable weights as start_run leaves them, before any step."""
    from trainer import distributed
    from trainer.model import trainable_state_dict

    runtime = distributed.Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return trainable_state_dict(start_run(config, runtime, resume=False).draft)


def test_a_run_started_from_an_export_starts_at_the_source_runs_loss(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source_run, draft = trained_run(), exported_draft()
    shards = trainer_data.prepared_inputs()["train_shards"]  # the data the source run trained on
    settings = dict(num_steps=2, log_every=1)

    # After 0 steps the weights are the export's (its bf16 values), d2t and t2d included.
    start = weights_at_start(config_from_dict(Config, run_config(tmp_path / "probe", shards, init_from=str(draft),
                                                                 **settings)))
    exported = load_file(draft / "model.safetensors")
    assert start.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(start[name], tensor.to(start[name].dtype)), name

    # Through the command line, stopped after one step and resumed without the flag: the record stays.
    config_path = tmp_path / "warm.json"
    config_path.write_text(json.dumps(run_config(tmp_path / "warm", shards, stop_after_steps=1, **settings)))
    assert main(["train", "--config", str(config_path), "--init-from", str(draft)]) == 0
    assert main(["train", "--config", str(config_path), "--resume", "stop_after_steps=null"]) == 0
    train(config_from_dict(Config, run_config(tmp_path / "cold", shards, **settings)))

    source_final_loss = read_metrics(source_run / "metrics.jsonl", "train")[-1]["loss"]
    warm, cold = first_loss(tmp_path / "warm"), first_loss(tmp_path / "cold")
    print(f"first loss: warm start {warm:.3f}, untrained {cold:.3f}; source run's last {source_final_loss:.3f}")
    # Measured: warm start 11.18, untrained 19.49, the source's last 11.03 (another batch of the same data).
    assert abs(warm - source_final_loss) < 0.1 * (cold - source_final_loss)  # where the source ended, far below
    recorded = json.loads((tmp_path / "warm" / "config.json").read_text())
    digest = hashlib.sha256((draft / "model.safetensors").read_bytes()).hexdigest()
    assert recorded["init_from"] == str(draft) and recorded["init_from_sha256"] == digest


def test_a_run_started_from_a_run_folder_holds_its_final_weights_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    shards = trainer_data.prepared_inputs()["train_shards"]
    start = weights_at_start(config_from_dict(Config, run_config(tmp_path / "out", shards, init_from=str(trained_run()))))
    final = load_file(trained_run() / "final" / "model.safetensors")
    assert start.keys() == final.keys() and all(torch.equal(start[name], final[name]) for name in final)


def other_vocab_mapping(directory: Path) -> Path:
    """The prepared mapping with its last draft token swapped for a token it lacks: same size, other mapping."""
    from trainer.vocab import VocabMapping, load_vocab_mapping

    mapping = load_vocab_mapping(trainer_data.prepared_inputs()["vocab"])
    target_ids = mapping.draft_token_ids.copy()
    target_ids[-1] = int(np.flatnonzero(~mapping.t2d)[0])
    VocabMapping.from_target_ids(target_ids, mapping.t2d.size, mapping.meta).save(directory)
    shutil.copy(trainer_data.prepared_inputs()["vocab"] / "token_frequencies.json", directory)
    return directory


def edited_export(directory: Path, edit) -> Path:
    shutil.copytree(exported_draft(), directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("edit, message", [
    (lambda config: config.update(hidden_size=64), "has hidden_size 64; this run .* has 128"),
    (lambda config: config.update(num_attention_heads=2), "has num_attention_heads 2; this run"),
    (lambda config: config.update(draft_vocab_size=256), "has draft_vocab_size 256; this run"),
    (lambda config: config["eagle_tap"].update(capture_layers=[1, 2, 3]), r"reads capture layers \[1, 2, 3\]"),
    (lambda config: config["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]),
     r"reads SGLang aux layer ids \[1, 2, 3\]"),
    (lambda config: config["eagle_tap"].update(target_model_fingerprint="f00d"), "was made for target f00d"),
])
def test_a_source_of_another_shape_layers_or_target_is_refused_before_anything_is_written(
        tmp_path: Path, edit, message: str) -> None:
    source = edited_export(tmp_path / "draft", edit)
    out_dir = tmp_path / "out"
    config = config_from_dict(Config, run_config(out_dir, trainer_data.prepared_inputs()["train_shards"],
                                                 init_from=str(source)))
    with pytest.raises(ValueError, match=message):
        train(config)
    assert not out_dir.exists()


def test_a_source_with_another_vocab_mapping_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    config = config_from_dict(Config, run_config(out_dir, trainer_data.prepared_inputs()["train_shards"],
                                                 init_from=str(exported_draft()),
                                                 vocab=str(other_vocab_mapping(tmp_path / "vocab"))))
    with pytest.raises(ValueError, match=r"has another vocab mapping than this run .*: its d2t differs \(\d+ of 512 entries"):
        train(config)
    assert not out_dir.exists()


def test_a_pinned_sha256_and_resume_with_init_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = trainer_data.prepared_inputs()["train_shards"]
    config = config_from_dict(Config, run_config(tmp_path / "out", shards, init_from=str(exported_draft()),
                                                 init_from_sha256="0" * 64))
    with pytest.raises(ValueError, match="the source changed since it was pinned"):
        train(config)
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(run_config(tmp_path / "out", shards)))
    assert main(["train", "--config", str(config_path), "--init-from", str(exported_draft()), "--resume"]) == 2
    assert "--init-from starts a new run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
