"""What a training run's out_dir keeps of its inputs, so `eval` and `export` work after it is moved;
and where trained draft weights are read from: a run's folder or an exported draft folder.

What must hold: a run folder is self-contained for everything but the target model. `train` copies
the draft config and the vocab mapping into it and writes the record ids and token-id digests of
every training record (only the selected ones, with data.record_ids); `eval` reads those copies (the
original paths are a fallback for folders written before the copies existed) and refuses eval records
that share a record with them, before it builds any model.

Trained weights (`DraftSource`) come from either kind of folder, both holding config.json (the draft
config with its `eagle_tap` section) and model.safetensors (SGLang's names, d2t and t2d included):
- a run's out_dir or its final/ folder: float32 weights, the run's config.json next to final/;
- an exported draft (`eagle-tap export`): weights in the config's torch_dtype, nothing about the run.
`trainer.draft_fit.check_draft_fits` refuses weights made for another draft shape, capture layers, target or
vocab mapping, naming the difference, before a model is built.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capture_format import IndexEntry, is_remote, open_shard_directory

if TYPE_CHECKING:
    import torch

__all__ = ["TRAINING_RECORDS_NAME", "DraftSource", "check_held_out", "keep_inputs", "read_draft_source",
           "resolve_checkpoint", "run_inputs", "sha256_file"]

DRAFT_CONFIG_NAME = "draft_config.json"
VOCAB_DIR_NAME = "vocab"
TRAINING_RECORDS_NAME = "training_records.json"


def _is_training_config(path: Path) -> bool:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and {"draft_config", "vocab", "data"} <= config.keys()


def resolve_checkpoint(checkpoint: str | Path) -> tuple[Path, Path | None]:
    """(folder with model.safetensors + draft config.json, the training run's config.json or None).

    Accepts a run's out_dir (uses out_dir/final), its final/ folder itself, or an exported draft folder
    (None: no run). Only a folder named final/ next to a training config.json is a run's: an exported
    draft written inside a run's out_dir stays an exported draft."""
    path = Path(checkpoint)
    final = path / "final" if (path / "final" / "model.safetensors").is_file() else path
    if not (final / "model.safetensors").is_file() or not (final / "config.json").is_file():
        raise ValueError(f"{checkpoint} holds no trained draft: expected model.safetensors and config.json in it "
                         f"or in {path / 'final'} (what `eagle-tap train` writes at the end of a run)")
    run_config = final.parent / "config.json"
    return final, run_config if final.name == "final" and _is_training_config(run_config) else None


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 16 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while piece := file.read(1 << 24):
            digest.update(piece)
    return digest.hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class DraftSource:
    """Trained draft weights, from a training run's folder or an exported draft folder (module docstring)."""

    path: Path
    """The folder as given."""
    folder: Path
    """The folder holding model.safetensors and the draft's config.json (a run's final/)."""
    draft_config: dict[str, Any]
    """Its config.json: the draft config (a run's) or the served config (an export's)."""
    run_config_path: Path | None
    """The training run's config.json; None for an exported draft."""

    @property
    def weights_path(self) -> Path:
        return self.folder / "model.safetensors"

    @property
    def kind(self) -> str:
        """What the folder is: "run" (a training run's) or "exported" (`eagle-tap export`'s)."""
        return "exported" if self.run_config_path is None else "run"

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of model.safetensors but an `embed_tokens` (the draft uses the target's), as stored."""
        from safetensors.torch import load_file

        return {name: tensor for name, tensor in load_file(self.weights_path).items() if "embed_tokens" not in name}


def read_draft_source(path: str | Path) -> DraftSource:
    """The trained draft in a run's out_dir, its final/ folder, or an exported draft folder."""
    folder, run_config_path = resolve_checkpoint(path)
    try:
        draft_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the draft config {folder / 'config.json'}: {error}") from None
    return DraftSource(path=Path(path), folder=folder, draft_config=draft_config, run_config_path=run_config_path)


def keep_inputs(out_dir: Path, *, draft_config: str, vocab: str, training_records: Sequence[IndexEntry]) -> None:
    """Copies the draft config and vocab mapping into out_dir and lists the records it trains on there."""
    shutil.copyfile(draft_config, out_dir / DRAFT_CONFIG_NAME)
    shutil.copytree(vocab, out_dir / VOCAB_DIR_NAME, dirs_exist_ok=True)
    records = {"record_ids": [entry.record_id for entry in training_records],
               "ids_xxh3_64": [entry.ids_xxh3_64 for entry in training_records]}
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


def check_held_out(eval_shards: str | Path, run_dir: Path, run_config: dict[str, Any],
                   selected: Collection[str] | None = None) -> dict[str, Any]:
    """Refuse eval records the run trained on (same record id or same token ids); return the rule applied.

    selected: the record ids to be evaluated (None: every record of eval_shards)."""
    record_ids, digests, source = _training_records(run_dir, run_config)
    trained_ids, trained_sequences = set(record_ids), set(digests)
    with open_shard_directory(eval_shards) as shards:
        overlap = [entry.record_id for entry in shards.iter_index()
                   if (selected is None or entry.record_id in selected)
                   and (entry.record_id in trained_ids or entry.ids_xxh3_64 in trained_sequences)]
    if overlap:
        raise ValueError(
            f"{len(overlap)} records of {eval_shards} were in the run's training records ({source}; first: "
            f"{overlap[0]!r}); evaluate on held-out shards the run never read")
    return {"training_records": source, "num_training_records": len(record_ids),
            "rule": "no eval record shares a record id or its token ids with the training shards"}
