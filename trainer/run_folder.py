"""What a training run's out_dir keeps of its inputs, so `eval` and `export` work after it is moved.

What must hold: a run folder is self-contained for everything but the target model. `train` copies
the draft config and the vocab mapping into it and writes the record ids and token-id digests of
every training record; `eval` reads those copies (the original paths are a fallback for folders
written before the copies existed) and refuses eval shards that share a record with them, before it
builds any model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from capture_format import is_remote, open_shard_directory

__all__ = ["TRAINING_RECORDS_NAME", "check_held_out", "keep_inputs", "resolve_checkpoint", "run_inputs"]

DRAFT_CONFIG_NAME = "draft_config.json"
VOCAB_DIR_NAME = "vocab"
TRAINING_RECORDS_NAME = "training_records.json"


def resolve_checkpoint(checkpoint: str | Path) -> tuple[Path, Path | None]:
    """(folder with model.safetensors + draft config.json, the training run's config.json or None).

    Accepts a run's out_dir (uses out_dir/final) or its final/ folder itself."""
    path = Path(checkpoint)
    final = path / "final" if (path / "final" / "model.safetensors").is_file() else path
    if not (final / "model.safetensors").is_file() or not (final / "config.json").is_file():
        raise ValueError(f"{checkpoint} holds no trained draft: expected model.safetensors and config.json in it "
                         f"or in {path / 'final'} (what `eagle-tap train` writes at the end of a run)")
    run_config = final.parent / "config.json"
    return final, run_config if run_config.is_file() else None


def keep_inputs(out_dir: Path, *, draft_config: str, vocab: str, training_shards: str) -> None:
    """Copies the draft config and vocab mapping into out_dir and lists the training records there."""
    shutil.copyfile(draft_config, out_dir / DRAFT_CONFIG_NAME)
    shutil.copytree(vocab, out_dir / VOCAB_DIR_NAME, dirs_exist_ok=True)
    with open_shard_directory(training_shards) as shards:
        entries = list(shards.iter_index())
    records = {"record_ids": [entry.record_id for entry in entries],
               "ids_xxh3_64": [entry.ids_xxh3_64 for entry in entries]}
    (out_dir / TRAINING_RECORDS_NAME).write_text(json.dumps(records) + "\n", encoding="utf-8")


def run_inputs(run_dir: Path, run_config: dict[str, Any]) -> dict[str, Any]:
    """run_config with draft_config and vocab pointing at the run's own copies, where it has them."""
    resolved = dict(run_config)
    if (run_dir / DRAFT_CONFIG_NAME).is_file():
        resolved["draft_config"] = str(run_dir / DRAFT_CONFIG_NAME)
    if (run_dir / VOCAB_DIR_NAME).is_dir():
        resolved["vocab"] = str(run_dir / VOCAB_DIR_NAME)
    return resolved


def _training_records(run_dir: Path, run_config: dict[str, Any]) -> tuple[list[str], list[str], str]:
    listed = run_dir / TRAINING_RECORDS_NAME
    if listed.is_file():
        records = json.loads(listed.read_text(encoding="utf-8"))
        return records["record_ids"], records["ids_xxh3_64"], str(listed)
    shards = run_config["data"]["shards"]
    if not is_remote(shards) and not Path(shards).is_dir():
        raise ValueError(f"{run_dir} has no {TRAINING_RECORDS_NAME} and its training shards {shards} are gone: "
                         "eval cannot tell held-out records from training ones")
    with open_shard_directory(shards) as directory:
        entries = list(directory.iter_index())
    return [entry.record_id for entry in entries], [entry.ids_xxh3_64 for entry in entries], shards


def check_held_out(eval_shards: str | Path, run_dir: Path, run_config: dict[str, Any]) -> dict[str, Any]:
    """Refuse eval records the run trained on (same record id or same token ids); return the rule applied."""
    record_ids, digests, source = _training_records(run_dir, run_config)
    trained_ids, trained_sequences = set(record_ids), set(digests)
    with open_shard_directory(eval_shards) as shards:
        overlap = [entry.record_id for entry in shards.iter_index()
                   if entry.record_id in trained_ids or entry.ids_xxh3_64 in trained_sequences]
    if overlap:
        raise ValueError(
            f"{len(overlap)} records of {eval_shards} were in the run's training records ({source}; first: "
            f"{overlap[0]!r}); evaluate on held-out shards the run never read")
    return {"training_records": source, "num_training_records": len(record_ids),
            "rule": "no eval record shares a record id or its token ids with the training shards"}
