"""The two target tensors the trainer needs, read alone from the target's (possibly sharded) safetensors.

The draft embeds tokens with the target's `embed_tokens` and learns the target's distribution
`softmax(lm_head(final))`; both stay frozen. Only these two tensors are read (safetensors maps the
file and copies just their bytes), so a target of hundreds of GB costs two tensors of memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors.index.json or the single model.safetensors."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file_name for name, file_name in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{model_dir} holds neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def _read(files: dict[str, Path], candidates: tuple[str, ...]) -> torch.Tensor | None:
    from safetensors import safe_open

    for name in candidates:
        if name in files:
            with safe_open(files[name], framework="pt") as handle:
                return handle.get_tensor(name)
    return None


def load_embedding_and_lm_head(model_dir: str | Path, tie_word_embeddings: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens (V, H), lm_head (V, H)) of the target, in their stored dtype."""
    model_dir = Path(model_dir)
    files = tensor_files(model_dir)
    embedding = _read(files, EMBEDDING_NAMES)
    lm_head = embedding if tie_word_embeddings else _read(files, LM_HEAD_NAMES)
    for tensor, names in ((embedding, EMBEDDING_NAMES), (lm_head, LM_HEAD_NAMES)):
        if tensor is None:
            similar = sorted(name for name in files if name.endswith(names[0].rsplit(".", 2)[-2] + ".weight"))
            raise ValueError(
                f"{model_dir} has none of the tensors {', '.join(names)}; tensors with a similar name: "
                f"{', '.join(similar[:10]) or 'none'}"
            )
    if embedding.shape != lm_head.shape:
        raise ValueError(
            f"{model_dir}: embed_tokens {tuple(embedding.shape)} and lm_head {tuple(lm_head.shape)} differ"
        )
    return embedding, lm_head
