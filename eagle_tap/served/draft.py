"""A draft folder next to its target: the checks that must pass before SGLang serves it, and SGLang's flags.

What must hold: a draft whose hidden size, target vocab, aux layer ids or tokenizer disagree with the
target is refused with one line naming the disagreement, before any process starts (SGLang itself
would start and then serve garbage, or fail on the first request). The chain settings are SGLang's:
`--speculative-num-steps k --speculative-eagle-topk 1 --speculative-num-draft-tokens k + 1`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import capture_format as cf


class DraftMismatchError(ValueError):
    """The draft cannot serve with this target; the message says why in one line."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    """EAGLE-3 chain drafting (top-k 1) with one draft folder."""

    draft_dir: Path
    """The folder `eagle-tap export` wrote (config.json + model.safetensors)."""
    num_steps: int = 3
    """Draft tokens proposed per verify step (SGLang's --speculative-num-steps)."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"the number of draft steps must be at least 1; got {self.num_steps}")

    def server_args(self) -> tuple[str, ...]:
        """SGLang's flags for this chain: each verify step checks the last accepted token plus the drafts."""
        return ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(self.draft_dir),
                "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(self.num_steps + 1))


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DraftMismatchError(f"cannot read the {what} config {path}: {error}") from None


def check_draft_fits_target(draft_dir: str | Path, target_dir: str | Path) -> dict[str, Any]:
    """Raise DraftMismatchError unless the draft in draft_dir can serve with the target in target_dir.

    Returns what was checked (capture layers, aux layer ids, fingerprints) for logs and reports."""
    from trainer.vocab import tokenizer_fingerprint

    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    draft = _read_json(draft_dir / "config.json", "draft")
    full_target = _read_json(target_dir / "config.json", "target")
    target = full_target.get("text_config") or full_target
    architecture = (full_target.get("architectures") or ["unknown"])[0]
    if not (draft_dir / "model.safetensors").is_file():
        raise DraftMismatchError(f"{draft_dir} holds no model.safetensors; export the draft with `eagle-tap export`")

    draft_hidden = draft.get("target_hidden_size", draft.get("hidden_size"))
    if draft_hidden != target["hidden_size"]:
        raise DraftMismatchError(f"the draft reads target states of hidden size {draft_hidden}; "
                                 f"{target_dir} has hidden size {target['hidden_size']}")
    if draft.get("vocab_size") != target["vocab_size"]:
        raise DraftMismatchError(f"the draft maps into a target vocab of {draft.get('vocab_size')} tokens; "
                                 f"{target_dir} has {target['vocab_size']}")
    layer_ids = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids:
        raise DraftMismatchError("the draft config has no eagle_config.eagle_aux_hidden_state_layer_ids")
    num_layers = target["num_hidden_layers"]
    try:
        served_layers = cf.capture_layers_from_sglang_ids(architecture, layer_ids, num_layers)
    except cf.LayerConfigError as error:
        raise DraftMismatchError(f"the draft's aux layer ids {layer_ids} do not fit {target_dir}: {error}") from None
    tap = draft.get("eagle_tap") or {}
    trained_layers = tap.get("capture_layers")
    if trained_layers is not None and list(trained_layers) != served_layers:
        raise DraftMismatchError(
            f"the draft was trained on the inputs of layers {list(trained_layers)}, but its aux layer ids "
            f"{layer_ids} make {architecture} with {num_layers} layers feed it layers {served_layers}")
    if tap.get("target_num_hidden_layers") not in (None, num_layers):
        raise DraftMismatchError(f"the draft was trained for a {tap['target_num_hidden_layers']}-layer target; "
                                 f"{target_dir} has {num_layers} layers")
    checked = {"architecture": architecture, "capture_layers": served_layers, "aux_layer_ids": list(layer_ids)}
    expected_tokenizer = tap.get("target_tokenizer_fingerprint")
    if expected_tokenizer is not None:
        served_tokenizer = tokenizer_fingerprint(target_dir)
        if served_tokenizer != expected_tokenizer:
            raise DraftMismatchError(f"the draft was trained with tokenizer {expected_tokenizer}; "
                                     f"{target_dir} has tokenizer {served_tokenizer}")
        checked["tokenizer_fingerprint"] = served_tokenizer
    return checked
