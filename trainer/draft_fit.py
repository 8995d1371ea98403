"""Whether a trained draft fits where it is put: the one check that warm starts, `eval`, swaps into a running
replica, the loop and the SGLang launcher all run, each naming what it compares against.

`check_draft_fits(draft, ...)` compares a draft (a run's folder or an exported one: trainer/run_folder.py's
DraftSource) with any of:
- `draft_config`: the draft config it must take the place of (every SHAPE_KEYS key, head_dim included; capture
  layers and SGLang's aux layer ids where both record them);
- `d2t`, `t2d`: the vocab mapping its own must equal (SGLang keeps the mapping a replica started with);
- `tensor_shapes`: the names, dtypes and shapes its model.safetensors must have (another draft's, for a swap);
- `target_fingerprint`: the target it must have been made for, where the draft records one;
- `target_dir`: the target folder it is served with: hidden size, vocab, SGLang's aux layer ids translated for
  the target's architecture and layer count against the capture layers it was trained on, and the tokenizer.

What must hold: the first difference raises DraftMismatchError (a ValueError) in one line that names the key,
both values and which side is which, before anything is built, sent or started; only the config, the
safetensors header and the two mapping tensors are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import capture_format as cf
from trainer.run_folder import DraftSource, read_draft_source

__all__ = ["SHAPE_KEYS", "DraftMismatchError", "check_draft_fits", "in_place_of", "safetensors_shapes"]

SHAPE_KEYS = ("architectures", "hidden_size", "target_hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size",
              "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "fc_norm",
              "norm_output")
"""Draft config keys two drafts must share for one's weights to take the other's place."""


class DraftMismatchError(ValueError):
    """The draft does not fit where it is put; the message says why in one line."""


def _shape_value(config: dict[str, Any], key: str) -> Any:
    if key == "target_hidden_size":  # a draft config without it reads states as wide as its own hidden size
        return config.get(key, config.get("hidden_size"))
    if key in ("fc_norm", "norm_output"):  # EAGLE3.1 options; a config without them has neither
        return bool(config.get(key, False))
    return config.get(key)


def _aux_layer_ids(config: dict[str, Any]) -> list[int] | None:
    return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def safetensors_shapes(path: str | Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor of a safetensors file, from its header alone."""
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
    return {name: (entry["dtype"], entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def check_draft_fits(draft: DraftSource | str | Path, *, draft_config: dict[str, Any] | None = None,
                     d2t: np.ndarray | None = None, t2d: np.ndarray | None = None,
                     tensor_shapes: dict[str, tuple[str, list[int]]] | None = None,
                     target_fingerprint: str | None = None, target_dir: str | Path | None = None,
                     used_as: str = "this run's draft") -> dict[str, Any]:
    """Raise DraftMismatchError naming the first difference (module docstring); returns what was checked against
    the target (architecture, capture layers, aux layer ids, tokenizer) for logs and reports."""
    source = draft if isinstance(draft, DraftSource) else read_draft_source(draft)
    source_config, where = source.draft_config, f"{source.path} ({source.kind} draft)"
    if draft_config is not None:
        _check_shapes(source_config, draft_config, where, used_as)
    made_for = (source_config.get("eagle_tap") or {}).get("target_model_fingerprint")
    if target_fingerprint is not None and made_for is not None and made_for != target_fingerprint:
        raise DraftMismatchError(f"{where} was made for target {made_for}; {used_as} is for target {target_fingerprint}")
    if tensor_shapes is not None:
        shapes = safetensors_shapes(source.weights_path)
        if shapes != tensor_shapes:
            differing = sorted(name for name in shapes.keys() | tensor_shapes.keys()
                               if shapes.get(name) != tensor_shapes.get(name))
            raise DraftMismatchError(f"{where} and {used_as} differ in tensors {differing[:5]}")
    if d2t is not None or t2d is not None:
        _check_vocab_mapping(source, {"d2t": d2t, "t2d": t2d}, where, used_as)
    return {} if target_dir is None else _check_target(source, Path(target_dir))


def _check_shapes(source_config: dict[str, Any], draft_config: dict[str, Any], where: str, used_as: str) -> None:
    for key in SHAPE_KEYS:
        mine, theirs = _shape_value(draft_config, key), _shape_value(source_config, key)
        if mine != theirs:
            raise DraftMismatchError(f"{where} has {key} {theirs!r}; {used_as} has {mine!r}")
    source_tap, tap = source_config.get("eagle_tap") or {}, draft_config.get("eagle_tap") or {}
    if "capture_layers" in source_tap and source_tap["capture_layers"] != tap.get("capture_layers"):
        raise DraftMismatchError(f"{where} reads capture layers {source_tap['capture_layers']}; {used_as} reads "
                                 f"{tap.get('capture_layers')}")
    source_ids, ids = _aux_layer_ids(source_config), _aux_layer_ids(draft_config)
    if source_ids is not None and ids is not None and source_ids != ids:
        raise DraftMismatchError(f"{where} reads SGLang aux layer ids {source_ids}; {used_as} reads {ids}")
    if "capture_layers" not in source_tap and source_ids is None:
        raise DraftMismatchError(f"{where} records neither capture layers (eagle_tap) nor SGLang's aux layer ids "
                                 "(eagle_config): nothing says which target layers it was trained on")


def _check_vocab_mapping(source: DraftSource, expected: dict[str, np.ndarray | None], where: str, used_as: str) -> None:
    from safetensors import safe_open

    with safe_open(source.weights_path, "np") as weights:
        names = set(weights.keys())
        for name, wanted in expected.items():
            if wanted is None:
                continue
            if name not in names:
                raise DraftMismatchError(f"{where} holds no {name} tensor: its vocab mapping cannot be checked")
            found = weights.get_tensor(name)
            if found.shape != wanted.shape or not np.array_equal(found, wanted):
                num_different = int((found != wanted).sum()) if found.shape == wanted.shape else None
                how = (f"shape {found.shape} vs {wanted.shape}" if num_different is None
                       else f"{num_different} of {wanted.size} entries differ")
                raise DraftMismatchError(f"{where} has another vocab mapping than {used_as}: its {name} differs "
                                         f"({how}); use the mapping it was trained with")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DraftMismatchError(f"cannot read the {what} config {path}: {error}") from None


def _check_target(source: DraftSource, target_dir: Path) -> dict[str, Any]:
    """The draft against the target folder it is served with (module docstring)."""
    from trainer.vocab import tokenizer_fingerprint

    draft = source.draft_config
    full_target = _read_json(target_dir / "config.json", "target")
    target = full_target.get("text_config") or full_target
    architecture = (full_target.get("architectures") or ["unknown"])[0]
    draft_hidden = draft.get("target_hidden_size", draft.get("hidden_size"))
    if draft_hidden != target["hidden_size"]:
        raise DraftMismatchError(f"the draft reads target states of hidden size {draft_hidden}; "
                                 f"{target_dir} has hidden size {target['hidden_size']}")
    if draft.get("vocab_size") != target["vocab_size"]:
        raise DraftMismatchError(f"the draft maps into a target vocab of {draft.get('vocab_size')} tokens; "
                                 f"{target_dir} has {target['vocab_size']}")
    layer_ids = _aux_layer_ids(draft)
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


def in_place_of(draft_dir: str | Path, used_as: str | None = None) -> dict[str, Any]:
    """What another draft must match to take this one's place (a swap into a replica serving it): its draft
    config, vocab mapping and tensor shapes, as check_draft_fits keywords: `check_draft_fits(new, **in_place_of(old))`."""
    from safetensors import safe_open

    serving = read_draft_source(draft_dir)
    shapes = safetensors_shapes(serving.weights_path)
    with safe_open(serving.weights_path, "np") as weights:
        mapping = {name: weights.get_tensor(name) for name in ("d2t", "t2d") if name in shapes}
    return {"draft_config": serving.draft_config, "tensor_shapes": shapes, **mapping,
            "used_as": used_as or f"the serving draft {draft_dir}"}
