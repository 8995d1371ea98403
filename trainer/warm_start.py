"""Warm starts of `eagle-tap train`: a run starts its trainable weights from another run's or an exported draft.

What must hold: the source fits the run (draft shape, capture layers, target, vocab mapping) or is refused,
naming the difference, before anything is written; the weights are copied exactly as stored; the run records
the source's path and the sha256 of its weights file, and a resumed run keeps what it recorded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from trainer.config import Config
from trainer.model import Eagle3Draft, trainable_state_dict
from trainer.run_folder import DraftSource

log = logging.getLogger(__name__)


def check_init_from(config: Config) -> DraftSource:
    """config.init_from's draft, after checking that it fits this run (ValueError naming the difference)."""
    from capture_format.fingerprint import model_fingerprint
    from trainer.draft_config import load_draft_config
    from trainer.draft_fit import check_draft_fits
    from trainer.run_folder import read_draft_source
    from trainer.vocab import load_vocab_mapping

    assert config.init_from is not None
    source = read_draft_source(config.init_from)
    mapping = load_vocab_mapping(config.vocab)
    check_draft_fits(source, draft_config=load_draft_config(config.draft_config), d2t=mapping.d2t, t2d=mapping.t2d,
                     target_fingerprint=model_fingerprint(config.target),
                     used_as=f"this run (draft config {config.draft_config}, vocab {config.vocab})")
    return source


def load_init_from(draft: Eagle3Draft, source: DraftSource) -> None:
    """Copies the source's trainable weights and vocab buffers into draft (cast to its dtype); the embedding stays."""
    tensors = source.tensors()
    expected = trainable_state_dict(draft)
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{source.weights_path} does not hold this draft's tensors: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{source.weights_path}: tensor {name!r} has shape {tuple(tensor.shape)}; this draft's "
                             f"is {tuple(expected[name].shape)}")
    draft.load_state_dict({**tensors, "embed_tokens.weight": draft.embed_tokens.weight})


def recorded_init_from(config: Config, resume: str | bool) -> Config:
    """config with init_from and init_from_sha256 as this run records them; refuses a source that does not fit.

    A new run checks its source and hashes its weights file (against init_from_sha256 when that is set); a
    resumed one keeps what out_dir/config.json recorded when it started, since its checkpoint holds the weights."""
    from trainer.run_folder import sha256_file

    if resume:
        written = Path(config.out_dir) / "config.json"
        recorded = json.loads(written.read_text(encoding="utf-8")) if written.is_file() else {}
        if config.init_from is not None and recorded.get("init_from") != config.init_from:
            log.warning("init_from %s is not read on resume: the run continues from its checkpoint (it started "
                        "from %s)", config.init_from, recorded.get("init_from") or "its own initialisation")
        return dataclasses.replace(config, init_from=recorded.get("init_from"),
                                   init_from_sha256=recorded.get("init_from_sha256"))
    if config.init_from is None:
        return config
    source = check_init_from(config)
    digest = sha256_file(source.weights_path)
    if config.init_from_sha256 is not None and config.init_from_sha256 != digest:
        raise ValueError(f"{source.weights_path} has sha256 {digest}; init_from_sha256 says "
                         f"{config.init_from_sha256}: the source changed since it was pinned")
    log.info("warm start from %s (%s draft, %s sha256 %s)", config.init_from, source.kind, source.weights_path, digest)
    return dataclasses.replace(config, init_from_sha256=digest)
